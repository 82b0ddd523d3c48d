"""Self-attention implementations (config `attention`): jax.nn.dot_product_attention equals the model's own dot
attention (forward and gradient, causal, grouped-query) on the CPU; 'auto' picks cuDNN's fused attention for GPU
programs, whose compiled training step then holds one cuDNN kernel per layer pass and no S x S buffer."""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from models.config import resolve_attention
from models.presets import get_config
from models.transformer import Transformer
from partitioning import topology as topo
from workbench.errors import WorkbenchError
from workbench.testing import assert_close


@pytest.mark.parametrize("overrides", ["n_kv_heads=4", "n_kv_heads=2,pos=rope,norm=rmsnorm,mlp=swiglu,bias=false"])
def test_xla_attention_equals_dot_attention_forward_and_gradient(overrides):
    """The same parameters, the same tokens: the logits and every parameter's gradient agree in float32 whether
    attention is the model's einsums or jax.nn.dot_product_attention (the call the cuDNN path makes, with
    implementation='xla' on the CPU)."""
    base = get_config("tiny", overrides)
    tokens = jax.random.randint(jax.random.key(1), (2, base.seq_len), 0, base.vocab_size)

    def loss_and_grads(attention):
        model = Transformer(base.replace(attention=attention), "float32", nnx.Rngs(0))

        def loss(m):
            logits, _ = m(tokens)
            return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])

        return nnx.value_and_grad(loss)(model)

    (l_dot, g_dot), (l_xla, g_xla) = loss_and_grads("dot"), loss_and_grads("xla")
    assert_close(l_xla, l_dot, "float32")
    for a, b in zip(jax.tree.leaves(nnx.state(g_xla)), jax.tree.leaves(nnx.state(g_dot))):
        assert_close(a, b, "float32")


def test_auto_resolves_per_platform_and_precision():
    cfg = get_config("gpt2-small")
    assert resolve_attention(cfg, "gpu", jnp.bfloat16).attention == "cudnn"
    assert resolve_attention(cfg, "cuda", jnp.float16).attention == "cudnn"
    assert resolve_attention(cfg, "gpu", jnp.float32).attention == "dot"  # cuDNN's flash kernels take bf16/fp16
    assert resolve_attention(cfg, "cpu", jnp.bfloat16).attention == "dot"
    assert resolve_attention(cfg, "tpu", jnp.bfloat16).attention == "dot"
    assert resolve_attention(cfg.replace(attention="xla"), "gpu", jnp.bfloat16).attention == "xla"
    with pytest.raises(WorkbenchError, match="attention=cudnn needs a program for NVIDIA GPUs"):
        resolve_attention(cfg.replace(attention="cudnn"), "cpu", jnp.bfloat16)
    with pytest.raises(WorkbenchError, match="attention='flash' is not one of"):
        cfg.replace(attention="flash")


@pytest.mark.compile_heavy
@pytest.mark.skipif(not topo.gpu_compiler_available(), reason="needs the JAX CUDA plugin (requirements.lock)")
def test_a_gpu_training_step_runs_cudnn_attention_and_holds_no_score_matrix(results_dir):
    """Compiled by XLA:GPU for one H200 (deviceless): 'auto' is cuDNN's fused attention, forward and backward custom
    calls, priced (no unpriced call), the step's flops within 10 % of the model's; its temporaries are below the same
    step with the S x S scores written (attention=dot)."""
    from workbench.programs import predict as wp

    def run(attention):
        spec = wp.PredictSpec("tiny", "h200:1", "dp", mesh="data=1", batch=8, seq=64, policy="bf16", remat="none",
                              overrides=f"attention={attention},n_layers=2", gpu_compiler="xla-gpu")
        return wp.predict(spec, store=False)

    fused, dot = run("auto"), run("dot")
    r = fused.record
    assert r["attention"] == "cudnn" and dot.record["attention"] == "dot"
    assert r["compiler"] == "xla-gpu" and not r["unpriced_custom_calls"]
    fmha = [k for k in fused.cost.kernels if k.library.startswith("__cudnn$fmha")]
    assert len(fmha) == 2 * 2 and all(k.dot_flops > 0 for k in fmha)  # a forward and a backward call per layer
    assert not any(k.library.startswith("__cudnn$fmha") for k in dot.cost.kernels)
    assert abs(r["flops_per_device"] / r["model_flops_per_step"] - 1) < 0.10, r["flop_counts"]
    assert r["memory_breakdown"]["temp_bytes"] < dot.record["memory_breakdown"]["temp_bytes"]
