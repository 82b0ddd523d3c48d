"""Meshes, strategy rule tables (logical axis -> mesh axes), and applying them to NNX state and activations.

    make_mesh(spec, devices=None)        'data=2,model=4' -> jax.sharding.Mesh (AxisType.Auto)
    get_rules(strategy)                  dp | fsdp | tp | fsdp+tp | sp | cp | fsdp+cp | fsdp+tp+cp | ep | pp... -> Rules
    state_shardings(state, mesh, rules)  NamedSharding per parameter from its logical axis names
    activation_sharding / constrain      activation constraints inside model code
"""
from partitioning.mesh import MESH_AXES, make_mesh, parse_mesh_spec  # noqa: F401
from partitioning.rules import LOGICAL_AXES, Rules, get_rules, strategies  # noqa: F401
from partitioning.shard import (  # noqa: F401
    activation_sharding,
    constrain,
    sharding_table,
    spec_for,
    state_shardings,
)
