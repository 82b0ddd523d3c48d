"""Meshes, rule tables, applying them to NNX state; every parameter of every preset sharded as the documented rules
say (derived by hand from the config), with the golden snapshots checked against that derivation.

Rewrite the golden files after an intended change (they must still match the hand derivation) with:
    WORKBENCH_REGEN_GOLDEN=1 .venv/bin/pytest tests/partitioning/test_shard.py -k documented_rules
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

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "sharding"
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
    assert set(strategies()) == {"dp", "fsdp", "tp", "fsdp+tp", "sp", "cp", "fsdp+cp", "fsdp+tp+cp", "ep", "pp",
                                 "pp+fsdp", "pp+tp", "pp+fsdp+tp"}
    assert get_rules("cp").mapping == {"batch": ("data",), "seq": ("context",)}
    assert get_rules("fsdp+cp").mapping["embed"] == ("data", "context")
    assert get_rules("fsdp+tp+cp").mapping["mlp"] == ("model",)
    assert get_rules("pp+fsdp").mapping["layers"] == ("stage",) and "layers" not in get_rules("fsdp").mapping
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


def test_context_parallel_rules_split_the_sequence_and_the_parameters():
    mesh = make_mesh("data=2,context=4")
    # parameters: embed over data x context; activations: batch over data, the sequence over context, embed whole
    assert spec_for(("embed", "mlp"), (64, 256), mesh, get_rules("fsdp+cp")) == P(("data", "context"))
    assert spec_for(("batch", "seq", "embed"), (8, 64, 64), mesh, get_rules("fsdp+cp")) == P("data", "context")
    assert spec_for(("embed", "mlp"), (64, 256), mesh, get_rules("cp")) == P()
    with pytest.raises(WorkbenchError, match=r"seq=30\) is not divisible by mesh axis context=4"):
        spec_for(("batch", "seq"), (8, 30), mesh, get_rules("cp"))


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
# The sharding of every parameter of every preset, derived by hand from the config and the documented rules, and
# compared with what partitioning/ computes and with the golden files (which only document it: a snapshot that the
# code regenerates is checked here against the hand derivation, never against the code alone).
#
# The model's parameters, typed in from the transformer family's definition (docs/models.md; names spell their
# dimensions): name -> (dimension sizes from the config, logical axis per dimension).
def _params_by_hand(cfg) -> dict[str, tuple[tuple[int, ...], tuple]]:
    d, n, k, h, f, v, e = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size,
                           cfg.n_experts)
    norm = {"scale_d": ((d,), ("embed",))}
    if cfg.norm == "layernorm":
        norm["bias_d"] = ((d,), ("embed",))
    block = {f"norm_{x}/{name}": sa for x in ("attn", "mlp") for name, sa in norm.items()}
    block.update({"attn/w_dnh": ((d, n, h), ("embed", "heads", "head_dim")),
                  "attn/w_dkh_k": ((d, k, h), ("embed", "kv_heads", "head_dim")),
                  "attn/w_dkh_v": ((d, k, h), ("embed", "kv_heads", "head_dim")),
                  "attn/w_nhd": ((n, h, d), ("heads", "head_dim", "embed"))})
    if cfg.bias:
        block.update({"attn/b_nh": ((n, h), ("heads", "head_dim")), "attn/b_kh_k": ((k, h), ("kv_heads", "head_dim")),
                      "attn/b_kh_v": ((k, h), ("kv_heads", "head_dim")), "attn/b_d": ((d,), ("embed",))})
    if e:  # mixture of experts; the router is replicated: every device scores every expert
        block.update({"mlp/w_router_de": ((d, e), ("embed", None)),
                      "mlp/w_in_edf": ((e, d, f), ("experts", "embed", "mlp")),
                      "mlp/w_out_efd": ((e, f, d), ("experts", "mlp", "embed"))})
        if cfg.mlp == "swiglu":
            block["mlp/w_gate_edf"] = ((e, d, f), ("experts", "embed", "mlp"))
        if cfg.bias:
            block.update({"mlp/b_in_ef": ((e, f), ("experts", "mlp")), "mlp/b_out_ed": ((e, d), ("experts", "embed"))})
        if cfg.n_shared_experts:  # shared experts: one dense MLP of n_shared·d_ff, sharded like the dense MLP
            fs = cfg.n_shared_experts * f
            block.update({"mlp/w_sh_in_df": ((d, fs), ("embed", "mlp")), "mlp/w_sh_out_fd": ((fs, d), ("mlp", "embed"))})
            if cfg.mlp == "swiglu":
                block["mlp/w_sh_gate_df"] = ((d, fs), ("embed", "mlp"))
    else:
        block.update({"mlp/w_df": ((d, f), ("embed", "mlp")), "mlp/w_fd": ((f, d), ("mlp", "embed"))})
        if cfg.mlp == "swiglu":
            block["mlp/w_df_gate"] = ((d, f), ("embed", "mlp"))
        if cfg.bias:
            block.update({"mlp/b_f": ((f,), ("mlp",)), "mlp/b_d": ((d,), ("embed",))})
    out = {"w_vd": ((v, d), ("vocab", "embed"))}
    out.update({f"norm_f/{name}": sa for name, sa in norm.items()})
    if cfg.pos == "learned":
        out["w_sd"] = ((cfg.seq_len, d), (None, "embed"))  # positions: never sharded along the sequence
    if not cfg.tie_embeddings:
        out["w_dv"] = ((d, v), ("embed", "vocab"))
    for name, (shape, axes) in block.items():
        if cfg.scan_layers:  # stacked on a leading layer axis that is never sharded
            out[f"blocks/{name}"] = ((cfg.n_layers, *shape), (None, *axes))
        else:
            out[f"blocks/0/{name}"] = (shape, axes)
    return out


# The rule tables as partitioning/rules.py documents them (logical axis -> mesh axis; parameters only: batch and
# seq name activations). A dimension takes its mesh axis when the mesh has it and no earlier dimension of the same
# array took it; the dimension must divide by the axis size — except key/value heads fewer than the axis (the axis
# a multiple of them), which every device keeps whole.
_TP_RULES = {"heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}
DOCUMENTED_RULES = {"dp": {}, "fsdp": {"embed": "data"}, "tp": _TP_RULES, "fsdp+tp": {"embed": "data", **_TP_RULES},
                    "sp": _TP_RULES, "ep": {**_TP_RULES, "experts": "expert"}}


def _shard_by_hand(shape, axes, strategy, mesh_sizes):
    """(spec as partitioning prints it, shard shape) or (None, the dimension that does not divide)."""
    used, spec, shard = set(), [], []
    for size, logical in zip(shape, axes):
        m = DOCUMENTED_RULES[strategy].get(logical)
        if logical == "kv_heads" and m in mesh_sizes and size % mesh_sizes[m] and mesh_sizes[m] % size == 0:
            spec.append(None)
            shard.append(size)
        elif m in mesh_sizes and m not in used:
            if size % mesh_sizes[m]:
                return None, f"{logical}={size}"
            used.add(m)
            spec.append(m)
            shard.append(size // mesh_sizes[m])
        else:
            spec.append(None)
            shard.append(size)
    while spec and spec[-1] is None:
        spec.pop()
    return str(tuple(spec)), shard


def _by_hand(preset: str) -> dict:
    cfg = get_config(preset)
    cfg = cfg.replace(n_layers=min(cfg.n_layers, 2))
    out = {}
    for strat, mesh_spec in STRATEGY_MESH.items():
        sizes = parse_mesh_spec(mesh_spec)
        table, offenders = {}, {}
        for name, (shape, axes) in _params_by_hand(cfg).items():
            spec, shard = _shard_by_hand(shape, axes, strat, sizes)
            if spec is None:
                offenders[name] = shard
            else:
                table[name] = {"spec": spec, "shape": list(shape), "shard_shape": shard}
        out[f"{strat} @ {mesh_spec}"] = {"offenders": offenders} if offenders else table
    return out


def _snapshot(preset: str) -> dict:
    """What partitioning/ computes: layer 0 and the non-layer parameters of the preset (layers are identical: built
    with two layers, layer 1 checked equal to layer 0), per strategy on its mesh. Abstract state only."""
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


def _assert_matches_hand(table: dict, hand: dict, what: str):
    if "offenders" in hand:  # the hand derivation finds a dimension that does not divide: a one-line error naming it
        assert set(table) == {"error"}, (what, "expected an error naming one of", hand["offenders"])
        err = table["error"]
        assert "not divisible" in err and "\n" not in err
        assert any(f"parameter {name}:" in err and f"({dim})" in err for name, dim in hand["offenders"].items()), \
            (what, err, hand["offenders"])
    else:
        assert "error" not in table, (what, table.get("error"))
        assert set(table) == set(hand), (what, sorted(set(table) ^ set(hand)))
        for name in hand:
            assert table[name] == hand[name], (what, name, table[name], hand[name])


@pytest.mark.parametrize("preset", list(PRESETS))
def test_sharding_of_every_parameter_follows_the_documented_rules(preset):
    """partitioning/ against the hand derivation, then the golden file (documentation) against it too."""
    hand = _by_hand(preset)
    got = _snapshot(preset)
    assert set(got) == set(hand)
    for key in hand:
        _assert_matches_hand(got[key], hand[key], f"{preset} {key} (partitioning)")
    path = GOLDEN / f"{preset}.json"
    if os.environ.get("WORKBENCH_REGEN_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert path.exists(), f"missing {path}; regenerate with WORKBENCH_REGEN_GOLDEN=1"
    golden = json.loads(path.read_text())
    assert set(golden) == set(hand)
    for key in hand:
        _assert_matches_hand(golden[key], hand[key], f"{preset} {key} (golden file)")


def test_hand_derivation_says_what_each_strategy_means():
    """The hand derivation itself, on llama3-8b's MLP (d_model 4096, d_ff 14336; layers scanned, so every block
    parameter is stacked on a leading layer axis that is never sharded) and gpt2's vocabulary, written out."""
    hand = _by_hand("llama3-8b")
    w, L = "blocks/mlp/w_df", hand["dp @ data=8"]["blocks/mlp/w_df"]["shape"][0]
    assert hand["dp @ data=8"][w] == {"spec": "()", "shape": [L, 4096, 14336], "shard_shape": [L, 4096, 14336]}
    assert hand["fsdp @ data=8"][w]["shard_shape"] == [L, 4096 // 8, 14336]
    assert hand["tp @ data=2,model=4"][w]["shard_shape"] == [L, 4096, 14336 // 4]
    assert hand["fsdp+tp @ data=2,model=4"][w] == {"spec": "(None, 'data', 'model')", "shape": [L, 4096, 14336],
                                                   "shard_shape": [L, 4096 // 2, 14336 // 4]}
    assert hand["fsdp+tp @ data=2,model=4"]["blocks/mlp/w_fd"]["spec"] == "(None, 'model', 'data')"
    assert hand["tp @ data=2,model=4"]["blocks/attn/w_dkh_k"]["shard_shape"] == [L, 4096, 8 // 4, 128]
    assert _by_hand("gpt2-small")["tp @ data=2,model=4"] == {"offenders": {"w_vd": "vocab=50257"}}


# ------------------------------------------------------------------------------------------------- optimizer state
def test_optimizer_state_is_sharded_like_its_parameters():
    from workbench.programs.step import build_train_step

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
