"""Grouped matmul (rows sorted by group, one (d, f) matrix per group) in three forms, chosen per backend.

    y[r] = x[r] @ w[group of r]          x (R, D) rows sorted by group, w (G, D, F), group_sizes (G,) int32, sum <= R

Forms (`GMM_IMPLS`), all with compute-dtype operands and float32 accumulation and result, forward and backward:
- 'ragged_dot': `jax.lax.ragged_dot` (models.precision.ragged_dot_f32). What it costs is the backend's lowering:
  XLA:CPU expands it to a dense matmul over every group (G× the useful flops, docs/moe.md).
- 'gmm': the Pallas grouped matmul that ships with JAX for TPU (megablox `gmm`, `tgmm` for the weight gradient).
  It visits only the row tiles each group covers; its cost estimate is 2·R·D·F. TPU only (Mosaic); `interpret=True`
  runs it anywhere, for tests.
- 'blocked': the sort-plus-dense-per-expert fallback for any backend. Each group's rows are padded up to a multiple
  of `block` rows, so every block of rows belongs to one group; a scan over the blocks multiplies each by its group's
  matrix (a dynamic slice of w). Work: (R + G·block)·D·F·2 at most, i.e. within (1 + G·block/R) of the useful flops.

`choose_impl(impl, platform)` resolves 'auto' from `GMM_BY_PLATFORM`, the table measured by `workbench moe gmm`
(docs/moe.md, "Grouped matmul per backend").
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox_ops

from models.config import GMM_IMPLS, resolve_gmm
from models.precision import einsum_f32, ragged_dot_f32
from workbench.errors import WorkbenchError

F32 = jnp.float32


def choose_impl(impl: str, platform: str) -> str:
    if impl not in GMM_IMPLS:
        raise WorkbenchError(f"unknown grouped matmul {impl!r}; choose one of {', '.join(GMM_IMPLS)}")
    if impl == "auto":
        return resolve_gmm(impl, platform)
    if impl == "gmm" and platform != "tpu":
        raise WorkbenchError(f"the megablox grouped matmul (moe_gmm=gmm) is a TPU (Mosaic) kernel; on {platform} "
                             "use moe_gmm=blocked, ragged_dot or auto")
    return impl


def grouped_matmul(x_rd, w_gdf, group_sizes, compute_dtype=F32, impl: str = "ragged_dot", *, block: int | None = None,
                   interpret: bool = False):
    """(R, D) rows sorted by group × (G, D, F) -> (R, F) float32. Rows past sum(group_sizes) come back as zeros."""
    if impl == "ragged_dot":
        return ragged_dot_f32(x_rd, w_gdf, group_sizes, compute_dtype)
    if impl == "gmm":
        return megablox_matmul(x_rd, w_gdf, group_sizes, compute_dtype, interpret=interpret)
    if impl == "blocked":
        return blocked_matmul(x_rd, w_gdf, group_sizes, compute_dtype, block=block)
    raise WorkbenchError(f"unknown grouped matmul {impl!r}; choose one of {', '.join(GMM_IMPLS[1:])}")


# --------------------------------------------------------------------------------------------- megablox (TPU)
# libtpu's default scoped-VMEM limit is 16 MiB on v5e/v5p (the v5p compile of DeepSeek-MoE's tgmm with (512, 1024,
# 1024) tiles asked for 17.02M: "Scoped allocation with size 17.02M and limit 16.00M"); tiles are kept under 3/4 of it
MEGABLOX_VMEM_BUDGET = 12 * 2 ** 20


def megablox_vmem_bytes(tiling, transposed: bool = False, in_bytes: int = 2) -> int:
    """A megablox kernel's scoped VMEM for one tiling (tm, tk, tn): both operand tiles double-buffered in the compute
    dtype, the float32 output tile double-buffered plus its accumulator. gmm: lhs (tm, tk), rhs (tk, tn), out
    (tm, tn); tgmm (`transposed`): lhs (tk, tm), rhs (tm, tn), out (tk, tn)."""
    tm, tk, tn = tiling
    rhs, out = (tm * tn, tk * tn) if transposed else (tk * tn, tm * tn)
    return 2 * in_bytes * (tm * tk + rhs) + 3 * 4 * out


def _tiling(m: int, k: int, n: int, transposed: bool = False) -> tuple[int, int, int]:
    """megablox tile sizes: MaxText's (512, 1024, 1024) where the dimension is that large; a whole small dimension
    otherwise (a block equal to the array dimension is always legal). m is padded to a multiple of its tile. The
    larger of tk, tn is halved (to no less than 128) while the kernel's VMEM (megablox_vmem_bytes; tgmm when
    `transposed`) is over MEGABLOX_VMEM_BUDGET."""
    tm = 512 if m >= 512 else max(8, -(-m // 8) * 8)
    tk, tn = (1024 if k >= 1024 else k), (1024 if n >= 1024 else n)
    size = lambda tk, tn: megablox_vmem_bytes((tm, tk, tn), transposed)
    while size(tk, tn) > MEGABLOX_VMEM_BUDGET and max(tk, tn) > 128:
        if tn >= tk and tn > 128:
            tn = max(128, tn // 2)
        else:
            tk = max(128, tk // 2)
    return tm, tk, tn


def _mb_gmm(lhs, rhs, gs, tiling, interpret, transpose_rhs=False):
    return megablox_ops.backend.gmm(lhs, rhs, gs, F32, tiling, transpose_rhs=transpose_rhs, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _megablox(compute_dtype, interpret, x_rd, w_gdf, group_sizes):
    return _megablox_fwd(compute_dtype, interpret, x_rd, w_gdf, group_sizes)[0]


def _pad_rows(x, tm):
    pad = (-x.shape[0]) % tm
    return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def _used_rows(y, gs):
    """Zero the rows past sum(group_sizes): the kernel leaves them unwritten (NaN in interpret mode)."""
    return jnp.where((jnp.arange(y.shape[0]) < jnp.sum(gs))[:, None], y, 0.0)


def _megablox_fwd(compute_dtype, interpret, x_rd, w_gdf, group_sizes):
    R, D = x_rd.shape
    F = w_gdf.shape[-1]
    tiling = _tiling(R, D, F)
    xc = _pad_rows(x_rd.astype(compute_dtype), tiling[0])
    wc = w_gdf.astype(compute_dtype)
    gs = group_sizes.astype(jnp.int32)
    y = _used_rows(_mb_gmm(xc, wc, gs, tiling, interpret)[:R], gs)
    return y, (xc, wc, gs, jnp.zeros((0,), x_rd.dtype), jnp.zeros((0,), w_gdf.dtype), R)


def _megablox_bwd(compute_dtype, interpret, res, g_rf):
    xc, wc, gs, x_proto, w_proto, R = res
    G, D, F = wc.shape
    gc = jnp.pad(g_rf.astype(compute_dtype), ((0, xc.shape[0] - R), (0, 0)))  # to the forward's padded rows
    dx = _used_rows(_mb_gmm(gc, wc, gs, _tiling(xc.shape[0], F, D), interpret, transpose_rhs=True)[:R], gs)
    dw = megablox_ops.backend.tgmm(xc.swapaxes(0, 1), gc, gs, F32, _tiling(xc.shape[0], D, F, transposed=True),
                                   num_actual_groups=G,
                                   interpret=interpret)
    return dx.astype(x_proto.dtype), dw.astype(w_proto.dtype), None


_megablox.defvjp(_megablox_fwd, _megablox_bwd)


def megablox_matmul(x_rd, w_gdf, group_sizes, compute_dtype=F32, *, interpret: bool = False):
    """megablox gmm with compute-dtype operands, float32 accumulation and result; backward gmm (dx) and tgmm (dw)."""
    return _megablox(np.dtype(compute_dtype), interpret, x_rd, w_gdf, group_sizes)


# --------------------------------------------------------------------------------------------- blocked fallback
def default_block(rows: int, groups: int) -> int:
    """Rows per block: at most a quarter of the rows per group (padding <= 25 % + one block), 8-aligned, <= 512."""
    b = max(1, rows // (4 * groups))
    if b >= 8:
        b = b // 8 * 8
    return int(min(512, b))


def blocked_layout(group_sizes, rows: int, block: int):
    """Where each sorted row goes in the block-padded layout, and each block's group.
    Returns (dest_r (R,) int32, group_b (n_blocks,) int32, n_blocks)."""
    G = group_sizes.shape[0]
    n_blocks = -(-rows // block) + G
    gs = group_sizes.astype(jnp.int32)
    padded = (gs + block - 1) // block * block
    start = jnp.cumsum(gs) - gs
    pstart = jnp.cumsum(padded) - padded
    r = jnp.arange(rows, dtype=jnp.int32)
    group_r = jnp.clip(jnp.searchsorted(jnp.cumsum(gs), r, side="right"), 0, G - 1).astype(jnp.int32)
    dest_r = (pstart[group_r] + r - start[group_r]).astype(jnp.int32)
    # rows past sum(group_sizes) (padding of the caller's buffer) go to a spare row past the last block
    dest_r = jnp.where(r < jnp.sum(gs), dest_r, n_blocks * block)
    b0 = jnp.arange(n_blocks, dtype=jnp.int32) * block
    group_b = jnp.clip(jnp.searchsorted(jnp.cumsum(padded), b0, side="right"), 0, G - 1).astype(jnp.int32)
    return dest_r, group_b, n_blocks


def blocked_matmul(x_rd, w_gdf, group_sizes, compute_dtype=F32, *, block: int | None = None):
    """Sort-plus-dense-per-expert grouped matmul: rows placed in group-aligned blocks, a scan of (block, D) @ (D, F)
    products, each block against its group's matrix, results gathered back to the sorted row order."""
    R, D = x_rd.shape
    G, _, F = w_gdf.shape
    block = block or default_block(R, G)
    dest_r, group_b, n_blocks = blocked_layout(group_sizes, R, block)
    xp = jnp.zeros((n_blocks * block + 1, D), x_rd.dtype).at[dest_r].set(x_rd)[:-1]

    def body(carry, inp):
        xb, g = inp
        wg = jax.lax.dynamic_index_in_dim(w_gdf, g, axis=0, keepdims=False)
        return carry, einsum_f32("bd,df->bf", xb, wg, compute_dtype)

    _, yp = jax.lax.scan(body, None, (xp.reshape(n_blocks, block, D), group_b))
    yp = jnp.concatenate([yp.reshape(n_blocks * block, F), jnp.zeros((1, F), yp.dtype)], axis=0)
    return yp[dest_r]
