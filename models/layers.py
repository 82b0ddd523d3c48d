"""Transformer building blocks (Flax NNX). Every matmul goes through the precision policy's einsum module.

Variables are named after their dimensions and carry logical axis names (nnx `out_sharding` metadata) that
partitioning/ maps to mesh axes. Letters: b batch, t query positions, s key positions, d d_model, n heads,
k kv heads, g query heads per kv head, h head_dim, f d_ff, v vocab.
Norms, softmax and RoPE run in float32 whatever the policy; the residual stream between layers is kept in the
model's residual dtype (the compute dtype of a bf16 policy) and each block adds in it (or in float32:
model config residual_add).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.config import ModelConfig
from models.fused_attention import FUSED, fused_attention
from models.moe import MoEBlock
from models.params import normal, ones, param, zeros
from models.precision import Einsum, elementwise_f32
from models.remat import saves
from partitioning.shard import constrain, is_context_parallel, is_sharded


class Norm(nnx.Module):
    """LayerNorm (scale and bias) or RMSNorm (scale), computed in float32."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.kind, self.eps = cfg.norm, cfg.norm_eps
        self.scale_d = param(rngs, ones, (cfg.d_model,), ("embed",))
        if cfg.norm == "layernorm":
            self.bias_d = param(rngs, zeros, (cfg.d_model,), ("embed",))

    def __call__(self, x_btd):
        x = x_btd.astype(jnp.float32)
        if self.kind == "layernorm":
            mean = jnp.mean(x, axis=-1, keepdims=True)
            var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
            y = (x - mean) * jax.lax.rsqrt(var + self.eps) * self.scale_d[...] + self.bias_d[...]
        else:
            ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
            y = x * jax.lax.rsqrt(ms + self.eps) * self.scale_d[...]
        return y


def rope(x_btnh, positions_bt, theta: float):
    """Rotary position embedding (Su et al. 2021), half-split layout as in LLaMA's HF port; float32 math."""
    h = x_btnh.shape[-1]
    freq_j = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))  # (h/2,)
    angle_btj = positions_bt.astype(jnp.float32)[..., None] * freq_j  # (b, t, h/2)
    cos, sin = jnp.cos(angle_btj)[:, :, None, :], jnp.sin(angle_btj)[:, :, None, :]  # (b, t, 1, h/2)
    x = x_btnh.astype(jnp.float32)
    x1, x2 = x[..., : h // 2], x[..., h // 2:]
    y = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return y.astype(x_btnh.dtype)


class Attention(nnx.Module):
    """Multi-head / grouped-query causal self-attention with an optional KV cache (models/inference.py)."""

    def __init__(self, cfg: ModelConfig, policy, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.cfg = cfg
        std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2: residual projections scaled by 1/sqrt(2L)
        self.w_dnh = param(rngs, normal(std), (d, n, h), ("embed", "heads", "head_dim"))  # query
        self.w_dkh_k = param(rngs, normal(std), (d, k, h), ("embed", "kv_heads", "head_dim"))  # key
        self.w_dkh_v = param(rngs, normal(std), (d, k, h), ("embed", "kv_heads", "head_dim"))  # value
        self.w_nhd = param(rngs, normal(out_std), (n, h, d), ("heads", "head_dim", "embed"))  # output
        if cfg.bias:
            self.b_nh = param(rngs, zeros, (n, h), ("heads", "head_dim"))
            self.b_kh_k = param(rngs, zeros, (k, h), ("kv_heads", "head_dim"))
            self.b_kh_v = param(rngs, zeros, (k, h), ("kv_heads", "head_dim"))
            self.b_d = param(rngs, zeros, (d,), ("embed",))
        self.q_dot = policy.einsum_module(rngs=rngs)
        self.k_dot = policy.einsum_module(rngs=rngs)
        self.v_dot = policy.einsum_module(rngs=rngs)
        self.o_dot = policy.einsum_module(rngs=rngs)
        self.score_dot = policy.einsum_module(rngs=rngs)
        self.mix_dot = policy.einsum_module(rngs=rngs)

    def project_qkv(self, x_btd, positions_bt):
        cfg = self.cfg
        # biases added to the float32 accumulators (models/precision.py finish_dot: one rounding)
        q_btnh = self.q_dot("btd,dnh->btnh", x_btd, self.w_dnh[...], bias=self.b_nh[...] if cfg.bias else None)
        k_btkh = self.k_dot("btd,dkh->btkh", x_btd, self.w_dkh_k[...], bias=self.b_kh_k[...] if cfg.bias else None)
        v_btkh = self.v_dot("btd,dkh->btkh", x_btd, self.w_dkh_v[...], bias=self.b_kh_v[...] if cfg.bias else None)
        if cfg.pos == "rope":
            q_btnh = rope(q_btnh, positions_bt, cfg.rope_theta)
            k_btkh = rope(k_btkh, positions_bt, cfg.rope_theta)
        q_btnh = constrain(q_btnh, ("batch", "seq", "heads", "head_dim"), "query")
        k_btkh = constrain(k_btkh, ("batch", "seq", "kv_heads", "head_dim"), "key")
        v_btkh = constrain(v_btkh, ("batch", "seq", "kv_heads", "head_dim"), "value")
        # MaxText's names for remat policies (models/remat.py)
        q_btnh = checkpoint_name(q_btnh, "query_proj")
        k_btkh, v_btkh = checkpoint_name(k_btkh, "key_proj"), checkpoint_name(v_btkh, "value_proj")
        return (q_btnh, *self.gather_context(k_btkh, v_btkh))

    def gather_context(self, k_bskh, v_bskh):
        """Context parallelism (strategies cp, fsdp+cp, fsdp+tp+cp: partitioning/rules.py): the sequence stays split
        over the `context` mesh axis for the queries and everything outside attention, and the keys and values are
        all-gathered along it, so each device attends its block of queries to every key (the causal mask is the
        global one: XLA partitions it with the scores). The backward pass reduce-scatters their gradients. The
        projections are tagged for remat before the gather, so a policy that keeps them keeps the local block."""
        if not is_context_parallel(k_bskh.shape[1]):
            return k_bskh, v_bskh
        axes = ("batch", None, "kv_heads", "head_dim")
        return (constrain(k_bskh, axes, "keys gathered over context"),
                constrain(v_bskh, axes, "values gathered over context"))

    def attend(self, q_btnh, k_bskh, v_bskh, mask_bts, causal_blocks: int = 1):
        """Softmax(q k^T / sqrt(h)) v over the key positions allowed by mask_bts (True = attend).

        Heads move in front of positions first ((b, k, g, t, h) queries, (b, k, s, h) keys and values): every product
        is then a plain batched matmul over (b, k) with the g query heads of a kv head merged into its rows, and XLA
        transposes the 4 MB q/k/v rather than the (t × s) score matrices (on XLA:CPU the attention of `small` ran
        1.6× faster, docs/models.md). causal_blocks > 1 (self-attention, mask_bts causal) splits the queries into
        that many row blocks; block i attends only to keys [0, (i + 1)·t/blocks): the masked upper triangle beyond
        each block is never computed (2 blocks: 3/4 of the score and mix flops, 4: 5/8).
        """
        cfg = self.cfg
        b, t, n, h = q_btnh.shape
        k, g = cfg.n_kv_heads, cfg.q_heads_per_kv
        q_btkgh = (q_btnh * (1.0 / math.sqrt(h))).astype(q_btnh.dtype).reshape(b, t, k, g, h)
        q_bkgth = jnp.transpose(q_btkgh, (0, 2, 3, 1, 4))
        k_bksh, v_bksh = jnp.transpose(k_bskh, (0, 2, 1, 3)), jnp.transpose(v_bskh, (0, 2, 1, 3))
        if causal_blocks > 1:
            tb = t // causal_blocks
            outs = []
            for i in range(causal_blocks):
                hi = (i + 1) * tb
                mask_ts = jnp.arange(i * tb, hi)[:, None] >= jnp.arange(hi)[None, :]
                outs.append(self._softmax_mix(q_bkgth[:, :, :, i * tb:hi], k_bksh[:, :, :hi], v_bksh[:, :, :hi],
                                              mask_ts))
            o_bkgth = jnp.concatenate(outs, axis=3)
        else:
            o_bkgth = self._softmax_mix(q_bkgth, k_bksh, v_bksh, mask_bts[:, None, None])
        return jnp.transpose(o_bkgth, (0, 3, 1, 2, 4)).reshape(b, t, n, h)

    def _softmax_mix(self, q_bkgth, k_bksh, v_bksh, mask, keys_transposed: bool = False):
        """keys_transposed: the keys come laid out (b, k, h, s), as the KV cache keeps them (models/inference.py)."""
        eq = "bkgth,bkhs->bkgts" if keys_transposed else "bkgth,bksh->bkgts"
        s_bkgts = self.score_dot(eq, q_bkgth, k_bksh, out_dtype=jnp.float32)
        s_bkgts = jnp.where(mask, s_bkgts, jnp.finfo(jnp.float32).min)
        p_bkgts = jax.nn.softmax(s_bkgts, axis=-1)
        return self.mix_dot("bkgts,bksh->bkgth", p_bkgts, v_bksh)

    def causal_blocks(self, t: int) -> int:
        """Row blocks for causal self-attention over t positions: 2, 4 or 8 blocks of at least 128 queries; 1 (no
        split) below 256 positions, for quantizing policies (their score/mix modules keep one scale per call) and
        when the sequence axis is sharded (sp: slicing a sharded axis would move data between devices)."""
        if type(self.score_dot) is not Einsum or is_sharded("seq", t):
            return 1
        for nb in (8, 4, 2):
            if t % nb == 0 and t // nb >= 128:
                return nb
        return 1

    def out(self, o_btnh):
        # float32 out (the block adds it in the stream's dtype), the bias added to the accumulator: its gradient sums b*t
        # terms in float32
        o_btnh = checkpoint_name(o_btnh, "context")  # the attention output, MaxText's name
        # heads labelled "a", so that they sort before head_dim ("h"): jnp.einsum lists a dot's contracting labels
        # sorted, and with "n" for heads the dot contracted (head_dim, heads), against both operands' memory order:
        # XLA:CPU transposed both — the whole weight on every call. (Reshaping both to one heads × head_dim axis
        # avoids it too, but then libtpu reduce-scatters this weight's gradient in float32 under
        # weight_grad_dtype=compute: tests/programs/test_master_weights.py.)
        y_btd = self.o_dot("btah,ahd->btd", o_btnh, self.w_nhd[...], bias=self.b_d[...] if self.cfg.bias else None,
                           out_dtype=jnp.float32)
        return remat_tag(y_btd, "out_proj", self.cfg.remat, self.o_dot)

    def causal_self_attention(self, q_btnh, k_btkh, v_btkh):
        """Causal attention of t positions over themselves with the configured implementation (a fused kernel: no
        S x S in memory, models/fused_attention.py; or the model's own products). Also the serving engine's prefill."""
        t = q_btnh.shape[1]
        if self.cfg.attention in FUSED:
            return fused_attention(self.cfg.attention, q_btnh, k_btkh, v_btkh).astype(q_btnh.dtype)
        causal_ts = jnp.tril(jnp.ones((t, t), dtype=bool))
        return self.attend(q_btnh, k_btkh, v_btkh, causal_ts[None], causal_blocks=self.causal_blocks(t))

    def __call__(self, x_btd, positions_bt):
        q_btnh, k_btkh, v_btkh = self.project_qkv(x_btd, positions_bt)
        return self.out(self.causal_self_attention(q_btnh, k_btkh, v_btkh))


def _gelu(u):
    return jax.nn.gelu(u, approximate=True)


def _silu_gate(g, u):
    return jax.nn.silu(g) * u


def remat_tag(y, name: str, remat: str, dot):
    """`y` tagged `name` for remat policies (models/remat.py). When the policy keeps that tensor and `y` is wider than
    the dot's compute dtype (a float32 output for the residual stream), it is kept in the compute dtype, as MaxText
    keeps it, and the layer goes on with that rounded value; float32 policies are unchanged."""
    cd = getattr(dot, "compute_dtype", None)
    if cd is None or not saves(remat, name) or jnp.dtype(cd).itemsize >= jnp.dtype(y.dtype).itemsize:
        return checkpoint_name(y, name)
    return checkpoint_name(y.astype(cd), name).astype(y.dtype)


class MLP(nnx.Module):
    """GELU (tanh approximation, GPT-2) or SwiGLU (Shazeer 2020, LLaMA) feed-forward block.

    With bias=True the up projection and the output carry biases (b_f, b_d); the SwiGLU gate has none (as in
    models/moe.py's experts, so dense and expert MLPs count the same).
    """

    def __init__(self, cfg: ModelConfig, policy, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        self.kind, self.bias, self.remat = cfg.mlp, cfg.bias, cfg.remat
        std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layers)
        self.w_df = param(rngs, normal(std), (d, f), ("embed", "mlp"))  # up (GELU) / up (SwiGLU)
        if cfg.mlp == "swiglu":
            self.w_df_gate = param(rngs, normal(std), (d, f), ("embed", "mlp"))
        self.w_fd = param(rngs, normal(out_std), (f, d), ("mlp", "embed"))  # down
        if cfg.bias:
            self.b_f = param(rngs, zeros, (f,), ("mlp",))
            self.b_d = param(rngs, zeros, (d,), ("embed",))
        self.up_dot = policy.einsum_module(rngs=rngs)
        if cfg.mlp == "swiglu":
            self.gate_dot = policy.einsum_module(rngs=rngs)
        self.down_dot = policy.einsum_module(rngs=rngs)

    def __call__(self, x_btd):
        # the bias and the activation in float32 on the dot's accumulator, one rounding to the compute dtype
        # (models/precision.py finish_dot). A remat policy that keeps the input projections (mlpwi: GELU's; mlpwi_0 /
        # mlpwi_1: SwiGLU's gate and up) keeps them before the activation in the compute dtype, as MaxText does: the
        # activation then runs in float32 on that rounded value.
        b_f = self.b_f[...] if self.bias else None
        if self.kind == "gelu" and saves(self.remat, "mlpwi"):
            u_btf = checkpoint_name(self.up_dot("btd,df->btf", x_btd, self.w_df[...], bias=b_f), "mlpwi")
            a_btf = _gelu(u_btf.astype(jnp.float32)).astype(self.up_dot.out_dtype)
        elif self.kind == "gelu":
            a_btf = self.up_dot("btd,df->btf", x_btd, self.w_df[...], bias=b_f, epilogue=_gelu)
        else:
            u_btf = self.up_dot("btd,df->btf", x_btd, self.w_df[...], bias=b_f, out_dtype=jnp.float32)
            g_btf = self.gate_dot("btd,df->btf", x_btd, self.w_df_gate[...], out_dtype=jnp.float32)
            g_btf = remat_tag(g_btf, "mlpwi_0", self.remat, self.gate_dot)
            u_btf = remat_tag(u_btf, "mlpwi_1", self.remat, self.up_dot)
            a_btf = elementwise_f32(_silu_gate, self.up_dot.out_dtype, getattr(self.up_dot, "compute_dtype", None),
                                    g_btf, u_btf)
        a_btf = constrain(a_btf, ("batch", "seq", "mlp"), "mlp hidden")
        # float32 out (the block adds it in the stream's dtype), the bias on the accumulator: its gradient sums b*t terms
        y_btd = self.down_dot("btf,fd->btd", a_btf, self.w_fd[...], bias=self.b_d[...] if self.bias else None,
                              out_dtype=jnp.float32)
        return remat_tag(y_btd, "mlpwo", self.remat, self.down_dot), {}


def make_mlp(cfg: ModelConfig, policy, rngs: nnx.Rngs):
    """Dense MLP, or the MoE engineer's models.moe.MoEBlock when cfg.n_experts > 0. Both return (y_btd, aux)."""
    if cfg.is_moe:
        return MoEBlock(cfg, policy, rngs=rngs)
    return MLP(cfg, policy, rngs)


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)) (sequential); or x + attn(norm(x)) +
    mlp(norm(x)) with one norm (parallel, model config `block`). The adds run in the residual stream's dtype, or
    float32 under residual_add=float32."""

    def __init__(self, cfg: ModelConfig, policy, rngs: nnx.Rngs):
        self.parallel = cfg.block == "parallel"
        self.add_f32 = cfg.residual_add == "float32"
        self.norm_attn = Norm(cfg, rngs)
        self.attn = Attention(cfg, policy, rngs)
        if not self.parallel:  # a parallel block's MLP reads the attention's normed input
            self.norm_mlp = Norm(cfg, rngs)
        self.mlp = make_mlp(cfg, policy, rngs)

    def add(self, x_btd, *ys):
        """x + (the sum of ys), in float32 under residual_add=float32, else in x's dtype (the residual stream's)."""
        dt = jnp.promote_types(x_btd.dtype, jnp.float32) if self.add_f32 else x_btd.dtype
        return x_btd.astype(dt) + functools.reduce(jnp.add, [y.astype(dt) for y in ys])

    def __call__(self, x_btd, positions_bt):
        if self.parallel:
            h_btd = self.norm_attn(x_btd)
            y_btd, aux = self.mlp(h_btd)
            x_btd = self.add(x_btd, self.attn(h_btd, positions_bt), y_btd)
            return constrain(x_btd, ("batch", "seq", "act_embed"), "residual"), aux
        x_btd = self.add(x_btd, self.attn(self.norm_attn(x_btd), positions_bt))
        x_btd = constrain(x_btd, ("batch", "seq", "act_embed"), "residual")
        y_btd, aux = self.mlp(self.norm_mlp(x_btd))
        x_btd = self.add(x_btd, y_btd)
        x_btd = constrain(x_btd, ("batch", "seq", "act_embed"), "residual")
        return x_btd, aux
