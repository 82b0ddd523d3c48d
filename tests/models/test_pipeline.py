"""Pipeline parallelism (models/pipeline.py, the pp strategies): every schedule gives the unpipelined loss and
gradients on the same batch; activations move by collective permutes on `stage`; 1F1B holds fewer activations than
GPipe; bad stage / microbatch counts, schedules and policies are one-line errors."""
import functools
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from models import pipeline as pp
from models.presets import get_config
from partitioning.mesh import make_mesh
from partitioning.strategy import get_strategy
from workbench import compat
from workbench.errors import WorkbenchError
from workbench.programs.data import Batches, load_corpus
from workbench.programs.step import build_train_step
from workbench.testing import assert_close, tol

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
    # 1F1B: m + 2p - 2 ticks of one F and one B slot each; the step is m + p - 1 ticks of F + B (GPipe's bubble);
    # stage 0 stashes min(m, 2p - 1) stage inputs where GPipe holds every microbatch's activations
    f = pp.PipelineSpec(4, 8, schedule="1f1b")
    assert (f.ticks, f.step_ticks, f.held_microbatches, f.work_ratio) == (14, 11, 7, 1.0)
    assert f.bubble_fraction == pytest.approx(g.bubble_fraction)
    assert (g.held_microbatches, pp.PipelineSpec(4, 4, schedule="1f1b").held_microbatches) == (8, 4)
    rec = f.to_record()
    assert (rec["schedule"], rec["held_microbatches"], rec["ticks"]) == ("1f1b", 7, 14)
    assert pp.PipelineSpec(2, 4, 2, "gpipe").schedule == "circular"  # gpipe over virtual stages reads circular


@pytest.mark.parametrize("spec,words", [
    (pp.PipelineSpec(3, 4), "does not divide the model's n_layers=4"),
    (pp.PipelineSpec(4, 2), "fewer than the 4 pipeline stages"),
    (pp.PipelineSpec(2, 3, repeats=2), "multiple of the 2 stages"),
    (pp.PipelineSpec(2, 4, repeats=4), "does not divide"),
    (pp.PipelineSpec(2, 4, repeats=2, schedule="1f1b"), "interleaved 1F1B"),
    (pp.PipelineSpec(2, 4, schedule="circular"), "needs --pipeline-repeats > 1"),
    (pp.PipelineSpec(2, 4, schedule="zb-h1"), "unknown pipeline schedule 'zb-h1'"),
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


@pytest.mark.parametrize("kw,words", [
    (dict(strategy="pp", mesh="stage=2", policy="fp16"), "1F1B does not apply fp16's loss scaling"),
    (dict(strategy="pp", mesh="stage=2", policy="fp8-delayed"), "delayed-scaling gradient state"),
    (dict(strategy="fsdp", mesh="data=2"), "--pipeline-schedule applies to the pipelined strategies"),
])
def test_1f1b_refusals_are_one_line_errors(kw, words):
    """Refused while the step is built, before anything is traced or compiled."""
    mesh = make_mesh(kw.pop("mesh"), devices=jax.devices()[:2])
    with pytest.raises(WorkbenchError, match=words):
        build_train_step(get_config("tiny", CFG), mesh=mesh, batch_size=B, seq_len=T, microbatches=2,
                         pipeline_schedule="1f1b", **kw)


def _loss_and_grads(cfg, strategy, mesh, microbatches=1, repeats=1, schedule="gpipe"):
    prog = build_train_step(cfg, policy="float32", mesh=mesh, strategy=strategy, batch_size=B, seq_len=T,
                            microbatches=microbatches, pipeline_repeats=repeats, pipeline_schedule=schedule)
    batch = Batches(B, T, seed=1, corpus=load_corpus(400_000)).train(0)
    batch = {k: jax.device_put(v, prog.batch_sharding) for k, v in batch.items()}
    loss, grads = prog.grads(prog.state["params"], prog.state["gmeta"], prog.state["rest"], batch)
    grads = jax.tree.map(np.asarray, grads)
    if prog.pipeline is not None:  # back to the model's layer order
        grads["blocks"] = pp.from_stage_order(grads["blocks"], prog.pipeline, cfg.n_layers)
    hlo = prog.grads.lower(prog.state["params"], prog.state["gmeta"], prog.state["rest"], batch).compile().as_text()
    return float(loss), grads, hlo


@functools.lru_cache(maxsize=1)
def _unpipelined():
    """The reference: the same model and batch on one device, no pipeline (compiled once per session)."""
    return _loss_and_grads(get_config("tiny", CFG), "dp", make_mesh("data=1", devices=jax.devices()[:1]))


@pytest.mark.compile_heavy
@pytest.mark.parametrize("strategy,mesh,m,v,schedule", [
    ("pp", "stage=4", 4, 1, "gpipe"),     # GPipe, 4 stages
    ("pp", "stage=2", 4, 2, "gpipe"),     # circular: 2 stages x 2 virtual stages
    ("pp+fsdp+tp", "stage=2,data=2,model=2", 2, 1, "gpipe"),
    ("pp", "stage=4", 4, 1, "1f1b"),      # 1F1B, m < 2p - 1: every microbatch has its own stash slot
    ("pp", "stage=4", 8, 1, "1f1b"),      # m > 2p - 1 = 7: stash slots are reused
    ("pp+fsdp+tp", "stage=2,data=2,model=2", 4, 1, "1f1b"),
])
def test_pipeline_equals_unpipelined(strategy, mesh, m, v, schedule):
    from workbench.cost.hlo import parse_collectives

    cfg = get_config("tiny", CFG)
    ref = _unpipelined()
    n = int(np.prod([int(kv.split("=")[1]) for kv in mesh.split(",")]))
    mesh_obj = make_mesh(mesh, devices=jax.devices()[:n])
    got = _loss_and_grads(cfg, strategy, mesh_obj, microbatches=m, repeats=v, schedule=schedule)
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


@pytest.mark.compile_heavy
def test_1f1b_holds_less_than_gpipe():
    """p = 4, m = 16: GPipe's backward keeps every tick's layer activations, 1F1B a stash of 2p - 1 = 7 stage
    inputs (its backward recomputes the stage): the compiled step's temporaries are several times smaller
    (docs/pipeline.md: 7.6 MB against 0.94 MB here)."""
    cfg = get_config("tiny", CFG)
    mesh = make_mesh("stage=4", devices=jax.devices()[:4])
    temp = {}
    for schedule in ("gpipe", "1f1b"):
        prog = build_train_step(cfg, policy="float32", mesh=mesh, strategy="pp", batch_size=16, seq_len=T,
                                microbatches=16, abstract=True, pipeline_schedule=schedule)
        compiled = prog.step.lower(prog.state, prog.batch).compile()
        temp[schedule] = compat.memory_analysis(compiled)[0]["temp"]
        hlo = compiled.as_text()
        assert (" conditional(" in hlo) == (schedule == "1f1b")  # idle 1F1B slots branch around the work
    assert temp["1f1b"] < 0.5 * temp["gpipe"], temp


def _run_cli(*args, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", WORKBENCH_RESULTS=str(tmp_path), WORKBENCH_HUGEPAGES="0")
    r = subprocess.run([sys.executable, "-m", "workbench", "run", "--preset", "tiny", "--set", CFG,
                        "--steps", "2", "--batch", "16", "--json", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


@pytest.mark.compile_heavy
def test_1f1b_training_run_equals_unpipelined(tmp_path):
    """The CLI path: two training steps of a 4-layer `tiny` under 1F1B on 4 stages (8 microbatches of 2) give the
    data-parallel run's losses."""
    got = _run_cli("--strategy", "pp", "--mesh", "stage=4", "--devices", "4", "--microbatches", "8",
                   "--pipeline-schedule", "1f1b", tmp_path=tmp_path)
    ref = _run_cli("--strategy", "dp", "--mesh", "data=1", "--devices", "1", tmp_path=tmp_path)
    assert got["pipeline"]["schedule"] == "1f1b" and got["pipeline"]["held_microbatches"] == 7
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-4)
    assert any(k.startswith("collective-permute@stage") for k in got["collectives"]), got["collectives"]
