"""A plain MLP for small studies (precision, fusion, partitioning of a matmul chain).

    model = MLPModel(d_model=256, d_ff=1024, n_layers=2, policy=get_policy('bf16'), rngs=nnx.Rngs(0))
    y_bd, aux = model(x_bd)        # residual blocks x + W2 gelu(W1 norm(x)); aux is {} (same contract as Transformer)

Weights carry the same logical axis names as the transformer's MLP (embed, mlp), so every strategy applies.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.params import normal, param, zeros
from models.precision import get_policy
from partitioning.shard import constrain


class MLPBlock(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, n_layers: int, policy, rngs: nnx.Rngs):
        self.w_df = param(rngs, normal(1.0 / math.sqrt(d_model)), (d_model, d_ff), ("embed", "mlp"))
        self.b_f = param(rngs, zeros, (d_ff,), ("mlp",))
        self.w_fd = param(rngs, normal(1.0 / math.sqrt(d_ff * 2 * n_layers)), (d_ff, d_model), ("mlp", "embed"))
        self.b_d = param(rngs, zeros, (d_model,), ("embed",))
        self.up_dot = policy.einsum_module(rngs=rngs)
        self.down_dot = policy.einsum_module(rngs=rngs)

    def __call__(self, x_bd):
        h_bf = self.up_dot("bd,df->bf", x_bd, self.w_df[...])
        h_bf = jax.nn.gelu(h_bf + self.b_f[...].astype(h_bf.dtype), approximate=True)
        h_bf = constrain(h_bf, ("batch", "mlp"), "mlp hidden")
        y_bd = self.down_dot("bf,fd->bd", h_bf, self.w_fd[...])
        return x_bd + (y_bd + self.b_d[...].astype(y_bd.dtype)).astype(jnp.float32)


class MLPModel(nnx.Module):
    """n_layers residual GELU blocks on (batch, d_model) float32 inputs."""

    def __init__(self, d_model: int = 128, d_ff: int = 512, n_layers: int = 2, policy=None,
                 rngs: nnx.Rngs | None = None):
        policy = get_policy("float32") if policy is None else get_policy(policy)
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.blocks = nnx.List([MLPBlock(d_model, d_ff, n_layers, policy, rngs) for _ in range(n_layers)])

    def __call__(self, x_bd):
        x_bd = constrain(x_bd.astype(jnp.float32), ("batch", "embed"), "mlp input")
        for block in self.blocks:
            x_bd = block(x_bd)
        return x_bd, {}
