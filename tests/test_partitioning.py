"""Meshes, rule tables, applying them to NNX state; golden sharding snapshots per preset x strategy.

Regenerate the snapshots after an intended change with:
    WORKBENCH_REGEN_GOLDEN=1 .venv/bin/pytest tests/test_partitioning.py -k golden
"""
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.presets import PRESETS, get_config
from models.transformer import Transformer
from partitioning.mesh import make_mesh, parse_mesh_spec
from partitioning.rules import get_rules, rules_from_pairs, strategies
from partitioning.shard import activation_sharding, constrain, sharding_table, spec_for, state_shardings
from workbench.errors import WorkbenchError

GOLDEN = Path(__file__).parent / "golden" / "sharding"
# the mesh each strategy is snapshotted on (8 simulated devices)
STRATEGY_MESH = {"dp": "data=8", "fsdp": "data=8", "tp": "data=2,model=4", "fsdp+tp": "data=2,model=4",
                 "sp": "data=2,seq=4", "ep": "data=2,expert=4"}


# ------------------------------------------------------------------------------------------------- meshes
def test_mesh_spec_parsing_and_errors():
    assert parse_mesh_spec("data=2, model=4") == {"data": 2, "model": 4}
    m = make_mesh("data=2,model=4")
    assert dict(m.shape) == {"data": 2, "model": 4}
    assert all(t == jax.sharding.AxisType.Auto for t in m.axis_types)
    for bad, msg in [("data=2,tensor=4", "unknown mesh axis 'tensor'"), ("data=x", "positive whole number"),
                     ("data=2,data=4", "given twice"), ("data", "name=size"), ("", "empty mesh spec"),
                     ("data=0", "positive whole number")]:
        with pytest.raises(WorkbenchError, match=msg):
            parse_mesh_spec(bad)
    with pytest.raises(WorkbenchError, match="has 6 devices but 8 are available"):
        make_mesh("data=2,model=3")
    assert make_mesh("data=1", devices=jax.devices()[:1]).size == 1


# ------------------------------------------------------------------------------------------------- rules
def test_rule_tables_and_errors():
    assert set(strategies()) == {"dp", "fsdp", "tp", "fsdp+tp", "sp", "ep"}
    assert get_rules("fsdp").mapping["embed"] == ("data",)
    assert get_rules("ep").mapping["experts"] == ("expert",)
    with pytest.raises(WorkbenchError, match="unknown strategy 'zero'"):
        get_rules("zero")
    with pytest.raises(WorkbenchError, match="conflicting rules for logical axis 'embed'"):
        rules_from_pairs("mine", [("embed", "data"), ("embed", "model")])
    with pytest.raises(WorkbenchError, match="unknown logical axis 'hidden'"):
        rules_from_pairs("mine", [("hidden", "data")])
    with pytest.raises(WorkbenchError, match="unknown mesh axis 'tensor'"):
        rules_from_pairs("mine", [("mlp", "tensor")])


def test_spec_for_uses_each_mesh_axis_once_and_checks_divisibility():
    mesh = make_mesh("data=2,model=4")
    fsdp_tp = get_rules("fsdp+tp")
    assert spec_for(("embed", "mlp"), (64, 256), mesh, fsdp_tp) == P("data", "model")
    # activations: batch takes 'data' first, so embed stays whole
    assert spec_for(("batch", "seq", "embed"), (8, 16, 64), mesh, fsdp_tp) == P("data")
    # axes the mesh lacks are absent: tp on a data-only mesh is dp
    assert spec_for(("embed", "heads", "head_dim"), (64, 4, 16), make_mesh("data=8"), get_rules("tp")) == P()
    with pytest.raises(WorkbenchError, match=r"parameter w_vd: dimension 0 \(vocab=50257\) is not divisible by mesh "
                                             r"axis model=4"):
        spec_for(("vocab", "embed"), (50257, 768), mesh, get_rules("tp"), what="parameter w_vd")


def test_divisibility_error_names_the_parameter():
    cfg = get_config("tiny", "n_heads=2,head_dim=32")
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, None, nnx.Rngs(0))))
    with pytest.raises(WorkbenchError, match=r"parameter blocks/0/attn/\w+.*heads=2.*model=4"):
        state_shardings(abstract, make_mesh("data=2,model=4"), "tp")


def test_constrain_is_identity_outside_a_context_and_shards_inside():
    x = jnp.ones((8, 4, 16))
    assert constrain(x, ("batch", "seq", "embed")) is x
    mesh = make_mesh("data=8")

    @jax.jit
    def f(x):
        with activation_sharding(mesh, "dp"):
            return constrain(x * 2, ("batch", "seq", "embed"))

    y = f(x)
    assert y.sharding.spec == P("data")


# ------------------------------------------------------------------------------------------------- golden snapshots
def _snapshot(preset: str) -> dict:
    """Layer 0 and the non-layer parameters of the preset (layers are identical: built with two layers, layer 1
    checked equal to layer 0), per strategy on its mesh. Abstract state only: nothing is materialised."""
    cfg = get_config(preset)
    cfg = cfg.replace(n_layers=min(cfg.n_layers, 2))
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, None, nnx.Rngs(0))), nnx.Param)
    out = {}
    for strat, spec in STRATEGY_MESH.items():
        key = f"{strat} @ {spec}"
        try:
            table = sharding_table(abstract, make_mesh(spec), strat)
        except WorkbenchError as e:  # e.g. gpt2's vocabulary 50257 is not divisible by a model axis
            out[key] = {"error": str(e)}
            continue
        layer1 = {k.replace("blocks/1/", "blocks/0/"): v for k, v in table.items() if k.startswith("blocks/1/")}
        out[key] = {k: v for k, v in table.items() if not k.startswith("blocks/1/")}
        assert layer1 == {k: v for k, v in out[key].items() if k.startswith("blocks/0/")}
    return out


@pytest.mark.parametrize("preset", list(PRESETS))
def test_golden_sharding_snapshot(preset):
    path = GOLDEN / f"{preset}.json"
    got = _snapshot(preset)
    if os.environ.get("WORKBENCH_REGEN_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert path.exists(), f"missing {path}; regenerate with WORKBENCH_REGEN_GOLDEN=1"
    want = json.loads(path.read_text())
    assert got == want


def test_golden_snapshots_say_what_each_strategy_means():
    snap = json.loads((GOLDEN / "llama3-8b.json").read_text())
    w = "blocks/0/mlp/w_df"
    assert snap["dp @ data=8"][w]["spec"] == "()"
    assert snap["fsdp @ data=8"][w]["shard_shape"] == [4096 // 8, 14336]
    assert snap["tp @ data=2,model=4"][w]["shard_shape"] == [4096, 14336 // 4]
    assert snap["fsdp+tp @ data=2,model=4"][w]["shard_shape"] == [4096 // 2, 14336 // 4]
    assert "not divisible" in json.loads((GOLDEN / "gpt2-small.json").read_text())["tp @ data=2,model=4"]["error"]


# ------------------------------------------------------------------------------------------------- optimizer state
def test_optimizer_state_is_sharded_like_its_parameters():
    from workbench.programs.train import build_train_step

    mesh = make_mesh("data=2,model=4")
    prog = build_train_step(get_config("tiny"), policy="float32", mesh=mesh, strategy="fsdp+tp", batch_size=8,
                            seq_len=16, abstract=True)
    params = jax.tree_util.tree_flatten_with_path(prog.state["params"])[0]
    adam = prog.state["opt"][1][0]  # chain(clip, adamw): adamw's ScaleByAdamState
    for moments in (adam.mu, adam.nu):
        moms = jax.tree_util.tree_flatten_with_path(moments)[0]
        assert len(moms) == len(params)
        for (pp, p), (mp, m) in zip(params, moms):
            assert pp == mp and p.sharding == m.sharding and p.shape == m.shape
    specs = {p.sharding.spec for _, p in params}
    assert P("data", "model") in specs  # something really is sharded two ways
    assert prog.batch["inputs"].sharding.spec == P("data")
    with pytest.raises(WorkbenchError, match="batch .*not divisible by mesh axis data=2"):
        build_train_step(get_config("tiny"), policy="float32", mesh=mesh, strategy="dp", batch_size=3,
                         seq_len=16, abstract=True)
