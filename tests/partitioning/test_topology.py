"""Target names parse and validate; libtpu gives compile-only TPU devices; a sharded program compiles for them."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from partitioning import topology as topo
from workbench.errors import WorkbenchError


@pytest.mark.parametrize("text,name,kind,n", [
    ("tpu-v5e:4x4", "tpu-v5e:4x4", "tpu", 16),
    ("v5e:2x2", "tpu-v5e:2x2", "tpu", 4),
    ("v5litepod:2x4", "tpu-v5e:2x4", "tpu", 8),
    ("TPU-V4:2x2x1", "tpu-v4:2x2x1", "tpu", 4),
    ("tpu-v5p:2x2x2", "tpu-v5p:2x2x2", "tpu", 8),
    ("v6e:16x16", "tpu-v6e:16x16", "tpu", 256),
    ("h100:8", "h100:8", "gpu", 8),
    ("h200:16", "h200:16", "gpu", 16),
    ("b200:4", "b200:4", "gpu", 4),
])
def test_parse_target(text, name, kind, n):
    t = topo.parse_target(text)
    assert (t.name, t.kind, t.n_chips) == (name, kind, n)
    assert topo.parse_target(t.name) == t  # canonical names round-trip


def test_gpu_nodes():
    t = topo.parse_target("h100:16")
    assert t.shape == (2, 8) and t.n_nodes == 2 and t.kind == "gpu"


@pytest.mark.parametrize("text,words", [
    ("tpu-v9:2x2", "unknown chip"),
    ("v5e:3x3", "does not come in a 3x3"),
    ("v5e:2x2x2", "2D tori"),
    ("v4:2x2", "3D tori"),
    ("v4:3x2x1", "1, 2, 4"),
    ("v5e", "needs a topology"),
    ("v5e-16", "gives a size but not a topology"),
    ("v5e:0x2", "zero dimension"),
    ("v5e:axb", "cannot read"),
    ("h100", "needs a GPU count"),
    ("h100:12", "multiple of 8"),
    ("", "empty --target"),
    ("v4:64x64x64", "largest v4 slice"),
])
def test_bad_targets_are_one_line_errors(text, words):
    with pytest.raises(WorkbenchError) as e:
        topo.parse_target(text)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_mesh_spec_and_factorizations():
    topo.check_mesh_size({"data": 4, "model": 4}, 16, "tpu-v5e:4x4")
    with pytest.raises(WorkbenchError, match="tpu-v5e:4x4 has 16 chips; make the axis sizes multiply to 16"):
        topo.check_mesh_size({"data": 4, "model": 2}, 16, "tpu-v5e:4x4")
    facts = topo.mesh_factorizations(16)
    assert all(math.prod(f.values()) == 16 for f in facts) and len(facts) == 5  # divisors of 16
    assert len({tuple(f.values()) for f in topo.mesh_factorizations(12, ("a", "b", "c"))}) == 18


def test_missing_libtpu_is_one_line(monkeypatch):
    monkeypatch.setattr(topo, "libtpu_available", lambda: False)
    with pytest.raises(WorkbenchError, match="libtpu is not installed"):
        topo.require_libtpu()


needs_libtpu = pytest.mark.skipif(not topo.libtpu_available(), reason="libtpu not installed (pip install -e .[tpu])")


@needs_libtpu
@pytest.mark.parametrize("target,kind", [("tpu-v5e:2x2", "TPU v5 lite"), ("tpu-v4:2x2x1", "TPU v4")])
def test_tpu_devices_compile_a_sharded_mlp(target, kind):
    """Compile-only devices from libtpu: a sharded MLP gradient compiles; costs and collectives are readable;
    JAX's default devices stay the simulated CPUs."""
    t = topo.parse_target(target)
    devs = topo.target_devices(t)
    assert len(devs) == t.n_chips and devs[0].platform == "tpu" and devs[0].device_kind == kind
    assert jax.devices()[0].platform == "cpu" and len(jax.devices()) == 8
    mesh = Mesh(topo.device_grid(devs, (2, 2)), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def loss(w1, w2, x):  # (B, D) @ (D, F) -> (B, F) @ (F, D)
        y = jax.nn.gelu(x @ w1) @ w2
        return jnp.sum(y.astype(jnp.float32) ** 2)

    b, d, f = 64, 256, 1024
    args = (jax.ShapeDtypeStruct((d, f), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "model"))),
            jax.ShapeDtypeStruct((f, d), jnp.bfloat16, sharding=NamedSharding(mesh, P("model", None))),
            jax.ShapeDtypeStruct((b, d), jnp.bfloat16, sharding=NamedSharding(mesh, P("data", None))))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    # per device: 2 forward matmuls + 3 backward (dW2, dH, dW1; no dX), each 2*(b/2)*d*(f/2) on its shard
    expect = 5 * 2 * (b // 2) * d * (f // 2)
    assert expect * 0.99 <= ca["flops"] <= expect * 1.5  # the rest: gelu and its derivative, elementwise
    mem = compiled.memory_analysis()
    assert mem.argument_size_in_bytes >= (2 * d * f // 2 + b * d // 2) * 2  # shards of the bf16 inputs
    text = compiled.as_text()
    assert "all-reduce" in text  # weight gradients summed over the data axis


@needs_libtpu
def test_device_grid_rejects_wrong_size():
    devs = topo.target_devices(topo.parse_target("tpu-v5e:2x2"))
    with pytest.raises(WorkbenchError, match="needs 8 devices"):
        topo.device_grid(devs, (2, 4))
    assert np.asarray(topo.device_grid(devs, (4, 1))).shape == (4, 1)


def test_gpu_target_devices_are_the_simulated_cpus():
    devs = topo.target_devices(topo.parse_target("h100:8"), gpu_compiler="cpu-sim")
    assert len(devs) == 8 and devs[0].platform == "cpu"
    with pytest.raises(WorkbenchError, match="needs 4 simulated CPU devices|too late"):
        topo.target_devices(topo.parse_target("h100:4"), gpu_compiler="cpu-sim")
    with pytest.raises(WorkbenchError, match="unknown --gpu-compiler"):
        topo.gpu_compiler_for(topo.parse_target("h100:8"), "nvcc")


def test_gpu_compiler_auto_is_xla_gpu_when_the_plugin_imports(monkeypatch):
    """XLA:GPU is the default for every GPU target whenever the JAX CUDA plugin is importable; the XLA:CPU stand-in
    only by name or without the plugin; TPU targets are libtpu's."""
    for name in ("h100:8", "h200:1", "b200:8"):
        t = topo.parse_target(name)
        monkeypatch.setattr(topo, "gpu_compiler_available", lambda: True)
        assert topo.gpu_compiler_for(t, "auto") == "xla-gpu" and topo.gpu_compiler_for(t, "cpu-sim") == "cpu-sim"
        monkeypatch.setattr(topo, "gpu_compiler_available", lambda: False)
        assert topo.gpu_compiler_for(t, "auto") == "cpu-sim"
        with pytest.raises(WorkbenchError, match="needs the JAX CUDA plugin"):
            topo.gpu_compiler_for(t, "xla-gpu")
    assert topo.gpu_compiler_for(topo.parse_target("tpu-v5e:2x2"), "auto") == "libtpu"


def test_gpu_target_config_is_a_text_proto():
    cfg = topo.gpu_target_config("h100")
    assert "core_count: 132" in cfg and "major: 9" in cfg and 'platform_name: "CUDA"' in cfg


@pytest.mark.skipif(not topo.gpu_compiler_available(),
                    reason="JAX CUDA plugin not installed (optional, docs/targets.md)")
def test_xla_gpu_deviceless_devices():
    devs = topo.target_devices(topo.parse_target("h100:8"), gpu_compiler="xla-gpu")
    assert len(devs) == 8 and "H100" in devs[0].device_kind
