"""Sharded training: the same loss and gradients on every strategy and mesh; collectives as each strategy implies;
tiny learns the stdlib corpus; the run record carries what the issue lists."""
import dataclasses

import jax
import numpy as np
import pytest

from models.analytics import analytics, collective_bytes_per_step
from models.presets import get_config
from partitioning.mesh import make_mesh
from workbench.errors import WorkbenchError
from workbench.programs.data import Batches, load_corpus
from workbench.programs.step import build_train_step
from workbench.programs.train import train_model
from workbench.testing import assert_close, tol

GQA_TP = "pos=rope,norm=rmsnorm,mlp=swiglu,n_heads=8,n_kv_heads=4,head_dim=8,bias=false,tie_embeddings=false"
B, T = 8, 32


def _one_device():
    return make_mesh("data=1", devices=jax.devices()[:1])


def _loss_and_grads(cfg, strategy, mesh, policy="float32", microbatches=1):
    prog = build_train_step(cfg, policy=policy, mesh=mesh, strategy=strategy, batch_size=B, seq_len=T,
                            microbatches=microbatches)
    batch = Batches(B, T, seed=1, corpus=load_corpus(400_000)).train(0)
    batch = {k: jax.device_put(v, prog.batch_sharding) for k, v in batch.items()}
    loss, grads = prog.grads(prog.state["params"], prog.state["gmeta"], prog.state["rest"], batch)
    return float(loss), jax.tree.map(np.asarray, grads)


def _compare(ref, got, dtype):
    """Loss within the dtype's relative tolerance. Gradients: float32 element by element (atol scaled to the
    gradient's largest entry: entries near zero have no relative accuracy); bfloat16 as vectors per parameter
    (partial sums are rounded to bf16 at different points on different meshes, so single elements can differ by a
    few bf16 ulps)."""
    rtol, atol = tol(dtype)
    assert abs(got[0] - ref[0]) <= rtol * abs(ref[0]), (got[0], ref[0])
    flat_r = jax.tree_util.tree_flatten_with_path(ref[1])[0]
    flat_g = jax.tree_util.tree_flatten_with_path(got[1])[0]
    assert [p for p, _ in flat_r] == [p for p, _ in flat_g]
    for (path, a), (_, b) in zip(flat_r, flat_g):
        if dtype == "float32":
            assert_close(b, a, dtype, scale=max(1.0, float(np.abs(a).max()) * rtol / atol))
        else:
            # the vector form of assert_close: |g - g_ref| <= rtol |g_ref| + atol sqrt(n) (the atol term matters
            # for gradients that are zero in exact arithmetic, e.g. the key bias under softmax)
            err = np.linalg.norm(b.astype(np.float64) - a)
            assert err <= rtol * np.linalg.norm(a.astype(np.float64)) + atol * np.sqrt(a.size), \
                (jax.tree_util.keystr(path), err, np.linalg.norm(a))


# (8), (2,4), (4,2) meshes; fsdp+tp on (2,4) is covered by the GQA test below
CASES = [("dp", "data=8"), ("fsdp", "data=8"), ("tp", "data=2,model=4"), ("fsdp+tp", "data=4,model=2"),
         ("sp", "data=2,seq=4")]


@pytest.mark.compile_heavy
def test_loss_and_grads_agree_across_strategies_float32():
    cfg = get_config("tiny", "seq_len=32,n_layers=1")
    ref = _loss_and_grads(cfg, "dp", _one_device())
    for strategy, spec in CASES:
        _compare(ref, _loss_and_grads(cfg, strategy, make_mesh(spec)), "float32")


@pytest.mark.compile_heavy
def test_loss_and_grads_agree_across_strategies_gqa_rope_swiglu():
    cfg = get_config("tiny", GQA_TP + ",seq_len=32,n_layers=1")
    ref = _loss_and_grads(cfg, "dp", _one_device())
    for strategy, spec in [("fsdp+tp", "data=2,model=4")]:
        _compare(ref, _loss_and_grads(cfg, strategy, make_mesh(spec)), "float32")


@pytest.mark.compile_heavy
def test_loss_and_grads_agree_across_strategies_bf16():
    cfg = get_config("tiny", "seq_len=32,n_layers=1")
    ref = _loss_and_grads(cfg, "dp", _one_device(), policy="bf16")
    _compare(ref, _loss_and_grads(cfg, "fsdp+tp", make_mesh("data=2,model=4"), policy="bf16"), "bfloat16")


@pytest.mark.compile_heavy
def test_sharded_activations_give_the_same_gradients_and_split_the_residual():
    """MaxText's activation_embed rule (get_rules(..., shard_activations=True)): the residual stream's embed dimension
    over the tensor axis changes where the partial sums are reduced (reduce-scatter + all-gather in place of
    all-reduce), not the step's arithmetic."""
    from partitioning.rules import get_rules

    cfg = get_config("tiny", "seq_len=32,n_layers=1")
    mesh = make_mesh("data=2,model=4")
    rules = get_rules("fsdp+tp", shard_activations=True)
    assert rules.mesh_axes_for("act_embed") == ("model",) and get_rules("fsdp+tp").mesh_axes_for("act_embed") == ()
    _compare(_loss_and_grads(cfg, "fsdp+tp", mesh), _loss_and_grads(cfg, rules, mesh), "float32")
    with pytest.raises(WorkbenchError, match="has none"):
        get_rules("fsdp", shard_activations=True)


@pytest.mark.compile_heavy
def test_microbatching_gives_the_same_gradients():
    cfg = get_config("tiny", "seq_len=32,n_layers=1")
    mesh = make_mesh("data=2,model=4")
    _compare(_loss_and_grads(cfg, "fsdp+tp", mesh), _loss_and_grads(cfg, "fsdp+tp", mesh, microbatches=2),
             "float32")


# ------------------------------------------------------------------------------------------------- collectives
def _collective_bytes_by_axis(cfg, strategy, spec):
    from workbench.cost.hlo import parse_collectives

    mesh = make_mesh(spec)
    prog = build_train_step(cfg, policy="float32", mesh=mesh, strategy=strategy, batch_size=B, seq_len=64,
                            abstract=True)
    text = prog.step.lower(prog.state, prog.batch).compile().as_text()
    out = {}
    for c in parse_collectives(text, mesh=mesh, n_devices=mesh.size):
        key = "+".join(c.mesh_axes) or "?"
        out[key] = out.get(key, 0.0) + c.payload_bytes * c.count
    return out


@pytest.mark.compile_heavy
@pytest.mark.parametrize("strategy,spec", [("dp", "data=8"), ("fsdp", "data=8"), ("tp", "data=2,model=4")])
def test_hlo_collective_bytes_match_the_strategy_formula(strategy, spec):
    # untied, d=128: big enough that scalar reductions (loss, norms) are noise
    cfg = get_config("tiny", "d_model=128,d_ff=512,tie_embeddings=false")
    got = _collective_bytes_by_axis(cfg, strategy, spec)
    want = collective_bytes_per_step(cfg, strategy, dict(make_mesh(spec).shape), B, 64)
    assert want, strategy
    for axis, expected in want.items():
        assert abs(got.get(axis, 0.0) - expected) <= 0.10 * expected, (axis, got, want)
    if strategy == "dp":
        assert set(got) == {"data"}  # dp moves nothing but gradients over data


# ------------------------------------------------------------------------------------------------- learning
@pytest.mark.compile_heavy
def test_tiny_learns_the_corpus_below_the_unigram_baseline():
    r = train_model(get_config("tiny"), strategy="dp", mesh=_one_device(), steps=200, batch_size=16,
                    eval_every=100, progress=False, hardware=None, analytic=False).to_record()
    base = r["unigram_baseline_val"]
    first_val, last_val = r["val_losses"][0][1], r["val_loss"]
    print(f"tiny 200 steps: val loss {first_val:.3f} -> {last_val:.3f} nats/byte; unigram baseline {base:.3f}")
    assert first_val > base  # starts near ln(256) = 5.55
    assert last_val < base - 0.5, (last_val, base)
    assert np.mean(r["losses"][-20:]) < np.mean(r["losses"][:20]) - 1.0


def test_bad_requests_are_one_line_errors():
    mesh = make_mesh("data=8")
    cfg = get_config("tiny")
    with pytest.raises(WorkbenchError, match="batch .* not divisible by mesh axis data=8"):
        build_train_step(cfg, mesh=mesh, strategy="dp", batch_size=4, seq_len=16, abstract=True)
    with pytest.raises(WorkbenchError, match="exceeds the model's learned positions"):
        build_train_step(cfg, mesh=mesh, strategy="dp", batch_size=8, seq_len=128, abstract=True)
    with pytest.raises(WorkbenchError, match="multiple of microbatches"):
        build_train_step(cfg, mesh=mesh, strategy="dp", batch_size=8, seq_len=16, microbatches=3, abstract=True)
    with pytest.raises(WorkbenchError, match="unknown strategy"):
        build_train_step(cfg, mesh=mesh, strategy="zero3", batch_size=8, seq_len=16, abstract=True)


# ------------------------------------------------------------------------------------------------- the record
@pytest.mark.compile_heavy
def test_run_records_everything(monkeypatch, results_dir, capsys):
    """`workbench run` on 8 simulated devices: JSON keys, MFU arithmetic, replication near 1 for fsdp+tp, a record.

    The host ceiling is a test double (a catalogue chip renamed 'host', kind cpu) so the test does not calibrate."""
    import json

    import workbench.hardware.spec as hw
    import workbench.programs.train as train
    from workbench.cli import main
    from workbench.results.store import Store

    fake = dataclasses.replace(next(iter(hw.catalogue().values())), name="host", kind="cpu").with_measured(
        physical_peak_flops={"float32": 3.0e11})
    real = train.get_spec  # workbench.measure.calibrate.get_spec, as train imported it
    monkeypatch.setattr(train, "get_spec", lambda name, **kw: fake if name == "host" else real(name, **kw))
    main(["run", "--preset", "tiny", "--strategy", "fsdp+tp", "--mesh", "data=2,model=4", "--devices", "8",
          "--steps", "4", "--profile", "--json"])
    out = json.loads(capsys.readouterr().out)
    kp = out["kernel_profile"]  # --profile: measured time per kernel class, matmuls and collectives among them
    assert {"matmul", "collective"} <= set(kp["classes"]) and kp["kernel_ms"] > 0
    assert sum(c["ms"] for c in kp["classes"].values()) == pytest.approx(kp["kernel_ms"])
    fl = out["dot_floor"]  # the step's dots alone, on 8 simulated devices sharing the host: 8 x one device's dots
    assert fl["step_floor_s"] == pytest.approx(8 * fl["dot_s"]) and 0 < fl["step_floor_s"]
    assert fl["mfu_bound"] == pytest.approx(
        analytics(get_config("tiny"))["train_flops_per_token"] * 8 * 64 / fl["step_floor_s"] / fake.peak("float32"))
    for k in ("losses", "step_s", "tokens_per_s", "mfu", "replication", "collectives", "val_loss"):
        assert out[k] is not None, k
    assert len(out["losses"]) == 4
    flops = analytics(get_config("tiny"))["train_flops_per_token"] * 8 * 64
    assert out["mfu"] == pytest.approx(flops / out["step_s"] / fake.peak("float32"), rel=1e-9)
    assert out["mfu_physical"] == pytest.approx(flops / out["step_s"] / 3.0e11, rel=1e-9)  # beside it: the physical
    assert 0.9 < out["replication"] < 1.5
    assert any(k.endswith("@model") for k in out["collectives"])
    recs = Store().records("train")
    assert len(recs) == 1 and recs[0]["spec"]["strategy"] == "fsdp+tp"
    assert recs[0]["costs"]["scope"] == "per_device" and recs[0]["prediction"] is not None
