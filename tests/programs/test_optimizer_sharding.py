"""ZeRO-1 (optimizer_sharding='data', Megatron's distributed optimizer): the optimizer state split over the
data-parallel replicas trains like one device, keeps a 1/data slice of the moments per device, and reduce-scatters
the gradients to those slices."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from models.presets import get_config
from partitioning import topology as topo
from partitioning.mesh import make_mesh
from partitioning.shard import over_replicas
from workbench.cost.hlo import parse_collectives
from workbench.errors import WorkbenchError
from workbench.hardware.devices import default_platform
from workbench.programs.data import Batches
from workbench.programs.step import build_train_step

B, T = 8, 64


def _opt_bytes_on_one_device(state) -> int:
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(state["opt"]))


def _run(cfg, strategy, mesh, steps=3):
    prog = build_train_step(cfg, policy="float32", mesh=mesh, strategy=strategy, batch_size=B, seq_len=T)
    batches = Batches(B, T, seed=0)
    state, losses = prog.state, []
    opt_bytes = _opt_bytes_on_one_device(state)
    for i in range(steps):
        state, metrics = prog.step(state, batches.train_sharded(i, prog.batch_sharding))
        losses.append(float(metrics["loss"]))
    return losses, opt_bytes


def test_zero1_trains_like_one_device_with_a_quarter_of_the_moments():
    """Tensor parallel over `model`, the parameters replicated over data=4: with optimizer_sharding='data' each
    device keeps about a quarter of the AdamW moments (a dimension that does not divide stays whole) and the
    losses are those of one device."""
    cfg = get_config("tiny")
    one, _ = _run(cfg, "dp", make_mesh("data=1", devices=jax.devices()[:1]))
    mesh = make_mesh("data=4,model=2")
    tp, tp_bytes = _run(cfg, "tp", mesh)
    z1, z1_bytes = _run(get_config("tiny", "optimizer_sharding=data"), "tp", mesh)
    assert np.max(np.abs(np.array(z1) - np.array(one))) < 1e-4, (z1, one)
    assert np.max(np.abs(np.array(tp) - np.array(one))) < 1e-4, (tp, one)
    assert z1_bytes < 0.3 * tp_bytes, (z1_bytes, tp_bytes)


@pytest.mark.skipif(not topo.libtpu_available(), reason="libtpu not installed (pip install -e .[tpu])")
def test_zero1_reduce_scatters_the_gradients_over_data_on_a_tpu_slice():
    """Compiled by libtpu for v5e:2x4 (tp, data=4 × model=2): without ZeRO-1 the gradients are all-reduced over
    `data`; with it they are reduce-scattered to each rank's slice and the updated slices all-gathered, and each
    chip's arguments (the state) shrink. (XLA:CPU keeps the all-reduce and slices it locally.)"""
    default_platform()
    mesh = make_mesh({"data": 4, "model": 2}, devices=topo.target_devices(topo.parse_target("tpu-v5e:2x4")))
    out = {}
    for zero1 in (False, True):
        cfg = get_config("tiny", "n_layers=1" + (",optimizer_sharding=data" if zero1 else ""))
        prog = build_train_step(cfg, policy="float32", mesh=mesh, strategy="tp", batch_size=B, seq_len=T,
                                abstract=True)
        compiled = prog.step.lower(prog.state, prog.batch).compile()
        kinds = {(c.kind, c.mesh_axes) for c in parse_collectives(compiled.as_text(), mesh=mesh, n_devices=8)}
        out[zero1] = kinds, compiled.memory_analysis().argument_size_in_bytes
    assert ("reduce-scatter", ("data",)) not in out[False][0]
    assert ("reduce-scatter", ("data",)) in out[True][0], out[True][0]
    assert ("all-gather", ("data",)) in out[True][0], out[True][0]
    assert out[True][1] < 0.8 * out[False][1], (out[True][1], out[False][1])


def test_over_replicas_takes_the_largest_whole_dimension_that_divides():
    mesh = make_mesh("data=4,model=2")
    assert over_replicas(P(None, "model"), (64, 256), mesh, "tp") == P("data", "model")
    assert over_replicas(P("model"), (256, 6), mesh, "tp") == P("model")  # 6 does not divide by 4
    assert over_replicas(P(), (6, 12), mesh, "tp") == P(None, "data")
    assert over_replicas(P("data"), (64, 64), mesh, "fsdp") == P("data")  # FSDP already splits it over data
    with pytest.raises(WorkbenchError, match="optimizer_sharding"):
        get_config("tiny", "optimizer_sharding=zero1")
