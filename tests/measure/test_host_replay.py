"""Stored hosts replayed: each CPU class's stored calibration predicts its own stored measurements.

tests/data/hosts/<class>-<date>/ holds what the workbench wrote on a host (calibration, demo results, the error
benchmark's report), unedited. The ops are compiled here and priced from the stored calibration (nothing is timed
here), so the host model is held to every CPU class the project has met, whatever machine runs the tests.
"""
from __future__ import annotations

import json
import os

import pytest

from workbench.programs.replay import host_folders, replay, stored_spec, summarize

FOLDERS = host_folders()
ZEN5 = next(f for f in FOLDERS if os.path.basename(f).startswith("zen5-"))
# hosts stored with a calibration of version 25 on (cache levels as this process holds them)
MEASURED_LEVELS = [f for f in FOLDERS if not os.path.basename(f).startswith("zen5-")]


@pytest.fixture(scope="module")
def zen5_rows():
    return replay(ZEN5)


def test_the_stored_hosts_are_there_unedited():
    for name in ("calibration.json", "demo-results.json", "demo-results-2.json", "prediction-error.json"):
        assert os.path.exists(os.path.join(ZEN5, name)), name


def test_zen5_demo_ops_replay_within_15_percent_median_and_none_over_50(zen5_rows):
    s = summarize(zen5_rows)
    demo = [r for r in zen5_rows if r.source.startswith("demo")]
    assert s["demo_rows"] == 16  # 8 ops in each of the two demo files
    worst = max(demo, key=lambda r: r.error)
    assert s["demo_median"] <= 0.15, [(r.name, round(r.signed_error, 2)) for r in demo]
    assert s["demo_max"] <= 0.50, (worst.name, worst.predicted_s, worst.measured_s)


def test_zen5_error_benchmark_held_out_ops_replay_within_12_percent_median(zen5_rows):
    s = summarize(zen5_rows)
    held = [r for r in zen5_rows if r.source == "prediction-error" and not r.in_sample]
    assert s["heldout_rows"] == 14
    assert s["heldout_median"] <= 0.12, [(r.name, round(r.signed_error, 2)) for r in held]


def test_zen5_dots_stay_where_the_host_priced_them(zen5_rows):
    """The memory model changes memory-bound kernels only: a compute-bound dot replays as the host priced it."""
    for r in zen5_rows:
        if r.builder == "matmul" and r.source.startswith("demo"):
            assert r.predicted_s == pytest.approx(r.predicted_s_stored, rel=0.02), r.name


def test_a_calibration_without_cache_levels_falls_back_to_what_it_has():
    """The stored Zen 5 calibration predates the per-level figures: its last-level cache (sysfs size) at the in-cache
    stream, the memory's read rate from its sum over the stream's buffer, a library fusion's special functions at
    the library's in-cache reduction rate; its first-touch figure lies within its stream's noise and is not priced."""
    spec = stored_spec(ZEN5)
    assert spec.measured.cache_levels is None
    assert spec.onchip_bytes == 32 * 2**20
    assert 1.0 < spec.measured.memory_read_ratio < 1.2
    assert spec.measured.transcendentals_per_s_library == pytest.approx(spec.measured.reduce_per_s_cached)
    assert spec.measured.first_touch_bw is None


def _drifted(folder) -> float | None:
    """The stored error benchmark's median error on its in-sample ops (the sizes the calibration itself timed) when
    it is over 10 %: the machine the benchmark timed was not the machine the calibration described."""
    with open(os.path.join(folder, "prediction-error.json"), encoding="utf-8") as f:
        in_sample = json.load(f)["median_error_ops_in_sample"]
    return in_sample if in_sample > 0.10 else None


@pytest.mark.parametrize("folder", MEASURED_LEVELS, ids=os.path.basename)
def test_hosts_with_measured_cache_levels_replay_their_demo_and_held_out_ops(folder):
    """Every other stored host: its demo within 15 % median over every stored timing, no demo op over 50 % from its
    fastest timing (one disturbed timing is the machine's, not the model's), its held-out ops within 12 %. A host
    whose own calibrated sizes missed by over 10 % in its error benchmark drifted while it was measured: replayed
    and reported, not held to the thresholds (the Zen 3 VM: in-sample 20 %, matmul +28 % and stream -29 % between
    calibration and the benchmark's end)."""
    drift = _drifted(folder)
    if drift is not None:
        pytest.skip(f"{os.path.basename(folder)} drifted while measured: in-sample ops missed by {drift:.0%}")
    rows = replay(folder)
    s = summarize(rows)
    assert s["demo_rows"] >= 8 and s["heldout_rows"] >= 14  # 16 from 2026-12-07: two decode-like products
    demo = [(r.name, round(r.signed_error, 2)) for r in rows if r.source.startswith("demo")]
    assert s["demo_median"] <= 0.15 and s["demo_max_fastest"] <= 0.5, (s["demo_median"], demo)
    assert s["heldout_median"] <= 0.12, s["heldout_median"]
    assert stored_spec(folder).measured.cache_levels  # the levels it was priced with
