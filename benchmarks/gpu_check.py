#!/usr/bin/env python3
"""GPU host check: run as it is on a GPU host (installs nothing), from the source tree's root (`-m` puts it on the path).

    python -m benchmarks.gpu_check [OUT_DIR]        # OUT_DIR defaults to $OUT, then ./gpu-check-out
    python -m benchmarks.gpu_check --tiny OUT_DIR   # a CPU smoke run with tiny sizes (the test suite uses it)

1. detects the backend and the chip (device_kind → catalogue entry);
2. calibrates: a bfloat16 matmul large enough to fill an H200 (8192³), a float32 one, and a device-to-device copy
   (bytes read + written) — through the one harness, workbench.measure.harness;
3. runs the built-in op suite, measured, and predicted against both the catalogue chip and the calibration;
4. runs the sections other parts add (precision: bf16 vs fp8 matmul), each guarded so one failure does not lose
   the rest;
5. writes results.jsonl (records), summary.json and table.md under OUT_DIR; everything in under 8 minutes.
Works on jax 0.10 and 0.11.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback

from workbench.hardware.devices import default_platform
from workbench.hardware.spec import catalogue
from workbench.measure.calibrate import get_spec
from workbench.measure.harness import measure, measure_steps, random_inputs
from workbench.programs.demo import run_suite
from workbench.results.store import Store

GPU_SUITE = [
    ("matmul", {"m": 4096, "n": 4096, "k": 4096}, "bfloat16"),
    ("matmul", {"m": 8192, "n": 8192, "k": 8192}, "bfloat16"),
    ("matmul", {"m": 8192, "n": 8192, "k": 8192}, "float32"),
    ("elementwise", {"n": 1 << 28}, "float32"),
    ("softmax", {"rows": 32768, "cols": 4096}, "bfloat16"),
    ("layernorm", {"rows": 32768, "cols": 4096}, "bfloat16"),
    ("attention", {"batch": 8, "heads": 16, "seq": 2048, "head_dim": 128}, "bfloat16"),
]
TINY_SUITE = [("matmul", {"m": 128, "n": 128, "k": 128}, "float32"), ("elementwise", {"n": 1 << 16}, "float32"),
              ("softmax", {"rows": 64, "cols": 128}, "float32"),
              ("attention", {"batch": 1, "heads": 2, "seq": 64, "head_dim": 32}, "float32")]
SECTIONS = ["benchmarks.gpu_precision"]  # modules with run(out_dir, spec, tiny) -> dict


def detect_chip(device_kind: str, platform: str):

    kind = device_kind.lower().replace(" ", "").replace("-", "")
    if platform == "cpu":
        return get_spec("host")
    for name, spec in catalogue().items():
        keys = [name, *spec.aliases]
        if any(k.lower().replace("-", "").replace(" ", "") in kind for k in keys):
            return spec
    if "h100" in kind:
        return catalogue()["h100-sxm"]
    raise SystemExit(f"gpu_check: device kind {device_kind!r} matches no catalogue chip")


def calibrate_device(dev, tiny: bool) -> dict:
    import jax
    import jax.numpy as jnp


    out = {}
    n = 256 if tiny else 8192
    for dt in ("bfloat16", "float32"):
        a = jax.ShapeDtypeStruct((n, n), jnp.dtype(dt))
        x, y = (jax.device_put(v, dev) for v in random_inputs((a, a), seed=1))
        c = jax.jit(lambda p, q: p @ q).lower(x, y).compile()
        m = measure(c, x, y, warmup=3, repeats=10)
        out[f"matmul_{dt}"] = {"n": n, "flops_per_s": 2.0 * n**3 / m.median_s, "spread": m.spread,
                               "best_flops_per_s": 2.0 * n**3 / m.min_s}
    nel = (1 << 16) if tiny else (1 << 30) // 4 * 2  # 2 GiB of float32
    f = jax.jit(lambda v: v * 1.0001 + 0.5, donate_argnums=0)
    st = {"x": jax.device_put(jax.random.normal(jax.random.key(0), (nel,), jnp.float32), dev)}

    def step(i):
        st["x"] = f(st["x"])
        return st["x"]

    m = measure_steps(step, warmup=3, repeats=10, guard=f)
    out["copy"] = {"bytes": nel * 4, "bytes_per_s": 2.0 * nel * 4 / m.median_s, "spread": m.spread,
                   "counted": "bytes read + bytes written"}
    st.clear()
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    tiny = "--tiny" in argv
    argv = [a for a in argv if a != "--tiny"]
    out_dir = argv[0] if argv else os.environ.get("OUT") or "gpu-check-out"
    os.makedirs(out_dir, exist_ok=True)
    os.environ["WORKBENCH_RESULTS"] = os.path.join(out_dir, "results.jsonl")
    t_start = time.time()
    import jax


    if tiny:
        default_platform()
    dev = jax.devices()[0]
    platform = dev.platform
    summary = {"backend": platform, "device_kind": dev.device_kind, "device_count": len(jax.devices()),
               "jax": jax.__version__, "tiny": tiny, "sections": {}}
    print(f"gpu_check: {platform} {dev.device_kind} × {len(jax.devices())}, jax {jax.__version__}", flush=True)
    spec = detect_chip(dev.device_kind, platform)
    summary["catalogue_chip"] = spec.name
    cal = calibrate_device(dev, tiny)
    summary["calibration"] = cal
    measured_spec = dataclasses.replace(
        spec, name=f"{spec.name}-calibrated",
        peak_flops={**spec.peak_flops, "bfloat16": cal["matmul_bfloat16"]["flops_per_s"],
                    "float32": cal["matmul_float32"]["flops_per_s"]},
        hbm_bw=cal["copy"]["bytes_per_s"], first_touch_bw=None)
    for k in ("bfloat16", "float32"):
        summary.setdefault("peak_vs_catalogue", {})[k] = cal[f"matmul_{k}"]["flops_per_s"] / spec.peak(k)
    summary["bw_vs_catalogue"] = cal["copy"]["bytes_per_s"] / spec.hbm_bw
    print("calibration:", json.dumps(cal), flush=True)
    rows = []
    for name, sizes, dt in (TINY_SUITE if tiny else GPU_SUITE):
        try:
            r = run_suite([(name, sizes)], dtype=dt, target=spec, repeats=10, progress=False,
                          kind="gpu-check-op", also_predict=(measured_spec,))[0]
            rec = _last_record()
            p2 = rec["extra"]["predictions"][measured_spec.name]["predicted_s"]
            r.update(dtype=dt, predicted_calibrated_s=p2,
                     error_calibrated=abs(p2 - r["measured_s"]) / r["measured_s"] if r["measured_s"] else None)
            rows.append(r)
            print(f"  {name} {sizes} {dt}: measured {r['measured_s']:.3g}s, predicted {r['predicted_s']:.3g}s "
                  f"(catalogue) / {p2:.3g}s (calibrated), bound {r['bound']}", flush=True)
        except Exception as e:
            rows.append({"op": name, "sizes": str(sizes), "dtype": dt, "failed": f"{type(e).__name__}: {e}"[:300]})
            print(f"  {name} failed: {e}", flush=True)
    summary["ops"] = rows
    import importlib

    for modname in SECTIONS:
        try:
            mod = importlib.import_module(modname)
            summary["sections"][modname] = mod.run(out_dir=out_dir, spec=spec, tiny=tiny)
        except ModuleNotFoundError as e:
            if e.name != modname:
                summary["sections"][modname] = {"failed": str(e)}
        except Exception as e:
            summary["sections"][modname] = {"failed": f"{type(e).__name__}: {e}"[:300],
                                            "traceback": traceback.format_exc()[-1500:]}
    summary["wall_s"] = time.time() - t_start
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    lines = [f"# GPU check: {dev.device_kind} ({platform}), jax {jax.__version__}", "",
             f"bf16 matmul {cal['matmul_bfloat16']['flops_per_s'] / 1e12:.1f} TFLOP/s "
             f"({summary['peak_vs_catalogue']['bfloat16']:.0%} of catalogue), copy "
             f"{cal['copy']['bytes_per_s'] / 1e12:.2f} TB/s ({summary['bw_vs_catalogue']:.0%} of catalogue)", "",
             "| op | sizes | dtype | bound | predicted (catalogue) | predicted (calibrated) | measured | error cat. | "
             "error cal. |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['op']} | {r['sizes']} | {r['dtype']} | failed: {r['failed'][:80]} |||||")
            continue
        lines.append(f"| {r['op']} | {r['sizes']} | {r['dtype']} | {r['bound']} | {r['predicted_s']:.3g} | "
                     f"{r['predicted_calibrated_s']:.3g} | {r['measured_s']:.3g} | {r['error']:.1%} | "
                     f"{r['error_calibrated']:.1%} |")
    for name, sec in summary["sections"].items():
        lines += ["", f"## {name}", "", "```", json.dumps(sec, indent=1, default=str)[:3000], "```"]
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"gpu_check: done in {summary['wall_s']:.0f}s; results under {out_dir}")
    return 0


def _last_record() -> dict:

    return Store().records()[-1]


if __name__ == "__main__":
    sys.exit(main())
