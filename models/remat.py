"""Rematerialization policies by name: MaxText's `remat_policy` values and its per-tensor custom mode.

    policy = parse_remat("save_dot_except_mlpwi")     # RematPolicy(kind='names', save=(...), offload=())
    policy = parse_remat("decoder_layer_input=offload,query_proj=offload")   # custom: each tensor remat|device|offload
    policy.jax_policy()                                # the jax.checkpoint policy (None: save nothing but the input)
    saves("minimal", "mlpwo")                          # True: the policy keeps that tensor (on device or host)

The model tags the tensors MaxText tags with `jax.ad_checkpoint.checkpoint_name`, under MaxText's names (TAGGED:
models/transformer.py the layer input, models/layers.py the rest), and a named policy keeps exactly the tagged tensors
it lists, through `jax.checkpoint_policies.save_only_these_names` (kept in device memory) or
`save_and_offload_only_these_names` (copied to pinned host memory after the forward pass and back for the backward).
Everything else inside a layer is recomputed in the backward pass from the layer's input, which a layer under remat
always keeps (it is the argument of the checkpointed function). The definitions follow MaxText's
`Decoder.get_remat_policy` and `maxtext_utils.get_save_and_offload_names`.

The workbench's own names keep their meaning: `none` (no rematerialization), `per-layer` (= MaxText's `full`: each
layer keeps only its input), `dots` (every matmul output saved, jax.checkpoint_policies.dots_saveable) and `offload`
(the layer input and the q/k/v projections offloaded to host memory: the custom policy
`decoder_layer_input=offload,query_proj=offload,key_proj=offload,value_proj=offload`).
"""
from __future__ import annotations

import dataclasses
import functools

from workbench.errors import WorkbenchError

# the tensors this model tags, MaxText's names: the layer input; the q/k/v projections (after RoPE, as MaxText tags
# them); the attention output before its projection (context); the attention output projection; the MLP's input
# projections before the activation (mlpwi: GELU's one matrix; mlpwi_0 / mlpwi_1: SwiGLU's gate and up matrices);
# the MLP's output projection
TAGGED = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi", "mlpwi_0",
          "mlpwi_1", "mlpwo")
# names MaxText's custom mode takes that this model never produces (fused projections, MLA, MoE experts, ...):
# accepted so that a MaxText configuration reads as written; they keep nothing here
UNTAGGED = ("kv_proj", "qkv_proj", "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo", "query_wa_proj", "kv_wa_proj",
            "mla_q", "mla_kv", "attention_out", "engram", "indexer_cutoff_threshold")
TENSORS = TAGGED + UNTAGGED
MODES = ("remat", "device", "offload")

_QKV = ("query_proj", "value_proj", "key_proj", "kv_proj", "qkv_proj")
_MINIMAL = _QKV + ("out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")

# name -> (saved in device memory, offloaded to host memory); MaxText's definitions
NAMED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "minimal": (_MINIMAL, ()),
    "minimal_with_context": (_MINIMAL + ("context",), ()),
    "save_dot_with_context_except_mlp": (_QKV + ("context", "out_proj"), ()),
    "save_dot_except_mlpwi": (_QKV + ("out_proj", "mlpwo"), ()),
    "save_dot_except_mlp": (_QKV + ("out_proj",), ()),
    "save_qkv_proj": (_QKV, ()),
    "save_out_proj": (("out_proj",), ()),
    "qkv_proj_offloaded": ((), ("query_proj", "value_proj", "key_proj", "kv_proj")),
    "minimal_offloaded": ((), _MINIMAL),
    "offload": ((), ("decoder_layer_input", "query_proj", "key_proj", "value_proj")),  # the workbench's own
    # torchtitan's selective op-level activation checkpointing (activation_checkpoint.py: every op in its save list
    # keeps its output but every second matmul of a block, counted from 1): of a LLaMA block's matmuls q k v o w1 w3
    # w2 it keeps q, v, w1 (the SwiGLU gate: mlpwi_0) and w2 (mlpwo), and the fused attention's output (context)
    "torchtitan_selective_op": (("query_proj", "value_proj", "context", "mlpwi_0", "mlpwo"), ()),
}
# every name --remat takes (besides a custom NAME=MODE list)
REMATS = ("none", "full", "per-layer", "dots", *NAMED)
ALIASES = {"per-layer": "full"}  # MaxText's 'full': nothing saved inside the layer


@dataclasses.dataclass(frozen=True)
class RematPolicy:
    """kind: 'none' (no remat) | 'full' (each layer keeps only its input) | 'dots' (every matmul output) | 'names'
    (the tagged tensors in `save` kept in device memory, those in `offload` copied to host memory)."""

    name: str
    kind: str
    save: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()

    @property
    def kept(self) -> frozenset[str]:
        """The tagged tensors the backward pass reads instead of recomputing (saved or offloaded)."""
        if self.kind == "none":
            return frozenset(TAGGED)
        return frozenset(self.save) | frozenset(self.offload)

    def jax_policy(self):
        """The jax.checkpoint policy; None for 'full' (nothing saved) and 'none' (no checkpoint at all)."""
        import jax

        if self.kind == "dots":
            return jax.checkpoint_policies.dots_saveable
        if self.kind != "names":
            return None
        if not self.offload:
            return jax.checkpoint_policies.save_only_these_names(*self.save)
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=list(self.save), names_which_can_be_offloaded=list(self.offload),
            offload_src="device", offload_dst="pinned_host")


def _custom(text: str) -> RematPolicy:
    """'decoder_layer_input=offload,query_proj=offload' (',' ';' or spaces between): MaxText's custom mode. Tensors
    not named are recomputed, but for the layer input, which is kept on the device (MaxText's defaults)."""
    modes: dict[str, str] = {}
    for item in text.replace(";", ",").replace(" ", ",").split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise WorkbenchError(f"remat tensor {item!r} is not of the form name=mode (e.g. --remat "
                                 "decoder_layer_input=offload,query_proj=offload)")
        k, v = (p.strip() for p in item.split("=", 1))
        if k not in TENSORS:
            raise WorkbenchError(f"unknown remat tensor {k!r}; tensors are {', '.join(TENSORS)}")
        if v not in MODES:
            raise WorkbenchError(f"remat tensor {k}={v!r}: choose {', '.join(MODES)}")
        if k in modes and modes[k] != v:
            raise WorkbenchError(f"remat tensor {k!r} given twice ({modes[k]} and {v})")
        modes[k] = v
    if not modes:
        raise WorkbenchError("empty custom remat policy; write name=remat|device|offload pairs")
    if modes.get("decoder_layer_input") == "remat":
        raise WorkbenchError("decoder_layer_input cannot be rematerialized: the recompute starts from it; choose "
                             "device or offload")
    save = tuple(k for k in TENSORS if modes.get(k) == "device" and k != "decoder_layer_input")
    offload = tuple(k for k in TENSORS if modes.get(k) == "offload")
    canonical = ",".join(f"{k}={modes[k]}" for k in TENSORS if k in modes)
    return RematPolicy(canonical, "names", save, offload)


@functools.lru_cache(maxsize=256)
def parse_remat(text: str) -> RematPolicy:
    """The policy a `--remat` value names (REMATS, or a custom NAME=MODE list); a bad value is a one-line error."""
    if not isinstance(text, str) or not text.strip():
        raise WorkbenchError(f"empty remat policy; choose {', '.join(REMATS)} or name=remat|device|offload,...")
    s = text.strip()
    if "=" in s:
        return _custom(s)
    if s == "custom":
        return RematPolicy("custom", "full")  # MaxText's defaults: every tensor recomputed, the layer input kept
    if s == "none":
        return RematPolicy(s, "none")
    if s in ("full", "per-layer"):
        return RematPolicy(s, "full")
    if s == "dots":
        return RematPolicy(s, "dots")
    if s in NAMED:
        save, offload = NAMED[s]
        return RematPolicy(s, "names", save, offload)
    raise WorkbenchError(f"unknown remat policy {s!r}; choose {', '.join(REMATS)} or a per-tensor list "
                         "name=remat|device|offload,... (e.g. decoder_layer_input=offload,query_proj=offload)")


def saves(remat: str, name: str) -> bool:
    """Whether `remat` keeps the tagged tensor `name` for the backward pass (in device or host memory) rather than
    recomputing it. The model stores such a tensor in the compute dtype, as MaxText does (models/layers.py)."""
    p = parse_remat(remat)
    return p.kind == "names" and name in p.kept


def offloads(remat: str) -> bool:
    """Whether the policy copies tensors to host memory (pinned_host: TPU and GPU targets)."""
    return bool(parse_remat(remat).offload)
