"""Precision policies: the one object every dense/einsum in the models consults (no precision flags inside layers).

A layer asks its policy for an einsum module once, at construction:

    self.dot = policy.einsum_module(rngs=rngs)      # may carry state (fp8 scales, amax histories)
    y_btf = self.dot("btd,df->btf", x_btd, w_df)     # returns policy.compute_dtype, accumulates in float32

Parameters stay in `policy.param_dtype` (float32 master weights). Softmax, norms, losses and optimizer state stay in
float32 whatever the policy. Policies that need more (fp16 dynamic loss scaling, fp8 scaling, MX block formats)
subclass `PrecisionPolicy` and register themselves in `_REGISTRY` (see models/quant.py where present).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
from flax import nnx

from workbench.errors import WorkbenchError


class Einsum(nnx.Module):
    """Plain einsum: cast both operands to the compute dtype, accumulate in float32, return the compute dtype."""

    def __init__(self, compute_dtype):
        self.compute_dtype = compute_dtype

    def __call__(self, eq: str, x, w):
        cd = self.compute_dtype
        y = jnp.einsum(eq, x.astype(cd), w.astype(cd), preferred_element_type=jnp.float32)
        return y.astype(cd)


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    name: str
    compute_dtype: object = jnp.float32
    param_dtype: object = jnp.float32
    description: str = ""

    def einsum_module(self, rngs: nnx.Rngs | None = None) -> nnx.Module:
        return Einsum(self.compute_dtype)

    @property
    def loss_scaling(self):
        """None, or an object with init()/scale(loss)/unscale_and_check(grads, state) for fp16 dynamic scaling."""
        return None


_REGISTRY: dict[str, Callable[..., PrecisionPolicy]] = {
    "float32": lambda **kw: PrecisionPolicy("float32", jnp.float32, description="float32 everywhere"),
    "bf16": lambda **kw: PrecisionPolicy(
        "bf16", jnp.bfloat16,
        description="float32 master parameters, bfloat16 compute, float32 accumulation/softmax/norms/optimizer"),
}
_EXTENSIONS = ["models.quant"]  # modules that add policies to _REGISTRY when imported


def register(name: str, factory: Callable[..., PrecisionPolicy]) -> None:
    _REGISTRY[name] = factory


def available() -> list[str]:
    _load_extensions()
    return sorted(_REGISTRY)


def _load_extensions():
    import importlib

    for m in _EXTENSIONS:
        try:
            importlib.import_module(m)
        except ModuleNotFoundError as e:
            if e.name != m:
                raise


def get_policy(name: str, **options) -> PrecisionPolicy:
    """Policy by name ('float32', 'bf16', ...). Unknown or ambiguous names raise a one-line WorkbenchError."""
    _load_extensions()
    if isinstance(name, PrecisionPolicy):
        return name
    if name not in _REGISTRY:
        hint = ""
        if name == "fp8":
            hint = " ('fp8' is ambiguous: choose a scaling recipe, fp8-current or fp8-delayed)"
        raise WorkbenchError(f"unknown precision policy {name!r}{hint}; choose one of {', '.join(available())}")
    return _REGISTRY[name](**options)
