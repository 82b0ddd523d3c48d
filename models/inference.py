"""Autoregressive inference with a KV cache: prefill a prompt, then decode one token at a time.

    logits_btv, cache = prefill(model, tokens_bt, max_len=256)
    logits_b1v, cache = decode_step(model, next_token_b1, cache)

The cache holds, per layer, keys and values (b, max_len, n_kv_heads, head_dim) in the policy's compute dtype and the
number of filled positions. Both functions are pure given the model (jit them with nnx.jit or split/merge) so a
predictor can compile a prefill and a decode step separately: prefill is compute-bound (b*t tokens per weight read),
decode memory-bound (one token per weight and cache read).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from workbench.errors import WorkbenchError


def init_cache(model, batch_size: int, max_len: int) -> dict:
    cfg = model.cfg
    if cfg.pos == "learned" and max_len > cfg.seq_len:
        raise WorkbenchError(f"max_len={max_len} exceeds the model's learned positions ({cfg.seq_len})")
    dtype = model.head_dot.compute_dtype if hasattr(model.head_dot, "compute_dtype") else jnp.float32
    shape = (batch_size, max_len, cfg.n_kv_heads, cfg.head_dim)
    if cfg.scan_layers:  # stacked like the layer parameters: (n_layers, b, max_len, k, h)
        return {"k": jnp.zeros((cfg.n_layers, *shape), dtype), "v": jnp.zeros((cfg.n_layers, *shape), dtype),
                "index": jnp.zeros((), jnp.int32)}
    return {"k": [jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)],
            "v": [jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)],
            "index": jnp.zeros((), jnp.int32)}


def _layer_cached(block, x_btd, positions_bt, mask_bts, k_cache, v_cache, start):
    """One block on new tokens: write their keys/values into the cache at `start`, attend over the cache."""
    h_btd = block.norm_attn(x_btd)
    q_btnh, k_btkh, v_btkh = block.attn.project_qkv(h_btd, positions_bt)
    k_bskh = jax.lax.dynamic_update_slice(k_cache, k_btkh.astype(k_cache.dtype), (0, start, 0, 0))
    v_bskh = jax.lax.dynamic_update_slice(v_cache, v_btkh.astype(v_cache.dtype), (0, start, 0, 0))
    o_btnh = block.attn.attend(q_btnh, k_bskh, v_bskh, mask_bts)
    x_btd = x_btd + block.attn.out(o_btnh).astype(jnp.float32)
    y_btd, _ = block.mlp(block.norm_mlp(x_btd))
    return x_btd + y_btd.astype(jnp.float32), k_bskh, v_bskh


def _forward_cached(model, tokens_bt, cache):
    from flax import nnx

    b, t = tokens_bt.shape
    start = cache["index"]
    max_len = cache["k"][0].shape[1] if isinstance(cache["k"], list) else cache["k"].shape[2]
    positions_bt = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
    # key position s is visible to query position p when s <= p (causal) — later cache slots are still empty
    mask_bts = positions_bt[:, :, None] >= jnp.arange(max_len, dtype=jnp.int32)[None, None, :]
    rd = model.residual_dtype  # the residual stream between layers, as the training forward keeps it
    x_btd = model.embed(tokens_bt, positions_bt).astype(rd)
    if model.cfg.scan_layers:
        def body(x_btd, block, k_cache, v_cache):
            x_btd, k, v = _layer_cached(block, x_btd, positions_bt, mask_bts, k_cache, v_cache, start)
            return x_btd.astype(rd), (k, v)  # the carry keeps its dtype (each block adds in float32)

        x_btd, (new_k, new_v) = nnx.scan(body, in_axes=(nnx.Carry, 0, 0, 0), out_axes=(nnx.Carry, 0))(
            x_btd, model.blocks, cache["k"], cache["v"])
    else:
        new_k, new_v = [], []
        for i, block in enumerate(model.blocks):
            x_btd, k, v = _layer_cached(block, x_btd, positions_bt, mask_bts, cache["k"][i], cache["v"][i], start)
            x_btd = x_btd.astype(rd)
            new_k.append(k)
            new_v.append(v)
    return model.head(x_btd), {"k": new_k, "v": new_v, "index": start + t}


def prefill(model, tokens_bt, max_len: int | None = None, cache: dict | None = None):
    """Run the prompt through the model, filling a fresh cache of max_len positions (default cfg.seq_len)."""
    b, t = tokens_bt.shape
    max_len = max_len or model.cfg.seq_len
    if t > max_len:
        raise WorkbenchError(f"prompt of {t} tokens does not fit a cache of {max_len} positions")
    cache = cache if cache is not None else init_cache(model, b, max_len)
    return _forward_cached(model, tokens_bt, cache)


def decode_step(model, token_b1, cache: dict):
    """One new token per sequence: (b, 1) int32 -> logits (b, 1, v) and the cache with one more position."""
    if token_b1.ndim == 1:
        token_b1 = token_b1[:, None]
    return _forward_cached(model, token_b1, cache)


def generate(model, prompt_bt, n_new: int, max_len: int | None = None):
    """Greedy decoding (for demos and tests): returns (b, t + n_new) tokens."""
    logits, cache = prefill(model, prompt_bt, max_len or prompt_bt.shape[1] + n_new)
    out = [prompt_bt]
    tok = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
    for _ in range(n_new):
        out.append(tok)
        logits, cache = decode_step(model, tok, cache)
        tok = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
    return jnp.concatenate(out, axis=1)
