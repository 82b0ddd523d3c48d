"""Prediction error of the host roofline on ops the calibration never ran and on whole programs.

    python -m benchmarks.prediction_error [--quick] [--json] [--no-programs] [--no-kernels]

Writes reports/prediction_error.json: keys `ops` and `programs` (each row: name, config, predicted_s, measured_s,
error = |predicted − measured| / measured, signed_error, in_sample), `median_error_ops_heldout`,
`median_error_ops_in_sample`, `median_error_programs`, `kernel_classes` (per kernel class, the predicted and measured
time summed over the programs' traced steps, from workbench.measure.kernels) and `calibration_drift` (a fresh calibration at
the start and another at the end: how far the machine moved meanwhile). Every row is priced twice: with the opening
calibration (`predicted_s`, `error`: what a user gets from a cached calibration) and with the machine's state sampled
just before the row is timed, the out-of-place stream, the calibration's float32 matmul probe and its exp probe (the
vector units' rate: special functions, conversions, in-cache reductions) (`predicted_s_now`,
`error_now`, `stream_now_bytes_per_s`, `matmul_now_flops_per_s`; medians `median_error_ops_heldout_now`,
`median_error_programs_now`): on a VM whose memory bandwidth and matmul rate move by tens of percent within minutes,
the second separates the machine's drift from the model's error. Every row is timed three times, and its
`measured_s` is the median of the three (`measured_s_timings`; ops in three passes over the list, before the
programs, halfway through them and after them; programs three times in their process, each timing at least a second
of steps): one timing caught in a slow spell of the VM does not decide a row. The first timing's figures stay beside
it (`measured_s_first`, `error_first`, medians `median_error_*_first_timing`). The first two timings give
`measured_s_repeat` and `repeat_change`: `repeatability` holds the median |second / first − 1|, the floor under any
prediction's error on this host.

Ops: in-sample rows are shapes the calibration itself ran (square float32 matmuls at the sizes of its rate curve): a
prediction there replays the calibration. Held-out rows are shapes it never ran: non-square, odd, batched and
transposed dots, 1000×3000×777, skinny dots, reductions over the short axis, bf16, odd softmax/layernorm/attention.
Programs: training steps of tiny, small and small-moe at 1 and 8 simulated devices under dp/fsdp/tp in float32 and
bf16, plus one prefill and one decode step. The device count is fixed when JAX starts, so every program runs in its
own process (`--worker`), with the calibration cached by the parent.

Targets (a benchmark, not a test): median program error ≤ 10 %, held-out ops ≤ 10 %. Records land in the results
store: each op as kind 'prediction-error', the whole report as one record of kind 'prediction_error'.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from models.precision import get_policy
from models.presets import get_config
from models.quant import matmul_format
from partitioning.mesh import make_mesh
from workbench.cost.compile import compile_program
from workbench.hardware.devices import request_devices
from workbench.hardware.hostmem import reexec_with_hugepages
from workbench.measure.calibrate import (
    get_spec,
    load_or_calibrate,
    matmul_probe,
    matmul_sample,
    spec_from_calibration,
    stream_out_of_place,
    vector_probe,
    vector_sample,
)
from workbench.measure.harness import measure, measure_steps, random_inputs
from workbench.measure.kernels import join, trace_kernels
from workbench.programs.experiment import run_program, summary
from workbench.programs.ops import program
from workbench.programs.predict import build_inference_step
from workbench.programs.step import build_train_step
from workbench.results.console import print_table
from workbench.results.store import Store, make_record
from workbench.roofline.prediction import memory_bw, predict

NOW = "host-now"  # the host spec with the stream and the matmul rate sampled just before a row is timed
PROGRAM_MIN_S = 1.0  # each of a program's timings runs at least this long (a `tiny` step is ~10 ms)
_BUF: dict = {}


def machine_now(host, cal: dict):
    """`host` with its memory rate and its matmul level replaced by the machine's state sampled now: the
    out-of-place stream (workbench.measure.calibrate) over the calibration's buffer size (3 repeats, a few seconds)
    and the calibration's float32 matmul probe (3 repeats, about a second), every matmul figure scaled by the probe's
    rate over the calibration's level for it, and the vector-unit rates by its exp probe's (vector_now). The
    machine's own drift between the calibration and a row is then apart from the model's error: rows carry both
    predictions."""
    nel = max(int(cal["stream"]["buffer_bytes"]) // 4, 1 << 20)
    n = int((cal.get("matmul_level") or {}).get("n") or cal["matmul"]["float32"]["n"])
    if _BUF.get("n") != nel:
        _BUF.update(n=nel, x=jnp.ones((nel,), jnp.float32))
    if _BUF.get("mm_n") != n:
        _BUF.update(mm_n=n, probe=matmul_probe(n, jax.devices()[0]))
    bw = stream_out_of_place(_BUF["x"], reps=3, trips=(1, 3))["bytes_per_s"]
    rate = matmul_sample(_BUF["probe"], 3)
    f = rate / cal["matmul"]["float32"]["flops_per_s"]
    curve = tuple((m, r * f) for m, r in host.measured.matmul_curve) if host.measured.matmul_curve else None
    curves = tuple((dt, tuple((m, r * f) for m, r in pts)) for dt, pts in host.measured.matmul_curves or ()) or None
    vec = vector_now(host, cal)
    now = dataclasses.replace(host, name=NOW, hbm_bw=bw, peak_flops={dt: v * f for dt, v in host.peak_flops.items()})
    return with_vector(now.with_measured(hbm_bw_range=None, matmul_curve=curve, matmul_curves=curves), vec), rate


def drift_sample(cal: dict) -> dict:
    """The machine at the end of the run, as the drift needs it: the calibration's stream and float32 matmul probe
    sampled now (machine_now; seconds, where a second whole calibration took minutes), in the calibration's keys."""
    now, rate = machine_now(spec_from_calibration(cal), cal)
    return {"matmul": {"float32": {"flops_per_s": rate}}, "stream": {"bytes_per_s": now.hbm_bw}, "findings": []}


VECTOR_FIELDS = ("transcendentals_per_s", "convert_per_s", "reduce_per_s_cached")  # the first the spec's, the rest measured


def vector_rate(spec, k: str):
    return getattr(spec, k) if k == "transcendentals_per_s" else getattr(spec.measured, k)


def with_vector(spec, rates: dict):
    """`spec` with some VECTOR_FIELDS replaced."""
    top = {k: v for k, v in rates.items() if k == "transcendentals_per_s"}
    return dataclasses.replace(spec, **top).with_measured(**{k: v for k, v in rates.items() if k not in top})


def vector_now(host, cal: dict) -> dict:
    """The host's vector-unit rates (special functions, conversions, in-cache reductions) scaled by the calibration's
    exp probe sampled now over its calibrated level (`vector_level.level`, workbench.measure.calibrate): {} for a
    calibration without one (before version 18)."""
    lv = cal.get("vector_level") or {}
    if not lv.get("level"):
        return {}
    nel = int(cal["transcendentals"]["exp"]["elements"])
    if _BUF.get("vec_n") != nel:
        _BUF.update(vec_n=nel, vprobe=vector_probe(nel, jax.devices()[0]))
    g = vector_sample(_BUF["vprobe"], 3) / lv["level"]
    return {k: vector_rate(host, k) * g for k in VECTOR_FIELDS if vector_rate(host, k)}


def mean_spec(a, b):
    """The host spec whose memory rate, peaks, matmul curve and vector rates are the means of two machine_now samples' (a
    program's timing spans a minute: sampled before and after it)."""
    mean = lambda p, q: tuple((n, (r + s) / 2) for (n, r), (_, s) in zip(p, q))  # noqa: E731
    curve = mean(a.measured.matmul_curve, b.measured.matmul_curve) if a.measured.matmul_curve else None
    curves = tuple((dt, mean(p, q)) for (dt, p), (_, q)
                   in zip(a.measured.matmul_curves or (), b.measured.matmul_curves or ())) or None
    vec = {k: (vector_rate(a, k) + vector_rate(b, k)) / 2 for k in VECTOR_FIELDS
           if vector_rate(a, k) and vector_rate(b, k)}
    m = dataclasses.replace(a, hbm_bw=(a.hbm_bw + b.hbm_bw) / 2,
                            peak_flops={dt: (v + b.peak_flops[dt]) / 2 for dt, v in a.peak_flops.items()})
    return with_vector(m.with_measured(matmul_curve=curve, matmul_curves=curves), vec)


IN_SAMPLE = [("matmul", {"m": 512, "n": 512, "k": 512}), ("matmul", {"m": 1024, "n": 1024, "k": 1024}),
             ("matmul", {"m": 2048, "n": 2048, "k": 2048})]
# (name, builder, sizes, dtype): shapes the calibration never ran
HELD_OUT = [
    ("matmul 1000x3000x777", "matmul", {"m": 1000, "k": 3000, "n": 777}, "float32"),
    ("matmul odd 333x4095x2049", "matmul", {"m": 333, "k": 4095, "n": 2049}, "float32"),
    ("matmul batched 16x(256x512)(512x384)", "batched", {"b": 16, "m": 256, "k": 512, "n": 384}, "float32"),
    ("matmul transposed A^T B 2048x1024x1536", "matmul_tn", {"m": 1024, "k": 2048, "n": 1536}, "float32"),
    ("matmul transposed A B^T 1536x2048x1024", "matmul_nt", {"m": 1536, "k": 2048, "n": 1024}, "float32"),
    ("matmul skinny 8192x4096x16", "matmul", {"m": 8192, "k": 4096, "n": 16}, "float32"),
    ("matmul bf16 1536^3", "matmul", {"m": 1536, "k": 1536, "n": 1536}, "bfloat16"),
    ("sum over the short axis [262144,32]", "reduce_short", {"rows": 1 << 18, "cols": 32}, "float32"),
    ("sum over the short axis [32,262144] axis 0", "reduce_short_t", {"rows": 32, "cols": 1 << 18}, "float32"),
    ("softmax short rows [65536,96]", "softmax", {"rows": 65536, "cols": 96}, "float32"),
    ("softmax [8192,2048]", "softmax", {"rows": 8192, "cols": 2048}, "float32"),
    ("layernorm odd [3000,1000]", "layernorm", {"rows": 3000, "cols": 1000}, "float32"),
    ("elementwise bf16 2^24", "elementwise", {"n": 1 << 24}, "bfloat16"),
    ("attention b3 h6 s384 d80", "attention", {"batch": 3, "heads": 6, "seq": 384, "head_dim": 80}, "float32"),
    ("decode products 8 rows over 96 MiB of weights", "weight_stream", {"rows": 8, "d": 512, "f": 2048, "layers": 12},
     "float32"),
    ("decode products 1 row over 96 MiB of weights", "weight_stream", {"rows": 1, "d": 512, "f": 2048, "layers": 12},
     "float32"),
]
QUICK_OPS = [("matmul 300x200x100", "matmul", {"m": 300, "k": 200, "n": 100}, "float32"),
             ("sum over the short axis [4096,32]", "reduce_short", {"rows": 4096, "cols": 32}, "float32")]
# whole programs: (name, worker spec)
PROGRAMS = [
    ("tiny 1 device dp float32", dict(kind="train", preset="tiny", devices=1, mesh="data=1", strategy="dp", batch=8)),
    ("tiny 1 device dp bf16", dict(kind="train", preset="tiny", devices=1, mesh="data=1", strategy="dp", batch=8,
                                   precision="bf16")),
    ("tiny 8 devices dp float32", dict(kind="train", preset="tiny", devices=8, mesh="data=8", strategy="dp", batch=8)),
    ("tiny 8 devices fsdp float32", dict(kind="train", preset="tiny", devices=8, mesh="data=8", strategy="fsdp",
                                         batch=8)),
    ("tiny 8 devices tp float32", dict(kind="train", preset="tiny", devices=8, mesh="data=2,model=4", strategy="tp",
                                       batch=8)),
    ("tiny 8 devices fsdp bf16", dict(kind="train", preset="tiny", devices=8, mesh="data=8", strategy="fsdp", batch=8,
                                      precision="bf16")),
    ("small 1 device dp float32", dict(kind="train", preset="small", devices=1, mesh="data=1", strategy="dp", batch=8)),
    ("small 1 device dp bf16", dict(kind="train", preset="small", devices=1, mesh="data=1", strategy="dp", batch=8,
                                    precision="bf16")),
    ("small 8 devices dp float32", dict(kind="train", preset="small", devices=8, mesh="data=8", strategy="dp",
                                        batch=16)),
    ("small 8 devices fsdp float32", dict(kind="train", preset="small", devices=8, mesh="data=8", strategy="fsdp",
                                          batch=16)),
    ("small 8 devices tp float32", dict(kind="train", preset="small", devices=8, mesh="data=2,model=4", strategy="tp",
                                        batch=16)),
    ("small-moe 1 device dp float32", dict(kind="train", preset="small-moe", devices=1, mesh="data=1", strategy="dp",
                                           batch=8)),
    ("small-moe 8 devices fsdp float32", dict(kind="train", preset="small-moe", devices=8, mesh="data=8",
                                              strategy="fsdp", batch=16)),
    ("small prefill 1 device", dict(kind="prefill", preset="small", devices=1, mesh="data=1", strategy="dp", batch=4)),
    ("small decode 1 device", dict(kind="decode", preset="small", devices=1, mesh="data=1", strategy="dp", batch=8)),
]
QUICK_PROGRAMS = [("tiny 1 device dp float32", dict(kind="train", preset="tiny", devices=1, mesh="data=1",
                                                     strategy="dp", batch=2, steps=3))]


# ------------------------------------------------------------------------------------------ ops
def op_program(builder: str, sizes: dict, dtype: str):
    """(fn, abstract args) of one held-out op (workbench.programs.ops.program)."""
    return program(builder, sizes, dtype)


def in_sample(builder: str, sizes: dict, dtype: str, cal: dict) -> bool:
    """Whether the calibration `cal` itself ran this op: a square matmul at a size of its rate curve for that dtype
    (float32's, or bfloat16's own since calibration version 21), or at the size of its matmul ceiling for it."""
    if builder != "matmul" or not (sizes["m"] == sizes["n"] == sizes["k"]):
        return False
    n = sizes["m"]
    curve = {r["n"] for r in (cal.get("matmul_curve", []) if dtype == "float32"
                              else (cal.get("matmul_curves") or {}).get(dtype, []))}
    return n in curve or cal.get("matmul", {}).get(dtype, {}).get("n") == n


def run_ops(ops, cal: dict, repeats: int, save=None) -> list[dict]:
    rows = []
    host = get_spec("host")
    for name, builder, sizes, dtype in ops:
        print(f"op: {name}", file=sys.stderr, flush=True)
        fn, args = op_program(builder, sizes, dtype)
        now, rate = machine_now(host, cal)
        rec = run_program(fn, args, kind="prediction-error", repeats=repeats, compute_dtype=dtype,
                          spec={"op": builder, "sizes": sizes, "dtype": dtype, "description": name},
                          also_predict=(now,))
        s = summary(rec)
        p, m = s["predicted_s"], s["measured_s"]
        pn = rec["extra"]["predictions"][NOW]["predicted_s"]
        rows.append({"name": name, "config": {"op": builder, "sizes": sizes, "dtype": dtype}, "predicted_s": p,
                     "measured_s": m, "error": abs(p - m) / m, "signed_error": p / m - 1,
                     "predicted_s_now": pn, "error_now": abs(pn - m) / m,
                     "stream_now_bytes_per_s": now.hbm_bw, "matmul_now_flops_per_s": rate,
                     "in_sample": in_sample(builder, sizes, dtype, cal), "bound": s["bound"],
                     "predicted_s_band": rec["prediction"].get("predicted_s_band"),
                     "wide_spread": s["wide_spread"]})
        if save:
            save(rows, [])
    return rows


def remeasure_ops(rows: list[dict], ops, repeats: int, save=None, which: str = "second") -> list[dict]:
    """Time every op again, minutes after its first timing (a pass over the whole list). The second pass gives
    `measured_s_repeat` and `repeat_change` (second / first − 1) per row: the spread between the two passes is the
    host's own repeatability, the floor under any prediction's error on it. Every pass's median joins the row's
    `measured_s_passes`."""
    for row, (name, builder, sizes, dtype) in zip(rows, ops):
        print(f"op ({which} timing): {name}", file=sys.stderr, flush=True)
        fn, args = op_program(builder, sizes, dtype)
        c = jax.jit(fn).lower(*args).compile()
        m = measure(c, *random_inputs(args, seed=0), warmup=2, repeats=repeats)
        row.setdefault("measured_s_passes", [row["measured_s"]]).append(m.median_s)
        if which == "second":
            row.update(measured_s_repeat=m.median_s, repeat_change=m.median_s / row["measured_s"] - 1)
        if save:
            save(rows, None)
    return rows


def settle(row: dict, timings: list[float]) -> dict:
    """The row's measured time is the median of its timings spread over the run (an op: three passes over the list,
    minutes apart; a program: three timings in its process), so that one timing caught in a slow spell of the VM
    does not decide the row; the first timing's figures stay beside it (`measured_s_first`, `error_first`,
    `signed_error_first`)."""
    first = timings[0]
    m = statistics.median(timings)
    p, pn = row["predicted_s"], row.get("predicted_s_now")
    row.update(measured_s_first=first, error_first=abs(p - first) / first, signed_error_first=p / first - 1,
               measured_s=m, error=abs(p - m) / m, signed_error=p / m - 1, measured_s_timings=list(timings))
    if pn is not None:
        row["error_now"] = abs(pn - m) / m
    return row


# ------------------------------------------------------------------------------------------ programs
def run_worker(spec: dict) -> dict:
    """One program in this process (its device count set before JAX starts): compile, predict, time, and join a
    trace kernel by kernel. Returns the program's row."""
    request_devices(int(spec["devices"]))
    cfg = get_config(spec["preset"], spec.get("overrides"))
    mesh = make_mesh(spec["mesh"])
    policy = get_policy(spec.get("precision", "float32"))
    n = mesh.size
    if spec["kind"] == "train":
        prog = build_train_step(cfg, policy=policy, mesh=mesh, strategy=spec["strategy"], batch_size=spec["batch"],
                                seq_len=spec.get("seq"))
        comp = compile_program(prog.step, prog.state, prog.batch, mesh=mesh, n_devices=n, analytic=False,
                               compute_dtype=np.dtype(policy.compute_dtype).name)
        box = {"state": prog.state}

        def step(i):
            box["state"], metrics = comp.compiled(box["state"], prog.batch)
            return metrics["loss"]
    else:
        seq = spec.get("seq") or cfg.seq_len
        jitted, args, _ = build_inference_step(cfg, policy, mesh, spec["strategy"], spec["batch"], seq, spec["kind"])
        comp = compile_program(jitted, *args, mesh=mesh, n_devices=n, analytic=False,
                               compute_dtype=np.dtype(policy.compute_dtype).name)
        params, rest, tokens, cache = random_inputs(args, seed=0)
        box = {"cache": cache}

        def step(i):
            logits, box["cache"] = comp.compiled(params, rest, tokens, box["cache"])
            return logits

    host = get_spec("host")
    dtype = matmul_format(policy)["peak_dtype"]
    pred = predict(comp.cost, host, dtype=dtype)
    cal = load_or_calibrate(run_if_missing=False)
    now, rate = machine_now(host, cal) if spec.get("now", True) else (None, None)
    steps = int(spec.get("steps", 5))
    m = measure_steps(step, warmup=2, repeats=steps, compile_s=comp.compile_s, min_total_s=PROGRAM_MIN_S)
    classes = None
    if spec.get("kernels", True):
        bw, _ = memory_bw(comp.cost, host, n > 1)
        table = join(trace_kernels(step, steps=1, warmup=0), comp.hlo_text, host, n_devices=n, mesh=mesh,
                     dtype=dtype, memory_bw=bw, program_bytes=comp.cost.peak_memory_bytes)
        classes = {c.kernel_class: c.to_record() for c in table.classes}
        classes["_idle"] = {"measured_s": table.idle_s, "wall_s": table.wall_s}
    again = measure_steps(step, warmup=1, repeats=steps, min_total_s=PROGRAM_MIN_S)  # after the trace: repeatability
    third = measure_steps(step, warmup=1, repeats=steps, min_total_s=PROGRAM_MIN_S)
    if now is not None:  # the machine sampled again after the timings: the program is priced at the mean
        now_after, rate_after = machine_now(host, cal)
        now, rate = mean_spec(now, now_after), (rate + rate_after) / 2
    pn = predict(comp.cost, now, dtype=dtype).predicted_s if now is not None else None
    return {"measured_s_repeat": again.median_s, "repeat_change": again.median_s / m.median_s - 1,
            "predicted_s": pred.predicted_s, "timings_s": [m.median_s, again.median_s, third.median_s],
            "measured_iqr_s": m.iqr_s, "steps_timed": [m.repeats, again.repeats, third.repeats],
            "predicted_s_now": pn,
            "stream_now_bytes_per_s": now.hbm_bw if now is not None else None, "matmul_now_flops_per_s": rate,
            "predicted_s_band": pred.predicted_s_band, "bound": pred.bound, "wide_spread": m.wide_spread,
            "compile_s": comp.compile_s, "n_devices": n, "kernel_classes": classes}


def run_programs(programs, *, kernels: bool, timeout: int = 900, save=None, rows=None) -> list[dict]:
    """Each program in its own worker process; the rows are appended to `rows` (a list begun by an earlier call)."""
    rows = [] if rows is None else rows
    for name, spec in programs:
        print(f"program: {name}", file=sys.stderr, flush=True)
        spec = dict(spec, kernels=kernels)
        p = subprocess.run([sys.executable, "-m", "benchmarks.prediction_error", "--worker", json.dumps(spec)],
                           capture_output=True, text=True, timeout=timeout)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            rows.append({"name": name, "config": spec, "predicted_s": None, "measured_s": None, "error": None,
                         "in_sample": False, "failed": (p.stderr or "").strip().splitlines()[-1:] or ["no output"]})
            continue
        r = json.loads(lines[-1])
        timings = r.pop("timings_s")
        rows.append(settle({"name": name, "config": spec, "in_sample": False, **r}, timings))
        if save:
            save(None, rows)
    return rows


def class_totals(programs: list[dict]) -> dict:
    """Per kernel class, predicted and measured seconds summed over the programs' traced steps, and the error."""
    tot: dict[str, dict] = {}
    for r in programs:
        for cls, c in (r.get("kernel_classes") or {}).items():
            if cls.startswith("_"):
                continue
            t = tot.setdefault(cls, {"predicted_s": 0.0, "measured_s": 0.0, "kernels": 0, "programs": 0})
            t["predicted_s"] += c["predicted_s"]
            t["measured_s"] += c["measured_s"]
            t["kernels"] += c["kernels"]
            t["programs"] += 1
    for t in tot.values():
        t["error"] = t["predicted_s"] / t["measured_s"] - 1 if t["measured_s"] else None
    return tot


def report(ops: list[dict], programs: list[dict], before: dict, after: dict | None) -> dict:
    """The JSON report (see the module docstring); `after` None: the run has not finished (no drift yet)."""
    drift = None
    if after is not None:
        drift = {"matmul_float32": after["matmul"]["float32"]["flops_per_s"] / before["matmul"]["float32"]["flops_per_s"]
                 - 1, "stream": after["stream"]["bytes_per_s"] / before["stream"]["bytes_per_s"] - 1,
                 "stream_range_before": before["stream"].get("range_bytes_per_s"),
                 "stream_range_after": after["stream"].get("range_bytes_per_s")}
    held = [o for o in ops if not o["in_sample"]]
    return {"ops": ops, "programs": programs, "complete": after is not None,
            "median_error_ops_heldout": _median(o["error"] for o in held),
            "median_error_ops_in_sample": _median(o["error"] for o in ops if o["in_sample"]),
            "median_error_programs": _median(p["error"] for p in programs),
            # against each row's first timing alone (before the median of three timings)
            "median_error_ops_heldout_first_timing": _median(o.get("error_first") for o in held),
            "median_error_programs_first_timing": _median(p.get("error_first") for p in programs),
            # the same, priced with the stream and the matmul rate sampled just before each row (the machine's drift
            # taken out)
            "median_error_ops_heldout_now": _median(o.get("error_now") for o in held),
            "median_error_programs_now": _median(p.get("error_now") for p in programs),
            "kernel_classes": class_totals(programs), "calibration_drift": drift,
            # the host's own repeatability: each row timed twice (ops: a second pass over the list, minutes later;
            # programs: again after the trace, in the same process), median |second / first − 1|
            "repeatability": {"ops": _median(abs(o["repeat_change"]) for o in ops if o.get("repeat_change") is not None),
                              "programs": _median(abs(p["repeat_change"]) for p in programs
                                                  if p.get("repeat_change") is not None)},
            "findings": before.get("findings", []) + [f"(end) {f}" for f in (after or {}).get("findings", [])],
            "n_ops_heldout": len(held), "n_programs": len([p for p in programs if p.get("error") is not None])}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two ops and one tiny program (smoke test)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-programs", action="store_true", help="ops only")
    ap.add_argument("--no-kernels", action="store_true", help="no per-kernel trace of the programs")
    ap.add_argument("--out", default=os.path.join("reports", "prediction_error.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker)), default=str))
        return {}

    request_devices(None)
    before = load_or_calibrate(force=True, quick=args.quick)
    done = {"ops": [], "programs": []}

    def save(ops_rows=None, program_rows=None, after=None):
        """Write the report so far (a partial one after every row: an interrupted run keeps what it measured)."""
        if ops_rows is not None:
            done["ops"] = ops_rows
        if program_rows is not None:
            done["programs"] = program_rows
        out = report(done["ops"], done["programs"], before, after)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2, default=str)
        return out

    op_list = QUICK_OPS if args.quick else IN_SAMPLE_OPS + HELD_OUT
    ops = run_ops(op_list, before, repeats=5 if args.quick else 10, save=save)
    # the ops are timed in three passes spread over the run: before the programs, halfway through them, after them
    plist = [] if args.no_programs else (QUICK_PROGRAMS if args.quick else PROGRAMS)
    half = (len(plist) + 1) // 2
    programs = run_programs(plist[:half], kernels=not args.no_kernels, save=save)
    ops = remeasure_ops(ops, op_list, repeats=5 if args.quick else 10, save=save)
    programs = run_programs(plist[half:], kernels=not args.no_kernels, save=save, rows=programs)
    ops = remeasure_ops(ops, op_list, repeats=5 if args.quick else 10, save=save, which="third")
    ops = [settle(o, o["measured_s_passes"]) for o in ops]
    after = drift_sample(before)
    out = save(ops, programs, after)
    Store().append(make_record("prediction_error", {"quick": args.quick, "programs": not args.no_programs},
                               extra=out))  # the record the paper's notebook reads (notebooks/prediction_error.py)
    drift = out["calibration_drift"]
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        cols = ["name", "in_sample", "predicted_s", "measured_s", "signed_error"]
        print_table(ops, cols, title="ops: predicted vs measured on this host")
        print_table(programs, cols, title="whole programs")
        print_table([{"class": k, **v} for k, v in out["kernel_classes"].items()],
                    ["class", "kernels", "predicted_s", "measured_s", "error"], title="per kernel class (programs)")
        fmt = lambda x: f"{x:.1%}" if x is not None else "n/a"  # noqa: E731
        print(f"median error: held-out ops {fmt(out['median_error_ops_heldout'])}, in-sample ops "
              f"{fmt(out['median_error_ops_in_sample'])}, programs {fmt(out['median_error_programs'])} (with the "
              f"stream and the matmul sampled before each row: held-out ops "
              f"{fmt(out['median_error_ops_heldout_now'])}, programs {fmt(out['median_error_programs_now'])}); "
              f"first timings alone: held-out ops {fmt(out['median_error_ops_heldout_first_timing'])}, programs "
              f"{fmt(out['median_error_programs_first_timing'])}; the "
              f"host's repeatability (first timing against the second): ops {fmt(out['repeatability']['ops'])}, programs "
              f"{fmt(out['repeatability']['programs'])}; drift "
              f"matmul {drift['matmul_float32']:+.1%}, stream {drift['stream']:+.1%}; {args.out}")
    return out


IN_SAMPLE_OPS = [(f"matmul {s['m']}^3 (calibrated size)", "matmul", s, "float32") for _, s in IN_SAMPLE]

if __name__ == "__main__":

    reexec_with_hugepages()  # before JAX starts: huge pages for XLA:CPU buffers (workbench/hostmem.py)
    main()
