"""Blocked matmul Pallas kernels: a plain one and one with a fused bias + activation epilogue.

    out[m, n] = act(sum_k a[m, k] · b[k, n] + bias[n])        a (M, K), b (K, N), bias (N,), out (M, N)

TPU form (Mosaic): a 3-D grid (M/bm, N/bn, K/bk); each step copies an (bm, bk) block of `a` and a (bk, bn) block of
`b` from HBM into VMEM (Pallas double-buffers them: the next step's blocks load while this one multiplies) and adds
their product into a float32 (bm, bn) accumulator that lives in VMEM scratch across the K steps ("arbitrary", the
innermost grid axis); at the last K step the epilogue (bias, activation, cast) runs on the accumulator and the
result block is written back once. M and N steps are "parallel".

Edges: a dimension that is not a multiple of its block leaves the last block partly outside the array. Reads
there return whatever the buffer held (NaN in interpret mode), so the K edge is masked: the columns of `a` and rows
of `b` past K are zeroed before the dot. Rows past M and columns past N only reach output positions that are never
written back, so they need no mask.

GPU form (Triton lowering): the grid is (M/bm, N/bn) (GPU programs run concurrently, so an accumulator cannot be
carried across grid steps); each program loops over K in bk slices with the accumulator in registers. Its operands
are zero-padded to whole blocks by XLA before the call (Triton loads past an array's end are not safe without
masks), and the output is sliced back.

Each kernel states its own cost (`pl.CostEstimate`): a Pallas call is opaque to XLA's cost analysis. The flops are
the useful 2·M·N·K (+ the epilogue's), the bytes the HBM traffic of the blocked schedule: `a` is read once per
column of output blocks, `b` once per row of output blocks, the output written once.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from workbench import compat
from workbench.errors import WorkbenchError

ACTIVATIONS = ("none", "relu", "gelu")
BACKENDS = ("tpu", "gpu")
_GELU_C = math.sqrt(2.0 / math.pi)


@dataclasses.dataclass(frozen=True)
class Block:
    """A block shape of the blocked matmul (rows of a, columns of b, contraction slice)."""

    bm: int
    bn: int
    bk: int

    def __str__(self):
        return f"{self.bm}x{self.bn}x{self.bk}"

    def to_record(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """What the kernel tells XLA it costs (pl.CostEstimate's three fields), with how the bytes were counted."""

    flops: float
    transcendentals: float
    bytes_accessed: float
    grid: tuple[int, ...]

    def to_record(self) -> dict:
        return dataclasses.asdict(self)


def activate(x, activation: str):
    """The epilogue's activation (gelu: the tanh approximation, as models/ uses for GPT-2 style MLPs)."""
    if activation == "none":
        return x
    if activation == "relu":
        return jnp.maximum(x, 0)
    if activation == "gelu":
        return 0.5 * x * (1.0 + jnp.tanh(_GELU_C * (x + 0.044715 * x * x * x)))
    raise WorkbenchError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")


def kernel_cost(m: int, n: int, k: int, block: Block, in_bytes: float, out_bytes: float, *, bias: bool = False,
                activation: str = "none") -> KernelCost:
    """The blocked schedule's flops, transcendentals and HBM bytes (module docstring)."""
    gm, gn, gk = -(-m // block.bm), -(-n // block.bn), -(-k // block.bk)
    flops = 2.0 * m * n * k + (m * n if bias else 0) + {"none": 0, "relu": 1, "gelu": 8}[activation] * m * n
    trans = float(m * n) if activation == "gelu" else 0.0
    nbytes = gn * m * k * in_bytes + gm * k * n * in_bytes + m * n * out_bytes + (gm * n * in_bytes if bias else 0)
    return KernelCost(flops, trans, float(nbytes), (gm, gn, gk))


def _check(a, b, bias, block: Block, activation: str, backend: str):
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise WorkbenchError(f"matmul needs a (M, K) and b (K, N); got {a.shape} and {b.shape}")
    if bias is not None and bias.shape != (b.shape[1],):
        raise WorkbenchError(f"bias must have shape (N,) = ({b.shape[1]},), got {bias.shape}")
    if activation not in ACTIVATIONS:
        raise WorkbenchError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    if backend not in BACKENDS:
        raise WorkbenchError(f"unknown kernel backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if min(block.bm, block.bn, block.bk) < 1:
        raise WorkbenchError(f"block sizes must be >= 1, got {block}")


# ------------------------------------------------------------------------------------------------ TPU (Mosaic)


def _tpu_kernel(*refs, nk: int, bk: int, k_rem: int, has_bias: bool, activation: str):
    if has_bias:
        a_ref, b_ref, bias_ref, o_ref, acc_ref = refs
    else:
        a_ref, b_ref, o_ref, acc_ref = refs
        bias_ref = None
    kk = compat.program_id(2)

    @compat.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    a, b = a_ref[...], b_ref[...]  # (bm, bk), (bk, bn)
    if k_rem:  # the last K block runs past K: zero what lies outside (static: no cost when K % bk == 0)
        limit = jnp.where(kk == nk - 1, k_rem, bk)
        a = jnp.where(lax.broadcasted_iota(jnp.int32, a.shape, 1) < limit, a, jnp.zeros_like(a))
        b = jnp.where(lax.broadcasted_iota(jnp.int32, b.shape, 0) < limit, b, jnp.zeros_like(b))
    acc_ref[...] += jnp.dot(a, b, preferred_element_type=jnp.float32)

    @compat.when(kk == nk - 1)
    def _epilogue():
        y = acc_ref[...]
        if bias_ref is not None:
            y = y + bias_ref[...].astype(jnp.float32)  # (1, bn) broadcast over rows
        o_ref[...] = activate(y, activation).astype(o_ref.dtype)


def _tpu_call(a, b, bias, block: Block, activation: str, out_dtype, interpret, vmem_limit_bytes):
    m, k = a.shape
    n = b.shape[1]
    gm, gn, nk = -(-m // block.bm), -(-n // block.bn), -(-k // block.bk)
    in_specs = [compat.BlockSpec((block.bm, block.bk), lambda i, j, kk: (i, kk)),
                compat.BlockSpec((block.bk, block.bn), lambda i, j, kk: (kk, j))]
    args = [a, b]
    if bias is not None:
        in_specs.append(compat.BlockSpec((1, block.bn), lambda i, j, kk: (0, j)))
        args.append(bias.reshape(1, n))
    cost = kernel_cost(m, n, k, block, a.dtype.itemsize, jnp.dtype(out_dtype).itemsize, bias=bias is not None,
                       activation=activation)
    kern = functools.partial(_tpu_kernel, nk=nk, bk=block.bk, k_rem=k % block.bk, has_bias=bias is not None,
                             activation=activation)
    call = compat.pallas_call(
        kern, out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid_spec=compat.PrefetchScalarGridSpec(
            num_scalar_prefetch=0, grid=(gm, gn, nk), in_specs=in_specs,
            out_specs=compat.BlockSpec((block.bm, block.bn), lambda i, j, kk: (i, j)),
            scratch_shapes=[compat.VMEM((block.bm, block.bn), jnp.float32)]),
        compiler_params=compat.tpu_compiler_params(("parallel", "parallel", "arbitrary"), vmem_limit_bytes),
        cost_estimate=compat.CostEstimate(flops=int(cost.flops), transcendentals=int(cost.transcendentals),
                                          bytes_accessed=int(cost.bytes_accessed)),
        interpret=interpret, name=f"matmul_{activation}_{block}")
    return call(*args)


# ------------------------------------------------------------------------------------------------ GPU (Triton)


def _gpu_kernel(*refs, nk: int, bk: int, has_bias: bool, activation: str):
    if has_bias:
        a_ref, b_ref, bias_ref, o_ref = refs
    else:
        a_ref, b_ref, o_ref = refs
        bias_ref = None
    bm, bn = o_ref.shape

    def body(kk, acc):
        a = a_ref[:, compat.ds(kk * bk, bk)]
        b = b_ref[compat.ds(kk * bk, bk), :]
        return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), jnp.float32))
    if bias_ref is not None:
        acc = acc + bias_ref[...].astype(jnp.float32)
    o_ref[...] = activate(acc, activation).astype(o_ref.dtype)


def _gpu_call(a, b, bias, block: Block, activation: str, out_dtype, interpret):
    m, k = a.shape
    n = b.shape[1]
    gm, gn, nk = -(-m // block.bm), -(-n // block.bn), -(-k // block.bk)
    mp, np_, kp = gm * block.bm, gn * block.bn, nk * block.bk
    ap = jnp.pad(a, ((0, mp - m), (0, kp - k))) if (mp, kp) != (m, k) else a
    bp = jnp.pad(b, ((0, kp - k), (0, np_ - n))) if (kp, np_) != (k, n) else b
    in_specs = [compat.BlockSpec((block.bm, kp), lambda i, j: (i, 0)),
                compat.BlockSpec((kp, block.bn), lambda i, j: (0, j))]
    args = [ap, bp]
    if bias is not None:
        in_specs.append(compat.BlockSpec((1, block.bn), lambda i, j: (0, j)))
        args.append(jnp.pad(bias, (0, np_ - n)).reshape(1, np_))
    cost = kernel_cost(m, n, k, block, a.dtype.itemsize, jnp.dtype(out_dtype).itemsize, bias=bias is not None,
                       activation=activation)
    kern = functools.partial(_gpu_kernel, nk=nk, bk=block.bk, has_bias=bias is not None, activation=activation)
    params = None if interpret else compat.triton_compiler_params()
    call = compat.pallas_call(
        kern, out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype), grid=(gm, gn), in_specs=in_specs,
        out_specs=compat.BlockSpec((block.bm, block.bn), lambda i, j: (i, j)),
        compiler_params=params,
        cost_estimate=compat.CostEstimate(flops=int(cost.flops), transcendentals=int(cost.transcendentals),
                                          bytes_accessed=int(cost.bytes_accessed)),
        interpret=interpret, name=f"matmul_{activation}_{block}")
    out = call(*args)
    return out[:m, :n] if (mp, np_) != (m, n) else out


# ------------------------------------------------------------------------------------------------ entry point


def matmul(a, b, bias=None, *, block: Block | tuple[int, int, int] = Block(128, 128, 128), activation: str = "none",
           out_dtype=None, backend: str = "tpu", interpret: bool = False, vmem_limit_bytes: int | None = None):
    """act(a @ b + bias) as a blocked Pallas kernel; float32 accumulation, output in `out_dtype` (default a's).

    backend: 'tpu' (Mosaic: 3-D grid, VMEM accumulator) or 'gpu' (Triton: 2-D grid, K loop in the kernel).
    interpret: run the kernel in Pallas' interpreter (any host; what the tests use on a CPU).
    """
    block = block if isinstance(block, Block) else Block(*block)
    _check(a, b, bias, block, activation, backend)
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    if backend == "tpu":
        return _tpu_call(a, b, bias, block, activation, out_dtype, interpret, vmem_limit_bytes)
    return _gpu_call(a, b, bias, block, activation, out_dtype, interpret)


def reference(a, b, bias=None, activation: str = "none"):
    """The same function in float64 NumPy (the tests' reference)."""
    import numpy as np

    y = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    if activation == "relu":
        y = np.maximum(y, 0)
    elif activation == "gelu":
        y = 0.5 * y * (1.0 + np.tanh(_GELU_C * (y + 0.044715 * y ** 3)))
    return y
