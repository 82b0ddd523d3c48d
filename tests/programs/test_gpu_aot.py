"""XLA:GPU compiling deviceless for a GPU node (`predict --gpu-compiler xla-gpu`). Runs whenever the JAX CUDA plugin
of this jaxlib is installed (`pip install -e '.[gpu-aot]'`, a few GB: not in the locks), and says why it skips."""
import pytest

from partitioning import topology as topo
from workbench.programs import predict as wp
from workbench.results.store import Store

pytestmark = pytest.mark.skipif(
    not topo.gpu_compiler_available(),
    reason="JAX CUDA plugin not installed: `pip install -e '.[gpu-aot]'` (the plugin matching the pinned jaxlib; "
           "not in the locks, see docs/targets.md)")


def test_tiny_compiles_deviceless_for_an_h100_node(results_dir):
    r = wp.predict(wp.PredictSpec("tiny", "h100:8", "fsdp+tp", mesh="data=2,model=4", batch=16, gpu_compiler="xla-gpu"))
    assert r["compiler"] == "xla-gpu" and r["compiler_version"].startswith("jax-cuda1")
    assert r["compiled"] and r["fits"] and 0 < r["memory_per_device_bytes"] < r["hbm_bytes"]
    assert r["memory_breakdown"]["temp_bytes"] > 0  # XLA:GPU's own buffer assignment
    # XLA:GPU gives no cost_analysis for compile-only programs: flops come from the optimized HLO's kernels
    assert r["flops_per_device"] > 0 and any("summed from the optimized HLO" in n for n in r["notes"])
    assert r["unpriced_custom_calls"] == {} and r["flop_counts"]["compiler_per_device"] is None  # -1 is no count
    assert any(k.endswith("@model") for k in r["collectives"])  # tensor parallelism exchanges activations
    rec = Store().records("predict")[-1]
    assert rec["costs"]["platform"] in ("cuda", "gpu") and rec["costs"]["n_kernels"] > 0
    assert rec["costs"]["cost_analysis"]["flops"] == "unavailable" and rec["costs"]["unpriced_custom_calls"] == {}
    assert rec["provenance"].get("jax_cuda12_plugin") or rec["provenance"].get("jax_cuda13_plugin")
