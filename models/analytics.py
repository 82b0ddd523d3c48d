"""Analytic counts from a config: parameters, FLOPs per token, KV-cache and training-memory estimates.

Conventions (stated once, used everywhere):
- params_total counts every parameter of models.transformer.Transformer (a test checks it against the instantiated
  model). params_embedding = the input lookup tables (token embedding + learned positions); the output head is a
  matmul and is not in params_embedding (for tied embeddings it shares the token table, counted once).
- params_active: parameters one token touches (MoE: top_k of the n_experts expert MLPs).
- train_flops_per_token = 6 * N_matmul + 12 * n_layers * n_heads * head_dim * seq_len, where N_matmul counts the
  active matmul weights including the output head (and the MoE router) but not the embedding lookups, biases or
  norms: the Megatron-LM / PaLM convention (Narayanan et al. 2021 eq. 3; Chowdhery et al. 2022 App. B), full
  (non-causal) attention. train_flops_per_token_causal halves the attention term (the causal mask skips half).
- forward_flops_per_token = one third of the training figure (2 * N_matmul + 4 * L * n * h * s).
- kv_cache_bytes_per_token: 2 (K and V) * n_layers * n_kv_heads * head_dim * bytes(dtype).
- Training memory: 16 bytes per parameter (float32 master weights 4, float32 gradients 4, AdamW first and second
  moments 4 + 4); activations saved for the backward pass per token counted per layer in the manner of Korthikanti
  et al. 2022 ('Reducing Activation Recomputation in Large Transformer Models', Sec. 4.1) without dropout masks,
  in elements of the compute dtype, plus the float32 logits.
"""
from __future__ import annotations

import math

from models.config import ModelConfig, resolve_gmm
from models.remat import parse_remat
from workbench.errors import WorkbenchError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1, "int4": 0.5}


def _norm_params(cfg: ModelConfig) -> int:
    return 2 * cfg.d_model if cfg.norm == "layernorm" else cfg.d_model  # scale (+ bias for LayerNorm)


def mlp_params(cfg: ModelConfig) -> tuple[int, int]:
    """(matmul weights, biases) of one dense MLP (or one expert)."""
    d, f = cfg.d_model, cfg.d_ff
    b = f + d if cfg.bias else 0  # up-projection and output biases (the SwiGLU gate has none)
    return (2 if cfg.mlp == "gelu" else 3) * d * f, b


def attention_params(cfg: ModelConfig) -> tuple[int, int]:
    """(matmul weights, biases) of one attention block."""
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    w = d * n * h + 2 * d * k * h + n * h * d
    b = (n * h + 2 * k * h + d) if cfg.bias else 0
    return w, b


def param_groups(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts by group (total over layers). Keys: embedding, position, attention, mlp, router, norms, head."""
    L, d, v = cfg.n_layers, cfg.d_model, cfg.vocab_size
    aw, ab = attention_params(cfg)
    mw, mb = mlp_params(cfg)
    experts = max(cfg.n_experts, 1)
    return {
        "embedding": v * d,
        "position": cfg.seq_len * d if cfg.pos == "learned" else 0,
        "attention": L * (aw + ab),
        "mlp": L * experts * (mw + mb) + L * cfg.n_shared_experts * mw,  # shared experts: no biases
        "router": L * d * cfg.n_experts if cfg.is_moe else 0,
        "norms": ((1 if cfg.block == "parallel" else 2) * L + 1) * _norm_params(cfg),
        "head": 0 if cfg.tie_embeddings else v * d,
    }


def matmul_params_active(cfg: ModelConfig) -> int:
    """Active matmul weights per token, including the output head, excluding embedding lookups, biases, norms."""
    L, d, v = cfg.n_layers, cfg.d_model, cfg.vocab_size
    aw, _ = attention_params(cfg)
    mw, _ = mlp_params(cfg)
    per_layer = aw + ((cfg.top_k + cfg.n_shared_experts) * mw + d * cfg.n_experts if cfg.is_moe else mw)
    return L * per_layer + v * d


def activation_elements_per_token(cfg: ModelConfig, seq_len: int | None = None) -> dict[str, float]:
    """Elements saved for the backward pass per token: per layer (no remat), per layer with per-layer remat."""
    s = seq_len or cfg.seq_len
    d, n, k, h, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    attn = d + n * h + 2 * k * h + n * s + n * h  # x_in, q, k, v, softmax probs (n*s per token), attention out
    ff = f * (cfg.top_k + cfg.n_shared_experts if cfg.is_moe else 1)
    mlp = d + (2 * ff if cfg.mlp == "gelu" else 3 * ff)  # x_in, pre/post activation (swiglu: gate, up, product)
    norms = 2 * d
    return {"per_layer": attn + mlp + norms, "per_layer_remat": d, "logits_float32": cfg.vocab_size}


def analytics(cfg: ModelConfig, seq_len: int | None = None) -> dict:
    """Every analytic number the workbench quotes for a model config (see the module docstring for conventions)."""
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise WorkbenchError(f"sequence length must be a positive whole number, got {seq_len!r}")
    s = seq_len or cfg.seq_len
    g = param_groups(cfg)
    total = sum(g.values())
    L, n, h = cfg.n_layers, cfg.n_heads, cfg.head_dim
    mw, mb = mlp_params(cfg)
    inactive = L * (cfg.n_experts - cfg.top_k) * (mw + mb) if cfg.is_moe else 0
    n_matmul = matmul_params_active(cfg)
    attn_train = 12 * L * n * h * s
    kv_elems = 2 * L * cfg.n_kv_heads * h
    act = activation_elements_per_token(cfg, s)
    act_bytes = {}
    for dt in ("float32", "bfloat16"):
        b = DTYPE_BYTES[dt]
        full = L * act["per_layer"] * b + 4 * act["logits_float32"]
        remat = L * act["per_layer_remat"] * b + act["per_layer"] * b + 4 * act["logits_float32"]
        act_bytes[dt] = {"no_remat": full, "per_layer_remat": remat}
    return {
        "params_total": total,
        "params_embedding": g["embedding"] + g["position"],
        "params_non_embedding": total - g["embedding"] - g["position"],
        "params_active": total - inactive,
        "params_by_group": g,
        "matmul_params_active": n_matmul,
        "seq_len": s,
        "train_flops_per_token": 6 * n_matmul + attn_train,
        "train_flops_per_token_causal": 6 * n_matmul + attn_train // 2,
        "forward_flops_per_token": 2 * n_matmul + attn_train // 3,
        "forward_flops_per_token_causal": 2 * n_matmul + attn_train // 6,
        "kv_cache_bytes_per_token": {dt: kv_elems * DTYPE_BYTES[dt] for dt in ("float32", "bfloat16", "int8")},
        "train_memory_bytes_per_param": 16,
        "train_memory_params_bytes": 16 * total,
        "activation_bytes_per_token": act_bytes,
        "conventions": "train_flops = 6*N_matmul(active, incl. head, excl. embedding lookup) + 12*L*n_heads*head_dim*"
                       "seq (Megatron/PaLM, full attention); causal halves the attention term; memory: 16 B/param "
                       "(fp32 weights, grads, AdamW m, v) + activations per token (Korthikanti et al. 2022, no dropout)",
    }


def train_memory_bytes(cfg: ModelConfig, batch_size: int, seq_len: int | None = None,
                       compute_dtype: str = "float32") -> float:
    """Whole-model training memory estimate (bytes, unpartitioned): states + activations for one batch."""
    a = analytics(cfg, seq_len)
    # per-layer / full: each layer keeps its input; policies keeping tensors by name keep less than no remat: bounded
    key = "per_layer_remat" if parse_remat(cfg.remat).kind == "full" else "no_remat"
    return a["train_memory_params_bytes"] + batch_size * a["seq_len"] * a["activation_bytes_per_token"][compute_dtype][key]


def collective_bytes_per_step(cfg: ModelConfig, strategy: str, mesh_shape: dict, batch_size: int, seq_len: int,
                              compute_bytes: int = 4, param_bytes: int = 4) -> dict[str, float]:
    """Per-device collective payload bytes one training step of a dense model should move, by mesh axis.

    Payload convention (workbench.cost.hlo): all-reduce = the array reduced, all-gather = the gathered (full) array,
    reduce-scatter = the full input. What each strategy implies:
      dp       data:  all-reduce of every gradient                                  = P
      fsdp     data:  all-gather of every parameter with an embed dimension (once, kept for the backward pass)
                      + reduction of every gradient (reduce-scatter, or all-reduce for unsharded ones)  = P_emb + P
      tp       model: activations, Megatron: the output of every row-parallel matmul (attention out, MLP down, the
                      vocab-sharded embedding lookup) in the forward pass and the input gradient of every
                      column-parallel matmul (q, k, v projections are separate weights here: 3; the MLP's up (and
                      gate) projections; the vocab-sharded head) in the backward pass, each (b/data, t, d)
               data:  all-reduce of the per-device (model-sharded) gradients
      fsdp+tp  model: as tp (the data-axis side is not modelled here)
    Returns {} for strategies not modelled (sp, ep) and for MoE configs.
    """
    if cfg.is_moe:
        return {}
    D, M = int(mesh_shape.get("data", 1)), int(mesh_shape.get("model", 1))
    g = param_groups(cfg)
    P = sum(g.values()) * param_bytes
    L, d, n, k, h, f = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    no_embed_dim = L * ((n * h + 2 * k * h + f) if cfg.bias else 0)  # biases without an embed dimension
    P_emb = P - no_embed_dim * param_bytes
    out: dict[str, float] = {}
    if strategy == "dp" and D > 1:
        out["data"] = P
    elif strategy == "fsdp" and D > 1:
        out["data"] = P_emb + P
    if strategy in ("tp", "fsdp+tp") and M > 1:
        units = L * (2 + 3 + (1 if cfg.mlp == "gelu" else 2)) + 2
        out["model"] = units * (batch_size // D) * seq_len * d * compute_bytes
        if strategy == "tp" and D > 1:
            # gradients of model-sharded matmul weights are 1/M per device; norms, biases of d, positions are whole
            sharded = g["attention"] - L * (d if cfg.bias else 0) + g["mlp"] - L * (d if cfg.bias else 0) \
                + g["embedding"] + g["head"]
            out["data"] = (sharded / M + (sum(g.values()) - sharded)) * param_bytes
    return out


MOE_FUSED_PLATFORMS = ("tpu",)  # compilers whose MoE layer holds the `fused` buffer set (moe_layer_memory)


def moe_memory_fused(cfg: ModelConfig, platform: str) -> bool:
    """Which buffer set moe_layer_memory counts for a program compiled for `platform` (cpu | gpu | tpu).

    libtpu fuses elementwise work into XLA's own matmuls: the capacity path (einsums over the (E, C, D) buffer) is
    `fused`. A Pallas kernel is opaque to fusion, so the dropless layer on TPU (megablox gmm, float32 results) keeps
    every array around it: counted as written. XLA:CPU (and the simulated-CPU GPU targets) materialise everything."""
    if platform not in MOE_FUSED_PLATFORMS:
        return False
    return not (cfg.capacity_factor is None and resolve_gmm(cfg.moe_gmm, platform) == "gmm")

MOE_CHUNK_BYTES = 2 ** 28  # models/moe.py: expert hidden arrays above this are computed in pieces


def row_chunks(rows: int, width: int, itemsize: int, budget: int) -> int:
    """How many equal chunks of rows keep one (rows/n, width) array under `budget` bytes (n divides rows)."""
    n = max(1, math.ceil(rows * width * itemsize / max(budget, 1)))
    while n < rows and rows % n:
        n += 1
    return min(n, rows)


def moe_layer_memory(cfg: ModelConfig, tokens_per_device: int, *, groups_per_device: int = 1, compute_bytes: int = 2,
                     ep: int = 1, tensor: int = 1, fsdp: int = 1, backward: bool = True,
                     chunk_bytes: int = MOE_CHUNK_BYTES, fused: bool = False) -> dict:
    """Per-device bytes of the buffers one MoE layer builds (models/moe.py), by kind: what "does it fit" is made of.

    Routing is per token group (one group per device under every multi-device strategy): S = tokens_per_device /
    groups_per_device tokens, k choices, E experts, capacity C = min(S, ceil(cf·S·k/E)) per group (dropless: the
    sorted S·k rows). Buffers (compute dtype unless noted):
      router_state       logits, probabilities (float32 S·E each), the slot one-hot and its cumsum (int32 k·S·E
                         each, capacity routing), chosen experts and weights (S·k)
      dispatch_buffer    capacity: the (E, C, D) buffer and the (S·k, D) copies scattered into it; dropless: the
                         S·k sorted rows
      expert_activations the expert hidden (rows, F/tensor) for up, gate and their product (swiglu; gelu: 2), where
                         rows = E·C (capacity) or S·k (dropless); EP receives the same number of rows it sends.
                         When one such array is above `chunk_bytes` the layer computes it in pieces
                         (models/moe.py experts_scan: one expert's C rows; experts_ragged_chunked: S·k/n rows)
                         and only one piece is alive
      expert_outputs     (rows, D) from the down projection and the float32 (S·k, D) gather that combines them
      gathered_weights   fsdp: the expert weights of one layer all-gathered in the compute dtype (E/ep·D·F/tensor
                         per matrix; one expert's when the padded path runs expert by expert)
    peak_bytes: forward, the router state + dispatch + activations + outputs (+ gathered weights) of one layer alive
    at once; backward=True adds the activation gradients (one more set of expert activations and outputs), what the
    rematerialised backward of one layer holds.

    fused=False counts the program as written, every array materialised (what XLA:CPU holds). fused=True is what a
    compiler that fuses elementwise work into the neighbouring matmul and reduction holds (libtpu; MOE_FUSED_PLATFORMS):
    the gate·up product (SwiGLU; GELU's activation) is never written, it is computed inside the down projection's
    operand load, so 2 hidden arrays per set instead of 3 (GELU: 1 instead of 2); and the combine's float32 convert is
    fused into the weighted sum, so the gathered (S·k, D) rows stay in the compute dtype. Read from libtpu's buffer
    report for small-moe (docs/moe.md: the memory model). Tests compare both with memory_analysis (within 25 %).
    """
    if not cfg.is_moe:
        return {}
    if tokens_per_device % groups_per_device:
        raise WorkbenchError(f"{tokens_per_device} tokens per device do not split into {groups_per_device} groups")
    S = tokens_per_device // groups_per_device
    G = groups_per_device
    E, k, D, F = cfg.n_experts, cfg.top_k, cfg.d_model, cfg.d_ff
    cb = compute_bytes
    mats = 3 if cfg.mlp == "swiglu" else 2
    dropless = cfg.capacity_factor is None
    if dropless:
        C = None
        rows = S * k
    else:
        C = int(max(1, min(S, math.ceil(cfg.capacity_factor * S * k / E))))
        rows = E * C
    f_loc = F // max(tensor, 1)
    e_loc = E // max(ep, 1)
    chunks, live_rows, w_experts = 1, rows, e_loc
    if rows * f_loc * cb > chunk_bytes:
        if dropless:
            chunks = row_chunks(rows, f_loc, cb, chunk_bytes)
            live_rows = rows // chunks
        else:
            chunks, live_rows, w_experts = e_loc, rows // e_loc, 1
    router = G * (2 * 4 * S * E + (0 if dropless else 2 * 4 * k * S * E) + 2 * 4 * S * k)
    dispatch = G * (rows * D * cb + (0 if dropless else S * k * D * cb))
    held = mats - 1 if fused else mats  # fused: the gated product lives only inside the down projection
    acts = G * live_rows * f_loc * cb * held
    outs = G * (rows * D * cb + S * k * D * (cb if fused else 4))
    weights = w_experts * D * f_loc * mats * cb if fsdp > 1 else 0
    peak = router + dispatch + acts + outs + weights + ((acts + outs) if backward else 0)
    return {
        "tokens_per_device": tokens_per_device, "groups_per_device": G, "tokens_per_group": S,
        "capacity_per_expert": C, "expert_rows_per_group": rows, "dropless": dropless, "expert_chunks": chunks,
        "router_state_bytes": float(router), "dispatch_buffer_bytes": float(dispatch),
        "expert_activation_bytes": float(acts), "expert_output_bytes": float(outs),
        "gathered_weight_bytes": float(weights), "peak_bytes": float(peak),
        "fused": fused,
        "convention": "models.analytics.moe_layer_memory: one MoE layer's buffers per device (docstring); "
                      + ("fused: elementwise work inside the matmuls (libtpu)" if fused
                         else "every array materialised (XLA:CPU)"),
    }
