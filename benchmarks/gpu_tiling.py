"""GPU device-check section (benchmarks/gpu_check.py imports it): the shape sawtooth measured on the device, and the
Pallas blocked matmul's best block against the XLA dot (cuBLAS on a GPU).

    run(out_dir, spec, tiny) -> dict          # spec: the catalogue chip; tiny: a CPU smoke run (the test suite)

1. sawtooth: x[M, k] @ y[k, M] in bf16 for k across two multiples of 128 (M = 8192 on a GPU), compiled and measured
   through the harness (workbench.programs.tiling.sweep), each point beside the roofline at its padded shape;
2. tile search: the Pallas matmul's blocks for 4096^3 bf16 ranked by the tile model, the best three compiled with
   the Triton lowering and measured, against the XLA dot of the same shape measured the same way.
On a CPU (tiny) the sweep runs on the host at small sizes and the search ranks without compiling (no GPU compiler):
the row says so. About a minute on an H200.
"""
from __future__ import annotations

from workbench.measure.harness import measure, random_inputs
from workbench.programs.tiling import search, sweep


def run(out_dir: str | None = None, spec=None, tiny: bool = False) -> dict:
    import jax
    import jax.numpy as jnp

    gpu = jax.devices()[0].platform in ("gpu", "cuda", "rocm")
    chip = spec.name if (spec is not None and gpu) else "host"
    out: dict = {"device": jax.devices()[0].device_kind, "chip": chip}
    if gpu:
        sw = sweep(chip, 8192, 8192, 8064, 8320, 32, repeats=10, progress=False)
    else:
        sw = sweep("host", 128, 128, 112, 144, 16, dtype="float32", repeats=3, progress=False)
    out["sawtooth"] = [{"k": p.k, "predicted_s": p.predicted_s, "measured_s": p.measured_s,
                        "measured_tflops": (2.0 * p.m * p.n * p.k / p.measured_s / 1e12) if p.measured_s else None,
                        "mxu_padded_k": p.mxu_padded["k"]} for p in sw.points]
    n = 256 if tiny else 4096
    target = chip if gpu else "h100"  # on a CPU: rank an H100's blocks, compile nothing
    sr = search("matmul", n, n, n, target, top=3 if gpu else 0, progress=False)
    best = sr.best
    out["search"] = {"target": target, "compiled_here": gpu,
                     "top": [c.to_record() for c in sr.candidates[:5]],
                     "rejected": sum(1 for c in sr.candidates if not c.fits),
                     "notes": list(sr.notes)}
    if gpu:
        dt = jnp.bfloat16
        a = jax.ShapeDtypeStruct((n, n), dt)
        x, y = random_inputs((a, a), seed=3)
        c = jax.jit(lambda p, q: p @ q).lower(x, y).compile()
        m = measure(c, x, y, warmup=3, repeats=10)
        measured = [c_ for c_ in sr.candidates if c_.measured_s]
        fastest = min(measured, key=lambda c_: c_.measured_s) if measured else None
        out["xla_dot"] = {"measured_s": m.median_s, "tflops": 2.0 * n**3 / m.median_s / 1e12}
        out["pallas_best"] = ({"block": list(fastest.block), "measured_s": fastest.measured_s,
                               "tflops": 2.0 * n**3 / fastest.measured_s / 1e12,
                               "vs_xla": m.median_s / fastest.measured_s} if fastest else None)
        out["model_choice"] = list(best.block) if best else None
    else:
        out["pallas_best"] = "skipped: the Pallas GPU (Triton) compiler needs a GPU attached"
    return out
