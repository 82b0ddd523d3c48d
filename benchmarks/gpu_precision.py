"""GPU device-check section (benchmarks/gpu_check.py imports it): a bf16 and an fp8 matmul at a size that fills an
H200 (8192^3), timed with workbench.measure.harness and set against the catalogue's peaks.

    run(out_dir, spec, tiny) -> dict          # spec: the catalogue chip; tiny: 256^3 (a CPU smoke run, from a test)

fp8 variants (E4M3 operands, per-tensor float32 scales, bfloat16 output, float32 accumulation):
  fp8_prequantized  operands already in E4M3: `dot_general(a8, b8, preferred_element_type=f32) * (sa*sb)`, the form
                    XLA:GPU's GEMM rewriter turns into a cuBLASLt fp8 GEMM with scales (checked in the compiled HLO)
  fp8_dequant_dot   the "dequantize then dot" pattern (convert(a8) * sa) @ (convert(b8) * sb), also rewritten
  fp8_policy_fwd    models.quant's fp8-current forward end to end from bfloat16 inputs: amax, scale, saturating
                    quantization of both operands, then the fp8 GEMM (what a training step pays per matmul)
Each row reports achieved FLOP/s, the fraction of the catalogue peak for its dtype, and whether the compiled program
contains an fp8 GEMM (on a CPU every fp8 dot is emulated in float32: the row says so).
"""
from __future__ import annotations

import os
import sys

from models.precision import get_policy
from models.quant import E4M3, amax, compute_scale, quantize
from workbench.measure.harness import measure
from workbench.results import store as results


def _fp8_gemm_in(hlo: str) -> bool:
    """True when the optimized HLO multiplies fp8 operands natively (cuBLASLt fp8 custom call, or a dot on f8
    operands that the backend kept)."""
    h = hlo.lower()
    return ("cublas$lt$matmul$f8" in h) or ("__cublas$lt$matmul" in h and "f8e4m3" in h)


def run(out_dir: str | None = None, spec=None, tiny: bool = False, repeats: int | None = None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np


    n = 256 if tiny else 8192
    repeats = repeats or (3 if tiny else 20)
    dev = jax.devices()[0]
    backend = dev.platform
    flops = 2.0 * n ** 3
    rng = np.random.default_rng(0)
    a = jax.device_put(jnp.asarray(rng.standard_normal((n, n)), jnp.bfloat16), dev)
    b = jax.device_put(jnp.asarray(rng.standard_normal((n, n)) / np.sqrt(n), jnp.bfloat16), dev)
    one = jnp.ones((), jnp.float32)
    sa, sb = compute_scale(amax(a), one, E4M3), compute_scale(amax(b), one, E4M3)
    a8, b8 = quantize(a, E4M3, sa), quantize(b, E4M3, sb)
    dims = (((1,), (0,)), ((), ()))

    def bf16_mm(x, y):
        return jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    def fp8_pre(x8, y8, sx, sy):
        return (jax.lax.dot_general(x8, y8, dims, preferred_element_type=jnp.float32) * (sx * sy)).astype(jnp.bfloat16)

    def fp8_deq(x8, y8, sx, sy):
        xd = x8.astype(jnp.bfloat16) * sx.astype(jnp.bfloat16)
        yd = y8.astype(jnp.bfloat16) * sy.astype(jnp.bfloat16)
        return jnp.dot(xd, yd, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    mod = get_policy("fp8-current").einsum_module()

    def fp8_policy(x, y):
        return mod("mk,kn->mn", x, y)

    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    cases = [("bf16", "bfloat16", bf16_mm, (a, b)), ("fp8_prequantized", "float8_e4m3fn", fp8_pre, (a8, b8, sa, sb)),
             ("fp8_dequant_dot", "float8_e4m3fn", fp8_deq, (a8, b8, sa, sb)),
             ("fp8_policy_fwd", "float8_e4m3fn", fp8_policy, (a, b))]
    rows = []
    store = results.Store(os.path.join(out_dir, "results") if out_dir and not os.environ.get("WORKBENCH_RESULTS")
                          else None)
    for name, dt, fn, args in cases:
        row = {"case": name, "m": n, "k": n, "n": n, "dtype": dt, "backend": backend, "device_kind": dev.device_kind}
        try:
            compiled = jax.jit(fn).lower(*args).compile()
            hlo = compiled.as_text()
            m = measure(compiled, *args, warmup=2 if tiny else 5, repeats=repeats)
            y = np.asarray(compiled(*args), np.float64)
            row.update(median_s=m.median_s, iqr_s=m.iqr_s, min_s=m.min_s, spread=m.spread,
                       flops_per_s=flops / m.median_s, best_flops_per_s=flops / m.min_s,
                       rel_error_vs_float64=float(np.linalg.norm(y - ref) / np.linalg.norm(ref)),
                       fp8_gemm_in_hlo=_fp8_gemm_in(hlo) if dt != "bfloat16" else None)
            if spec is not None:
                pdt = spec.peak_dtype(dt)
                row.update(catalogue_chip=spec.name, peak_dtype=pdt, peak_flops=spec.peak_flops[pdt],
                           fraction_of_peak=row["flops_per_s"] / spec.peak_flops[pdt])
            if dt != "bfloat16" and not row["fp8_gemm_in_hlo"]:
                row["note"] = (f"no native fp8 GEMM in the compiled program on {backend}: emulated (upcast), so this "
                               "is not an fp8 unit's speed")
            rec = results.make_record("gpu_precision_matmul", {"case": name, "m": n, "k": n, "n": n, "dtype": dt},
                                      None, None, m, extra=row, seed=0)
            store.append(rec)
        except Exception as e:  # one failing variant must not lose the others
            row["failed"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        print(f"  precision {name}: " + (f"{row['flops_per_s'] / 1e12:.1f} TFLOP/s"
                                          + (f" ({row['fraction_of_peak']:.0%} of {row['peak_dtype']} peak)"
                                             if "fraction_of_peak" in row else "")
                                          if "failed" not in row else row["failed"]), flush=True)
    out = {"rows": rows, "size": n, "tiny": tiny}
    ok = {r["case"]: r for r in rows if "failed" not in r}
    if "bf16" in ok:
        fp8 = [r for r in ok.values() if r["dtype"] != "bfloat16"]
        if fp8:
            best = max(fp8, key=lambda r: r["flops_per_s"])
            out["fp8_speedup_over_bf16"] = best["flops_per_s"] / ok["bf16"]["flops_per_s"]
            out["best_fp8_case"] = best["case"]
    return out


if __name__ == "__main__":
    import json

    from workbench.hardware.devices import default_platform

    tiny = "--tiny" in sys.argv
    if tiny:
        default_platform()
    from workbench.measure.calibrate import get_spec

    print(json.dumps(run(spec=get_spec("h200"), tiny=tiny), indent=1, default=str))
