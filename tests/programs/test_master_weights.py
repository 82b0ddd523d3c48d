"""master_weights='optimizer' (Megatron's megatron_amp_O2 with its distributed optimizer): the parameters and their
gradients in the compute dtype, a float32 master copy in the optimizer state. It trains as float32 parameters do
(the dots already see bf16 operands either way), the master keeps what bf16 cannot hold, the state shrinks by the
parameters' and gradients' half, and under ZeRO-1 the gradients are reduce-scattered in bf16."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.presets import get_config
from partitioning import topology as topo
from partitioning.mesh import make_mesh
from workbench.cost.hlo import parse_collectives
from workbench.errors import WorkbenchError
from workbench.hardware.devices import default_platform
from workbench.programs.data import Batches
from workbench.programs.step import build_train_step
from workbench.testing import assert_close

B, T = 8, 64


def _bytes(tree) -> int:
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


def _train(cfg, strategy, mesh, steps=4):
    prog = build_train_step(cfg, policy="bf16", mesh=mesh, strategy=strategy, batch_size=B, seq_len=T,
                            microbatches=2)
    batches, state, losses = Batches(B, T, seed=0), prog.state, []
    sizes = _bytes(state["params"]), _bytes(state["opt"])
    for i in range(steps):
        state, metrics = prog.step(state, batches.train_sharded(i, prog.batch_sharding))
        losses.append(float(metrics["loss"]))
    return np.array(losses), state, sizes


def test_master_weights_in_the_optimizer_train_like_float32_parameters():
    one = make_mesh("data=1", devices=jax.devices()[:1])
    ref, ref_state, (ref_params, ref_opt) = _train(get_config("tiny"), "dp", one)
    got, state, (params, opt) = _train(get_config("tiny", "master_weights=optimizer"), "dp", one)
    assert_close(got, ref, jnp.bfloat16)
    assert {leaf.dtype for leaf in jax.tree.leaves(state["params"])} == {jnp.dtype(jnp.bfloat16)}
    masters = jax.tree.leaves(state["opt"]["master"])
    assert {leaf.dtype for leaf in masters} == {jnp.dtype(jnp.float32)}
    # the parameters are the master rounded, and the master holds what the rounding drops
    leaves = jax.tree.leaves(state["params"])
    assert all(np.array_equal(np.asarray(p), np.asarray(m.astype(jnp.bfloat16))) for p, m in zip(leaves, masters))
    assert any(np.any(np.asarray(p, np.float32) != np.asarray(m)) for p, m in zip(leaves, masters))
    # the master equals the float32-parameter run's parameters to bf16 accuracy (same arithmetic on the update)
    for m, r in zip(masters, jax.tree.leaves(ref_state["params"])):
        assert_close(m, r, jnp.bfloat16)
    assert params * 2 == ref_params  # bf16 parameters
    assert opt == ref_opt + ref_params  # moments + the float32 master


def test_master_weights_under_zero1_and_tensor_parallel_train_like_one_device():
    cfg = get_config("tiny", "master_weights=optimizer,optimizer_sharding=data")
    one, _, (_, opt_one) = _train(cfg, "dp", make_mesh("data=1", devices=jax.devices()[:1]))
    tp, _, (_, opt_tp) = _train(cfg, "tp", make_mesh("data=4,model=2"))
    assert_close(tp, one, jnp.bfloat16)
    assert opt_tp < 0.2 * opt_one, (opt_tp, opt_one)  # master and moments split over data=4 × model=2


def test_master_weights_need_a_narrow_compute_dtype():
    with pytest.raises(WorkbenchError, match="master_weights=optimizer.*--policy bf16"):
        build_train_step(get_config("tiny", "master_weights=optimizer"), policy="float32",
                         mesh=make_mesh("data=1", devices=jax.devices()[:1]), strategy="dp", batch_size=B,
                         seq_len=T, abstract=True)
    with pytest.raises(WorkbenchError, match="master_weights"):
        get_config("tiny", "master_weights=fp32")


@pytest.mark.skipif(not topo.libtpu_available(), reason="libtpu not installed (pip install -e .[tpu])")
def test_master_weights_shrink_the_state_and_reduce_scatter_bf16_gradients_on_a_tpu_slice():
    """libtpu, v5e:2x4, tp with ZeRO-1 (data=4 × model=2), bf16 policy: with the master in the optimizer each
    chip's arguments (the state) shrink by the parameters' half, and the gradients reach each rank's slice as a
    bf16 reduce-scatter over `data` (float32 with float32 parameters: the weight-gradient dot returns the weight's dtype); the updated
    parameters are all-gathered in bf16."""
    default_platform()
    mesh = make_mesh({"data": 4, "model": 2}, devices=topo.target_devices(topo.parse_target("tpu-v5e:2x4")))
    out = {}
    for master in ("params", "optimizer"):
        cfg = get_config("tiny", f"n_layers=1,d_model=256,d_ff=1024,optimizer_sharding=data,master_weights={master}")
        prog = build_train_step(cfg, policy="bf16", mesh=mesh, strategy="tp", batch_size=B, seq_len=T,
                                abstract=True)
        compiled = prog.step.lower(prog.state, prog.batch).compile()
        ops = parse_collectives(compiled.as_text(), mesh=mesh, n_devices=8)
        out[master] = ({c.dtype for c in ops if c.kind == "reduce-scatter" and c.mesh_axes == ("data",)},
                       {c.dtype for c in ops if c.kind == "all-gather" and c.mesh_axes == ("data",)},
                       compiled.memory_analysis().argument_size_in_bytes)
    assert out["params"][0] == {"float32"}, out["params"]
    assert out["optimizer"][0] == {"bfloat16"}, out["optimizer"]
    assert "bfloat16" in out["optimizer"][1], out["optimizer"]
    # per chip: 4 B × P/2 of parameters + 8 B × P/8 of moments, against 2 B × P/2 + 12 B × P/8 (0.83×); the norm
    # scales that do not split over data and the TPU's tile padding of small arrays bring it nearer 0.9×
    assert out["optimizer"][2] < 0.93 * out["params"][2], (out["optimizer"][2], out["params"][2])


def test_weight_grads_in_the_compute_dtype_change_nothing_on_a_cpu():
    """weight_grad_dtype=compute asks the weight-gradient dot for the compute dtype on a TPU or GPU only: on a CPU the
    step trains bit for bit as the default does."""
    one = make_mesh("data=1", devices=jax.devices()[:1])
    ref, _, _ = _train(get_config("tiny"), "dp", one, steps=2)
    got, _, _ = _train(get_config("tiny", "weight_grad_dtype=compute"), "dp", one, steps=2)
    np.testing.assert_array_equal(got, ref)


def test_weight_grad_dtype_refusals_are_one_line_errors():
    with pytest.raises(WorkbenchError, match="weight_grad_dtype='bf16' is not one of float32, compute"):
        get_config("tiny", "weight_grad_dtype=bf16")
    with pytest.raises(WorkbenchError, match="weight_grad_dtype=compute applies to .* not fp8-current"):
        build_train_step(get_config("tiny", "weight_grad_dtype=compute"), policy="fp8-current",
                         mesh=make_mesh("data=1", devices=jax.devices()[:1]), strategy="dp", batch_size=B,
                         seq_len=T, abstract=True)


@pytest.mark.skipif(not topo.libtpu_available(), reason="libtpu not installed (pip install -e .[tpu])")
def test_weight_grads_in_the_compute_dtype_are_reduce_scattered_in_bf16_on_a_tpu_slice():
    """libtpu, v5e:2x2, fsdp, bf16 policy, float32 parameters: the weight gradients reach each chip's shard as a
    float32 reduce-scatter over `data` by default and as a bf16 one with weight_grad_dtype=compute (MaxText's
    program: its dots return bf16), half the bytes."""
    default_platform()
    mesh = make_mesh({"data": 4}, devices=topo.target_devices(topo.parse_target("tpu-v5e:2x2")))
    out = {}
    for dtype in ("float32", "compute"):
        cfg = get_config("tiny", f"n_layers=2,d_model=256,d_ff=1024,scan_layers=true,weight_grad_dtype={dtype}")
        prog = build_train_step(cfg, policy="bf16", mesh=mesh, strategy="fsdp", batch_size=B, seq_len=T,
                                abstract=True)
        ops = parse_collectives(prog.step.lower(prog.state, prog.batch).compile().as_text(), mesh=mesh, n_devices=4)
        big = [c for c in ops if c.kind == "reduce-scatter" and c.mesh_axes == ("data",) and c.payload_bytes > 2**18]
        out[dtype] = ({c.dtype for c in big}, sum(c.payload_bytes * c.count for c in big))
    assert out["float32"][0] == {"float32"}, out
    assert out["compute"][0] == {"bfloat16"}, out
    assert out["compute"][1] == pytest.approx(out["float32"][1] / 2, rel=0.05), out
