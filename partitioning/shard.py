"""Applying a rule table to NNX state and to activations.

- `spec_for(axes, shape, mesh, rules, what)`: logical axes of one array -> PartitionSpec (divisibility checked;
  errors name the parameter and the mesh axis).
- `state_shardings(state, mesh, rules, shard_optimizer)`: an nnx.State (abstract or concrete) -> the same tree of
  NamedShardings, read from each Variable's `out_sharding` metadata (its logical axis names); shard_optimizer splits
  the optimizer state over the data-parallel replicas too (ZeRO-1, `over_replicas`).
- `activation_sharding(mesh, rules)`: context under which `constrain(x, axes)` in model code becomes a sharding
  constraint (outside it, `constrain` is the identity, so the models run unpartitioned too).
- `sharding_table(state, mesh, rules)`: parameter path -> (PartitionSpec, shard shape), for golden snapshots.
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from partitioning.mesh import CONTEXT_AXIS
from partitioning.rules import Rules, get_rules
from workbench.errors import WorkbenchError


def spec_for(axes, shape, mesh, rules: Rules, what: str = "array") -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dims carry logical `axes` (None = never sharded)."""
    rules = get_rules(rules)
    axes = tuple(axes) if axes is not None else ()
    if axes and len(axes) != len(shape):
        raise WorkbenchError(f"{what}: {len(axes)} logical axes {axes} for a rank-{len(shape)} array {tuple(shape)}")
    used: set[str] = set()
    out = []
    for dim, (logical, size) in enumerate(zip(axes, shape)):
        mesh_axes = tuple(a for a in rules.mesh_axes_for(logical) if a in mesh.shape and a not in used)
        if not mesh_axes:
            out.append(None)
            continue
        n = math.prod(mesh.shape[a] for a in mesh_axes)
        if size % n and logical == "kv_heads" and n % size == 0:
            # fewer key/value heads than tensor-parallel ways: each device keeps them all (MaxText, Megatron: a
            # grouped-query model replicates its key/value heads over the tensor ranks that share them)
            out.append(None)
            continue
        if size % n:
            raise WorkbenchError(
                f"{what}: dimension {dim} ({logical}={size}) is not divisible by mesh axis "
                f"{'*'.join(mesh_axes)}={n} under strategy {rules.name!r}; change the mesh, the strategy or the size")
        used.update(mesh_axes)
        out.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def _is_var(x) -> bool:
    from flax import nnx

    return isinstance(x, nnx.Variable)


def logical_axes(var) -> tuple | None:
    """The logical axis names a Variable was created with (nnx `out_sharding` metadata), or None."""
    md = var.get_metadata() if hasattr(var, "get_metadata") else {}
    return md.get("out_sharding")


def path_str(path) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def over_replicas(spec: PartitionSpec, shape, mesh, rules) -> PartitionSpec:
    """`spec` further split over the mesh axes that replicate the batch's copies of it (the axes `batch` maps to,
    and `context`, that the spec does not use yet): its largest dimension that is still whole and divides by them
    takes them. ZeRO-1, Megatron's distributed optimizer: each data-parallel rank keeps and updates its own slice
    of the optimizer state. An array with no such dimension stays as it was."""
    rules = get_rules(rules)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for e in entries if e is not None for a in ((e,) if isinstance(e, str) else e)}
    axes = tuple(a for a in (*rules.mesh_axes_for("batch"), CONTEXT_AXIS)
                 if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
    axes = tuple(dict.fromkeys(axes))
    n = math.prod(mesh.shape[a] for a in axes)
    if n <= 1:
        return spec
    free = [d for d, e in enumerate(entries) if e is None and shape[d] % n == 0]
    if not free:
        return spec
    d = max(free, key=lambda i: shape[i])
    entries[d] = axes[0] if len(axes) == 1 else axes
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _specs(state, mesh, rules, split=lambda path: False) -> Any:
    """The state's tree (Variables kept) with each value replaced by its PartitionSpec; the Variables at the paths
    `split` picks also split over the data-parallel replicas (`over_replicas`)."""
    rules = get_rules(rules)

    def one(path, v):
        if _is_var(v):
            axes = logical_axes(v)
            shape = getattr(v.get_value() if hasattr(v, "get_value") else v.value, "shape", ())
            if axes is None:
                return v.replace(PartitionSpec())
            spec = spec_for(axes, shape, mesh, rules, what=f"parameter {path_str(path)}")
            return v.replace(over_replicas(spec, shape, mesh, rules) if split(path) else spec)
        return PartitionSpec()

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_var)


def _under_opt(path) -> bool:
    return bool(path) and path_str(path[:1]) == "opt"


def state_specs(state, mesh, rules, shard_optimizer: bool = False) -> Any:
    """The state's tree (Variables kept) with each value replaced by its PartitionSpec. shard_optimizer: the
    optimizer state (the tree under 'opt') also split over the data-parallel replicas (`over_replicas`)."""
    return _specs(state, mesh, rules, _under_opt if shard_optimizer else (lambda path: False))


def _named(specs, mesh) -> Any:
    return jax.tree.map(lambda p: NamedSharding(mesh, p), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def state_shardings(state, mesh, rules, shard_optimizer: bool = False) -> Any:
    """Same tree as `state` with a NamedSharding per array (for jit in/out_shardings and device_put)."""
    return _named(state_specs(state, mesh, rules, shard_optimizer), mesh)


def replica_shardings(tree, mesh, rules) -> Any:
    """A parameter tree's shardings split over the data-parallel replicas as ZeRO-1 splits the optimizer state
    (`over_replicas`): where each rank's slice of the gradient is reduced to (a reduce-scatter, not an
    all-reduce) before its slice of the update."""
    return _named(_specs(tree, mesh, rules, lambda path: True), mesh)


def sharding_table(state, mesh, rules) -> dict[str, dict]:
    """{path: {'spec': str(PartitionSpec), 'shape': global shape, 'shard_shape': per-device shape}} for a state."""
    specs = state_specs(state, mesh, rules)
    flat_specs = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
    flat_vals = jax.tree_util.tree_flatten_with_path(state)[0]
    out = {}
    for (path, spec), (_, val) in zip(flat_specs, flat_vals):
        shape = tuple(val.shape)
        shard = NamedSharding(mesh, spec).shard_shape(shape)
        out[path_str(path).removesuffix("/value")] = {
            "spec": str(tuple(spec)), "shape": list(shape), "shard_shape": list(shard)}
    return out


# ---------------------------------------------------------------------------------------------- activations

_active = threading.local()


@contextlib.contextmanager
def activation_sharding(mesh, rules):
    """While active (at trace time), `constrain(x, axes)` pins activations to the rule table's sharding."""
    prev = getattr(_active, "ctx", None)
    _active.ctx = (mesh, get_rules(rules))
    try:
        yield
    finally:
        _active.ctx = prev


def current():
    """(mesh, rules) of the active activation_sharding context, or None."""
    return getattr(_active, "ctx", None)


def constrain(x, axes, what: str = "activation"):
    """Sharding constraint from logical axes when a context is active; the identity otherwise."""
    ctx = current()
    if ctx is None:
        return x
    mesh, rules = ctx
    spec = spec_for(axes, x.shape, mesh, rules, what=f"{what} {tuple(axes)}")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def is_sharded(axis: str, size: int) -> bool:
    """Whether the active activation rules split a logical axis of this size over more than one device."""
    ctx = current()
    if ctx is None:
        return False
    mesh, rules = ctx
    spec = spec_for((axis,), (size,), mesh, rules, what=f"{axis} axis")
    names = spec[0] if len(spec) else None
    if names is None:
        return False
    names = names if isinstance(names, tuple) else (names,)
    return any(mesh.shape[a] > 1 for a in names)


def is_context_parallel(seq: int) -> bool:
    """Whether the active rules split a sequence of this length over the `context` mesh axis (cp strategies): the
    attention then gathers keys and values over it (models/layers.py Attention.gather_context)."""
    ctx = current()
    if ctx is None:
        return False
    mesh, rules = ctx
    return (CONTEXT_AXIS in rules.mesh_axes_for("seq") and dict(mesh.shape).get(CONTEXT_AXIS, 1) > 1
            and is_sharded("seq", seq))
