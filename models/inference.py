"""The key-value cache and the cached forward pass: prefill a prompt, decode one token per sequence, verify a draft.

    cache = init_cache(model, batch_size=8, max_len=256)             # lengths (8,) all zero
    logits_b1v, cache = prefill(model, tokens_bt, cache=cache, lengths_b=prompt_lengths, last_only=True)
    logits_b1v, cache = decode_step(model, next_token_b1, cache)       # every row one position further

The cache holds, per layer, values laid out (b, n_kv_heads, max_len, head_dim) and keys the same way (`k`) or
transposed (`k_t`: (b, n_kv_heads, head_dim, max_len)); `init_cache(..., keys_transposed=)` chooses, by default
transposed for at most 8 rows on a CPU. At batch 1 XLA:CPU copies keys laid out like the values into the order its
batched matmul reads (the contracted axis second to last) on every decode step, three reads of them per step instead
of one; from 16 rows on it reads them in place and the transposed score product is the slower one. Timed interleaved
on a Zen 4 VM (`small` with rotary positions, decode step): transposed 6.1 ms against 7.3 at batch 1 over 2048
positions, 13.0 against 14.1 at batch 8 over 1024, equal at 1 and 8 over 192; 32.0 against 30.9 at batch 32 over 512
and 29.4 against 24.7 at batch 64 over 192. libtpu reads (max_len, head_dim) keys in place and does worse with them
transposed (llama3-8b on v6e at batch 128: 20.4 ms per output token against 8.7), so TPU and GPU programs keep them
like the values.

A new token's key/value is written into its row at that row's own length (`lengths`, one per sequence, so rows of a
batch may hold prompts of different lengths: continuous batching). The write is one scatter of each row's positions,
in bounds by construction (the start clamped as a dynamic-update-slice clamps it) and so promised to XLA: a dynamic-
update-slice per row lowers to a scatter that selects between the new and the old values, and reading the old values
made XLA:CPU copy each layer's value cache twice per step (the promised scatter ran a small decode step 7-8 % faster
at batch 1 and 64, timed interleaved on a Zen 4 VM). Compiled with the cache donated (`jax.jit(...,
donate_argnums=...)`), XLA writes it in place, so a decode step reads the weights and the cache once and writes only
the new keys/values (tests/models/test_serving.py checks this from the compiled program).

KV dtypes (`kv_dtype`): 'auto' (the policy's compute dtype), 'bfloat16', 'float8' (E4M3, saturating cast) and 'int8'
(symmetric, one float32 scale per position and kv head, kept beside the cache as `k_scale`/`v_scale`). A quantized
cache is dequantized where attention reads it.

Scanned models (`scan_layers=True`) keep the cache stacked (n_layers, b, k, max_len, h) and scan over it; the scan
writes every layer's cache back each step. The serving engine (models/serving.py) and the serving predictions run the
layers unrolled instead (`unrolled`), as MaxText's inference configurations do (`scan_layers: false`), so that each
layer's cache is a buffer of its own, updated in place.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from models.transformer import Transformer
from workbench.errors import WorkbenchError

KV_DTYPES = ("auto", "bfloat16", "float8", "int8")
TRANSPOSED_KEYS_ROWS = 8  # a CPU cache of at most this many rows keeps its keys transposed (the module docstring)
_KV_ALIASES = {"bf16": "bfloat16", "fp8": "float8", "float8_e4m3fn": "float8"}


def kv_dtype_name(name: str) -> str:
    n = _KV_ALIASES.get(name, name)
    if n not in KV_DTYPES:
        raise WorkbenchError(f"unknown KV-cache dtype {name!r}; choose one of auto, bf16, fp8, int8")
    return n


def _storage_dtype(kv: str, compute_dtype):
    return {"auto": jnp.dtype(compute_dtype), "bfloat16": jnp.dtype(jnp.bfloat16),
            "float8": jnp.dtype(jnp.float8_e4m3fn), "int8": jnp.dtype(jnp.int8)}[kv]


def compute_dtype_of(model):
    return model.head_dot.compute_dtype if hasattr(model.head_dot, "compute_dtype") else jnp.float32


def _max_len_of(cache) -> int:
    v = cache["v"]
    return (v[0] if isinstance(v, list) else v).shape[-2]


def keys_name(cache) -> str:
    """Where `cache` keeps its keys: 'k_t' (transposed, (b, k, h, s)) or 'k' ((b, k, s, h), like the values)."""
    return "k_t" if "k_t" in cache else "k"


def init_cache(model, batch_size: int, max_len: int, kv_dtype: str = "auto",
               keys_transposed: bool | None = None) -> dict:
    """An empty cache of max_len positions for batch_size sequences (all lengths zero). keys_transposed: keep the keys
    (b, k, head_dim, max_len) (the module docstring); None: for at most TRANSPOSED_KEYS_ROWS rows where JAX's
    default backend is the CPU. A program compiled for another platform than the one it is built on says which it
    wants (workbench.programs.predict)."""
    cfg = model.cfg
    if cfg.pos == "learned" and max_len > cfg.seq_len:
        raise WorkbenchError(f"max_len={max_len} exceeds the model's learned positions ({cfg.seq_len})")
    kv = kv_dtype_name(kv_dtype)
    dtype = _storage_dtype(kv, compute_dtype_of(model))
    b, k, h = batch_size, cfg.n_kv_heads, cfg.head_dim

    def layers(shape_, dtype_):
        if cfg.scan_layers:
            return jnp.zeros((cfg.n_layers, *shape_), dtype_)
        return [jnp.zeros(shape_, dtype_) for _ in range(cfg.n_layers)]

    if keys_transposed is None:
        keys_transposed = jax.default_backend() == "cpu" and batch_size <= TRANSPOSED_KEYS_ROWS
    kn = "k_t" if keys_transposed else "k"
    kshape = (b, k, h, max_len) if keys_transposed else (b, k, max_len, h)
    cache = {kn: layers(kshape, dtype), "v": layers((b, k, max_len, h), dtype),
             "lengths": jnp.zeros((batch_size,), jnp.int32)}
    if kv == "int8":
        cache[kn + "_scale"] = layers((b, k, 1, max_len) if keys_transposed else (b, k, max_len, 1), jnp.float32)
        cache["v_scale"] = layers((b, k, max_len, 1), jnp.float32)
    return cache


def tree_bytes(tree) -> int:
    """Bytes a tree's arrays occupy as stored (int4 at half a byte per element)."""
    return int(sum(math.prod(a.shape) * (0.5 if a.dtype == jnp.int4 else jnp.dtype(a.dtype).itemsize)
                   for a in jax.tree.leaves(tree)))


def cache_bytes(cache) -> int:
    """Bytes of the cache's arrays (keys, values, scales, lengths)."""
    return tree_bytes(cache)


# ------------------------------------------------------------------------------------------------- one layer


def _quantize_rows(x_bkth, dtype):
    """New keys/values into the cache's storage dtype: (stored, scale or None)."""
    if dtype == jnp.int8:
        amax = jnp.max(jnp.abs(x_bkth.astype(jnp.float32)), axis=-1, keepdims=True)
        scale = jnp.where(amax > 0, amax / 127.0, 1.0)
        return jnp.clip(jnp.round(x_bkth.astype(jnp.float32) / scale), -127, 127).astype(jnp.int8), scale
    if dtype == jnp.float8_e4m3fn:
        lim = float(jnp.finfo(jnp.float8_e4m3fn).max)
        return jnp.clip(x_bkth.astype(jnp.float32), -lim, lim).astype(dtype), None
    return x_bkth.astype(dtype), None


def _write_rows(c, new_bkth, lengths_b, keys: bool = False):
    """Write each row's t new positions (b, k, t, h) at that row's own length into c, laid out (b, k, s, h) or, for
    keys, (b, k, h, s); the start clamped so they fit (as a dynamic-update-slice clamps it): one scatter, promised in
    bounds and unique (the module docstring)."""
    b, k, t = new_bkth.shape[:3]
    pos = jnp.minimum(lengths_b, c.shape[-1 if keys else 2] - t)[:, None, None] + jnp.arange(t)[None, None, :]
    bi, ki = jnp.arange(b)[:, None, None], jnp.arange(k)[None, :, None]
    at = c.at[bi, ki, :, pos] if keys else c.at[bi, ki, pos]  # both index (b, k, t, h)
    return at.set(new_bkth, mode="promise_in_bounds", unique_indices=True)


def _store(lc: dict, k_btkh, v_btkh, lengths_b) -> dict:
    out = dict(lc)
    for name, x in ((keys_name(lc), k_btkh), ("v", v_btkh)):
        q, scale = _quantize_rows(jnp.transpose(x, (0, 2, 1, 3)), lc[name].dtype)
        transposed = name == "k_t"
        out[name] = _write_rows(lc[name], q, lengths_b, keys=transposed)
        if scale is not None:
            out[name + "_scale"] = _write_rows(lc[name + "_scale"], scale, lengths_b, keys=transposed)
    return out


def _read(lc: dict, name: str, dtype):
    x = lc[name]
    if x.dtype == jnp.int8:
        return (x.astype(jnp.float32) * lc[name + "_scale"]).astype(dtype)
    return x.astype(dtype) if x.dtype != dtype else x


def _attend(attn, q_btnh, keys, v_bksh, mask_bts, keys_transposed: bool):
    """Attention of t new queries over the cache's positions allowed by mask_bts (the model's own score and mix
    products, models/layers.py Attention._softmax_mix), the keys as the cache keeps them."""
    cfg = attn.cfg
    b, t, n, h = q_btnh.shape
    k, g = cfg.n_kv_heads, cfg.q_heads_per_kv
    q_bkgth = jnp.transpose((q_btnh * (1.0 / math.sqrt(h))).astype(q_btnh.dtype).reshape(b, t, k, g, h),
                            (0, 2, 3, 1, 4))
    o_bkgth = attn._softmax_mix(q_bkgth, keys, v_bksh, mask_bts[:, None, None], keys_transposed=keys_transposed)
    return jnp.transpose(o_bkgth, (0, 3, 1, 2, 4)).reshape(b, t, n, h)


def block_forward(block, x_btd, positions_bt, attend):
    """One block on the new tokens, its attention by `attend(q_btnh, k_btkh, v_btkh) -> (o_btnh, cache)` (which
    also stores the new keys/values wherever its cache keeps them): (the block's output, that cache)."""
    h_btd = block.norm_attn(x_btd)
    q_btnh, k_btkh, v_btkh = block.attn.project_qkv(h_btd, positions_bt)
    o_btnh, cache = attend(q_btnh, k_btkh, v_btkh)
    if block.parallel:
        y_btd, _ = block.mlp(h_btd)
        return block.add(x_btd, block.attn.out(o_btnh), y_btd), cache
    x_btd = block.add(x_btd, block.attn.out(o_btnh))
    y_btd, _ = block.mlp(block.norm_mlp(x_btd))
    return block.add(x_btd, y_btd), cache


def _layer(block, x_btd, positions_bt, mask_bts, lengths_b, lc: dict, fresh: bool = False):
    """One block on the new tokens: their keys/values into the cache at each row's length, attention over the cache
    (fresh: the rows' caches are empty, so the new tokens attend to themselves alone, with the model's configured
    attention — a fused kernel where it has one — instead of over the whole cache)."""
    def attend(q_btnh, k_btkh, v_btkh):
        new = _store(lc, k_btkh, v_btkh, lengths_b)
        if fresh:
            return block.attn.causal_self_attention(q_btnh, k_btkh.astype(q_btnh.dtype),
                                                    v_btkh.astype(q_btnh.dtype)), new
        kn = keys_name(new)
        return _attend(block.attn, q_btnh, _read(new, kn, q_btnh.dtype), _read(new, "v", q_btnh.dtype),
                       mask_bts, kn == "k_t"), new

    return block_forward(block, x_btd, positions_bt, attend)


def _layer_caches(cache) -> list[dict] | dict:
    names = [n for n in ("k", "k_t", "v", "k_scale", "k_t_scale", "v_scale") if n in cache]
    if isinstance(cache["v"], list):
        return [{n: cache[n][i] for n in names} for i in range(len(cache["v"]))]
    return {n: cache[n] for n in names}


# ------------------------------------------------------------------------------------------------- the model


def forward(model, tokens_bt, cache: dict, last_b=None, fresh: bool = False):
    """The model on t new tokens per row, starting at each row's cached length. Returns (logits, cache) with the new
    keys/values written and `lengths` unchanged (the caller says how far each row advanced). last_b: per row, the
    position (0..t-1) whose logits to return — the output head then runs on that one position only (b, 1, v).
    fresh: every row's cache is empty (a prefill): attention runs over the new tokens alone."""
    from flax import nnx

    b, t = tokens_bt.shape
    lengths_b = cache["lengths"]
    max_len = _max_len_of(cache)
    positions_bt = lengths_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    # key position s is visible to the query at position p when s <= p (causal); later slots are empty or stale
    mask_bts = jnp.arange(max_len, dtype=jnp.int32)[None, None, :] <= positions_bt[:, :, None]
    rd = model.residual_dtype  # the residual stream between layers, as the training forward keeps it
    x_btd = model.embed(tokens_bt, positions_bt).astype(rd)
    layers = _layer_caches(cache)
    if model.cfg.scan_layers:
        def body(x_btd, block, lc):
            x_btd, lc = _layer(block, x_btd, positions_bt, mask_bts, lengths_b, lc, fresh)
            return x_btd.astype(rd), lc  # the carry keeps its dtype

        x_btd, new = nnx.scan(body, in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))(x_btd, model.blocks, layers)
        new_cache = dict(new)
    else:
        outs = []
        for block, lc in zip(model.blocks, layers):
            x_btd, lc = _layer(block, x_btd, positions_bt, mask_bts, lengths_b, lc, fresh)
            x_btd = x_btd.astype(rd)
            outs.append(lc)
        new_cache = {n: [o[n] for o in outs] for n in outs[0]}
    if last_b is not None:
        x_btd = x_btd[jnp.arange(b), last_b][:, None]
    new_cache["lengths"] = lengths_b
    return model.head(x_btd), new_cache


def prefill(model, tokens_bt, max_len: int | None = None, cache: dict | None = None, lengths_b=None,
            last_only: bool = False, kv_dtype: str = "auto", fresh: bool = False):
    """Run prompts through the model, filling a fresh cache of max_len positions (default cfg.seq_len) or `cache`.
    lengths_b: each row's real prompt length when the prompts are right-padded to t (default t for all); the cache's
    lengths advance by it. last_only: logits of each row's last real position only, (b, 1, v). fresh: the rows'
    caches are empty (always so for a new cache), so the prompt attends to itself with the model's own attention."""
    b, t = tokens_bt.shape
    max_len = max_len or (_max_len_of(cache) if cache is not None else model.cfg.seq_len)
    if t > max_len:
        raise WorkbenchError(f"prompt of {t} tokens does not fit a cache of {max_len} positions")
    fresh = fresh or cache is None
    cache = cache if cache is not None else init_cache(model, b, max_len, kv_dtype)
    n_b = jnp.full((b,), t, jnp.int32) if lengths_b is None else jnp.asarray(lengths_b, jnp.int32)
    logits, cache = forward(model, tokens_bt, cache, last_b=(n_b - 1) if last_only else None, fresh=fresh)
    cache["lengths"] = cache["lengths"] + n_b
    return logits, cache


def decode_step(model, token_b1, cache: dict, active_b=None):
    """One new token per sequence: (b, 1) int32 -> logits (b, 1, v) and the cache one position further on every
    active row (active_b: bool (b,), default all)."""
    if token_b1.ndim == 1:
        token_b1 = token_b1[:, None]
    logits, cache = forward(model, token_b1, cache)
    step = jnp.ones_like(cache["lengths"]) if active_b is None else active_b.astype(jnp.int32)
    cache["lengths"] = cache["lengths"] + step
    return logits, cache


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


def unrolled(model, **changes):
    """The same model with its layers unrolled (a scanned model's stacked parameters split per layer) and any other
    config `changes` that keep the parameters' shapes (e.g. attention=...); returned as it is when nothing changes."""
    from flax import nnx

    cfg = model.cfg.replace(scan_layers=False, **changes)
    if cfg == model.cfg:
        return model
    target = nnx.eval_shape(lambda: Transformer(cfg, model.policy_name, nnx.Rngs(0)))
    _, state = nnx.split(model)
    flat = {}
    for path, var in nnx.to_flat_state(state):
        value = var.get_value() if hasattr(var, "get_value") else var
        if path and path[0] == "blocks" and model.cfg.scan_layers:
            for i in range(cfg.n_layers):
                flat[("blocks", i, *path[1:])] = value[i]
        else:
            flat[path] = value
    graphdef, abs_state = nnx.split(target)
    pairs = [(path, var.replace(flat[path])) for path, var in nnx.to_flat_state(abs_state)]
    return nnx.merge(graphdef, nnx.from_flat_state(pairs))
