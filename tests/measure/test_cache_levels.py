"""Cache levels as the calibration records them and the pricing reads them: a level counts where its stream or its
reads beat memory's, a VM's OS-reported last-level cache gives way to what this process was measured to hold, and
the in-cache probes are sized by it."""
from __future__ import annotations

import copy
import json
import os

import pytest

from workbench.measure.calibrate import (
    effective_llc_bytes,
    host_cache_levels,
    level_beats_memory,
    spec_from_calibration,
)
from workbench.roofline.host import memory_levels

ZEN5 = os.path.join(os.path.dirname(__file__), "..", "data", "hosts", "zen5-2026-12-04", "calibration.json")
MiB = 2**20


def test_a_level_counts_where_its_stream_or_its_reads_beat_memory():
    assert level_beats_memory(30e9, 1.0, memory_bw=20e9)  # stream 1.5x
    assert not level_beats_memory(22e9, 1.0, memory_bw=20e9, memory_read_bw=29e9)  # neither
    # a write-allocating VM: the stream near memory's, its reads (24.6 x 1.9 = 47 GB/s) 1.6x memory's 29 GB/s
    assert level_beats_memory(24.6e9, 1.9, memory_bw=20.75e9, memory_read_bw=29.9e9)
    assert not level_beats_memory(24.6e9, 1.9, memory_bw=20.75e9)  # without memory's read rate: the stream alone
    assert level_beats_memory(1.0, None, memory_bw=None)  # nothing to compare with


def _with_levels(levels):
    with open(ZEN5) as f:
        cal = json.load(f)
    cal = copy.deepcopy(cal)
    cal["cache_levels"] = levels
    return cal


L2 = {"level": 2, "type": "Unified", "capacity_bytes": 4 * MiB, "bytes_per_s": 44e9, "read_ratio": 0.8,
      "effective_bytes": 4 * MiB}


def test_the_largest_measured_level_is_the_last_level_cache_the_pricing_holds():
    l3 = {"level": 3, "type": "Unified", "capacity_bytes": 480 * MiB, "bytes_per_s": 38e9, "read_ratio": 1.2,
          "effective_bytes": 120 * MiB}
    cal = _with_levels([L2, l3])
    spec = spec_from_calibration(cal)
    assert [lv.name for lv in spec.measured.cache_levels] == ["L2", "L3"]
    assert spec.onchip_bytes == 120 * MiB and spec.measured.onchip_bw == 38e9  # not the OS's 480 MiB at the cache stream
    assert [lv.name for lv in memory_levels(spec, spec.hbm_bw)] == ["L2", "L3", "memory"]
    assert effective_llc_bytes(cal["cache_levels"], 999) == 120 * MiB
    assert effective_llc_bytes([{"capacity_bytes": 480 * MiB, "bytes_per_s": None}], 999) == 999


def test_a_level_judged_by_its_stream_alone_counts_where_its_reads_beat_memory():
    """A calibration that left a level unpriced because its stream was under 1.2x memory's: where its reads beat
    memory's read rate, its last working set counts as a level of that size."""
    cal = _with_levels([L2, {"level": 3, "type": "Unified", "capacity_bytes": 480 * MiB, "bytes_per_s": None,
                             "read_ratio": 1.9, "tried": [{"working_set_bytes": 240 * MiB, "bytes_per_s": 12.5e9},
                                                          {"working_set_bytes": 15 * MiB, "bytes_per_s": 24.6e9}]}])
    mem = cal["stream"]["bytes_per_s"]
    # scale the level to this calibration's memory: stream 1.19x memory's, reads 1.9x the stream
    cal["cache_levels"][1]["tried"][-1]["bytes_per_s"] = 1.19 * mem
    levels = host_cache_levels(cal)
    assert [lv.name for lv in levels] == ["L2", "L3"]
    assert levels[1].capacity == 15 * MiB and levels[1].bw == pytest.approx(1.19 * mem)
    cal["cache_levels"][1]["read_ratio"] = 1.0  # reads no faster than its stream: memory's level
    assert [lv.name for lv in host_cache_levels(cal)] == ["L2"]


def test_without_measured_levels_the_os_last_level_cache_stays():
    spec = spec_from_calibration(_with_levels([]))
    assert spec.measured.cache_levels is None and spec.onchip_bytes == 32 * MiB
    assert [lv.name for lv in memory_levels(spec, spec.hbm_bw)] == ["LLC", "memory"]


def test_a_level_streamed_over_all_of_it_gives_the_capacity_whose_replacement_matches():
    """The last level streamed over its whole capacity: the share from the cache is read off the times' mix between
    the level's rate and memory's, and the capacity given to the pricing is the one whose sweep hit rate
    (`residency`) is that share at the whole capacity — so the pricing reproduces the sample it came from."""
    from workbench.hardware.measured import MemoryLevel
    from workbench.measure.calibrate import fill_capacity
    from workbench.roofline.host import residency

    cap = 32 * MiB
    assert fill_capacity(100e9, 99e9, 25e9, cap) == (pytest.approx(0.9966, abs=1e-4), cap)  # all of it: kept
    assert fill_capacity(100e9, 20e9, 25e9, cap) == (0.0, cap / 10)  # slower than memory: a tenth
    assert fill_capacity(20e9, 20e9, 25e9, cap) == (1.0, cap)  # no faster than memory: nothing to read off
    h, eff = fill_capacity(100e9, 40e9, 25e9, cap)
    assert h == pytest.approx((1 / 25 - 1 / 40) / (1 / 25 - 1 / 100))  # 0.5
    assert eff < cap
    levels = [MemoryLevel("L3", eff, 100e9, 1.0), MemoryLevel("memory", float("inf"), 25e9, 1.0)]
    shares = dict((lv.name, s) for lv, s in residency(cap, levels))
    assert shares["L3"] == pytest.approx(h, rel=1e-6)
    t = shares["L3"] * cap / 100e9 + shares["memory"] * cap / 25e9
    assert cap / t == pytest.approx(40e9, rel=1e-6)  # the full stream's own rate


def test_a_library_fusions_loops_are_priced_only_where_all_were_measured_inside_one():
    """The stored Zen 4 calibration (version 27) timed the library's loops: the spec carries the pass and op rates
    and the exponentials' rate beyond the pass. Without the pass, or with probes that ran outside a library fusion,
    none of them is priced and the exponentials keep the rate that holds the pass."""
    zen4 = os.path.join(os.path.dirname(ZEN5), "..", "zen4-2026-12-07", "calibration.json")
    with open(zen4) as f:
        cal = json.load(f)
    tl = cal["transcendentals_library"]
    m = spec_from_calibration(cal).measured
    assert m.library_pass_per_s == cal["library_fusion"]["pass"]["per_s"] > 0
    assert m.library_ops_per_s == cal["library_fusion"]["ops"]["per_s"] > 0
    assert m.transcendentals_per_s_library == tl["per_s_beyond_pass"] > tl["per_s"]
    for broken in ({"pass": {"per_s": None}}, {"library": False}):
        c = copy.deepcopy(cal)
        c["library_fusion"].update(broken)
        m = spec_from_calibration(c).measured
        assert m.library_pass_per_s is None and m.library_ops_per_s is None
        assert m.transcendentals_per_s_library == tl["per_s"]


def test_the_start_of_a_stream_from_memory_is_measured_and_priced():
    """The calibration's memory start: sums over distinct arrays from memory at two sizes, round after round, a line
    fitted per round and the median round's intercept kept (within the rounds' range), its slope a memory rate; the
    spec carries it to the pricing, and a calibration from before it carries none."""
    import jax

    from workbench.measure.calibrate import measure_memory_start

    r = measure_memory_start(jax.local_devices()[0], 8 * MiB, reps=3, quick=True)
    assert r["total_bytes"] == 128 * MiB and r["rounds"] == 6
    assert set(r["seconds_per_sum"]) == {str(MiB), str(4 * MiB)}
    assert r["seconds_per_sum"][str(4 * MiB)] > r["seconds_per_sum"][str(MiB)] > 0
    lo, hi = r["per_kernel_s_range"]
    assert r["per_kernel_s"] == max(r["per_kernel_s"], 0.0) and (r["per_kernel_s"] == 0.0 or lo <= r["per_kernel_s"] <= hi)
    cal = _with_levels([L2])
    assert spec_from_calibration(cal).measured.memory_start_s is None
    cal["memory_start"] = r
    assert spec_from_calibration(cal).measured.memory_start_s == r["per_kernel_s"]
