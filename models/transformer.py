"""Decoder-only transformer (GPT-2/3, LLaMA, Mixtral styles from one config). Flax NNX.

    model = Transformer(cfg, policy, rngs=nnx.Rngs(0))
    logits_btv, aux = model(tokens_bt)     # logits in the policy's compute dtype; aux: float32 scalars

aux is empty for dense models; with experts it holds 'loss' (the weighted auxiliary losses summed over layers, to add
to the training loss) and the MoE block's metrics averaged over layers.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.config import ModelConfig
from models.layers import Block, Norm
from models.params import normal, param
from models.precision import get_policy
from models.remat import parse_remat
from partitioning.shard import constrain, is_context_parallel


def combine_aux(auxes: list[dict]) -> dict:
    """Sum 'loss' over layers, average every other metric."""
    out: dict = {}
    if not auxes or not any(auxes):
        return out
    keys = sorted({k for a in auxes for k in a})
    for key in keys:
        vals = [jnp.asarray(a[key], jnp.float32) for a in auxes if key in a]
        out[key] = sum(vals) if key == "loss" else sum(vals) / len(vals)
    return out


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, policy=None, rngs: nnx.Rngs | None = None):
        policy = get_policy("float32") if policy is None else get_policy(policy)
        if cfg.weight_grad_dtype == "compute":
            policy = policy.with_weight_grads_in_compute_dtype()
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.cfg, self.policy_name = cfg, policy.name
        # the residual stream between layers (what rematerialization saves per layer) is stored in the compute dtype,
        # as MaxText does; each block adds in float32 (models/layers.py). float32 policies keep float32 throughout.
        self.residual_dtype = jnp.dtype(policy.compute_dtype) if jnp.dtype(policy.compute_dtype).itemsize >= 2 \
            else jnp.dtype(jnp.bfloat16)
        d, v = cfg.d_model, cfg.vocab_size
        self.w_vd = param(rngs, normal(0.02), (v, d), ("vocab", "embed"))  # token embedding (and tied head)
        if cfg.pos == "learned":
            self.w_sd = param(rngs, normal(0.01), (cfg.seq_len, d), (None, "embed"))  # learned positions
        if cfg.scan_layers:  # parameters stacked on a leading layer axis (logical name 'layers': only the pipeline
            #                  strategies shard it, over the `stage` mesh axis; models/pipeline.py)
            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_blocks(rngs):
                return Block(cfg, policy, rngs)

            self.blocks = make_blocks(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, policy, rngs) for _ in range(cfg.n_layers)])
        self.norm_f = Norm(cfg, rngs)
        if not cfg.tie_embeddings:
            self.w_dv = param(rngs, normal(0.02), (d, v), ("embed", "vocab"))  # output head
        self.head_dot = policy.einsum_module(rngs=rngs)

    def embed(self, tokens_bt, positions_bt):
        w_vd = self.w_vd[...]
        w_sd = self.w_sd[...] if self.cfg.pos == "learned" else None
        if is_context_parallel(tokens_bt.shape[1]):  # the tables gathered whole along embed first (as fsdp gathers a
            # parameter before use), so the looked-up rows come out split like the tokens: XLA cannot move a lookup
            # split along embed over (data, context) to (batch over data, seq over context) and would replicate it
            w_vd = constrain(w_vd, ("vocab", None), "embedding table")
            w_sd = None if w_sd is None else constrain(w_sd, (None, None), "position table")
        x_btd = jnp.take(w_vd, tokens_bt, axis=0)  # float32 residual stream
        if w_sd is not None:
            x_btd = x_btd + jnp.take(w_sd, positions_bt, axis=0)
        return constrain(x_btd, ("batch", "seq", "embed"), "embedding output")

    def head(self, x_btd):
        x_btd = self.norm_f(x_btd)
        if self.cfg.tie_embeddings:
            logits_btv = self.head_dot("btd,vd->btv", x_btd, self.w_vd[...])
        else:
            logits_btv = self.head_dot("btd,dv->btv", x_btd, self.w_dv[...])
        return constrain(logits_btv, ("batch", "seq", "vocab"), "logits")

    def block_call(self):
        """(block, x_btd, positions_bt) -> (x_btd, aux): one layer under the config's remat policy (the function the
        layer loop and the pipeline, models/pipeline.py, both apply; policies: models/remat.py)."""
        return remat_block(self.cfg.remat)

    def __call__(self, tokens_bt, positions_bt=None):
        b, t = tokens_bt.shape
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        rd = self.residual_dtype
        x_btd = self.embed(tokens_bt, positions_bt).astype(rd)
        call = self.block_call()
        if self.cfg.scan_layers:
            def body(x_btd, block):
                x_btd, aux = call(block, x_btd, positions_bt)
                return x_btd.astype(rd), aux

            x_btd, aux_l = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(x_btd, self.blocks)
            aux = {k: (v.sum() if k == "loss" else v.mean()).astype(jnp.float32) for k, v in aux_l.items()}
            return self.head(x_btd), aux
        auxes = []
        for block in self.blocks:
            x_btd, aux = call(block, x_btd, positions_bt)
            x_btd = x_btd.astype(rd)
            auxes.append(aux)
        return self.head(x_btd), combine_aux(auxes)


def _block(block, x_btd, positions_bt):
    return block(checkpoint_name(x_btd, "decoder_layer_input"), positions_bt)


@functools.lru_cache(maxsize=64)
def remat_block(remat: str):
    """`_block` under the remat policy `remat` (models/remat.py): itself for 'none'; nnx.remat with no policy for
    'full' / 'per-layer' (each layer keeps its input and recomputes the rest); otherwise the jax.checkpoint policy
    that keeps the named tensors (save_only_these_names / save_and_offload_only_these_names) or, for 'dots', every
    matmul output (on XLA:CPU writing every elementwise residual into the scan's stacked buffers and reading it back
    cost more than recomputing it: small 0.75 -> 0.68 s/step, docs/models.md)."""
    policy = parse_remat(remat)
    if policy.kind == "none":
        return _block
    return nnx.remat(_block, policy=policy.jax_policy())


def count_params(model: nnx.Module) -> int:
    """Number of parameter scalars in an (abstract or concrete) model."""
    state = nnx.state(model, nnx.Param)
    return sum(int(x.size) for x in jax.tree.leaves(state))
