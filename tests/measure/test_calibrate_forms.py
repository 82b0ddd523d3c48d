"""Calibration of narrow-float matmuls: each result form measured, the faster kept, the slower a finding."""
import jax

from workbench.measure.calibrate import MATMUL_FORMS, bf16_isa, matmul_ceilings


def test_calibration_keeps_the_faster_form_and_names_the_slower():
    """Every dtype measured in each of its result forms; the ceiling is the faster (by median), each slower form is a
    finding naming both forms and the CPU's bf16 arithmetic; float32 has one form."""
    mm, findings = matmul_ceilings(128, 3, jax.devices()[0], {"flags": ["avx2"]}, quiet=True)
    assert set(mm) == set(MATMUL_FORMS)
    assert list(mm["float32"]["forms"]) == ["float32"]
    for dt, v in mm.items():
        rates = {rt: f["flops_per_s"] for rt, f in v["forms"].items()}
        assert v["result_dtype"] == max(rates, key=rates.get) and v["flops_per_s"] == max(rates.values())
        for rt in rates:
            if rt != v["result_dtype"]:
                assert any(line.startswith(f"XLA:CPU {dt} matmul") and f"with a {rt} result" in line
                           and "bf16 arithmetic: none" in line for line in findings), findings
    assert bf16_isa(["avx512f", "avx512_bf16"]) == "avx512_bf16" and bf16_isa(["amx_bf16", "avx512_bf16"]) == "amx_bf16"


def test_out_of_place_stream_kernel_writes_a_second_buffer():
    """The stream calibration's kernel: each trip reads x and writes the other carry buffer, never reading it, so the
    result is the last trip's a·x + b (an in-place body would have compounded the trips); the per-trip rate is
    positive."""
    import jax.numpy as jnp
    import numpy as np

    from workbench.measure.calibrate import _oop_loop, stream_out_of_place

    x = jnp.arange(4096, dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(_oop_loop(3)(x)), np.asarray(x) * 1.0001 + 2.0, rtol=1e-6)
    r = stream_out_of_place(jnp.ones((1 << 20,), jnp.float32), reps=3, trips=(1, 33))
    assert r["bytes_per_s"] > 0 and r["per_trip_s"] > 0 and r["trips"] == [1, 33]


def test_matmul_figures_take_the_median_samples_level():
    """The matmul phase's figures keep their ratios and take the level of the median float32 sample across the
    calibration (start, the phase itself, end); the phase values stay as flops_per_s_measured, and a spread over
    15 % is a finding naming the range."""
    from workbench.measure.calibrate import apply_matmul_level

    cal = {"matmul": {"float32": {"n": 2048, "flops_per_s": 100e9}, "bfloat16": {"n": 2048, "flops_per_s": 40e9}},
           "matmul_curve": [{"n": 512, "flops_per_s": 50e9}, {"n": 2048, "flops_per_s": 100e9}],
           "matmul_curves": {"bfloat16": [{"n": 512, "flops_per_s": 70e9}]}}
    findings = apply_matmul_level(cal, {"start": 80e9, "middle": 100e9, "end": 60e9})
    assert cal["matmul_level"]["factor"] == 0.8 and cal["matmul_level"]["range_flops_per_s"] == [60e9, 100e9]
    assert cal["matmul"]["float32"]["flops_per_s"] == 80e9 and cal["matmul"]["bfloat16"]["flops_per_s"] == 32e9
    assert [r["flops_per_s"] for r in cal["matmul_curve"]] == [40e9, 80e9]
    assert cal["matmul_curves"]["bfloat16"][0]["flops_per_s"] == 56e9
    assert cal["matmul"]["float32"]["flops_per_s_measured"] == 100e9
    assert len(findings) == 1 and "60–100 GFLOP/s" in findings[0] and "×0.80" in findings[0]
    steady = {"matmul": {"float32": {"n": 2048, "flops_per_s": 100e9}}, "matmul_curve": []}
    assert apply_matmul_level(steady, {"start": 99e9, "middle": 100e9, "end": 104e9}) == []
    assert steady["matmul"]["float32"]["flops_per_s"] == 100e9  # the phase was the median: unchanged


def test_vector_figures_take_the_median_exp_samples_level():
    """Special functions, conversions and in-cache reductions keep their ratios and take the level of the median exp
    probe sample (start, the phase's own exp rate, end); the reduction from memory is a memory rate and stays; the
    phase values stay as per_s_measured, and a spread over 15 % is a finding naming the range."""
    from workbench.measure.calibrate import apply_vector_level

    def cal():
        return {"transcendentals": {"exp": {"per_s": 2e9}, "tanh": {"per_s": 3e9}}, "convert": {"per_s": 10e9},
                "reduce": {"in_cache": {"per_s": 18e9}, "from_memory": {"per_s": 9e9}},
                "transcendentals_library": {"per_s": 4e9, "per_s_beyond_pass": 6e9},
                "library_fusion": {"ops": {"per_s": 80e9}, "pass": {"per_s": 20e9}}}

    c = cal()
    findings = apply_vector_level(c, {"start": 1.0e9, "middle": 2e9, "end": 1.5e9})
    assert c["vector_level"]["factor"] == 0.75 and c["vector_level"]["level"] == 1.5e9
    assert c["vector_level"]["range_per_s"] == [1.0e9, 2e9]
    assert c["transcendentals"]["exp"]["per_s"] == 1.5e9 and c["transcendentals"]["tanh"]["per_s"] == 2.25e9
    assert c["convert"]["per_s"] == 7.5e9 and c["reduce"]["in_cache"]["per_s"] == 13.5e9
    assert c["reduce"]["from_memory"]["per_s"] == 9e9 and "per_s_measured" not in c["reduce"]["from_memory"]
    assert c["convert"]["per_s_measured"] == 10e9
    assert c["transcendentals_library"]["per_s"] == 3e9 and c["transcendentals_library"]["per_s_beyond_pass"] == 4.5e9
    assert c["library_fusion"]["ops"]["per_s"] == 60e9 and c["library_fusion"]["pass"]["per_s"] == 15e9
    assert len(findings) == 1 and "1.00–2.00 G/s" in findings[0] and "×0.75" in findings[0]
    steady = cal()
    assert apply_vector_level(steady, {"start": 1.95e9, "middle": 2e9, "end": 2.1e9}) == []
    assert steady["convert"]["per_s"] == 10e9  # the phase was the median: unchanged


def test_vector_probe_is_the_calibrations_exp_chain():
    """The probe runs the exp chain the special-function phase times (its 'middle' sample): same depth, same op."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from workbench.measure.calibrate import VECTOR_DEPTH, vector_probe, vector_sample

    c, x = vector_probe(4096, jax.devices()[0])
    y = x
    for _ in range(VECTOR_DEPTH):
        y = jnp.exp(-y)
    np.testing.assert_allclose(np.asarray(c(x)), np.asarray(y), rtol=1e-6)
    assert vector_sample((c, x), 3) > 0


def test_every_dtype_and_form_alternates_in_rounds(monkeypatch):
    """The (dtype, form) pairs are measured round by round, all of them in each round, so a slow spell of the machine
    reaches every dtype alike: the order of the measurements is the pair list repeated, never one dtype's rounds
    back to back."""
    import workbench.measure.calibrate as cal

    order = []
    real = cal.measure

    def spy(c, x, y, **kw):
        order.append((str(x.dtype), c.as_text().count("f32[") > 0))
        return real(c, x, y, **kw)

    monkeypatch.setattr(cal, "measure", spy)
    mm, _ = matmul_ceilings(64, 3, jax.devices()[0], {"flags": []}, quiet=True)
    pairs = sum(len(v) for v in MATMUL_FORMS.values())
    assert len(order) == 3 * pairs and all(v["rounds"] == 3 for d in mm.values() for v in d["forms"].values())
    assert order[:pairs] == order[pairs:2 * pairs] == order[2 * pairs:]
    assert len({o[0] for o in order[:pairs]}) == len(MATMUL_FORMS)


def test_write_allocate_is_read_from_the_in_place_over_out_of_place_stream():
    from workbench.measure.calibrate import WRITE_ALLOCATE_RATIO, write_allocates

    oop = 2e10
    assert write_allocates({"stream": {"bytes_per_s": oop}, "stream_inplace": {"bytes_per_s": 1.7 * oop}})
    assert not write_allocates({"stream": {"bytes_per_s": oop},
                                "stream_inplace": {"bytes_per_s": 0.99 * WRITE_ALLOCATE_RATIO * oop}})
    assert not write_allocates({"stream": {"bytes_per_s": oop}})


def test_transpose_probes_avoid_power_of_two_strides_and_fit_their_residency():
    """The in-cache probe's input and output fit in half the last-level cache; the from-memory probe's arrays are
    at least twice the cache; neither row stride is a multiple of 1 KiB (a power-of-two stride falls into few L1
    sets, a worst case the calibration does not take as the rate); a quick run measures a real transpose."""
    import math

    from workbench.measure.calibrate import measure_transpose, transpose_sizes

    for llc in (8 * 2**20, 32 * 2**20, 96 * 2**20):
        s = transpose_sizes(llc)
        assert 8 * s["in_cache"] ** 2 <= llc / 2 and 4 * s["from_memory"] ** 2 >= 2 * llc * 0.9
        assert all(math.gcd(4 * n, 4096) < 1024 for n in s.values())
    r = measure_transpose(jax.devices()[0], 2 * 2**20, 3, True, quick=True)
    assert r["in_cache"]["per_s"] > 0 and r["from_memory"]["n"] == transpose_sizes(2 * 2**20, True)["from_memory"]


def test_rendezvous_is_measured_per_group_size():
    """A fresh 8-device process times psum chains in groups of 2, 4 and 8; each group size has its own figure, the
    top-level one is the whole mesh's."""
    import pytest

    from workbench.measure.calibrate import measure_rendezvous

    r = measure_rendezvous(8, 1)
    assert r is not None and set(r["by_group"]) == {"2", "4", "8"}
    for g, v in r["by_group"].items():
        assert v["collectives_apart"] == 16 and v["per_collective_s"] >= 0
        assert v["per_collective_per_device_s"] == pytest.approx(v["per_collective_s"] / 8)
    assert r["per_collective_s"] == r["by_group"]["8"]["per_collective_s"]
    assert measure_rendezvous(6, 1, groups=(4,))["by_group"].keys() == {"6"}  # 4 does not divide 6: the whole mesh


def test_two_processes_that_need_a_calibration_run_one(tmp_path, monkeypatch):
    """A calibration taken while another ran is wrong (they time each other): the second caller waits on the cache
    directory's lock and reads what the first wrote; forced calibrations take turns."""
    import threading
    import time as _time

    from workbench.measure import calibrate as cal

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    runs, inside, overlap = [], [0], []

    def fake(*, quick=False, quiet=False):
        inside[0] += 1
        overlap.append(inside[0])
        _time.sleep(0.3)
        inside[0] -= 1
        runs.append(1)
        return {"quick": quick, "n": len(runs)}

    monkeypatch.setattr(cal, "run_calibration", fake)
    got = []
    threads = [threading.Thread(target=lambda: got.append(cal.load_or_calibrate(quiet=True))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(runs) == 1 and max(overlap) == 1
    assert sorted(d["cached"] for d in got) == [False, True] and {d["n"] for d in got} == {1}
    threads = [threading.Thread(target=lambda: cal.load_or_calibrate(force=True, quiet=True)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(runs) == 3 and max(overlap) == 1  # forced: both ran, one after the other
