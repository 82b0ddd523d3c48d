"""Pipeline parallelism (models/pipeline.py, the pp strategies): every schedule gives the unpipelined loss and
gradients on the same batch; activations move by collective permutes on `stage`; bad stage / microbatch counts are
one-line errors."""
import jax
import numpy as np
import pytest

from models import pipeline as pp
from models.presets import get_config
from partitioning.mesh import make_mesh
from partitioning.strategy import get_strategy
from workbench.errors import WorkbenchError
from workbench.programs.data import Batches, load_corpus
from workbench.programs.train import build_train_step
from workbench.testing import assert_close, tol

B, T = 8, 32
CFG = "n_layers=4,scan_layers=true"


def test_schedule_arithmetic():
    g = pp.PipelineSpec(4, 8)
    assert (g.schedule, g.ticks) == ("gpipe", 11)
    assert g.bubble_fraction == pytest.approx(3 / 11)
    c = pp.PipelineSpec(2, 4, repeats=2)
    assert (c.schedule, c.ticks) == ("circular", 9)
    assert c.bubble_fraction == pytest.approx(1 / 9)
    perm = pp.stage_order(8, 2, 2)  # chunks of 2 layers: stage 0 holds chunks 0 and 2, stage 1 chunks 1 and 3
    assert perm.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    x = {"w": np.arange(8)}
    assert (pp.from_stage_order(pp.to_stage_order(x, c, 8), c, 8)["w"] == x["w"]).all()


@pytest.mark.parametrize("spec,words", [
    (pp.PipelineSpec(3, 4), "does not divide the model's n_layers=4"),
    (pp.PipelineSpec(4, 2), "fewer than the 4 pipeline stages"),
    (pp.PipelineSpec(2, 3, repeats=2), "multiple of the 2 stages"),
    (pp.PipelineSpec(2, 4, repeats=4), "does not divide"),
])
def test_bad_schedules_are_one_line_errors(spec, words):
    with pytest.raises(WorkbenchError, match=words):
        spec.check(4)


def test_strategy_meshes():
    cfg = get_config("small")
    s = get_strategy("pp+fsdp+tp")
    assert s.pipelined and s.base.name == "fsdp+tp" and not get_strategy("fsdp").pipelined
    assert {"stage": 2, "data": 4, "model": 2} in s.mesh_candidates(16, cfg)
    assert all(m["stage"] in (2, 4) for m in s.mesh_candidates(16, cfg))  # divisors of n_layers=4
    assert get_strategy("pp").default_mesh(8, cfg) == {"stage": 4, "data": 2}


def _loss_and_grads(cfg, strategy, mesh, microbatches=1, repeats=1):
    prog = build_train_step(cfg, policy="float32", mesh=mesh, strategy=strategy, batch_size=B, seq_len=T,
                            microbatches=microbatches, pipeline_repeats=repeats)
    batch = Batches(B, T, seed=1, corpus=load_corpus(400_000)).train(0)
    batch = {k: jax.device_put(v, prog.batch_sharding) for k, v in batch.items()}
    loss, grads = prog.grads(prog.state["params"], prog.state["gmeta"], prog.state["rest"], batch)
    grads = jax.tree.map(np.asarray, grads)
    if prog.pipeline is not None:  # back to the model's layer order
        grads["blocks"] = pp.from_stage_order(grads["blocks"], prog.pipeline, cfg.n_layers)
    hlo = prog.grads.lower(prog.state["params"], prog.state["gmeta"], prog.state["rest"], batch).compile().as_text()
    return float(loss), grads, hlo


@pytest.mark.compile_heavy
@pytest.mark.parametrize("strategy,mesh,m,v", [
    ("pp", "stage=4", 4, 1),              # GPipe, 4 stages
    ("pp", "stage=2", 4, 2),              # circular: 2 stages x 2 virtual stages
    ("pp+fsdp+tp", "stage=2,data=2,model=2", 2, 1),
])
def test_pipeline_equals_unpipelined(strategy, mesh, m, v):
    from workbench.cost.hlo import parse_collectives

    cfg = get_config("tiny", CFG)
    ref = _loss_and_grads(cfg, "dp", make_mesh("data=1", devices=jax.devices()[:1]))
    n = int(np.prod([int(kv.split("=")[1]) for kv in mesh.split(",")]))
    mesh_obj = make_mesh(mesh, devices=jax.devices()[:n])
    got = _loss_and_grads(cfg, strategy, mesh_obj, microbatches=m, repeats=v)
    rtol, atol = tol("float32")
    assert abs(got[0] - ref[0]) <= rtol * abs(ref[0]), (got[0], ref[0])
    flat_r = jax.tree_util.tree_flatten_with_path(ref[1])[0]
    flat_g = jax.tree_util.tree_flatten_with_path(got[1])[0]
    assert [p for p, _ in flat_r] == [p for p, _ in flat_g]
    for (path, a), (_, b) in zip(flat_r, flat_g):
        assert_close(b, a, "float32", scale=max(1.0, float(np.abs(a).max()) * rtol / atol))
    permutes = [c for c in parse_collectives(got[2], mesh_obj) if c.kind == "collective-permute"]
    assert permutes and all(any(a.startswith("stage") for a in c.mesh_axes) for c in permutes), permutes


@pytest.mark.compile_heavy
def test_bubble_shows_as_per_device_work():
    """Every stage computes every tick: the compiled per-device flops of the layers grow as (m + p - 1)/m."""
    from workbench.cost.report import costs_from_compiled

    cfg = get_config("tiny", CFG)
    mesh = make_mesh("stage=4", devices=jax.devices()[:4])
    flops = {}
    for m in (4, 8):
        prog = build_train_step(cfg, policy="float32", mesh=mesh, strategy="pp", batch_size=B, seq_len=T,
                                microbatches=m, abstract=True)
        c = prog.grads.lower(prog.state["params"], prog.state["gmeta"], prog.state["rest"], prog.batch).compile()
        flops[m] = costs_from_compiled(c, n_devices=4, mesh=mesh).counted_flops
        tick = pp.bubble_terms(prog.pipeline, cfg, B, T, 1, 1, None)
        assert tick["layer_flops_per_device"] <= flops[m]
    # same tokens per step: the layer work is (m + p - 1)/m of the useful; the rest (embed, head) is the same
    est = {m: pp.bubble_terms(pp.PipelineSpec(4, m), cfg, B, T, 1, 1, None)["layer_flops_per_device"]
           for m in (4, 8)}
    assert flops[4] - flops[8] == pytest.approx(est[4] - est[8], rel=0.1)
