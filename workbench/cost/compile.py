"""Compile a JAX program for a set of devices from abstract inputs, and read its costs."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from workbench.cost.analytic import analytic_count
from workbench.cost.report import CostReport, costs_from_compiled
from workbench.errors import DoesNotFit


@dataclasses.dataclass
class Compiled:
    fn: Any  # the jitted function (callable with concrete arrays; guarded against recompiles by measure)
    lowered: Any
    compiled: Any  # jax.stages.Compiled
    cost: CostReport
    lower_s: float
    compile_s: float
    hlo_text: str


def _dominant_dtype(args) -> str:
    import jax
    import numpy as np

    best, size = "float32", -1
    for a in jax.tree.leaves(args):
        if hasattr(a, "dtype") and hasattr(a, "shape") and np.issubdtype(np.dtype(a.dtype), np.floating):
            n = int(np.prod(a.shape))
            if n > size:
                best, size = np.dtype(a.dtype).name, n
    return best


def is_resource_exhausted(e: BaseException) -> bool:
    s = f"{type(e).__name__} {e}"
    return any(w in s for w in ("RESOURCE_EXHAUSTED", "ResourceExhausted", "Out of memory", "out of memory",
                                "exceeds the memory", "Ran out of memory"))


def compile_program(fn: Callable, *args, jit_kwargs: dict | None = None, mesh=None, n_devices: int | None = None,
                    analytic: bool = True, compute_dtype: str | None = None, compiler_options: dict | None = None,
                    **kwargs) -> Compiled:
    """jit(fn).lower(*args).compile() with abstract (ShapeDtypeStruct, possibly sharded) or concrete args.

    `fn` may already be jitted. `compiler_options` go to this compile only (XLA debug options such as
    xla_disable_hlo_passes: `lowered.compile(compiler_options=...)`, no process-wide XLA_FLAGS).
    A compile that runs out of device memory raises DoesNotFit with the compiler's words.
    """
    import jax

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn, **(jit_kwargs or {}))
    t0 = time.perf_counter()
    lowered = jitted.lower(*args, **kwargs)
    t1 = time.perf_counter()
    try:
        compiled = lowered.compile(compiler_options=compiler_options) if compiler_options else lowered.compile()
    except Exception as e:
        if is_resource_exhausted(e):
            raise DoesNotFit(str(e).strip().splitlines()[0][:400]) from e
        raise
    t2 = time.perf_counter()
    if n_devices is None:
        n_devices = mesh.size if mesh is not None else _devices_of(args)
    an = None
    if analytic:

        inner = getattr(fn, "__wrapped__", fn)
        an = analytic_count(inner, *args, **kwargs)
    text = compiled.as_text()
    cost = costs_from_compiled(compiled, n_devices=n_devices, mesh=mesh, analytic=an,
                               compute_dtype=compute_dtype or _dominant_dtype(args), hlo_text=text)
    return Compiled(jitted, lowered, compiled, cost, t1 - t0, t2 - t1, text)


def _devices_of(args) -> int:
    import jax

    n = 1
    for a in jax.tree.leaves(args):
        sh = getattr(a, "sharding", None)
        if sh is not None and hasattr(sh, "num_devices"):
            n = max(n, sh.num_devices)
    return n
