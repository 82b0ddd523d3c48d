"""Strategy rule tables: logical axis name -> mesh axes. One registry, loud on conflicts.

Logical axes (what models/ annotate): batch, seq, embed, act_embed, heads, kv_heads, head_dim, mlp, vocab, experts,
layers (the stacked layer axis of scan_layers models). act_embed is the residual stream's embed dimension between
blocks (MaxText's `activation_embed`); no table maps it: `get_rules(name, shard_activations=True)` maps it to the
tensor axis (`model`) as MaxText's rules do, so the residual stream and what remat saves of it are split over the
tensor-parallel group (reduce-scatter after the attention and MLP outputs, all-gather before the next projections,
in place of Megatron's all-reduce).
Mesh axes (partitioning/mesh.py): data, model, expert, seq, context, stage.

A rule maps a logical axis to a tuple of mesh axes. Applying a table to one array (partitioning/shard.py):
dimension by dimension, each logical axis takes its mesh axes that exist in the mesh and are not already used by an
earlier dimension of the same array. That is what lets `fsdp` shard parameters along `embed` over `data` while the
activations, whose `batch` dimension already took `data`, keep `embed` whole (the MaxText / t5x convention).
Mesh axes a table names but the mesh lacks are simply absent (size 1): `tp` on a `data=8` mesh is plain dp.

Strategies:
  dp       batch -> data; parameters replicated (gradients all-reduced).
  fsdp     dp + parameters (and optimizer state) sharded along embed over data (ZeRO-3: all-gather parameters,
           reduce-scatter gradients).
  tp       dp over data + Megatron tensor parallelism over model: heads, kv_heads, mlp (column/row) and vocab.
  fsdp+tp  fsdp over data + tp over model.
  sp       tp + sequence parallelism: activations' seq over the seq mesh axis (XLA chooses how attention gathers).
  cp       context parallelism: dp over data, the sequence of every activation over the context mesh axis; inside
           attention the keys and values are all-gathered over context (models/layers.py gather_context), the
           queries stay split. Parameters replicated.
  fsdp+cp  cp + parameters sharded along embed over data and context (MaxText shards them over its context axis too).
  fsdp+tp+cp  fsdp+cp + tp over model.
  ep       tp + experts over the expert mesh axis; batch over (data, expert).
  pp       pipeline parallelism: the stacked layers over the stage mesh axis (models/pipeline.py runs them as a
           schedule of microbatches); batch over data.
  pp+fsdp, pp+tp, pp+fsdp+tp   pp composed with fsdp / tp / fsdp+tp on the other axes.
"""
from __future__ import annotations

import dataclasses

from partitioning.mesh import MESH_AXES
from workbench.errors import WorkbenchError

LOGICAL_AXES = ("batch", "seq", "embed", "act_embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "experts",
                "layers")


@dataclasses.dataclass(frozen=True)
class Rules:
    """A validated rule table. `table` is a tuple of (logical axis, (mesh axes...))."""

    name: str
    table: tuple[tuple[str, tuple[str, ...]], ...]

    def __post_init__(self):
        seen: dict[str, tuple[str, ...]] = {}
        for logical, mesh_axes in self.table:
            if logical not in LOGICAL_AXES:
                raise WorkbenchError(f"rule table {self.name!r}: unknown logical axis {logical!r}; "
                                     f"logical axes are {', '.join(LOGICAL_AXES)}")
            for m in mesh_axes:
                if m not in MESH_AXES:
                    raise WorkbenchError(f"rule table {self.name!r}: logical axis {logical!r} maps to unknown mesh "
                                         f"axis {m!r}; mesh axes are {', '.join(MESH_AXES)}")
            if len(set(mesh_axes)) != len(mesh_axes):
                raise WorkbenchError(f"rule table {self.name!r}: logical axis {logical!r} names a mesh axis twice")
            if logical in seen and seen[logical] != mesh_axes:
                raise WorkbenchError(f"rule table {self.name!r}: conflicting rules for logical axis {logical!r}: "
                                     f"{seen[logical]} and {mesh_axes}; keep one")
            seen[logical] = mesh_axes

    @property
    def mapping(self) -> dict[str, tuple[str, ...]]:
        return dict(self.table)

    def mesh_axes_for(self, logical: str | None) -> tuple[str, ...]:
        if logical is None:
            return ()
        if logical not in LOGICAL_AXES:
            raise WorkbenchError(f"unknown logical axis {logical!r}; logical axes are {', '.join(LOGICAL_AXES)}")
        return self.mapping.get(logical, ())

    def with_overrides(self, pairs: dict[str, str | tuple[str, ...] | None]) -> "Rules":
        """A new table with some logical axes remapped ('embed' -> 'data', or None to replicate)."""
        m = self.mapping
        for k, v in pairs.items():
            m[k] = () if v is None else ((v,) if isinstance(v, str) else tuple(v))
        return Rules(self.name + "+custom", tuple(m.items()))


def _t(*pairs) -> tuple:
    return tuple((k, (v,) if isinstance(v, str) else tuple(v)) for k, v in pairs)


_TP = (("heads", "model"), ("kv_heads", "model"), ("mlp", "model"), ("vocab", "model"))

STRATEGIES: dict[str, tuple] = {
    "dp": _t(("batch", "data")),
    "fsdp": _t(("batch", "data"), ("embed", "data")),
    "tp": _t(("batch", "data"), *_TP),
    "fsdp+tp": _t(("batch", "data"), ("embed", "data"), *_TP),
    "sp": _t(("batch", "data"), ("seq", "seq"), *_TP),
    "cp": _t(("batch", "data"), ("seq", "context")),
    "fsdp+cp": _t(("batch", "data"), ("seq", "context"), ("embed", ("data", "context"))),
    "fsdp+tp+cp": _t(("batch", "data"), ("seq", "context"), ("embed", ("data", "context")), *_TP),
    "ep": _t(("batch", ("data", "expert")), ("experts", "expert"), *_TP),
    "pp": _t(("batch", "data"), ("layers", "stage")),
    "pp+fsdp": _t(("batch", "data"), ("embed", "data"), ("layers", "stage")),
    "pp+tp": _t(("batch", "data"), ("layers", "stage"), *_TP),
    "pp+fsdp+tp": _t(("batch", "data"), ("embed", "data"), ("layers", "stage"), *_TP),
}


def strategies() -> list[str]:
    return list(STRATEGIES)


def get_rules(strategy: str | Rules, shard_activations: bool = False) -> Rules:
    """The rule table of a strategy (dp, fsdp, tp, fsdp+tp, sp, cp, fsdp+cp, fsdp+tp+cp, ep, pp, pp+fsdp, pp+tp,
    pp+fsdp+tp).

    shard_activations: also split the residual stream's embed dimension (act_embed) over the tensor axis, MaxText's
    activation_embed rule; only for the strategies with tensor parallelism."""
    if isinstance(strategy, Rules):
        rules = strategy
    elif strategy not in STRATEGIES:
        raise WorkbenchError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    else:
        rules = Rules(strategy, STRATEGIES[strategy])
    if not shard_activations or rules.mesh_axes_for("act_embed"):
        return rules
    tensor = rules.mesh_axes_for("heads")
    if not tensor:
        raise WorkbenchError(f"--shard-activations splits the residual stream over the tensor axis; {rules.name} has "
                             "none: use tp, fsdp+tp, sp, fsdp+tp+cp, ep or a pp+tp strategy")
    return Rules(f"{rules.name}+act_embed", rules.table + (("act_embed", tensor),))


def rules_from_pairs(name: str, pairs) -> Rules:
    """A custom table from (logical, mesh axis or axes) pairs; conflicting pairs are a one-line error."""
    return Rules(name, _t(*pairs))
