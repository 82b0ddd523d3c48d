"""What a program's matmuls are priced at: one rule for `workbench run` and `workbench predict`.

1. The dtype comes from the precision policy (models.quant.matmul_format): float32 and bf16 policies at their compute
   dtype, fp8 policies at float8_e4m3fn, MX policies at their element format (fp8 or fp4); a chip without units for
   it is priced at the nearest it has (HardwareSpec.peak_dtype, and the prediction says so).
2. On a TPU, float32 matmuls run on the bf16 MXU in 1, 3 or 6 passes as the program asks (Precision.DEFAULT, HIGH,
   HIGHEST; the catalogue's TPU float32 peak is the 6-pass rate). The optimized HLO says what each dot asked for:
   its operands are bf16 when the compiler rounded them (DEFAULT), and `operand_precision={highest,...}` (or
   `algorithm=dot_bf16_bf16_f32_x6`) marks the multi-pass forms. `tpu_float32_spec` prices the program's float32
   work at bf16 peak / (the flop-weighted mean passes of its dots).
3. A kernel's arithmetic (`arithmetic_seconds`): its flops at the peak of the priced dtype — its dots at the rate
   measured for their size where the spec has a measured matmul curve — plus its transcendentals at the chip's
   special-function rate.
"""
from __future__ import annotations

import dataclasses
import re

from models.precision import get_policy
from models.quant import matmul_format
from workbench.cost import hlo

PASSES = {"default": 1, "high": 3, "highest": 6}
_ALGORITHM_PASSES = {"x6": 6, "x3": 3, "x9": 9}


def priced_dtype(policy) -> str:
    """The dtype name whose peak prices this policy's matmuls (rule 1)."""
    return matmul_format(get_policy(policy))["peak_dtype"]


def dot_passes(ins: hlo.Instr, shapes: dict) -> int:
    """bf16 MXU passes one dot or convolution takes on a TPU (rule 2)."""
    m = re.search(r"algorithm=dot_bf16_bf16_f32_(x\d)", ins.attrs)
    if m:
        return _ALGORITHM_PASSES.get(m.group(1), 1)
    ops = [shapes.get(o) for o in ins.operands[:2]]
    if not all(s is not None and s.dtype == "f32" for s in ops):
        return 1  # bf16 (or narrower) operands: one pass
    m = re.search(r"operand_precision=\{([^}]*)\}", ins.attrs)
    if m:
        return max(PASSES.get(p.strip().lower(), 1) for p in m.group(1).split(","))
    return 1  # float32 operands at DEFAULT: one pass on the MXU


def dot_forms(hlo_text: str) -> dict:
    """Per device: dot flops by the passes they take, and the flop-weighted mean passes."""
    mod = hlo.parse_module(hlo_text)
    runs = hlo.runs_per_computation(mod)
    shapes = hlo.array_shapes(mod)
    by: dict[int, float] = {}

    def walk(body, count, depth=0):
        for ins in body:
            if ins.opcode in ("dot", "convolution") and len(ins.operands) >= 2:
                _, _, df, _ = hlo.computation_cost([ins], shapes)
                p = dot_passes(ins, shapes)
                by[p] = by.get(p, 0.0) + df * count
            elif ins.opcode == "fusion" and depth < 4:
                walk(mod.computations.get(hlo.called_computation(ins), []), count, depth + 1)

    for comp, m in runs.items():
        walk(mod.computations.get(comp, []), m)
    total = sum(by.values())
    mean = sum(p * f for p, f in by.items()) / total if total else 1.0
    return {"dot_flops_by_passes": {str(p): f for p, f in sorted(by.items())}, "mean_passes": mean}


def tpu_float32_spec(spec, hlo_text: str):
    """(spec with its float32 peak set to what this program's dots ask for, note) for a TPU chip; unchanged else."""
    if spec.kind != "tpu" or "bfloat16" not in spec.peak_flops:
        return spec, None
    forms = dot_forms(hlo_text)
    mean = forms["mean_passes"]
    rate = spec.peak_flops["bfloat16"] / mean
    note = (f"float32 program on {spec.name}: its dots take {mean:.2g} bf16 MXU passes on average (read from the "
            f"optimized HLO: operand dtypes and operand_precision), so float32 is priced at bf16 peak / {mean:.2g} = "
            f"{rate:.3g} FLOP/s, not the catalogue's HIGHEST-precision figure")
    return dataclasses.replace(spec, peak_flops={**spec.peak_flops, "float32": rate}), note


def arithmetic_seconds(k, spec, peak_dtype: str, transcendentals_per_s: float | None = None) -> float:
    """Seconds of kernel `k`'s arithmetic (a workbench.cost.hlo.KernelCost) on `spec` at the peak of `peak_dtype`
    (rule 3); `transcendentals_per_s`: a rate other than the spec's own (the host's inside a library fusion)."""
    rate = transcendentals_per_s or spec.transcendentals_per_s
    peak = spec.peak_flops[peak_dtype]
    t_trans = k.transcendentals / rate if rate else 0.0
    if spec.measured.matmul_curve and k.dot_flops:
        rate = spec.matmul_rate(k.dot_size, peak_dtype)
        few = spec.measured.skinny_rate(getattr(k, "dot_rows", 0.0), peak_dtype)  # a product with few rows
        if few is not None:
            rate = min(rate, few)
        return k.dot_flops / rate + (k.flops - k.dot_flops) / peak + t_trans
    return k.flops / peak + t_trans
