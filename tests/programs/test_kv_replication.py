"""Fewer key/value heads than tensor-parallel ways (grouped-query and multi-query attention on a wide model axis):
each device keeps every key/value head, as MaxText and Megatron do, and the model trains as on one device."""
import jax
import numpy as np
import pytest

from models.presets import get_config
from partitioning.mesh import make_mesh
from partitioning.shard import spec_for
from workbench.errors import WorkbenchError
from workbench.programs.data import Batches
from workbench.programs.step import build_train_step

B, T = 8, 64


def _losses(cfg, strategy, mesh, steps=3):
    prog = build_train_step(cfg, policy="float32", mesh=mesh, strategy=strategy, batch_size=B, seq_len=T)
    batches, state, out = Batches(B, T, seed=0), prog.state, []
    for i in range(steps):
        state, metrics = prog.step(state, batches.train_sharded(i, prog.batch_sharding))
        out.append(float(metrics["loss"]))
    return np.array(out)


@pytest.mark.parametrize("kv", [1, 2])
def test_fewer_kv_heads_than_model_ways_train_like_one_device(kv):
    cfg = get_config("tiny", f"n_kv_heads={kv}")  # 4 query heads over model=4
    mesh = make_mesh("data=2,model=4", devices=jax.devices()[:8])
    spec = spec_for(("embed", "kv_heads", "head_dim"), (cfg.d_model, kv, cfg.head_dim), mesh, "tp")
    assert tuple(spec) == ()  # every device keeps the key/value heads whole
    assert tuple(spec_for(("embed", "heads", "head_dim"), (cfg.d_model, 4, cfg.head_dim), mesh, "tp")) == (
        None, "model")
    one = _losses(cfg, "dp", make_mesh("data=1", devices=jax.devices()[:1]))
    tp = _losses(cfg, "tp", mesh)
    assert np.max(np.abs(tp - one)) < 1e-4, (tp, one)


def test_kv_heads_that_do_not_divide_the_axis_either_way_are_an_error():
    """3 key/value heads on model=2: neither divides the other, so there is no even split and no whole copy per
    group of ranks — a one-line error as for any dimension."""
    mesh = make_mesh("data=4,model=2", devices=jax.devices()[:8])
    with pytest.raises(WorkbenchError, match=r"kv_heads=3\) is not divisible by mesh axis model=2"):
        spec_for(("embed", "kv_heads", "head_dim"), (64, 3, 16), mesh, "tp")
