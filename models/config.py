"""Model configuration: one frozen dataclass, validated on construction, precision-free.

Precision (compute dtype, fp8 scaling, ...) comes from the policy in models/precision.py, never from the config.
Presets live in models/presets.py; analytic counts (params, FLOPs, memory) in models/analytics.py.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from models.fused_attention import SPLASH_LANES, blocked_block
from models.remat import REMATS, parse_remat  # noqa: F401  (REMATS: the policies by name, re-exported)
from models.remat import TENSORS as REMAT_TENSORS
from workbench.errors import WorkbenchError

MLPS = ("gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
OPTIMIZER_SHARDINGS = ("params", "data")
MASTER_WEIGHTS = ("params", "optimizer")
WEIGHT_GRAD_DTYPES = ("float32", "compute")
POSITIONS = ("learned", "rope")
BLOCKS = ("sequential", "parallel")
RESIDUAL_ADDS = ("stream", "float32")
ROUTERS = ("token-choice", "expert-choice")
ROUTER_SCORES = ("softmax", "sigmoid")
A2A_MODES = ("auto", "padded", "ragged", "ragged-emulated")  # expert-parallel exchange (models/moe.py choose_a2a)
# self-attention (models/fused_attention.py): 'dot' (the model's own einsums, the S x S scores written), 'blocked'
# (flash-style attention in JAX: online softmax over key blocks, any backend), 'splash' (JAX's Pallas TPU splash
# kernels), 'flash' (JAX's Pallas GPU flash kernels), 'xla' / 'cudnn' (jax.nn.dot_product_attention with that
# implementation), 'auto' (resolved per platform when a program is built: resolve_attention)
ATTENTIONS = ("auto", "dot", "blocked", "splash", "flash", "xla", "cudnn")
# attention=auto on CPU hosts and simulated meshes: 'blocked' from this many positions, 'dot' below. From 2048 the
# scores of one head and sequence are >= 16 MiB in float32 (and their softmax as much again), more than the rest of a
# layer's activations per token for every preset (n·t scores against ~16·d values, t/h >= 16); below it the dot
# form's causal row blocks already keep them small and its few large matmuls need no loop
BLOCKED_MIN_SEQ = 2048
GMM_IMPLS = ("auto", "ragged_dot", "gmm", "blocked")  # dropless grouped matmul (models/kernels/grouped.py)
# moe_gmm=auto per platform, measured with `workbench moe gmm` (docs/moe.md): the form whose compiled flops are
# closest to the useful work
GMM_BY_PLATFORM = {"tpu": "gmm", "cpu": "blocked", "gpu": "blocked"}


def resolve_gmm(impl: str, platform: str) -> str:
    """The grouped-matmul form moe_gmm=`impl` runs on `platform`: 'auto' resolved from GMM_BY_PLATFORM (validation of
    the pair: models.kernels.grouped.choose_impl)."""
    return GMM_BY_PLATFORM.get(platform, "ragged_dot") if impl == "auto" else impl


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer (GPT-2/3, LLaMA, Mixtral styles).

    Shapes use the letters of the variable names in models/: b batch, t/s sequence, d d_model, n n_heads,
    k n_kv_heads, h head_dim, f d_ff, v vocab_size, e n_experts.
    """

    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: = n_heads (multi-head); fewer: grouped-query attention
    head_dim: int | None = None  # None: d_model // n_heads
    d_ff: int = 256
    vocab_size: int = 256
    seq_len: int = 64
    mlp: str = "gelu"  # 'gelu' (2 matrices) | 'swiglu' (3 matrices)
    norm: str = "layernorm"  # 'layernorm' (scale + bias) | 'rmsnorm' (scale)
    pos: str = "learned"  # 'learned' absolute positions | 'rope'
    rope_theta: float = 10000.0
    bias: bool = True  # biases on every dense layer (GPT-2 style)
    tie_embeddings: bool = True  # output head = embedding table transposed
    norm_eps: float = 1e-5
    # 'sequential' (x + attn(norm(x)), then + mlp(norm(that)): GPT-2/3, LLaMA) | 'parallel' (x + attn(norm(x)) +
    # mlp(norm(x)), one norm: GPT-J, PaLM, and MaxText's default decoder layer, which its 2023 16B-1T runs used)
    block: str = "sequential"
    # the dtype a block adds its attention and MLP outputs to the residual stream in: 'stream' (the stream's own, the
    # compute dtype under bf16 policies, as MaxText, Megatron without fp32_residual_connection and torchtitan add) |
    # 'float32' (added in float32 and rounded once, at the block's end). float32 policies: float32 either way
    residual_add: str = "stream"
    # mixture of experts (models/moe.py): n_experts=0 means a dense MLP
    n_experts: int = 0
    top_k: int = 2
    capacity_factor: float | None = None  # None: dropless
    router: str = "token-choice"
    router_score: str = "softmax"
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    router_jitter: float = 0.0  # multiplicative uniform noise on router inputs while training (0: off)
    router_bias_rate: float = 0.0  # loss-free balancing: per-expert bias update rate (0: off)
    moe_a2a: str = "auto"  # expert-parallel exchange: auto | padded | ragged | ragged-emulated (models/moe.py)
    moe_gmm: str = "auto"  # dropless grouped matmul: auto (per backend) | ragged_dot | gmm | blocked
    n_shared_experts: int = 0  # always-on experts every token passes through (DeepSeekMoE), each of d_ff
    # memory
    remat: str = "none"  # a policy of models/remat.py: 'none' | 'per-layer' (= MaxText's 'full': each layer keeps
    #                      its input, the rest is recomputed in the backward pass) | 'dots' (every matmul output saved)
    #                      | MaxText's names ('minimal', 'save_dot_except_mlpwi', 'save_qkv_proj', ...,
    #                      'minimal_offloaded') | 'offload' | a per-tensor list 'decoder_layer_input=offload,...'
    # compile: one block scanned over stacked layer parameters (nnx.scan) instead of n_layers unrolled blocks.
    # Compiles in time independent of depth, and the backward pass materialises the residual gradient once per
    # layer (unrolled, XLA:CPU re-fuses the whole downstream chain at every layer: bytes grow with depth squared).
    scan_layers: bool = False
    attention: str = "auto"  # ATTENTIONS; resolved per platform when a program is built (resolve_attention)
    # training: 'params' (the optimizer state sharded as its parameters) | 'data' (also split over the data-parallel
    # replicas: ZeRO-1, Megatron's distributed optimizer; gradients reduce-scattered to each rank's slice)
    optimizer_sharding: str = "params"
    # 'params' (the parameters are the float32 master weights; the policy casts them for each dot) | 'optimizer'
    # (the parameters and their gradients kept in the policy's compute dtype, a float32 master copy in the optimizer
    # state, sharded with it: Megatron's megatron_amp_O2 with its distributed optimizer and grad_sync_dtype=bf16)
    master_weights: str = "params"
    # the dtype a weight-gradient dot returns on a TPU or GPU: 'float32' (the float32 master weight's gradient
    # accumulated and reduced over the data-parallel devices in float32) | 'compute' (the policy's compute dtype, then
    # widened: MaxText's dots return bf16, so its programs reduce-scatter bf16 weight gradients). CPU hosts: float32.
    weight_grad_dtype: str = "float32"

    def __post_init__(self):
        # resolve the derived defaults first (frozen: object.__setattr__)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim is None:
            if self.n_heads and self.d_model % max(self.n_heads, 1):
                raise WorkbenchError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                                     "set head_dim explicitly or change n_heads")
            object.__setattr__(self, "head_dim", self.d_model // max(self.n_heads, 1))
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size", "seq_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise WorkbenchError(f"model config {name} must be a positive whole number, got {v!r}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise WorkbenchError(f"model config {f.name} must be a finite number, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise WorkbenchError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} "
                                 "(grouped-query attention shares each kv head among n_heads/n_kv_heads heads)")
        for name, allowed in (("mlp", MLPS), ("norm", NORMS), ("pos", POSITIONS), ("router", ROUTERS),
                              ("router_score", ROUTER_SCORES), ("block", BLOCKS), ("residual_add", RESIDUAL_ADDS)):
            if getattr(self, name) not in allowed:
                raise WorkbenchError(f"model config {name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        parse_remat(self.remat)  # an unknown policy or tensor: one line
        if self.optimizer_sharding not in OPTIMIZER_SHARDINGS:
            raise WorkbenchError(f"model config optimizer_sharding={self.optimizer_sharding!r} is not one of "
                                 f"{', '.join(OPTIMIZER_SHARDINGS)}")
        if self.master_weights not in MASTER_WEIGHTS:
            raise WorkbenchError(f"model config master_weights={self.master_weights!r} is not one of "
                                 f"{', '.join(MASTER_WEIGHTS)}")
        if self.weight_grad_dtype not in WEIGHT_GRAD_DTYPES:
            raise WorkbenchError(f"model config weight_grad_dtype={self.weight_grad_dtype!r} is not one of "
                                 f"{', '.join(WEIGHT_GRAD_DTYPES)}")
        if self.attention not in ATTENTIONS:
            raise WorkbenchError(f"model config attention={self.attention!r} is not one of {', '.join(ATTENTIONS)}")
        if self.moe_gmm not in GMM_IMPLS:
            raise WorkbenchError(f"model config moe_gmm={self.moe_gmm!r} is not one of {', '.join(GMM_IMPLS)}")
        if self.n_shared_experts < 0 or (self.n_shared_experts and not self.n_experts):
            raise WorkbenchError("n_shared_experts must be >= 0 and needs n_experts > 0")
        if self.moe_a2a not in A2A_MODES:
            raise WorkbenchError(f"model config moe_a2a={self.moe_a2a!r} is not one of {', '.join(A2A_MODES)}")
        if self.router_jitter < 0 or self.router_bias_rate < 0:
            raise WorkbenchError("model config router_jitter and router_bias_rate must be >= 0")
        if self.pos == "rope" and self.head_dim % 2:
            raise WorkbenchError(f"pos='rope' needs an even head_dim, got {self.head_dim}")
        if not isinstance(self.n_experts, int) or self.n_experts < 0 or self.n_experts == 1:
            raise WorkbenchError(f"n_experts must be 0 (dense) or >= 2, got {self.n_experts!r}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise WorkbenchError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")
        if self.capacity_factor is not None and not 0 < self.capacity_factor < math.inf:
            raise WorkbenchError(f"capacity_factor must be a finite number > 0, or None (dropless), got {self.capacity_factor!r}")
        for name in ("aux_loss_coef", "z_loss_coef", "norm_eps"):
            if not getattr(self, name) >= 0:
                raise WorkbenchError(f"model config {name} must be >= 0, got {getattr(self, name)!r}")
        if not self.rope_theta > 0:
            raise WorkbenchError(f"rope_theta must be > 0, got {self.rope_theta!r}")

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def q_heads_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    def replace(self, **overrides: Any) -> "ModelConfig":
        """A new validated config with some fields changed (unknown keys: one-line error)."""
        return dataclasses.replace(self, **_check_keys(overrides))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}


def _check_keys(overrides: dict) -> dict:
    unknown = [k for k in overrides if k not in FIELDS]
    if unknown:
        raise WorkbenchError(f"unknown model config key {unknown[0]!r}; valid keys: {', '.join(FIELDS)}")
    return overrides


def _parse_value(key: str, text: str):
    """Parse one `k=v` value with the type the field expects."""
    f = FIELDS[key]
    t = str(f.type)
    s = text.strip()
    if s.lower() in ("none", "null") and "None" in t:
        return None
    if t.startswith("bool"):
        if s.lower() in ("1", "true", "yes", "on"):
            return True
        if s.lower() in ("0", "false", "no", "off"):
            return False
        raise WorkbenchError(f"model config {key} must be true or false, got {text!r}")
    if t.startswith("int"):
        try:
            return int(s)
        except ValueError:
            raise WorkbenchError(f"model config {key} must be a whole number, got {text!r}") from None
    if t.startswith("float"):
        try:
            return float(s)
        except ValueError:
            raise WorkbenchError(f"model config {key} must be a number, got {text!r}") from None
    return s


def parse_overrides(overrides: dict | str | None) -> dict:
    """'k=v,k=v' (CLI --set) or a dict -> dict of typed values; unknown keys and bad values are one-line errors."""
    if overrides is None or overrides == "":
        return {}
    if isinstance(overrides, dict):
        return _check_keys(dict(overrides))
    out = {}
    for item in str(overrides).split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise WorkbenchError(f"override {item!r} is not of the form key=value (e.g. --set n_layers=4,d_model=128)")
        k, v = item.split("=", 1)
        k = k.strip()
        if k in REMAT_TENSORS and k not in FIELDS and isinstance(out.get("remat"), str) and "=" in out["remat"]:
            out["remat"] += f",{k}={v.strip()}"  # remat=decoder_layer_input=offload,query_proj=offload: one policy
            continue
        _check_keys({k: None})
        out[k] = _parse_value(k, v)
    return out


def resolve_attention(cfg: "ModelConfig", platform: str, compute_dtype, seq: int | None = None) -> "ModelConfig":
    """`cfg` with attention='auto' made concrete for a program over `seq` positions (default cfg.seq_len) compiled
    for `platform` ('cpu' | 'gpu' | 'tpu', or JAX's 'cuda'/'rocm') in `compute_dtype`:

    - TPU: 'splash' (Pallas splash kernels) when seq is a multiple of 128 (the kernels' lanes);
    - NVIDIA GPU in bf16/fp16 with a head size that is a multiple of 8 up to 128: 'cudnn' (cuDNN's flash kernels);
    - otherwise (CPU hosts, simulated meshes, the cases above that do not qualify): 'blocked' from BLOCKED_MIN_SEQ
      positions (when they split into blocks), 'dot' below.

    An explicit choice is kept; one that cannot compile for the platform is a one-line error ('cudnn' and 'flash'
    need a GPU program, cudnn in bf16/fp16; 'splash' a TPU program)."""
    import numpy as np

    seq = cfg.seq_len if seq is None else int(seq)
    narrow = np.dtype(compute_dtype).name in ("bfloat16", "float16")
    gpu, tpu = platform in ("gpu", "cuda"), platform == "tpu"
    if cfg.attention == "cudnn" and not (gpu and narrow):
        raise WorkbenchError("attention=cudnn needs a program for NVIDIA GPUs in bf16 or fp16 (cuDNN's fused attention); "
                             f"this one is for {platform} in {np.dtype(compute_dtype).name}: use attention=blocked or dot")
    if cfg.attention == "flash" and not gpu:
        raise WorkbenchError(f"attention=flash (Pallas GPU kernels) needs a program for NVIDIA GPUs; this one is for "
                             f"{platform}: use attention=blocked or dot")
    if cfg.attention == "splash" and not tpu:
        raise WorkbenchError(f"attention=splash (Pallas TPU kernels) needs a program for TPUs; this one is for "
                             f"{platform}: use attention=blocked or dot")
    if cfg.attention != "auto":
        return cfg
    if tpu and seq % SPLASH_LANES == 0:
        return cfg.replace(attention="splash")
    if gpu and narrow and cfg.head_dim % 8 == 0 and cfg.head_dim <= 128:
        return cfg.replace(attention="cudnn")
    blocked = seq >= BLOCKED_MIN_SEQ and blocked_block(seq) < seq
    return cfg.replace(attention="blocked" if blocked else "dot")
