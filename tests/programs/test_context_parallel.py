"""Context parallelism (strategies cp, fsdp+cp, fsdp+tp+cp): the sequence split over the `context` mesh axis trains
like one device, the compiled step gathers keys and values over that axis, and the planner searches it."""
import jax
import numpy as np
import pytest

from models.presets import get_config
from partitioning.mesh import make_mesh
from partitioning.strategy import get_strategy
from workbench.programs.data import Batches
from workbench.programs.step import build_train_step

B, T = 8, 64


def _losses(cfg, strategy, mesh, steps=5):
    prog = build_train_step(cfg, policy="float32", mesh=mesh, strategy=strategy, batch_size=B, seq_len=T)
    batches = Batches(B, T, seed=0)
    state, out = prog.state, []
    for i in range(steps):
        state, metrics = prog.step(state, batches.train_sharded(i, prog.batch_sharding))
        out.append(float(metrics["loss"]))
    return out


def test_fsdp_cp_trains_like_one_device():
    """What `workbench run --preset tiny --strategy fsdp+cp --mesh data=2,context=4 --devices 8 --steps 5` does,
    against one device: the same five losses."""
    cfg = get_config("tiny")
    one = _losses(cfg, "dp", make_mesh("data=1", devices=jax.devices()[:1]))
    cp = _losses(cfg, "fsdp+cp", make_mesh("data=2,context=4"))
    assert np.max(np.abs(np.array(cp) - np.array(one))) < 1e-4, (cp, one)
    assert one[-1] < one[0]


@pytest.mark.compile_heavy
def test_fsdp_tp_cp_with_rope_and_gqa_trains_like_one_device():
    cfg = get_config("tiny", "pos=rope,norm=rmsnorm,mlp=swiglu,n_heads=8,n_kv_heads=4,head_dim=8,bias=false,"
                             "tie_embeddings=false")
    one = _losses(cfg, "dp", make_mesh("data=1", devices=jax.devices()[:1]), steps=2)
    cp = _losses(cfg, "fsdp+tp+cp", make_mesh("data=2,model=2,context=2"), steps=2)
    assert np.max(np.abs(np.array(cp) - np.array(one))) < 1e-4, (cp, one)


def test_compiled_cp_step_gathers_keys_and_values_over_context():
    from workbench.cost.hlo import parse_collectives

    cfg = get_config("tiny", "n_layers=1")
    mesh = make_mesh("data=2,context=4")
    prog = build_train_step(cfg, policy="float32", mesh=mesh, strategy="cp", batch_size=B, seq_len=T, abstract=True)
    text = prog.step.lower(prog.state, prog.batch).compile().as_text()
    by_axis: dict[str, set] = {}
    for c in parse_collectives(text, mesh=mesh, n_devices=mesh.size):
        by_axis.setdefault("+".join(c.mesh_axes) or "?", set()).add(c.kind)
    assert "all-gather" in by_axis.get("context", set()), by_axis  # keys and values, one layer: (b, s, k, h) each
    # the backward pass sums the key and value gradients over context; cp keeps parameters replicated: their
    # gradients are all-reduced over every device
    assert any("context" in axes for axes in by_axis), by_axis


def test_strategies_meshes_and_planner_candidates():
    cfg = get_config("tiny")
    assert get_strategy("cp").default_mesh(8, cfg) == {"data": 2, "context": 4}
    assert get_strategy("fsdp+cp").without_context.name == "fsdp"
    assert get_strategy("fsdp+tp+cp").without_context.name == "fsdp+tp"
    cands = get_strategy("fsdp+tp+cp").mesh_candidates(8, cfg, seq=64)
    assert {"data": 2, "model": 2, "context": 2} in cands and all(m["context"] > 1 and m["model"] > 1 for m in cands)
    assert get_strategy("cp").mesh_candidates(8, cfg, seq=6) == [{"data": 4, "context": 2}]  # 6 splits by 2 only
    assert get_strategy("fsdp+cp").batch_ways({"data": 2, "context": 4}) == 2

    from workbench.programs.plan import enumerate_candidates

    strategies = {s.strategy for s in enumerate_candidates("tiny", "tpu-v5e:2x2", batch=8)}
    assert {"cp", "fsdp+cp", "fsdp+tp+cp"} <= strategies
