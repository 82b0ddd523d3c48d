"""Built-in single programs that span the roofline: matmul, an elementwise chain, softmax, layernorm, attention.

Each op gives a function, its abstract inputs, and its own analytic count (flops, minimum bytes moved) so the
compiler's count can be checked against a formula.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

from workbench.errors import WorkbenchError, positive_int
from workbench.hardware.spec import dtype_name

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    fn: Callable
    args: tuple  # ShapeDtypeStruct
    sizes: dict
    dtype: str
    formula_flops: float
    formula_bytes: float  # minimum: read inputs once, write output once
    description: str


def _sds(shape, dtype):
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _itemsize(dtype) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize


def matmul(m: int, n: int, k: int, dtype):
    import jax.numpy as jnp

    def f(a_mk, b_kn):
        return jnp.matmul(a_mk, b_kn, preferred_element_type=a_mk.dtype)

    b = _itemsize(dtype)
    return f, (_sds((m, k), dtype), _sds((k, n), dtype)), 2.0 * m * n * k, b * (m * k + k * n + m * n), \
        f"C[{m},{n}] = A[{m},{k}] @ B[{k},{n}]"


def elementwise(n: int, dtype, depth: int = 4):
    """A chain of `depth` multiply-adds fused into one pass: 2·depth flops per element, memory-bound."""
    def f(x):
        y = x
        for i in range(depth):
            y = y * (1.0 + 0.25 * i) + 0.5
        return y

    b = _itemsize(dtype)
    return f, (_sds((n,), dtype),), 2.0 * depth * n, 2.0 * b * n, f"y = chain of {depth} multiply-adds over {n} elements"


def softmax(rows: int, cols: int, dtype):
    import jax

    def f(x):
        return jax.nn.softmax(x, axis=-1)

    b = _itemsize(dtype)
    # max, subtract, exp, sum, divide: ~5 flops per element (exp counted as a transcendental by XLA)
    return f, (_sds((rows, cols), dtype),), 5.0 * rows * cols, 2.0 * b * rows * cols, f"softmax over [{rows},{cols}]"


def layernorm(rows: int, cols: int, dtype):
    import jax.numpy as jnp

    def f(x, g, beta):
        xf = x.astype(jnp.float32)
        mu = xf.mean(-1, keepdims=True)
        var = ((xf - mu) ** 2).mean(-1, keepdims=True)
        return ((xf - mu) * jnp.reciprocal(jnp.sqrt(var + 1e-5)) * g + beta).astype(x.dtype)

    b = _itemsize(dtype)
    return f, (_sds((rows, cols), dtype), _sds((cols,), dtype), _sds((cols,), dtype)), 8.0 * rows * cols, \
        2.0 * b * rows * cols + 2 * b * cols, f"layernorm over [{rows},{cols}]"


def attention(batch: int, heads: int, seq: int, head_dim: int, dtype):
    import jax
    import jax.numpy as jnp

    def f(q_bhsd, k_bhsd, v_bhsd):
        s_bhss = jnp.einsum("bhqd,bhkd->bhqk", q_bhsd, k_bhsd) / math.sqrt(head_dim)
        mask = jnp.tril(jnp.ones((seq, seq), bool))
        s_bhss = jnp.where(mask, s_bhss, jnp.finfo(s_bhss.dtype).min)
        p = jax.nn.softmax(s_bhss.astype(jnp.float32), axis=-1).astype(q_bhsd.dtype)
        return jnp.einsum("bhqk,bhkd->bhqd", p, v_bhsd)

    shp = (batch, heads, seq, head_dim)
    b = _itemsize(dtype)
    flops = 4.0 * batch * heads * seq * seq * head_dim  # QK^T and PV (full, unmasked work)
    return f, (_sds(shp, dtype),) * 3, flops, 4.0 * b * math.prod(shp), \
        f"causal attention b={batch} h={heads} s={seq} d={head_dim}"


OPS = {
    "matmul": (matmul, {"m": 1024, "n": 1024, "k": 1024}),
    "elementwise": (elementwise, {"n": 1 << 24}),
    "softmax": (softmax, {"rows": 4096, "cols": 1024}),
    "layernorm": (layernorm, {"rows": 4096, "cols": 1024}),
    "attention": (attention, {"batch": 4, "heads": 8, "seq": 512, "head_dim": 64}),
}


def build(name: str, dtype: str = "float32", **sizes) -> Op:
    if name not in OPS:
        raise WorkbenchError(f"unknown op {name!r}; choose one of {', '.join(OPS)}")
    d = dtype_name(dtype)
    if d not in DTYPES:
        raise WorkbenchError(f"unsupported dtype {dtype!r} for built-in ops; choose one of {', '.join(DTYPES)}")
    fn_builder, defaults = OPS[name]
    unknown = {k for k, v in sizes.items() if v is not None and k not in defaults}
    if unknown:
        raise WorkbenchError(f"{name} takes sizes {', '.join('--' + k.replace('_', '-') for k in defaults)}; "
                             f"got {', '.join('--' + k.replace('_', '-') for k in sorted(unknown))}")
    use = {k: positive_int("--" + k.replace("_", "-"), sizes[k]) if sizes.get(k) is not None else v
           for k, v in defaults.items()}
    import jax.numpy as jnp

    fn, args, fl, by, desc = fn_builder(**use, dtype=jnp.dtype(d))
    return Op(name, fn, args, use, d, fl, by, desc)


# the error benchmark's op forms beyond OPS (benchmarks.prediction_error): dots in other layouts and short-axis sums
def program(builder: str, sizes: dict, dtype: str = "float32") -> tuple[Callable, tuple]:
    """(fn, abstract args) of an op by builder name: one of OPS, or `batched` (b×(m×k)·(k×n)), `matmul_tn` (Aᵀ·B),
    `matmul_nt` (A·Bᵀ), `reduce_short` (a sum over axis 1 of rows × cols), `reduce_short_t` (over axis 0),
    `weight_stream` (`layers` few-row up and down products over weights of their own), as the error benchmark and the
    stored-host replay (workbench.programs.replay) build them."""
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(dtype_name(dtype))
    s = sizes

    def sds(*shape):
        return jax.ShapeDtypeStruct(shape, dt)

    if builder == "matmul" and set(s) >= {"m", "k", "n"}:
        return (lambda a, b: jnp.matmul(a, b, preferred_element_type=a.dtype)), (sds(s["m"], s["k"]), sds(s["k"], s["n"]))
    if builder == "batched":
        return (lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b)), (sds(s["b"], s["m"], s["k"]), sds(s["b"], s["k"], s["n"]))
    if builder == "matmul_tn":
        return (lambda a, b: a.T @ b), (sds(s["k"], s["m"]), sds(s["k"], s["n"]))
    if builder == "matmul_nt":
        return (lambda a, b: a @ b.T), (sds(s["m"], s["k"]), sds(s["n"], s["k"]))
    if builder == "reduce_short":
        return (lambda x: x.sum(axis=1)), (sds(s["rows"], s["cols"]),)
    if builder == "reduce_short_t":
        return (lambda x: x.sum(axis=0)), (sds(s["rows"], s["cols"]),)
    if builder == "weight_stream":
        # a decode step's products alone: `layers` pairs (rows × d)·(d × f)·(f × d), each over weights of its own
        # (program parameters, last read a call ago): the weights stream from memory when they outgrow the cache
        def stream(x, *ws):
            for up, down in zip(ws[::2], ws[1::2]):
                x = (x @ up) @ down
            return x
        return stream, (sds(s["rows"], s["d"]),) + (sds(s["d"], s["f"]), sds(s["f"], s["d"])) * s["layers"]
    o = build(builder, dtype, **s)
    return o.fn, o.args
