"""The one place the Pallas API differences between the jax versions the project supports are handled.

jax 0.10 and 0.12 both have `pl.pallas_call`, `pl.BlockSpec(block_shape, index_map)`, `pl.CostEstimate`,
`pltpu.PrefetchScalarGridSpec`, `pltpu.VMEM` and `pltpu.CompilerParams`; older releases named the last one
`pltpu.TPUCompilerParams` and the Triton one `plgpu.TritonCompilerParams`. The kernels import these names from here.
"""
from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

pallas_call = pl.pallas_call
BlockSpec = pl.BlockSpec
CostEstimate = pl.CostEstimate
program_id = pl.program_id
num_programs = pl.num_programs
when = pl.when
cdiv = pl.cdiv
ds = pl.ds
VMEM = pltpu.VMEM
PrefetchScalarGridSpec = pltpu.PrefetchScalarGridSpec
_TPU_PARAMS = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")


def tpu_compiler_params(dimension_semantics, vmem_limit_bytes: int | None = None):
    """Mosaic TPU compiler parameters (grid dimension semantics, the kernel's scoped-VMEM limit)."""
    kw = {"dimension_semantics": tuple(dimension_semantics)}
    if vmem_limit_bytes:
        kw["vmem_limit_bytes"] = int(vmem_limit_bytes)
    return _TPU_PARAMS(**kw)


def triton_compiler_params(num_warps: int = 4, num_stages: int = 3):
    """Triton (Pallas GPU) compiler parameters, or None where this jax has no Triton backend module."""
    try:
        from jax.experimental.pallas import triton as pltriton
    except ImportError:  # pragma: no cover - jax without the Triton backend
        return None
    cls = getattr(pltriton, "CompilerParams", None) or getattr(pltriton, "TritonCompilerParams", None)
    return cls(num_warps=num_warps, num_stages=num_stages) if cls else None
