"""The one measurement harness: warm-up, compile time apart from run time, block_until_ready, repeats with
median / IQR / min, random (never zero) inputs, a recompile during timing is an error, a wide spread is flagged.

Calls shorter than `min_batch_s` are timed in batches of several back-to-back calls (reported per call), so the
timer's and Python's overhead stay small against the program.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import numpy as np

from workbench.errors import RecompileError

WIDE_SPREAD = 0.25  # IQR / median above this flags the measurement as noisy


@dataclasses.dataclass(frozen=True, slots=True)
class Measurement:
    times_s: tuple[float, ...]  # per call, one entry per repeat
    median_s: float
    iqr_s: float
    min_s: float
    mean_s: float
    warmup: int
    repeats: int
    calls_per_repeat: int
    compile_s: float | None
    wide_spread: bool
    spread: float  # IQR / median
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summarize(times: list[float], *, warmup: int, calls: int, compile_s: float | None,
              notes=()) -> Measurement:
    a = np.asarray(times, dtype=np.float64)
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    spread = float((q3 - q1) / med) if med > 0 else math.inf
    n = list(notes)
    wide = spread > WIDE_SPREAD
    if wide:
        n.append(f"wide spread: IQR is {spread:.0%} of the median (threshold {WIDE_SPREAD:.0%}); "
                 "was something else running?")
    return Measurement(tuple(float(t) for t in a), float(med), float(q3 - q1), float(a.min()), float(a.mean()),
                       warmup, len(a), calls, compile_s, wide, spread, tuple(n))


def _block(out):
    import jax

    return jax.block_until_ready(out)


def _cache_size(fn) -> int | None:
    f = getattr(fn, "_cache_size", None)
    return f() if callable(f) else None


def measure(fn: Callable, *args, warmup: int = 2, repeats: int = 10, compile_s: float | None = None,
            min_batch_s: float = 0.02, max_calls: int = 64) -> Measurement:
    """Time fn(*args). `fn` is a jax Compiled (cannot recompile) or a jitted function (guarded: a recompile after
    warm-up raises RecompileError). Arguments are reused (no donation)."""
    for _ in range(max(1, warmup)):
        _block(fn(*args))
    before = _cache_size(fn)
    t0 = time.perf_counter()
    _block(fn(*args))
    single = time.perf_counter() - t0
    calls = 1 if single >= min_batch_s else int(min(max_calls, math.ceil(min_batch_s / max(single, 1e-7))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        _block(out)
        times.append((time.perf_counter() - t0) / calls)
    after = _cache_size(fn)
    if before is not None and after != before:
        raise RecompileError(f"the program recompiled while being timed ({before} → {after} cached executables): "
                             "shapes, dtypes or shardings of the inputs changed between calls")
    return summarize(times, warmup=warmup, calls=calls, compile_s=compile_s)


def measure_steps(step: Callable[[int], Any], *, warmup: int = 2, repeats: int = 10, guard=None,
                  compile_s: float | None = None) -> Measurement:
    """Time a stateful step: step(i) runs iteration i (feeding its own state forward) and returns what to block on.
    `guard` is the jitted function whose cache must not grow while timing."""
    for i in range(max(1, warmup)):
        _block(step(i))
    before = _cache_size(guard) if guard is not None else None
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        _block(step(warmup + i))
        times.append(time.perf_counter() - t0)
    if guard is not None and _cache_size(guard) != before:
        raise RecompileError("the step recompiled while being timed (input shapes/dtypes/shardings changed)")
    return summarize(times, warmup=warmup, calls=1, compile_s=compile_s)


def random_inputs(abstract_args, seed: int = 0):
    """Concrete random arrays (normal for floats, small positive ints otherwise; never zeros) matching abstract
    ShapeDtypeStructs, placed with their shardings when they have them."""
    import jax
    import jax.numpy as jnp

    leaves, tree = jax.tree.flatten(abstract_args)
    key = jax.random.key(seed)
    out = []
    for i, a in enumerate(leaves):
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            out.append(a)
            continue
        k = jax.random.fold_in(key, i)
        dt = jnp.dtype(a.dtype)
        if jnp.issubdtype(dt, jnp.floating):
            x = jax.random.normal(k, a.shape, jnp.float32).astype(dt)
        elif jnp.issubdtype(dt, jnp.integer):
            x = jax.random.randint(k, a.shape, 1, 100).astype(dt)
        else:
            x = jnp.ones(a.shape, dt)
        sh = getattr(a, "sharding", None)
        if sh is not None:
            x = jax.device_put(x, sh)
        out.append(x)
    return jax.tree.unflatten(tree, out)
