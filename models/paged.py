"""A paged KV cache: each layer's keys and values live in a pool of fixed-size pages, and a page table maps each
sequence's positions to pages, so a sequence holds only the pages its tokens fill (vLLM's PagedAttention layout).

    cache = init_paged(model, batch_size=4, max_len=256, page_size=16, n_pages=40)
    logits, cache = paged_forward(model, tokens_bt, cache)     # then advance cache["lengths"] as the caller decides

This is the page-table gather form: a step gathers each row's pages into the contiguous layout of
models/inference.py, runs the same cached forward pass, and writes the new keys/values back into their pages. It is
equal to the contiguous cache (tests/models/test_serving.py) and costs a gather of the cache per step; what it buys is
memory: `reserved_bytes` against a contiguous cache that reserves max_len positions for every slot.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from models import inference
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
    shape = (n_pages, cfg.n_kv_heads, page_size, cfg.head_dim)
    table = (jnp.arange(batch_size * per_row, dtype=jnp.int32) % n_pages).reshape(batch_size, per_row)
    return {"k": [jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)],
            "v": [jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)],
            "page_table": table, "lengths": jnp.zeros((batch_size,), jnp.int32)}


def _gather(pool, table):
    """(n_pages, k, page, h) pages -> (b, k, pages·page, h): each row's pages in its table's order."""
    g = pool[table]  # (b, P, k, page, h)
    b, p, k, ps, h = g.shape
    return jnp.transpose(g, (0, 2, 1, 3, 4)).reshape(b, k, p * ps, h)


def _scatter(pool, table, view_bksh, lengths_b, t: int):
    """Write positions [length, length + t) of each row's contiguous view back into its pages."""
    page = pool.shape[2]
    pos_bt = lengths_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    new_btkh = jnp.take_along_axis(jnp.transpose(view_bksh, (0, 2, 1, 3)), pos_bt[:, :, None, None], axis=1)
    pages_bt = jnp.take_along_axis(table, pos_bt // page, axis=1)
    return pool.at[pages_bt, :, pos_bt % page, :].set(new_btkh)


def paged_forward(model, tokens_bt, cache: dict, last_b=None):
    """models.inference.forward over a paged cache: (logits, cache with the new keys/values in their pages)."""
    t = tokens_bt.shape[1]
    view = {"k": [_gather(p, cache["page_table"]) for p in cache["k"]],
            "v": [_gather(p, cache["page_table"]) for p in cache["v"]], "lengths": cache["lengths"]}
    logits, new = inference.forward(model, tokens_bt, view, last_b=last_b)
    out = dict(cache)
    for name in ("k", "v"):
        out[name] = [_scatter(p, cache["page_table"], nv, cache["lengths"], t) for p, nv in zip(cache[name], new[name])]
    return logits, out


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
