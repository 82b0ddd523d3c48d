"""Compiled by libtpu for compile-only TPU devices (no TPU attached): collectives of known traffic, flop counts of
scanned and unrolled layers, host offloading against per-layer remat. Small programs on tiny topologies."""
import re
from unittest import mock

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from partitioning import topology as topo
from partitioning.mesh import make_mesh
from workbench.cost import hlo
from workbench.hardware.devices import default_platform
from workbench.programs import predict as wp

pytestmark = [pytest.mark.compile_heavy,
              pytest.mark.skipif(not topo.libtpu_available(), reason="libtpu not installed (pip install -e .[tpu])")]


def test_fsdp_gradient_reduce_scatter_of_a_4096_weight():
    """A 4096×4096 float32 weight sharded over `data` on v5e:2x2: libtpu reduces its gradient with a kCustom fusion
    (`%all-reduce-scatter`: an all-reduce of the padded array, then this device's dynamic-slice). It is one
    reduce-scatter over `data` of at least the 64 MiB array (padding allowed, under 10 %)."""
    default_platform()
    t = topo.parse_target("tpu-v5e:2x2")
    mesh = make_mesh({"data": 4}, devices=topo.target_devices(t))
    sh = NamedSharding(mesh, P("data", None))
    grad = jax.jit(jax.grad(lambda w, x: jnp.sum(jnp.square(x @ w))), in_shardings=(sh, sh), out_shardings=sh)
    w = jax.ShapeDtypeStruct((4096, 4096), jnp.float32, sharding=sh)
    x = jax.ShapeDtypeStruct((64, 4096), jnp.float32, sharding=sh)
    text = grad.lower(w, x).compile().as_text()
    rs = [c for c in hlo.parse_collectives(text, mesh=mesh, n_devices=4) if c.kind == "reduce-scatter"]
    assert len(rs) == 1 and rs[0].count == 1 and rs[0].mesh_axes == ("data",) and rs[0].group_size == 4
    full = 4096 * 4096 * 4
    assert full <= rs[0].payload_bytes <= 1.1 * full


PROGRAM = "n_layers=3,d_model=128,n_heads=4,d_ff=512,vocab_size=256,seq_len=128"


@pytest.mark.parametrize("scan", [True, False])
def test_flop_counts_of_scanned_and_unrolled_layers(scan, results_dir):
    """The HLO kernel sum (loop bodies × the trip count read from the loop condition; windowed convolutions by
    their real taps) agrees with the analytic count × the remat factor; cost_analysis counts a scanned body once."""
    r = wp.predict_once(wp.PredictSpec("tiny", "tpu-v5e:2x2", "fsdp", batch=8, seq=128, remat="per-layer",
                                       overrides=f"{PROGRAM},scan_layers={str(scan).lower()}"))
    fc = r["flop_counts"]
    assert fc["remat_factor"] > 1.2
    assert 0.85 <= fc["hlo_over_expected"] <= 1.25, fc
    assert 0.95 <= r["flops_per_device"] / (r["model_flops_per_step"] / r["n_chips"]) <= 1.6
    if scan:
        assert fc["compiler_over_expected"] < 0.75, "libtpu's cost_analysis counts the scanned body once"


def test_offload_lowers_device_memory_against_per_layer_remat(results_dir):
    """Host offloading of the layer inputs and q/k/v (remat offload) keeps less in HBM than per-layer remat. With the
    model's own attention products: at this size the splash kernel's lane-padded softmax statistics, which a policy
    that keeps q/k/v makes libtpu hold per layer, outweigh what offloading saves (docs/models.md, remat limits)."""
    mem = {}
    for remat in ("per-layer", "offload"):
        r = wp.predict_once(wp.PredictSpec("tiny", "tpu-v5e:2x2", "fsdp", batch=8, seq=128, remat=remat,
                                           overrides=f"{PROGRAM},n_layers=6,attention=dot"))
        assert r["compiled"] and r["fits"], r.get("reason")
        mem[remat] = r["memory_breakdown"]["temp_bytes"]
    assert mem["offload"] < mem["per-layer"], mem


@pytest.mark.parametrize("scan", ["false", "true"])
def test_offloaded_activations_are_priced_over_the_host_link(results_dir, scan):
    """Host offloading of the layer input and q/k/v: unrolled layers copy each to and from the host's memory
    (copy-start), scanned ones write slices of a stacked host buffer and read them back (dynamic-update-slice-start /
    dynamic-slice-start). Either way the bytes each way are the offloaded activations per device — batch 8 over 4
    chips, 128 positions, 4 tensors of width 128 in bf16, 6 layers — and their time is those bytes over v5e's
    host link."""
    r = wp.predict_once(wp.PredictSpec("tiny", "tpu-v5e:2x2", "fsdp", batch=8, seq=128, remat="offload",
                                       overrides=f"{PROGRAM},n_layers=6,attention=dot,scan_layers={scan}"))
    expected = (8 // 4) * 128 * 128 * 2 * 4 * 6
    assert r["host_bytes_out_per_device"] == expected and r["host_bytes_in_per_device"] == expected
    assert r["host_s"] == pytest.approx(expected / 1.6e10)
    plain = wp.predict_once(wp.PredictSpec("tiny", "tpu-v5e:2x2", "fsdp", batch=8, seq=128, remat="per-layer",
                                           overrides=f"{PROGRAM},n_layers=6,attention=dot,scan_layers={scan}"))
    assert plain["host_bytes_out_per_device"] == 0 and plain["host_s"] == 0


def test_windowed_einsum_loops_are_counted_at_their_real_trip_count(results_dir):
    """FSDP over 16 chips at these widths: libtpu turns the weight all-gathers and gradient reduce-scatters into
    collective matmuls (windowed einsum loops, unrolled by two, the counter stepping by 2). Counted at the loop
    bound alone their matmuls ran twice (1.57× the expected flops); read with the counter's step, the HLO kernel sum
    is the expected count."""
    r = wp.predict_once(wp.PredictSpec(
        "llama3-8b", "tpu-v5e:4x4", "fsdp", batch=16, seq=1024, remat="per-layer",
        overrides="n_layers=2,vocab_size=1024,d_model=2048,n_heads=16,n_kv_heads=4,d_ff=8192"))
    assert r["fits"]
    assert 0.9 <= r["flop_counts"]["hlo_over_expected"] <= 1.1, r["flop_counts"]


def test_a_program_that_does_not_fit_is_priced_from_the_hlo_the_compiler_wrote(results_dir):
    """The compiler refuses the program (HBM overflow) after optimizing it; compiled with a dump, its optimized HLO
    prices the step it would take, from that one compile. The record still says it does not fit, with the
    compiler's memory figure, and its flop count is the expected one (scanned layers read through the proto's
    printout)."""
    spec = wp.PredictSpec("tiny", "tpu-v5e:1x1", "dp", batch=2048, seq=1024, remat="none")
    refused = wp.predict_once(spec)
    assert not refused["fits"] and refused["predicted_step_s"] is None
    compiles = []
    real = jax.stages.Lowered.compile

    def counted(self, *a, **k):
        compiles.append(k)
        return real(self, *a, **k)

    with mock.patch.object(jax.stages.Lowered, "compile", counted):
        r = wp.predict_once(spec, price_unfit=True)
    assert len(compiles) == 1, compiles
    assert not r["fits"] and not r["compiled"] and "ran out of memory" in r["reason"]
    assert r["memory_per_device_bytes"] > 16e9 and r["priced_from"]
    assert r["predicted_step_s"] > 0 and r["compute_s"] > 0
    # the refusal names the largest buffers of the compiler's buffer assignment (GiB, the value's shape)
    largest = re.search(r"largest allocations: ([\d.]+) GiB (\w+\[[\d,]+\])", r["reason"])
    assert largest and float(largest.group(1)) > 1, r["reason"]
    assert 0.85 <= r["flop_counts"]["hlo_over_expected"] <= 1.25, r["flop_counts"]
