"""Causal self-attention without the S x S score matrix in memory: the implementations config `attention` names
beside the model's own einsums ('dot', models/layers.py Attention.attend).

- `blocked_attention`: flash-style attention written in JAX (online softmax over key blocks, a custom VJP whose
  backward pass recomputes each block's probabilities from the saved log-sum-exp). One lax.scan over the
  (query block, key block) pairs of the causal lower triangle: the masked blocks are never computed, and the largest
  temporary is one block of scores. Runs on every backend; what CPU hosts and simulated meshes use.
- `splash_attention`: JAX's Pallas TPU splash attention (jax.experimental.pallas.ops.tpu.splash_attention, causal
  mask, grouped-query heads, its own forward and backward kernels), run per device in shard_map over the batch and
  head axes as MaxText runs it. Compiles for TPUs only (Mosaic); `interpret=True` runs it on the CPU for tests.
- `flash_attention`: JAX's Pallas GPU flash attention (jax.experimental.pallas.ops.gpu.attention.mha, Triton;
  deprecated upstream in favour of tokamax); grouped-query heads are repeated to the query heads first (the kernel
  takes equal head counts).
- `cudnn_attention`: jax.nn.dot_product_attention with implementation 'cudnn' or 'xla'.

All take q (b, t, n, h) and k, v (b, s, k, h) with n a multiple of k, positions 0..t-1 on both sides (self-attention,
t == s), and return (b, t, n, h) in q's dtype. Products accumulate in float32; the softmax runs in float32.
"""
from __future__ import annotations

import contextlib
import functools
import math
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from partitioning.shard import current, spec_for
from workbench import compat
from workbench.errors import WorkbenchError

BLOCKED_BLOCKS = (512, 256, 128)  # key/query block sizes blocked_attention tries, largest first
SPLASH_BLOCK = 512  # splash's block sizes (MaxText's sa_block_* defaults), capped at the sequence length
SPLASH_LANES = 128  # splash needs the sequence to be a multiple of the TPU's 128 lanes


# ---- blocked (flash-style) attention in JAX ---------------------------------------------------------------------------


def blocked_block(t: int) -> int:
    """Block size blocked_attention uses for t positions: the largest of BLOCKED_BLOCKS that divides t into at least
    two blocks; t itself (one block, the dot form's memory) when none does."""
    for blk in BLOCKED_BLOCKS:
        if t % blk == 0 and t // blk >= 2:
            return blk
    return t


def _pairs(nb: int) -> tuple[np.ndarray, np.ndarray]:
    """(query block, key block) index pairs of the causal lower triangle, query-major: nb·(nb+1)/2 of them."""
    qi, kj = np.tril_indices(nb)
    return qi.astype(np.int32), kj.astype(np.int32)


def _block_scores(q_blk, k_blk, i, j, blk):
    """Scores of query block i against key block j, (b, k, g, blk, blk) float32, the causal mask applied on the
    diagonal block (off the diagonal every key precedes every query)."""
    s = jnp.einsum("bkgqh,bksh->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32)
    tri = jnp.arange(blk)[:, None] >= jnp.arange(blk)[None, :]
    keep = jnp.logical_or(i != j, tri)
    return jnp.where(keep, s, -jnp.inf), keep


def _slice_t(x, i, blk, axis):
    return jax.lax.dynamic_slice_in_dim(x, i * blk, blk, axis=axis)


def _update_t(x, upd, i, blk, axis):
    return jax.lax.dynamic_update_slice_in_dim(x, upd, i * blk, axis=axis)


def _blocked_fwd_impl(q, k, v, blk):
    """q (b, k, g, t, h) already scaled, k/v (b, k, s, h) -> (o (b, k, g, t, h) in q's dtype, lse (b, k, g, t) f32)."""
    b, kh, g, t, h = q.shape
    qi, kj = _pairs(t // blk)
    o = jnp.zeros((b, kh, g, t, h), jnp.float32)
    m = jnp.full((b, kh, g, t), -jnp.inf, jnp.float32)
    el = jnp.zeros((b, kh, g, t), jnp.float32)

    def step(carry, ij):
        o, m, el = carry
        i, j = ij
        s, _ = _block_scores(_slice_t(q, i, blk, 3), _slice_t(k, j, blk, 2), i, j, blk)
        m_old, l_old, o_old = _slice_t(m, i, blk, 3), _slice_t(el, i, blk, 3), _slice_t(o, i, blk, 3)
        m_new = jnp.maximum(m_old, jnp.max(s, axis=-1))  # finite: every query's diagonal block keeps its own key
        alpha = jnp.exp(m_old - m_new)
        p = jnp.exp(s - m_new[..., None])
        pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v.dtype), _slice_t(v, j, blk, 2),
                        preferred_element_type=jnp.float32)
        o = _update_t(o, o_old * alpha[..., None] + pv, i, blk, 3)
        m = _update_t(m, m_new, i, blk, 3)
        el = _update_t(el, l_old * alpha + jnp.sum(p, axis=-1), i, blk, 3)
        return (o, m, el), None

    (o, m, el), _ = jax.lax.scan(step, (o, m, el), (jnp.asarray(qi), jnp.asarray(kj)))
    return (o / el[..., None]).astype(q.dtype), m + jnp.log(el)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _blocked(q, k, v, blk):
    return _blocked_fwd_impl(q, k, v, blk)[0]


def _blocked_fwd(q, k, v, blk):
    o, lse = _blocked_fwd_impl(q, k, v, blk)
    return o, (q, k, v, o, lse)


def _blocked_bwd(blk, res, do):
    """The flash backward pass: per block pair, P recomputed from the saved log-sum-exp; dV += Pᵀ dO,
    dP = dO Vᵀ, dS = P ∘ (dP − rowsum(dO ∘ O)), dQ += dS K, dK += dSᵀ Q."""
    q, k, v, o, lse = res
    t = q.shape[3]
    qi, kj = _pairs(t // blk)
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # (b, k, g, t)
    dq = jnp.zeros(q.shape, jnp.float32)
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)

    def step(carry, ij):
        dq, dk, dv = carry
        i, j = ij
        q_i, do_i = _slice_t(q, i, blk, 3), _slice_t(do, i, blk, 3)
        k_j, v_j = _slice_t(k, j, blk, 2), _slice_t(v, j, blk, 2)
        s, keep = _block_scores(q_i, k_j, i, j, blk)
        p = jnp.where(keep, jnp.exp(s - _slice_t(lse, i, blk, 3)[..., None]), 0.0)
        dv_j = jnp.einsum("bkgqs,bkgqh->bksh", p.astype(do.dtype), do_i, preferred_element_type=jnp.float32)
        dp = jnp.einsum("bkgqh,bksh->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
        ds = p * (dp - _slice_t(delta, i, blk, 3)[..., None])
        dq_i = jnp.einsum("bkgqs,bksh->bkgqh", ds.astype(k.dtype), k_j, preferred_element_type=jnp.float32)
        dk_j = jnp.einsum("bkgqs,bkgqh->bksh", ds.astype(q.dtype), q_i, preferred_element_type=jnp.float32)
        dq = _update_t(dq, _slice_t(dq, i, blk, 3) + dq_i, i, blk, 3)
        dk = _update_t(dk, _slice_t(dk, j, blk, 2) + dk_j, j, blk, 2)
        dv = _update_t(dv, _slice_t(dv, j, blk, 2) + dv_j, j, blk, 2)
        return (dq, dk, dv), None

    (dq, dk, dv), _ = jax.lax.scan(step, (dq, dk, dv), (jnp.asarray(qi), jnp.asarray(kj)))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def blocked_attention(q_btnh, k_bskh, v_bskh, block: int | None = None):
    """Causal attention by blocks (module docstring): the temporaries are one (b, k, g, block, block) score block, not
    (b, n, t, s). `block` must divide t (default blocked_block(t))."""
    b, t, n, h = q_btnh.shape
    kh = k_bskh.shape[2]
    blk = block or blocked_block(t)
    if t % blk or k_bskh.shape[1] != t:
        raise WorkbenchError(f"blocked attention needs self-attention over positions divisible by its block; got "
                             f"{t} queries, {k_bskh.shape[1]} keys, block {blk}")
    q = (q_btnh * (1.0 / math.sqrt(h))).astype(q_btnh.dtype).reshape(b, t, kh, n // kh, h)
    q_bkgth = jnp.transpose(q, (0, 2, 3, 1, 4))
    k_bksh, v_bksh = jnp.transpose(k_bskh, (0, 2, 1, 3)), jnp.transpose(v_bskh, (0, 2, 1, 3))
    o_bkgth = _blocked(q_bkgth, k_bksh, v_bksh, blk)
    return jnp.transpose(o_bkgth, (0, 3, 1, 2, 4)).reshape(b, t, n, h)


# ---- splash attention (Pallas TPU) ------------------------------------------------------------------------------------


def splash_block(t: int) -> int:
    return min(SPLASH_BLOCK, t)


def _splash_kernel(t: int, heads: int, interpret: bool):
    """A causal splash kernel for `heads` query heads of t positions. Made at trace time on every call (its block
    tables become arrays of the trace they are made in; splash caches the numpy mask processing itself)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    blk = splash_block(t)
    sizes = sa.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk, block_kv_dkv=blk,
                          block_kv_dkv_compute=blk, block_q_dq=blk, block_kv_dq=blk)
    mask = sa.MultiHeadMask([sa.CausalMask(shape=(t, t)) for _ in range(heads)])
    return sa.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


SPLASH_CAUSAL_SCOPE = "splash_causal"  # named scope around the causal kernels: the HLO reader reads the mask from it


def _splash_local(q_bnth, k_bkth, v_bkth, interpret: bool):
    """Splash attention on one device's shard: the kernel takes one sequence, vmapped over the batch. The calls carry
    SPLASH_CAUSAL_SCOPE in their op_name (the kernels declare no cost: workbench/cost/hlo.py splash_cost counts the
    causal mask's blocks from it)."""
    kernel = _splash_kernel(q_bnth.shape[2], q_bnth.shape[1], interpret)
    with jax.named_scope(SPLASH_CAUSAL_SCOPE):
        return jax.vmap(kernel)(q_bnth, k_bkth, v_bkth)


def splash_attention(q_btnh, k_bskh, v_bskh, *, interpret: bool = False):
    """Causal splash attention, per device under an activation-sharding context (_per_device)."""
    b, t, n, h = q_btnh.shape
    if t % SPLASH_LANES or k_bskh.shape[1] != t:
        raise WorkbenchError(f"splash attention needs self-attention over a multiple of {SPLASH_LANES} positions; got "
                             f"{t} queries and {k_bskh.shape[1]} keys: use attention=blocked or dot")
    scale = 1.0 / math.sqrt(h)
    q = jnp.transpose((q_btnh * scale).astype(q_btnh.dtype), (0, 2, 1, 3))  # (b, n, t, h): the kernel's layout
    k, v = jnp.transpose(k_bskh, (0, 2, 1, 3)), jnp.transpose(v_bskh, (0, 2, 1, 3))
    o = _per_device(functools.partial(_splash_local, interpret=interpret), q, k, v, head_axis=1,
                    what="splash attention")
    return jnp.transpose(o, (0, 2, 1, 3))


def _per_device(local, q, k, v, *, head_axis: int, what: str):
    """local(q, k, v) (batch first, heads at `head_axis`, the sequence whole). Under an activation-sharding context
    (partitioning/shard.py) it runs per device in shard_map: batch and heads split as the strategy splits them, a
    sharded sequence gathered first; grouped-query key/value heads are repeated to the query heads when the strategy
    cannot split them like the query heads. A kernel with its own partitioning rule (cuDNN's) then never meets
    the shardings its rule cannot read (a pipeline stage's)."""
    ctx = current()
    if ctx is None:
        return local(q, k, v)
    mesh, rules = ctx
    b, n, kh = q.shape[0], q.shape[head_axis], k.shape[head_axis]
    q_spec = spec_for(("batch", "heads"), (b, n), mesh, rules, what=f"{what} query")
    try:
        kv_spec = spec_for(("batch", "kv_heads"), (b, kh), mesh, rules, what=f"{what} key")
    except WorkbenchError:
        kv_spec = None
    q_spec = tuple(q_spec) + (None,) * (2 - len(q_spec))
    if kv_spec is not None:
        kv_spec = tuple(kv_spec) + (None,) * (2 - len(kv_spec))
    if kv_spec is None or kv_spec[1] != q_spec[1]:  # kv heads split differently from q heads: give each its own
        k, v = jnp.repeat(k, n // kh, axis=head_axis), jnp.repeat(v, n // kh, axis=head_axis)
        kv_spec = q_spec

    def spec(s):
        dims = [None] * q.ndim
        dims[0], dims[head_axis] = s
        return P(*dims)

    # every mesh axis not already manual (a pipeline's `stage`): the kernel then meets no automatic axis, whose
    # sharding a kernel's own partitioning rule would have to read (a `context` axis: the sequence arrives whole)
    already = frozenset(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())
    manual = frozenset(mesh.axis_names) - already
    fn = compat.shard_map(local, mesh=mesh, in_specs=(spec(q_spec), spec(kv_spec), spec(kv_spec)),
                          out_specs=spec(q_spec), axis_names=manual, check_vma=False)
    return fn(q, k, v)


# ---- flash attention (Pallas GPU, Triton) -----------------------------------------------------------------------------


FLASH_CAUSAL_SCOPE = "flash_causal_b"  # + the block size: named scope around the causal Pallas GPU kernels


def flash_attention(q_btnh, k_bskh, v_bskh, *, interpret: bool = False):
    """Causal attention by JAX's Pallas GPU flash kernel (forward and backward kernels, its custom VJP). The kernel
    takes as many key/value heads as query heads: grouped-query heads are repeated first."""
    with warnings.catch_warnings():  # deprecated upstream in favour of tokamax (docs/models.md says why not here)
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as pga

    b, t, n, h = q_btnh.shape
    kh = k_bskh.shape[2]
    if k_bskh.shape[1] != t:
        raise WorkbenchError("flash attention here is causal self-attention: as many keys as queries")
    blk = next((c for c in (128, 64, 32, 16) if t % c == 0), None)
    if blk is None:
        raise WorkbenchError(f"flash attention needs a sequence divisible by 16; got {t}: use attention=blocked or dot")
    k, v = (jnp.repeat(x, n // kh, axis=2) if kh != n else x for x in (k_bskh, v_bskh))
    sizes = pga.BlockSizes(block_q=blk, block_k=blk, block_q_dkv=blk, block_kv_dkv=blk, block_q_dq=blk,
                           block_kv_dq=blk)
    with jax.named_scope(f"{FLASH_CAUSAL_SCOPE}{blk}"):  # the HLO reader's causal blocks (hlo.py flash_cost)
        return pga.mha(q_btnh, k, v, None, sm_scale=1.0 / math.sqrt(h), causal=True, block_sizes=sizes,
                       interpret=interpret)


# ---- dispatch ---------------------------------------------------------------------------------------------------------

FUSED = ("blocked", "splash", "flash", "xla", "cudnn")  # the implementations this module runs ('dot': the model's own)


_interpret = threading.local()


@contextlib.contextmanager
def interpret_kernels(on: bool = True):
    """While active (at trace time), the Pallas kernels (splash, flash) run in interpret mode: on the CPU, for tests
    that compare them with the model's own attention."""
    prev = getattr(_interpret, "on", False)
    _interpret.on = on
    try:
        yield
    finally:
        _interpret.on = prev


def fused_attention(impl: str, q_btnh, k_bskh, v_bskh, *, interpret: bool | None = None):
    """Causal self-attention by implementation `impl` (one of FUSED). interpret: the Pallas kernels (splash, flash)
    in interpret mode (CPU tests); None: as interpret_kernels says (off outside it)."""
    interpret = getattr(_interpret, "on", False) if interpret is None else interpret
    if impl == "blocked":
        return blocked_attention(q_btnh, k_bskh, v_bskh)
    if impl == "splash":
        return splash_attention(q_btnh, k_bskh, v_bskh, interpret=interpret)
    if impl == "flash":
        return flash_attention(q_btnh, k_bskh, v_bskh, interpret=interpret)
    if impl in ("xla", "cudnn"):
        local = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=impl)
        return _per_device(local, q_btnh, k_bskh, v_bskh, head_axis=2, what=f"{impl} attention")
    raise WorkbenchError(f"unknown fused attention {impl!r}; one of {', '.join(FUSED)}")
