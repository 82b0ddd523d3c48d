"""The models' one parameter convention: float32 parameters carrying logical axis names, created without eager
sharding (partitioning/ places them later), and the initializers the layers use."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs | None, init, shape: tuple[int, ...], axes: tuple, dtype=jnp.float32) -> nnx.Param:
    """A float32 parameter carrying logical axis names. Eager sharding is off: partitioning/ places it later."""
    key = rngs.params() if rngs is not None else jax.random.key(0)
    with nnx.use_eager_sharding(False):
        return nnx.Param(init(key, shape, dtype), out_sharding=tuple(axes))


def normal(std: float):
    return nnx.initializers.normal(stddev=std)


zeros = nnx.initializers.zeros_init()
ones = nnx.initializers.ones_init()
