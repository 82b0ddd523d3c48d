"""A paged KV cache: each layer's keys and values live in a pool of fixed-size pages, and a page table maps each
sequence's positions to pages, so a sequence holds only the pages its tokens fill (vLLM's PagedAttention layout).

    cache = init_paged(model, batch_size=4, max_len=256, page_size=16, n_pages=40)
    logits, cache = paged_forward(model, tokens_bt, cache)     # then advance cache["lengths"] as the caller decides
    logits, cache = paged_decode(model, tokens_b1, cache)      # one token per row by JAX's Pallas TPU kernel

A layer's pool is laid out (n_kv_heads, n_pages, page_size, head_dim), as JAX's Pallas TPU paged attention reads it
(jax.experimental.pallas.ops.tpu.paged_attention). Two forms of a step:
- `paged_forward`, the page-table gather form (any backend, any number of new tokens): it gathers each row's pages
  into the contiguous layout of models/inference.py, runs the same cached forward pass, and writes the new
  keys/values back into their pages. It costs a gather of the cache per step; what it buys is memory
  (`reserved_bytes` against a contiguous cache that reserves max_len positions for every slot).
- `paged_decode`, the kernel form (one new token per row): each layer writes its new key/value into its page and
  attends over the row's pages in place with JAX's Pallas kernel (compiled by Mosaic for a TPU; `interpret=True`,
  or pallas' TPU interpret mode, runs it on the CPU for tests). Under a mesh it runs per device in shard_map: rows
  split as the strategy splits the batch, heads as it splits them, and each batch shard owns a contiguous block of
  the pool (init_paged's table gives row r the pages [r·P, (r + 1)·P), so a shard's rows find their pages in its
  block).
Both equal the contiguous cache (tests/models/test_serving.py).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from models import inference
from partitioning.shard import current, spec_for
from workbench import compat
from workbench.errors import WorkbenchError


def pages_for(n_tokens: int, page_size: int) -> int:
    return max(1, math.ceil(n_tokens / page_size))


def init_paged(model, batch_size: int, max_len: int, page_size: int, n_pages: int | None = None) -> dict:
    """A pool of n_pages pages per layer (default: enough for every row's max_len) and a page table that hands each
    row its pages in order (row r owns pages [r·P, (r + 1)·P) of the default pool; a scheduler may assign others)."""
    cfg = model.cfg
    if cfg.scan_layers:
        raise WorkbenchError("the paged cache serves unrolled layers (models.inference.unrolled)")
    per_row = pages_for(max_len, page_size)
    n_pages = n_pages or batch_size * per_row
    if n_pages < per_row:
        raise WorkbenchError(f"{n_pages} pages cannot hold one sequence of {max_len} positions")
    dtype = inference.compute_dtype_of(model)
    shape = (cfg.n_kv_heads, n_pages, page_size, cfg.head_dim)
    table = (jnp.arange(batch_size * per_row, dtype=jnp.int32) % n_pages).reshape(batch_size, per_row)
    return {"k": [jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)],
            "v": [jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)],
            "page_table": table, "lengths": jnp.zeros((batch_size,), jnp.int32)}


def _gather(pool, table):
    """(k, n_pages, page, h) pages -> (b, k, pages·page, h): each row's pages in its table's order."""
    g = pool[:, table]  # (k, b, P, page, h)
    k, b, p, ps, h = g.shape
    return jnp.transpose(g, (1, 0, 2, 3, 4)).reshape(b, k, p * ps, h)


def _write(pool, table, new_btkh, lengths_b):
    """Write each row's t new keys (or values) at positions [length, length + t) into their pages."""
    page, t = pool.shape[2], new_btkh.shape[1]
    pos_bt = lengths_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    pages_bt = jnp.take_along_axis(table, pos_bt // page, axis=1)
    return pool.at[:, pages_bt, pos_bt % page, :].set(jnp.transpose(new_btkh, (2, 0, 1, 3)).astype(pool.dtype))


def _new_entries(view_bksh, lengths_b, t: int):
    """The t positions from each row's length out of its contiguous view: (b, t, k, h)."""
    pos_bt = lengths_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return jnp.take_along_axis(jnp.transpose(view_bksh, (0, 2, 1, 3)), pos_bt[:, :, None, None], axis=1)


def paged_forward(model, tokens_bt, cache: dict, last_b=None):
    """models.inference.forward over a paged cache: (logits, cache with the new keys/values in their pages)."""
    t = tokens_bt.shape[1]
    view = {"k": [_gather(p, cache["page_table"]) for p in cache["k"]],
            "v": [_gather(p, cache["page_table"]) for p in cache["v"]], "lengths": cache["lengths"]}
    logits, new = inference.forward(model, tokens_bt, view, last_b=last_b)
    out = dict(cache)
    for name in ("k", "v"):
        out[name] = [_write(p, cache["page_table"], _new_entries(nv, cache["lengths"], t), cache["lengths"])
                     for p, nv in zip(cache[name], new[name])]
    return logits, out


# ------------------------------------------------------------------------------------------------- the kernel form


def kernel_block(pages_per_row: int, page_size: int, target: int = 512) -> int:
    """Pages per compute block of the Pallas kernel: the largest divisor of the row's pages that keeps a block
    within `target` positions (at least one page)."""
    best = 1
    for d in range(1, pages_per_row + 1):
        if pages_per_row % d == 0 and d * page_size <= max(target, page_size):
            best = d
    return best


def _attend_local(q_bnh, k_new_bkh, v_new_bkh, k_pool, v_pool, lengths_b, table, *, interpret: bool, row_axes=None):
    """One device's rows: write the new key/value at each row's length, then attend over its pages with the Pallas
    kernel (lengths + 1 positions: the cache and the new token). Pages in `table` are global; split over the batch
    (`row_axes`), this shard's block of the pool starts at its index × its pool's pages."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    local = table - jax.lax.axis_index(row_axes) * k_pool.shape[1] if row_axes else table
    k_pool = _write(k_pool, local, k_new_bkh[:, None], lengths_b)
    v_pool = _write(v_pool, local, v_new_bkh[:, None], lengths_b)
    block = kernel_block(table.shape[1], k_pool.shape[2])
    call = functools.partial(paged_attention, pages_per_compute_block=block)
    if interpret:
        from jax.experimental.pallas import tpu as pltpu

        with pltpu.force_tpu_interpret_mode():
            o = call(q_bnh, k_pool, v_pool, lengths_b + 1, local)
    else:
        o = call(q_bnh, k_pool, v_pool, lengths_b + 1, local)
    return o, k_pool, v_pool


def _attend(q_bnh, k_bkh, v_bkh, k_pool, v_pool, lengths_b, table, interpret: bool):
    """_attend_local per device under an activation-sharding context (shard_map: rows as the strategy splits the
    batch, heads as it splits them, the pool's pages with the rows), on the whole arrays otherwise."""
    fn = functools.partial(_attend_local, interpret=interpret)
    ctx = current()
    if ctx is None:
        return fn(q_bnh, k_bkh, v_bkh, k_pool, v_pool, lengths_b, table)
    mesh, rules = ctx
    b, n, kh = q_bnh.shape[0], q_bnh.shape[1], k_bkh.shape[1]
    q_spec = tuple(spec_for(("batch", "heads"), (b, n), mesh, rules, what="paged attention query")) + (None,) * 2
    kv_spec = tuple(spec_for(("batch", "kv_heads"), (b, kh), mesh, rules, what="paged attention key")) + (None,) * 2
    if kv_spec[1] != q_spec[1]:
        raise WorkbenchError(f"the paged attention kernel needs the {kh} key/value heads split as the {n} query heads "
                             f"are ({q_spec[1]} against {kv_spec[1]}); use a tensor-parallel size that divides "
                             f"{kh}, or serve without --paged")
    rows, heads = q_spec[0], q_spec[1]
    fn_map = compat.shard_map(
        functools.partial(fn, row_axes=rows), mesh=mesh,
        in_specs=(P(rows, heads, None), P(rows, heads, None), P(rows, heads, None), P(heads, rows, None, None),
                  P(heads, rows, None, None), P(rows), P(rows, None)),
        out_specs=(P(rows, heads, None), P(heads, rows, None, None), P(heads, rows, None, None)),
        axis_names=frozenset(mesh.axis_names), check_vma=False)
    return fn_map(q_bnh, k_bkh, v_bkh, k_pool, v_pool, lengths_b, table)


def paged_decode(model, tokens_b1, cache: dict, interpret: bool = False):
    """One new token per row over a paged cache, attention by JAX's Pallas TPU paged kernel (the module docstring):
    (logits (b, 1, v), cache with the new keys/values in their pages; `lengths` unchanged)."""
    cfg = model.cfg
    if cfg.scan_layers:
        raise WorkbenchError("the paged cache serves unrolled layers (models.inference.unrolled)")
    if tokens_b1.ndim == 1:
        tokens_b1 = tokens_b1[:, None]
    if tokens_b1.shape[1] != 1 or cache["k"][0].dtype not in (jnp.float32, jnp.bfloat16):
        raise WorkbenchError("the paged attention kernel decodes one token per row over a float32 or bf16 cache; "
                             "use paged_forward for prefill or a quantized cache")
    lengths_b, table = cache["lengths"], cache["page_table"]
    positions_b1 = lengths_b[:, None]
    rd = model.residual_dtype
    x_btd = model.embed(tokens_b1, positions_b1).astype(rd)
    ks, vs = [], []
    for block, k_pool, v_pool in zip(model.blocks, cache["k"], cache["v"]):
        def attend(q_btnh, k_btkh, v_btkh, k_pool=k_pool, v_pool=v_pool):
            q_bnh = (q_btnh[:, 0] * (1.0 / math.sqrt(q_btnh.shape[-1]))).astype(q_btnh.dtype)
            o_bnh, k_pool, v_pool = _attend(q_bnh, k_btkh[:, 0], v_btkh[:, 0], k_pool, v_pool, lengths_b, table,
                                            interpret)
            return o_bnh[:, None].astype(q_btnh.dtype), (k_pool, v_pool)

        x_btd, (k_pool, v_pool) = inference.block_forward(block, x_btd, positions_b1, attend)
        x_btd = x_btd.astype(rd)
        ks.append(k_pool)
        vs.append(v_pool)
    return model.head(x_btd), dict(cache, k=ks, v=vs)


def reserved_bytes(model_cfg, n_positions: int, dtype_bytes: int) -> int:
    """Bytes of keys and values for n_positions cached positions over all layers."""
    return int(2 * model_cfg.n_layers * n_positions * model_cfg.n_kv_heads * model_cfg.head_dim * dtype_bytes)


def fragmentation(schedule: list[tuple[int, int, int]], slots: int, max_len: int, page_size: int) -> dict:
    """Positions a contiguous cache reserves (slots × max_len) against the pages a paged cache holds at the busiest
    step of a served schedule. schedule: per request (prompt length, admitted step, finished step); a live request at
    step s holds prompt + (s − admitted) positions."""
    if not schedule:
        return {"contiguous_positions": slots * max_len, "paged_positions_peak": 0}
    last = max(f for _, _, f in schedule)
    peak = 0
    for s in range(last + 1):
        pages = sum(pages_for(p + (s - a) + 1, page_size) for p, a, f in schedule if a <= s <= f)
        peak = max(peak, pages)
    mean_len = sum(p + (f - a) + 1 for p, a, f in schedule) / len(schedule)
    return {"contiguous_positions": slots * max_len, "paged_positions_peak": peak * page_size,
            "page_size": page_size, "saving": 1 - peak * page_size / (slots * max_len),
            "slots_in_the_same_memory": int(slots * max_len // (pages_for(int(round(mean_len)), page_size) * page_size))}
