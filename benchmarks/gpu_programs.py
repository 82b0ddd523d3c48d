"""Whole programs on a GPU, predicted two ways and measured: the GPU check's programs section.

Each program is a `workbench predict` spec for one GPU (`h200:1`): the same mode, batch, sequence, remat and
precision policy are
  (a) compiled on the GPU this runs on (XLA:GPU with its autotuner, the real kernels) and predicted from that compile
      by the one prediction path (workbench.programs.predict.predict_lowered: the catalogue chip) and again with the
      device's own calibration (workbench.measure.device.calibrated_spec);
  (b) predicted from a CPU host, with no GPU: `python -m benchmarks.gpu_programs --predict-host` compiles each with
      deviceless XLA:GPU (the JAX CUDA plugin) and writes benchmarks/data/gpu_host_predictions.json, which this
      script reads back (the user's workflow: predict on a laptop, then run);
and measured on the GPU through the one harness (workbench.measure.harness.measure_steps). The device's optimized
HLO of each program is written under OUT/hlo/ (with its memory and cost analysis) so that its costs can be read
again by a later reader.

    python -m benchmarks.gpu_programs --predict-host [--only NAME]   # on a CPU host with the CUDA plugin
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import sys
import time
import traceback

from models.precision import get_policy
from partitioning import topology as topo
from partitioning.rules import get_rules
from workbench import compat
from workbench.measure.harness import measure_steps, random_inputs
from workbench.measure.kernels import KernelTrace, events_from_trace, join, trace_events
from workbench.programs.predict import PredictSpec, build_inference_step, lower, predict, predict_lowered, target_spec
from workbench.programs.step import build_train_step
from workbench.roofline import prediction as roofline
from workbench.roofline.pricing import priced_dtype

HERE = os.path.dirname(os.path.abspath(__file__))
HOST_PREDICTIONS = os.path.join(HERE, "data", "gpu_host_predictions.json")
TARGET = "h200:1"
LLAMA4 = "n_layers=4"  # a llama-style model at d_model 4096 (Llama 3 8B's layers, 4 of them)

# name -> PredictSpec fields (target and strategy fixed: one GPU, data parallel)
GPU_PROGRAMS = {
    "gpt2-small train bf16 16x1024": dict(preset="gpt2-small", batch=16, seq=1024, policy="bf16", remat="none"),
    "gpt2-small train bf16 16x1024 remat per-layer": dict(preset="gpt2-small", batch=16, seq=1024, policy="bf16",
                                                         remat="per-layer"),
    "gpt2-small train fp8 16x1024": dict(preset="gpt2-small", batch=16, seq=1024, policy="fp8-current", remat="none"),
    "llama d4096 x4 train bf16 4x4096": dict(preset="llama3-8b", overrides=LLAMA4, batch=4, seq=4096, policy="bf16",
                                            remat="none"),
    "small-moe train bf16 64x256": dict(preset="small-moe", batch=64, seq=256, policy="bf16", remat="none"),
    "llama d4096 x4 decode bf16 16x4096": dict(preset="llama3-8b", overrides=LLAMA4, batch=16, seq=4096,
                                              mode="decode", policy="bf16"),
    "llama d4096 x4 prefill bf16 4x4096": dict(preset="llama3-8b", overrides=LLAMA4, batch=4, seq=4096,
                                              mode="prefill", policy="bf16"),
}
TINY_PROGRAMS = {
    "tiny train float32 4x64": dict(preset="tiny", batch=4, seq=64, policy="float32", remat="none"),
    "tiny train float32 4x64 remat per-layer": dict(preset="tiny", batch=4, seq=64, policy="float32",
                                                   remat="per-layer"),
    "tiny-moe train float32 4x64": dict(preset="tiny-moe", batch=4, seq=64, policy="float32", remat="none"),
    "tiny decode float32 4x64": dict(preset="tiny", batch=4, seq=64, mode="decode", policy="float32"),
}


def predict_spec(fields: dict, gpu_compiler: str = "auto"):
    return PredictSpec(target=TARGET, strategy="dp", mesh="data=1", gpu_compiler=gpu_compiler, **fields)


def _concrete_inputs(lw):
    """(make_step(program) -> step(i) returning what to block on, the concrete first inputs, the jitted function)
    of a lowered spec: a training step threads its state (initialised as `workbench run` does); inference threads
    its donated cache (random weights and cache: the time does not depend on their values)."""
    spec = lw.spec
    policy = get_policy(spec.policy)
    if spec.mode == "train":
        prog = build_train_step(lw.cfg, policy=policy, mesh=lw.mesh, strategy=get_rules(spec.strategy),
                                      batch_size=lw.batch, seq_len=lw.seq, microbatches=spec.microbatches)

        def make_step(program):
            box = {"state": prog.state}

            def step(i):
                box["state"], metrics = program(box["state"], prog.batch)
                return metrics["loss"]
            return step
        return make_step, (prog.state, prog.batch), prog.step
    jitted, args, _ = build_inference_step(lw.cfg, policy, lw.mesh, get_rules(spec.strategy), lw.batch, lw.seq,
                                           spec.mode)
    params, rest, tokens, cache = random_inputs(args, seed=0)

    def make_step(program):
        box = {"cache": cache}

        def step(i):
            logits, box["cache"] = program(params, rest, tokens, box["cache"])
            return logits
        return step
    return make_step, (params, rest, tokens, cache), jitted


def _compile_for(lw, make_step, args, jitted):
    """The lowered program compiled once and run on the concrete inputs (one trace, one compile: on a GPU the
    autotuning compile is the longest phase); where the concrete inputs' shardings or layouts do not match the
    abstract ones, the jitted function compiled for the concrete inputs instead."""
    import jax

    compiled = lw.lowered.compile()
    try:
        step = make_step(compiled)
        jax.block_until_ready(step(-1))
        return compiled, step, "the lowered program"  # this step holds the state its first call donated
    except (TypeError, ValueError) as e:
        compiled = jitted.lower(*args).compile()
        return compiled, make_step(compiled), f"recompiled for the concrete inputs ({str(e).splitlines()[0][:120]})"


def run_on_device(name: str, fields: dict, *, cal_spec=None, out_dir: str | None = None, tiny: bool = False,
                  host: dict | None = None, trace: bool = False) -> dict:
    """Compile `fields` on this process's first device, predict it (catalogue and calibrated), measure it."""
    import jax

    dev = jax.devices()[0]
    spec = predict_spec(fields)
    phases = {}
    t0 = time.perf_counter()
    lw = lower(spec, devices=[dev], precheck=False)
    lw = dataclasses.replace(lw, compiler=f"xla-{dev.platform} (device)" if dev.platform != "cpu" else "xla-cpu",
                             notes=lw.notes + [f"compiled on the device ({dev.device_kind}), autotuned"])
    phases["lower_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    make_step, args, jitted = _concrete_inputs(lw)
    phases["inputs_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled, step, how = _compile_for(lw, make_step, args, jitted)
    compile_s = phases["compile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tp = predict_lowered(lw, compiled, compile_s)
    phases["predict_s"] = time.perf_counter() - t0
    rec = dict(tp.record)
    hlo_text = compiled.as_text()
    if out_dir:
        os.makedirs(os.path.join(out_dir, "hlo"), exist_ok=True)
        slug = "".join(c if c.isalnum() else "-" for c in name)
        with gzip.open(os.path.join(out_dir, "hlo", f"{slug}.txt.gz"), "wt") as f:
            f.write(hlo_text)
        ca, _ = compat.cost_analysis(compiled)
        mem, _ = compat.memory_analysis(compiled)
        with open(os.path.join(out_dir, "hlo", f"{slug}.json"), "w") as f:
            json.dump({"name": name, "fields": fields, "cost_analysis": ca, "memory_analysis": mem,
                       "platform": dev.platform, "device_kind": dev.device_kind}, f, default=str)
    t0 = time.perf_counter()
    m = measure_steps(step, warmup=2, repeats=3 if tiny else 5, min_total_s=0.05 if tiny else 1.0)
    phases["measure_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    traced = _trace(step, hlo_text, tp, name, out_dir) if trace else None
    phases["trace_s"] = time.perf_counter() - t0
    row = {"program": name, "spec": fields, "compiler": rec.get("compiler"), "compile_s": compile_s,
           "phases_s": phases, "compiled_from": how,
           "measured_s": m.median_s, "measured_iqr_s": m.iqr_s, "steps_timed": m.repeats,
           "predicted_s": rec.get("predicted_step_s"), "roofline_s": rec.get("roofline_s"),
           "bound": rec.get("bound"), "flops_per_device": rec.get("flops_per_device"),
           "model_flops_per_step": rec.get("model_flops_per_step"),
           "memory_per_device_bytes": rec.get("memory_per_device_bytes"),
           "unpriced_custom_calls": rec.get("unpriced_custom_calls"), "flop_counts": rec.get("flop_counts"),
           "tokens_per_s": rec["tokens_per_step"] / m.median_s,
           "mfu": (rec["analytic_floor_s"] / m.median_s if rec.get("analytic_floor_s") else None),
           "mfu_convention": "model flops (6N + attention, full) / step / the catalogue chip's bf16 peak",
           "compute_s": rec.get("compute_s"), "memory_s": rec.get("memory_s"), "notes": rec.get("notes", [])[-6:]}
    row["error"] = _err(row["predicted_s"], m.median_s)
    if traced is not None:
        row["kernel_trace"] = traced
    if cal_spec is not None and tp.cost is not None:
        pc = roofline.predict(tp.cost, cal_spec, dtype=priced_dtype(spec.policy), simulated_mesh=False)
        row["predicted_calibrated_s"] = pc.predicted_s
        row["error_calibrated"] = _err(pc.predicted_s, m.median_s)
    h = (host or {}).get(name)
    if h and h.get("predicted_step_s"):
        row["predicted_host_s"] = h["predicted_step_s"]
        row["error_host"] = _err(h["predicted_step_s"], m.median_s)
        row["host_prediction"] = {k: h.get(k) for k in ("compiler", "compiler_version", "jax", "date",
                                                        "memory_per_device_bytes", "flops_per_device")}
    return row


def _trace(step, hlo_text: str, tp, name: str, out_dir: str | None) -> dict:
    """Per-kernel truth: one traced step joined with the HLO (workbench.measure.kernels), and the trace's complete
    events kept (gzipped JSON beside the HLO) for readers the join does not know yet."""
    try:
        raw, walls = trace_events(step, steps=2, warmup=1)
        out = {"events": len(raw), "walls_s": walls}
        if out_dir:
            slug = "".join(c if c.isalnum() else "-" for c in name)
            keep = [e for e in raw if e.get("ph") in ("X", "M")][:200_000]  # a bounded file (the device tool's limit)
            with gzip.open(os.path.join(out_dir, "hlo", f"{slug}.trace.json.gz"), "wt") as f:
                json.dump(keep, f)
        kt = KernelTrace(tuple(events_from_trace(raw)), tuple(walls))
        out["kernel_events"] = len(kt.events)
        if tp.prediction is not None:
            table = join(kt, hlo_text, _spec_of(tp),
                         dtype=tp.prediction.peak_dtype)
            out["join"] = table.to_record(top=25)
        return out
    except Exception as e:  # noqa: BLE001 - the trace is extra; its failure is reported, not fatal
        return {"failed": f"{type(e).__name__}: {e}"[:300]}


def _spec_of(tp):
    return target_spec(topo.parse_target(tp.record["target"]))


def _err(pred, meas):
    return (pred - meas) / meas if pred and meas else None


def load_host_predictions() -> dict:
    try:
        with open(HOST_PREDICTIONS) as f:
            return json.load(f).get("programs", {})
    except (OSError, ValueError):
        return {}


def run(out_dir: str, spec=None, tiny: bool = False, cal_spec=None, deadline: float | None = None,
        on_row=None) -> dict:
    """The programs section: every program measured and predicted; one failure does not lose the rest. A program
    is skipped when the longest one so far would not end before `deadline`; on_row(result so far) after each."""
    host = load_host_predictions()
    rows = []
    longest = 0.0
    only = [w for w in os.environ.get("WORKBENCH_GPU_PROGRAMS", "").split(",") if w]
    for name, fields in (TINY_PROGRAMS if tiny else GPU_PROGRAMS).items():
        if only and not any(w in name for w in only):
            continue
        if deadline is not None and time.time() + longest > deadline:
            rows.append({"program": name, "skipped": "out of time"})
            continue
        t0 = time.time()
        try:
            row = run_on_device(name, fields, cal_spec=cal_spec, out_dir=out_dir, tiny=tiny, host=host,
                                trace=not rows and os.environ.get("WORKBENCH_GPU_TRACE", "1") != "0")
            row["wall_s"] = time.time() - t0
            print(f"  {name}: measured {row['measured_s'] * 1e3:.2f} ms, predicted {_ms(row['predicted_s'])} "
                  f"(catalogue) / {_ms(row.get('predicted_calibrated_s'))} (calibrated) / "
                  f"{_ms(row.get('predicted_host_s'))} (CPU host), compile {row['compile_s']:.0f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - a program that fails is reported, the others still run
            row = {"program": name, "failed": f"{type(e).__name__}: {e}"[:400],
                   "traceback": traceback.format_exc()[-1500:], "wall_s": time.time() - t0}
            print(f"  {name}: failed: {row['failed']}", flush=True)
        rows.append(row)
        longest = max(longest, row["wall_s"])
        import gc

        gc.collect()
        if on_row is not None:
            on_row({"programs": rows, "summary": summarize(rows), "partial": True})
    return {"programs": rows, "summary": summarize(rows)}


def _ms(s):
    return f"{s * 1e3:.2f} ms" if s else "—"


def summarize(rows: list[dict]) -> dict:
    """Median and maximum |error| of each prediction over the programs measured."""
    import statistics

    out = {}
    for key in ("error", "error_calibrated", "error_host"):
        errs = [abs(r[key]) for r in rows if r.get(key) is not None]
        if errs:
            out[key] = {"median": statistics.median(errs), "max": max(errs), "n": len(errs)}
    return out


def predict_host(only: str | None = None) -> dict:
    """(b): each GPU program predicted from this CPU host for h200:1 (deviceless XLA:GPU when the CUDA plugin is
    installed, else the XLA:CPU stand-in, named in `compiler`), written to HOST_PREDICTIONS."""
    import datetime

    import jax

    try:
        with open(HOST_PREDICTIONS) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {"programs": {}}
    for name, fields in GPU_PROGRAMS.items():
        if only and only not in name:
            continue
        t0 = time.time()
        tp = predict(predict_spec(fields), store=False)
        r = tp.record
        data["programs"][name] = {
            "fields": fields, "target": TARGET, "predicted_step_s": r.get("predicted_step_s"),
            "compiler": r.get("compiler"), "compiler_version": r.get("compiler_version"), "fits": r.get("fits"),
            "memory_per_device_bytes": r.get("memory_per_device_bytes"), "flops_per_device": r.get("flops_per_device"),
            "model_flops_per_step": r.get("model_flops_per_step"), "bound": r.get("bound"),
            "unpriced_custom_calls": r.get("unpriced_custom_calls"), "jax": jax.__version__,
            "date": datetime.date.today().isoformat(), "wall_s": time.time() - t0}
        print(f"{name}: {_ms(r.get('predicted_step_s'))}, {r.get('compiler')}, "
              f"{(r.get('memory_per_device_bytes') or 0) / 1e9:.1f} GB ({time.time() - t0:.0f} s)", flush=True)
        data["written_by"] = "python -m benchmarks.gpu_programs --predict-host"
        os.makedirs(os.path.dirname(HOST_PREDICTIONS), exist_ok=True)
        with open(HOST_PREDICTIONS, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
    return data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--predict-host", action="store_true", help="write the CPU-host predictions (b)")
    ap.add_argument("--only", default=None, help="programs whose name contains this")
    a = ap.parse_args(argv)
    if a.predict_host:
        predict_host(a.only)
        return 0
    ap.error("choose --predict-host")
    return 2


if __name__ == "__main__":
    sys.exit(main())
