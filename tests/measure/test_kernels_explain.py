"""Whole-program accuracy: the per-kernel join (trace x HLO), the explained step, the clock source, held-out flagging."""
import json
import random

import pytest

from models.presets import get_config
from partitioning.mesh import make_mesh
from workbench.cost.hlo import parse_module
from workbench.hardware.measured import Measured
from workbench.hardware.spec import HardwareSpec, Interconnect
from workbench.measure.calibrate import KNOWN_PARTS, host_clock, peak_findings, physical_peaks
from workbench.measure.explain import TERMS, waterfall
from workbench.measure.kernels import KERNEL_CLASSES, KernelEvent, events_from_trace, kernel_table, wall_shares

# a host double: fixed ceilings, so the join is tested without calibrating
HOST = HardwareSpec(name="host", kind="cpu", vendor="test", peak_flops={"float32": 1e11, "bfloat16": 1e11},
                    hbm_bytes=2**34, hbm_bw=1e10, interconnect=Interconnect("host-memory", 1e10, 1),
                    transcendentals_per_s=1e9, measured=Measured(call_overhead_s=1e-5))


# ------------------------------------------------------------------------------------------ wall-clock shares
def _shares_by_loop(events, waits, dt=1e-3):
    """Reference: step through time in small slices, split each slice among the events running then."""
    end = max(e.start_s + e.dur_s for e in events)
    share = [0.0] * len(events)
    t = dt / 2
    while t < end:
        on = [i for i, e in enumerate(events) if e.start_s <= t < e.start_s + e.dur_s]
        work = [i for i in on if not waits[i]]
        for i in (work or on):
            share[i] += dt / len(work or on)
        t += dt
    return share


def test_wall_shares_match_a_plain_loop():
    rng = random.Random(0)
    events = [KernelEvent(f"k{i}", i % 3, "r", rng.uniform(0, 1), rng.uniform(0.01, 0.4)) for i in range(25)]
    waits = [i % 4 == 0 for i in range(25)]  # some are collectives (charged only when nothing else runs)
    share, busy = wall_shares(events, waits)
    ref = _shares_by_loop(events, waits, dt=1e-4)
    for s, r in zip(share, ref):
        assert s == pytest.approx(r, abs=2e-3)
    assert sum(share) == pytest.approx(busy)
    assert all(s <= e.dur_s + 1e-12 for s, e in zip(share, events))


def test_a_kernel_lasts_until_its_completion_mark():
    """XLA:CPU records an asynchronous kernel's event around its launch and marks its completion with 'end: <name>'
    later: each kernel event lasts until the first unmatched mark of its name at or after its start, in time order;
    a mark inside the event (a synchronous kernel) or none leaves it as recorded."""
    def ev(name, ts, dur):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "args": {"hlo_op": name, "device_ordinal": 0}}

    def mark(name, ts):
        return {"ph": "X", "name": f"end: {name}", "ts": ts, "dur": 1}

    raw = [ev("copy.1", 100, 10), mark("copy.1", 400), ev("copy.1", 1000, 10), mark("copy.1", 1200),
           ev("add.2", 500, 50), mark("add.2", 540), ev("dot.3", 600, 20), {"ph": "X", "name": "ThunkExecutor::Execute",
                                                                             "ts": 0, "dur": 5000}]
    got = {(e.name, round(e.start_s * 1e6)): round(e.dur_s * 1e6) for e in events_from_trace(raw)}
    assert got == {("copy.1", 100): 300, ("copy.1", 1000): 200, ("add.2", 500): 50, ("dot.3", 600): 20}


# ------------------------------------------------------------------------------------------ the join
@pytest.fixture(scope="module")
def scanned_fsdp():
    """tiny with scanned layers (a while loop), fsdp on 8 simulated devices (all-gathers, reduce-scatters)."""
    from workbench.cost.compile import compile_program
    from workbench.programs.step import build_train_step

    cfg = get_config("tiny", "scan_layers=true")
    mesh = make_mesh("data=8")
    prog = build_train_step(cfg, mesh=mesh, strategy="fsdp", batch_size=8, seq_len=32)
    comp = compile_program(prog.step, prog.state, prog.batch, mesh=mesh, n_devices=8, analytic=False)
    box = {"state": prog.state}

    def step(i):
        box["state"], m = comp.compiled(box["state"], prog.batch)
        return m["loss"]

    table = kernel_table(comp.compiled, step, HOST, n_devices=8, mesh=mesh, steps=2)
    return cfg, comp, table


@pytest.mark.compile_heavy
def test_per_kernel_join_on_a_scanned_program_with_collectives(scanned_fsdp):
    cfg, comp, table = scanned_fsdp
    assert table.unmatched_events == 0  # every traced kernel is an instruction of this program
    classes = {c.kernel_class for c in table.classes}
    assert {"collective", "elementwise/reduce"} <= classes and classes & {"dot", "dot-fusion"}
    assert classes <= set(KERNEL_CLASSES)
    # kernels of the scanned layer body run n_layers times per device per step, on all 8 devices
    mod = parse_module(comp.hlo_text)
    whiles = [i for i in mod.computations[mod.entry] if i.opcode == "while"]
    assert whiles
    body_names = set()
    for w in whiles:
        callee = w.attrs.split("body=")[1].split(",")[0].lstrip("%")
        body_names |= {i.name for i in mod.computations.get(callee, [])}
    looped = [r for r in table.rows if r.name in body_names and r.measured_s is not None and r.executions > 0]
    assert looped and any(r.executions == pytest.approx(cfg.n_layers * 8) for r in looped)
    # measured: shares of the wall clock, never more than the kernel's own durations; they add up to the busy time
    assert all(r.measured_s <= r.measured_raw_s + 1e-12 for r in table.rows if r.measured_s is not None)
    assert sum(r.measured_s or 0 for r in table.rows) == pytest.approx(table.busy_s, rel=1e-6)
    assert 0 < table.busy_s <= table.wall_s * 1.1
    # predicted: every priced kernel at its own roof, all devices added up
    assert all(r.predicted_s >= 0 for r in table.rows) and sum(r.predicted_s for r in table.rows) > 0
    c = table.by_class()["collective"]
    assert c.predicted_s > 0 and c.measured_s > 0
    json.dumps(table.to_record())


@pytest.mark.compile_heavy
def test_waterfall_terms_sum_to_the_step(scanned_fsdp):
    cfg, comp, table = scanned_fsdp
    from models.analytics import analytics

    an = analytics(cfg, 32)
    step_s = table.wall_s * 0.9  # any timed step: the remainder closes the gap to it
    w = waterfall(table, step_s=step_s, model_flops=an["train_flops_per_token"] * 8 * 32,
                  model_flops_causal=an["train_flops_per_token_causal"] * 8 * 32, ceiling_flops=HOST.peak("float32"),
                  call_overhead_s=HOST.measured.call_overhead_s)
    assert [t.name for t in w.terms] == list(TERMS)
    assert w.measured_sum_s == pytest.approx(step_s, rel=1e-9)
    by = {t.name: t for t in w.terms}
    cls = table.by_class()
    dots = sum(cls[c].measured_s for c in ("dot", "dot-fusion") if c in cls)
    assert (by[TERMS[0]].measured_s + by[TERMS[1]].measured_s + by[TERMS[2]].measured_s) == pytest.approx(dots)
    assert by["collectives not hidden"].measured_s == pytest.approx(cls["collective"].measured_s)
    assert by["dispatch/loop/host work"].measured_s >= table.idle_s - 1e-12
    # the remainder is the timed step against the traced one: kernels + idle add up to the traced wall clock
    assert by["unexplained remainder"].measured_s == pytest.approx(step_s - table.wall_s, abs=1e-9)
    assert w.mfu_causal < w.mfu  # causal-halved attention counts fewer flops
    assert w.predicted_s == pytest.approx(sum(t.predicted_s for t in w.terms))


@pytest.mark.compile_heavy
def test_run_explain_cli(monkeypatch, results_dir, capsys, tmp_path):
    """`workbench run --explain --json`: key `waterfall` (terms with predicted_s / measured_s summing to step_s),
    the chart under reports/run-<record>/, MFU in both conventions."""
    import os

    import workbench.programs.train as train
    from workbench.cli import main

    real = train.get_spec  # the host is a test double, so the test does not calibrate
    monkeypatch.setattr(train, "get_spec", lambda name, **kw: HOST if name == "host" else real(name, **kw))
    monkeypatch.chdir(tmp_path)
    main(["run", "--preset", "tiny", "--strategy", "dp", "--mesh", "data=8", "--devices", "8", "--batch", "8",
          "--seq", "32", "--steps", "4", "--explain", "--json"])
    out = json.loads(capsys.readouterr().out)
    terms = out["waterfall"]
    assert len(terms) == len(TERMS) and all({"name", "predicted_s", "measured_s"} <= set(t) for t in terms)
    assert sum(t["measured_s"] for t in terms) == pytest.approx(out["step_s"], rel=1e-6)
    assert os.path.exists(out["waterfall_detail"]["chart"])
    assert out["mfu_causal"] < out["mfu"] and out["waterfall_detail"]["mfu"]["full"] == pytest.approx(out["mfu"])


# ------------------------------------------------------------------------------------------ calibration
FEAT = {"model": "AMD EPYC", "vendor": "AuthenticAMD", "family": 0x19, "model_number": 0x01, "mhz": 2445.4,
        "max_mhz": 0.0, "cores": 2, "flags": ["avx", "avx2", "fma"], "llc_bytes": 2**25, "mem_bytes": 2**34}


def test_clock_comes_from_the_cpu_not_the_measurement(monkeypatch):
    monkeypatch.delenv("WORKBENCH_HOST_CLOCK_GHZ", raising=False)
    ghz, src, is_max = host_clock(FEAT)  # a known part: its maximum boost, with the source
    part = KNOWN_PARTS[("AuthenticAMD", 0x19, 0x01, 2450)]
    assert ghz == part[1] and is_max and part[2] in src
    ghz, src, _ = host_clock(dict(FEAT, max_mhz=3700.0))  # sysfs cpufreq wins when the kernel has it
    assert ghz == pytest.approx(3.7) and "cpufreq" in src
    ghz, src, is_max = host_clock(dict(FEAT, family=0x30))  # unknown part: the OS-reported clock, said so
    assert ghz == pytest.approx(2.4454) and "/proc/cpuinfo" in src and not is_max
    phys = physical_peaks(FEAT)  # Zen 3: 2 cores x 8 lanes x 2 FMA pipes x 2 x 3.5 GHz
    assert phys["peak_flops"]["float32"] == pytest.approx(2 * 8 * 2 * 2 * 3.5e9)
    assert "implied by the measured" not in json.dumps(phys)


def test_a_measurement_above_the_physical_peak_is_a_finding(monkeypatch):
    monkeypatch.delenv("WORKBENCH_HOST_CLOCK_GHZ", raising=False)
    phys = physical_peaks(FEAT)
    peak = phys["peak_flops"]["float32"]
    cal = {"physical": phys, "matmul": {"float32": {"n": 2048, "flops_per_s": 0.9 * peak,
                                                    "flops_per_s_best": 1.2 * peak}},
           "matmul_curve": [{"n": 512, "flops_per_s": 0.5 * peak}]}
    found = peak_findings(cal)
    assert len(found) == 1 and "exceeds the physical float32 peak" in found[0]
    cal["matmul"]["float32"]["flops_per_s_best"] = 0.95 * peak
    assert peak_findings(cal) == []
    # a curve point measured under the peak but levelled above it (apply_matmul_level) is a finding too
    cal["matmul_curve"] = [{"n": 512, "flops_per_s": 1.1 * peak, "flops_per_s_measured": 0.9 * peak}]
    assert len(peak_findings(cal)) == 1 and "rate curve" in peak_findings(cal)[0]


# ------------------------------------------------------------------------------------------ benchmark flags
def test_held_out_ops_are_flagged_apart_from_in_sample():
    from benchmarks.prediction_error import HELD_OUT, IN_SAMPLE_OPS, in_sample

    cal = {"matmul_curve": [{"n": n} for n in (128, 256, 512, 1024, 2048, 4096)],
           "matmul": {"float32": {"n": 2048}, "bfloat16": {"n": 2048}},
           "matmul_curves": {"bfloat16": [{"n": n} for n in (128, 256, 512, 1024, 2048)]}}
    assert all(in_sample(b, s, d, cal) for _, b, s, d in IN_SAMPLE_OPS)
    assert not any(in_sample(b, s, d, cal) for _, b, s, d in HELD_OUT)
    assert len(HELD_OUT) >= 10
    assert in_sample("matmul", {"m": 2048, "n": 2048, "k": 2048}, "bfloat16", cal)  # the bf16 calibration size
    assert not in_sample("matmul", {"m": 1536, "n": 1536, "k": 1536}, "bfloat16", cal)
    assert in_sample("matmul", {"m": 512, "n": 512, "k": 512}, "bfloat16", cal)  # a point of bf16's own curve
    assert not in_sample("matmul", {"m": 1024, "n": 1024, "k": 512}, "float32", cal)


def test_a_row_is_measured_at_the_median_of_its_three_timings():
    """settle: the row's measured time is the median of its timings (one slow timing does not decide it), its errors
    are against that median, and the first timing's figures stay beside them."""
    from benchmarks.prediction_error import settle

    row = settle({"predicted_s": 1.0, "predicted_s_now": 1.1}, [2.0, 1.0, 1.25])
    assert row["measured_s"] == 1.25 and row["measured_s_first"] == 2.0 and row["measured_s_timings"] == [2.0, 1.0, 1.25]
    assert row["signed_error"] == 1.0 / 1.25 - 1 and row["error"] == 0.25 / 1.25
    assert row["signed_error_first"] == -0.5 and row["error_first"] == 0.5
    assert abs(row["error_now"] - 0.15 / 1.25) < 1e-12
    assert settle({"predicted_s": 1.0}, [1.0])["error"] == 0.0  # a single timing: itself


def test_report_keeps_the_now_medians_apart():
    """The primary medians use the opening calibration; the *_now ones the machine (stream and matmul) sampled per
    row."""
    from benchmarks.prediction_error import report

    cal = {"matmul": {"float32": {"flops_per_s": 1.0}}, "stream": {"bytes_per_s": 1.0}, "findings": []}
    ops = [{"in_sample": False, "error": e, "error_now": n} for e, n in ((0.3, 0.05), (0.1, 0.02), (0.2, 0.5))]
    progs = [{"error": 0.4, "error_now": 0.1}, {"error": 0.2, "error_now": None}]
    r = report(ops, progs, cal, cal)
    assert r["median_error_ops_heldout"] == 0.2 and r["median_error_ops_heldout_now"] == 0.05
    assert abs(r["median_error_programs"] - 0.3) < 1e-12
    assert r["median_error_programs_now"] == 0.1


def test_machine_now_scales_every_matmul_figure_by_the_probe_over_the_calibrated_level():
    """machine_now samples the stream and the calibration's matmul probe: the spec it returns has the sampled stream
    as its memory rate and every peak and curve point scaled by one factor, probe rate / calibrated level."""
    import dataclasses

    from benchmarks.prediction_error import machine_now
    from workbench.hardware.spec import catalogue_spec as get_spec

    host = dataclasses.replace(get_spec("tpu-v5e"), kind="cpu").with_measured(
        matmul_curve=((128, 1e10), (1024, 4e10)),
        matmul_curves=(("bfloat16", ((128, 2e10),)),))
    cal = {"stream": {"buffer_bytes": 4 << 20}, "matmul": {"float32": {"n": 128, "flops_per_s": 2e10}},
           "matmul_level": {"n": 128}}
    now, rate = machine_now(host, cal)
    f = rate / 2e10
    assert rate > 0 and now.hbm_bw > 0 and now.name == "host-now" and now.measured.hbm_bw_range is None
    assert now.measured.matmul_curve == ((128, 1e10 * f), (1024, 4e10 * f))
    assert now.measured.matmul_curves == (("bfloat16", ((128, 2e10 * f),)),)
    assert all(abs(now.peak_flops[dt] / (host.peak_flops[dt] * f) - 1) < 1e-12 for dt in host.peak_flops)


def test_machine_now_scales_the_vector_rates_by_the_exp_probe_over_its_level():
    """With a calibration that levelled its vector figures (vector_level), machine_now also samples the exp probe and
    scales the special-function, conversion and in-cache reduction rates by one factor, probe / level; without
    one it leaves them."""
    import dataclasses

    from benchmarks.prediction_error import VECTOR_FIELDS, machine_now, vector_now
    from workbench.hardware.spec import catalogue_spec as get_spec

    host = dataclasses.replace(get_spec("tpu-v5e"), kind="cpu", transcendentals_per_s=2e9).with_measured(
        convert_per_s=1e10,
        reduce_per_s_cached=2e10,
        reduce_per_s=9e9)
    cal = {"stream": {"buffer_bytes": 4 << 20}, "matmul": {"float32": {"n": 128, "flops_per_s": 2e10}},
           "matmul_level": {"n": 128}, "transcendentals": {"exp": {"elements": 4096}},
           "vector_level": {"level": 1e9}}
    vec = vector_now(host, cal)
    assert set(vec) == set(VECTOR_FIELDS)
    g = vec["transcendentals_per_s"] / 2e9
    assert g > 0 and abs(vec["convert_per_s"] / (1e10 * g) - 1) < 1e-12
    assert abs(vec["reduce_per_s_cached"] / (2e10 * g) - 1) < 1e-12
    now, _ = machine_now(host, cal)
    assert now.measured.reduce_per_s == 9e9 and now.transcendentals_per_s > 0
    assert vector_now(host, {k: v for k, v in cal.items() if k != "vector_level"}) == {}


def test_mean_spec_averages_two_machine_samples():
    """A program priced at the machine sampled before and after its timing: memory rate, peaks and curve averaged."""
    import dataclasses

    from benchmarks.prediction_error import mean_spec
    from workbench.hardware.spec import catalogue_spec as get_spec

    base = dataclasses.replace(get_spec("tpu-v5e"), hbm_bw=10.0).with_measured(
        matmul_curve=((128, 1e10), (1024, 4e10)),
        matmul_curves=(("bfloat16", ((128, 2e10),)),))
    b = dataclasses.replace(base, hbm_bw=20.0, peak_flops={dt: 3 * v for dt, v in base.peak_flops.items()}).with_measured(
        matmul_curve=((128, 3e10), (1024, 6e10)),
        matmul_curves=(("bfloat16", ((128, 4e10),)),))
    m = mean_spec(base, b)
    assert m.hbm_bw == 15.0 and m.measured.matmul_curve == ((128, 2e10), (1024, 5e10))
    assert m.measured.matmul_curves == (("bfloat16", ((128, 3e10),)),)
    assert all(m.peak_flops[dt] == 2 * v for dt, v in base.peak_flops.items())
