"""Causal attention forward as one Pallas TPU kernel (flash-style online softmax): a kernel XLA does not make.

    out[b, i] = Σ_j softmax_j(q[b, i] · k[b, j] · scale, j ≤ i) v[b, j]        q, k, v, out: (BH, S, D)

XLA compiles attention as separate kernels and writes the (S, S) score matrix to HBM between them. This kernel
keeps a (bq, D) query block in VMEM and streams (bk, D) key/value blocks past it (grid (BH, S/bq, S/bk), the key axis
innermost and "arbitrary"), carrying the running row maximum m, the running denominator l and the float32 output
accumulator in VMEM scratch across key blocks (Milakov & Gimelshein 2018; Dao et al. 2022):

    m' = max(m, rowmax(s));  p = exp(s - m');  l' = e^(m - m') l + rowsum(p);  acc' = e^(m - m') acc + p v

Key blocks entirely above the diagonal are skipped. Edges: key columns past S are masked out of the scores and value
rows past S are zeroed (a padded row of v times a zero probability would still be NaN in interpret mode); query rows
past S only reach output rows that are never written back.

Cost (`pl.CostEstimate`): flops 4·BH·S²·D·(fraction of the key blocks visited), one exp per visited score, bytes =
q and out once + k and v once per query block.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from models.kernels.matmul import KernelCost
from workbench import compat
from workbench.errors import WorkbenchError

_LANES = 128  # m and l are kept lane-replicated, (bq, 128), the layout Mosaic wants for a row statistic
_NEG = -1e30


def visited_fraction(s: int, bq: int, bk: int, causal: bool) -> float:
    """Fraction of (query block, key block) pairs the causal skip leaves (1.0 without a mask)."""
    nq, nk = -(-s // bq), -(-s // bk)
    if not causal:
        return 1.0
    seen = sum(min(nk, (qi * bq + bq - 1) // bk + 1) for qi in range(nq))
    return seen / (nq * nk)


def attention_cost(bh: int, s: int, d: int, bq: int, bk: int, itemsize: float, causal: bool = True) -> KernelCost:
    f = visited_fraction(s, bq, bk, causal)
    nq = -(-s // bq)
    flops = 4.0 * bh * s * s * d * f
    trans = float(bh * s * s * f)
    nbytes = bh * s * d * itemsize * 2 + bh * s * d * itemsize * 2 * nq * f
    return KernelCost(flops, trans, float(nbytes), (bh, nq, -(-s // bk)))


def _kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, bq: int, bk: int, nk: int, seq: int, scale: float,
            causal: bool):
    qi, ki = compat.program_id(1), compat.program_id(2)

    @compat.when(ki == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def _step():
        q, k, v = q_ref[0], k_ref[0], v_ref[0]                       # (bq, D), (bk, D), (bk, D)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale  # (bq, bk)
        cols = ki * bk + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        keep = cols < seq
        if causal:
            rows = qi * bq + lax.broadcasted_iota(jnp.int32, s.shape, 0)
            keep = jnp.logical_and(keep, cols <= rows)
        s = jnp.where(keep, s, _NEG)
        if seq % bk:
            vrows = ki * bk + lax.broadcasted_iota(jnp.int32, v.shape, 0)
            v = jnp.where(vrows < seq, v, jnp.zeros_like(v))
        m_prev = m_ref[...][:, :1]                                    # (bq, 1)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m_prev - m_new)
        l_new = alpha * l_ref[...][:, :1] + jnp.sum(p, axis=1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        m_ref[...] = jnp.broadcast_to(m_new, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(l_new, l_ref.shape)

    if causal:
        compat.when(ki * bk <= qi * bq + (bq - 1))(_step)
    else:
        _step()

    @compat.when(ki == nk - 1)
    def _out():
        o_ref[0] = (acc_ref[...] / l_ref[...][:, :1]).astype(o_ref.dtype)


def causal_attention(q, k, v, *, block_q: int = 128, block_k: int = 128, causal: bool = True,
                     interpret: bool = False, scale: float | None = None):
    """Attention forward over (BH, S, D) arrays (fold batch and heads first); float32 statistics, output in q's dtype."""
    if q.ndim != 3 or q.shape != k.shape or k.shape != v.shape:
        raise WorkbenchError(f"attention needs q, k, v of one shape (BH, S, D); got {q.shape}, {k.shape}, {v.shape}")
    bh, s, d = q.shape
    bq, bk = min(block_q, s), min(block_k, s)
    nq, nk = -(-s // bq), -(-s // bk)
    scale = (1.0 / math.sqrt(d)) if scale is None else scale
    cost = attention_cost(bh, s, d, bq, bk, q.dtype.itemsize, causal)
    kern = functools.partial(_kernel, bq=bq, bk=bk, nk=nk, seq=s, scale=scale, causal=causal)
    # keys/values above the diagonal are never read: clamp their block index to the last one needed (no new DMA)
    if causal:
        def kv_map(b, i, j):
            # lax.div (truncating; the operand is >= 0): `//` on a traced index lowers through sign(), which asks
            # for the TPU generation of the attached device and fails when compiling from a CPU host
            return (b, jnp.minimum(j, lax.div(i * bq + (bq - 1), bk)), 0)
    else:
        def kv_map(b, i, j):
            return (b, j, 0)
    call = compat.pallas_call(
        kern, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid_spec=compat.PrefetchScalarGridSpec(
            num_scalar_prefetch=0, grid=(bh, nq, nk),
            in_specs=[compat.BlockSpec((1, bq, d), lambda b, i, j: (b, i, 0)),
                      compat.BlockSpec((1, bk, d), kv_map), compat.BlockSpec((1, bk, d), kv_map)],
            out_specs=compat.BlockSpec((1, bq, d), lambda b, i, j: (b, i, 0)),
            scratch_shapes=[compat.VMEM((bq, _LANES), jnp.float32), compat.VMEM((bq, _LANES), jnp.float32),
                            compat.VMEM((bq, d), jnp.float32)]),
        compiler_params=compat.tpu_compiler_params(("parallel", "parallel", "arbitrary")),
        cost_estimate=compat.CostEstimate(flops=int(cost.flops), transcendentals=int(cost.transcendentals),
                                          bytes_accessed=int(cost.bytes_accessed)),
        interpret=interpret, name=f"causal_attention_{bq}x{bk}")
    return call(q, k, v)


def reference(q, k, v, causal: bool = True, scale: float | None = None):
    """The same in float64 NumPy."""
    import numpy as np

    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) * ((1.0 / math.sqrt(q.shape[-1])) if scale is None else scale)
    if causal:
        n = s.shape[-1]
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    return (p / p.sum(-1, keepdims=True)) @ v
