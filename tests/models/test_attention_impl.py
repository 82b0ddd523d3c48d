"""Self-attention implementations (config `attention`, models/fused_attention.py): each equals the model's own dot
attention in float32 (forward and gradient, causal, grouped-query) on the CPU, the Pallas kernels in interpret mode;
'auto' picks one per platform and sequence length; compiled for a TPU, splash attention is one kernel per layer pass,
priced by the HLO reader, and holds no S x S buffer; compiled by XLA:GPU, cuDNN's fused attention likewise."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import fused_attention as fa
from models.config import BLOCKED_MIN_SEQ, resolve_attention
from models.presets import get_config
from models.transformer import Transformer
from partitioning import topology as topo
from workbench.cost import hlo
from workbench.errors import WorkbenchError
from workbench.testing import assert_close

needs_libtpu = pytest.mark.skipif(not topo.libtpu_available(), reason="libtpu not installed (pip install -e .[tpu])")


def _loss_and_grads(cfg, tokens):
    model = Transformer(cfg, "float32", nnx.Rngs(0))

    def loss(m):
        logits, _ = m(tokens)
        return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])

    return nnx.value_and_grad(loss)(model)


@pytest.mark.parametrize("impl", ["blocked", "splash", "flash", "xla"])
@pytest.mark.parametrize("overrides", ["n_kv_heads=4", "n_kv_heads=2,pos=rope,norm=rmsnorm,mlp=swiglu,bias=false"])
def test_every_implementation_equals_dot_forward_and_gradient(impl, overrides):
    """The same parameters, the same tokens: the loss and every parameter's gradient agree in float32 whether
    attention is the model's einsums or `impl` (256 positions: two blocks of blocked attention, a multiple of the
    splash kernel's 128 lanes; the Pallas kernels interpreted on the CPU)."""
    base = get_config("tiny", overrides + ",seq_len=256")
    tokens = jax.random.randint(jax.random.key(1), (2, base.seq_len), 0, base.vocab_size)
    l_dot, g_dot = _loss_and_grads(base.replace(attention="dot"), tokens)
    with fa.interpret_kernels():
        l_impl, g_impl = _loss_and_grads(base.replace(attention=impl), tokens)
    assert_close(l_impl, l_dot, "float32")
    for a, b in zip(jax.tree.leaves(nnx.state(g_impl)), jax.tree.leaves(nnx.state(g_dot))):
        assert_close(a, b, "float32")


def _reference(q, k, v):
    """Causal softmax attention with the S x S scores written (grouped-query heads repeated)."""
    b, t, n, h = q.shape
    k, v = (jnp.repeat(x, n // x.shape[2], axis=2) for x in (k, v))
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


def _qkv(t=128, n=4, kv=2, h=16, b=2):
    kq, kk, kv_ = jax.random.split(jax.random.key(3), 3)
    return (jax.random.normal(kq, (b, t, n, h)), jax.random.normal(kk, (b, t, kv, h)),
            jax.random.normal(kv_, (b, t, kv, h)))


def _grads(f, q, k, v):
    return jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2))(q, k, v)


def test_blocked_attention_over_many_blocks():
    """Four blocks of 32 (ten causal block pairs, six off the diagonal): forward and the gradients of q, k, v."""
    q, k, v = _qkv()
    f = lambda q, k, v: fa.blocked_attention(q, k, v, block=32)
    assert_close(f(q, k, v), _reference(q, k, v), "float32")
    for a, b in zip(_grads(f, q, k, v), _grads(_reference, q, k, v)):
        assert_close(a, b, "float32")
    assert fa.blocked_block(4096) == 512 and fa.blocked_block(384) == 128 and fa.blocked_block(100) == 100


@pytest.mark.parametrize("impl", ["splash", "xla"])
@pytest.mark.parametrize("kv", [2, 1])
def test_fused_attention_in_shard_map_over_batch_and_heads(kv, impl):
    """Under tp's activation rules on a data=2 x model=2 CPU mesh, splash attention and jax.nn.dot_product_attention
    (the cuDNN kernel's entry: run per device, its own partitioning rule never meets a pipeline stage's shardings,
    which it cannot read) run per device in shard_map (batch over data, heads over model; one key/value head cannot
    split over two devices and is repeated) and equal the reference, forward and gradient."""
    from partitioning.mesh import make_mesh
    from partitioning.shard import activation_sharding

    mesh = make_mesh("data=2,model=2", devices=jax.devices()[:4])
    q, k, v = _qkv(kv=kv)
    f = lambda q, k, v: fa.fused_attention(impl, q, k, v, interpret=True)

    def sharded(g):
        def run(q, k, v):
            with activation_sharding(mesh, "tp"):
                return g(q, k, v)
        return jax.jit(run)

    with activation_sharding(mesh, "tp"):
        text = jax.jit(f).lower(q, k, v).as_text()
    assert "shard_map" in text or "sdy.manual_computation" in text
    assert_close(sharded(f)(q, k, v), _reference(q, k, v), "float32")
    for a, b in zip(jax.jit(lambda *x: _grads(sharded(f), *x))(q, k, v), _grads(_reference, q, k, v)):
        assert_close(a, b, "float32")


@pytest.mark.parametrize("impl", ["splash", "xla"])
def test_fused_attention_under_context_parallelism(impl):
    """fsdp+cp on a data=2 x context=2 CPU mesh: the sequence is split over `context` outside attention; the kernel
    runs per device with every mesh axis manual (no automatic axis left for a kernel's own partitioning rule, which
    cuDNN's cannot apply to such shardings) and equals the reference, forward and gradient."""
    from partitioning.mesh import make_mesh
    from partitioning.shard import activation_sharding

    mesh = make_mesh("data=2,context=2", devices=jax.devices()[:4])
    q, k, v = _qkv(kv=2)

    def run(q, k, v):
        with activation_sharding(mesh, "fsdp+cp"):
            return fa.fused_attention(impl, q, k, v, interpret=True)

    f = jax.jit(run)
    assert_close(f(q, k, v), _reference(q, k, v), "float32")
    for a, b in zip(jax.jit(lambda *x: _grads(f, *x))(q, k, v), _grads(_reference, q, k, v)):
        assert_close(a, b, "float32")


def test_auto_resolves_per_platform_precision_and_length():
    cfg = get_config("gpt2-small")  # 1024 positions, head size 64
    assert resolve_attention(cfg, "tpu", jnp.bfloat16).attention == "splash"
    assert resolve_attention(cfg, "tpu", jnp.float32).attention == "splash"
    assert resolve_attention(cfg, "tpu", jnp.bfloat16, seq=1000).attention == "dot"  # not a multiple of 128 lanes
    assert resolve_attention(cfg, "gpu", jnp.bfloat16).attention == "cudnn"
    assert resolve_attention(cfg, "cuda", jnp.float16).attention == "cudnn"
    assert resolve_attention(cfg, "gpu", jnp.float32).attention == "dot"  # cuDNN's flash kernels take bf16/fp16
    assert resolve_attention(cfg, "gpu", jnp.float32, seq=8192).attention == "blocked"
    assert resolve_attention(cfg, "cpu", jnp.bfloat16).attention == "dot"
    assert resolve_attention(cfg, "cpu", jnp.bfloat16, seq=BLOCKED_MIN_SEQ).attention == "blocked"
    assert resolve_attention(cfg, "cpu", jnp.bfloat16, seq=BLOCKED_MIN_SEQ - 128).attention == "dot"
    assert resolve_attention(cfg.replace(attention="xla"), "gpu", jnp.bfloat16).attention == "xla"
    assert resolve_attention(cfg.replace(attention="blocked"), "tpu", jnp.bfloat16).attention == "blocked"
    with pytest.raises(WorkbenchError, match="attention=cudnn needs a program for NVIDIA GPUs"):
        resolve_attention(cfg.replace(attention="cudnn"), "cpu", jnp.bfloat16)
    with pytest.raises(WorkbenchError, match="attention=splash .* needs a program for TPUs"):
        resolve_attention(cfg.replace(attention="splash"), "gpu", jnp.bfloat16)
    with pytest.raises(WorkbenchError, match="attention=flash .* needs a program for NVIDIA GPUs"):
        resolve_attention(cfg.replace(attention="flash"), "tpu", jnp.bfloat16)
    with pytest.raises(WorkbenchError, match="attention='ring' is not one of"):
        cfg.replace(attention="ring")


def test_causal_block_fraction_and_multi_line_instructions():
    """The share of blocks a causal mask visits, and a Pallas kernel call whose attributes run over several lines
    (as libtpu prints a splash kernel's frontend attributes) read as one instruction with its op_name."""
    assert hlo.causal_block_fraction(4096, 4096, 512, 512) == 36 / 64
    assert hlo.causal_block_fraction(256, 256, 256, 256) == 1.0
    assert hlo.causal_block_fraction(1024, 1024, 512, 256) == (2 + 4) / 8
    text = """HloModule m
ENTRY %main (q: bf16[2,4,1024,128], k: bf16[2,2,1024,128], v: bf16[2,2,1024,128], m: s8[1,2,2]) -> bf16[2,4,1024,128] {
  %q = bf16[2,4,1024,128]{3,2,1,0} parameter(0)
  %k = bf16[2,2,1024,128]{3,2,1,0} parameter(1)
  %v = bf16[2,2,1024,128]{3,2,1,0} parameter(2)
  %m = s8[1,2,2]{2,1,0} parameter(3)
  %splash_mha_fwd.1 = bf16[2,4,1024,128]{3,2,1,0} custom-call(%m, %m, %q, %k, %v), custom_call_target=\
"tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 512, \\"block_kv\\": 512, \\"q_layout\\": 1, \\"k_layout\\": 1, \\"v_layout\\": 1}"
}}, metadata={op_name="jit(f)/shard_map/splash_causal/vmap(static_sparsity_splash)/splash_mha_fwd/pallas_call"}
  ROOT %copy = bf16[2,4,1024,128]{3,2,1,0} copy(%splash_mha_fwd.1)
}
"""
    mod = hlo.parse_module(text)
    [call] = [i for i in mod.computations["main"] if i.opcode == "custom-call"]
    c = hlo.price_custom_call(call, hlo.array_shapes(mod))
    scores = 2 * 4 * 1024 * 1024
    assert c.dot_flops == pytest.approx(2 * 2 * scores * 128 * 3 / 4)  # Q·Kᵀ and P·V over 3 of 4 blocks
    assert c.transcendentals == pytest.approx(scores * 3 / 4)
    assert "analytic" in c.note and "causal" in c.note
    assert [i.opcode for i in mod.computations["main"]][-1] == "copy"


def _widest_score_rows(text: str, seq: int) -> int:
    """The most rows of any array whose last dimension is all `seq` keys: a block of scores (dot attention's row
    blocks hold 128 queries × every key; splash keeps its scores on chip, only per-row statistics reach HBM)."""
    return max((int(r) for r in re.findall(rf"\[(?:\d+,)*(\d+),{seq}\]", text)), default=0)


@needs_libtpu
@pytest.mark.compile_heavy
def test_a_tpu_training_step_runs_splash_and_holds_no_score_matrix(results_dir):
    """Compiled by libtpu for tpu-v5e:2x2 (deviceless), 1024 positions: 'auto' is splash, three kernels per layer
    (forward, dq, dkv), each priced (the analytic count, marked), no block of score rows against all 1024 keys in
    the program, the temporaries below the dot program's, the kernels' flops in the count the prediction uses."""
    from workbench.programs import predict as wp

    def run(attention):
        spec = wp.PredictSpec("tiny", "tpu-v5e:2x2", "fsdp", batch=8, seq=1024, policy="bf16", remat="none",
                              overrides=f"attention={attention},seq_len=1024,n_kv_heads=2,pos=rope")
        lw = wp.lower(spec)
        compiled, secs, err = wp.compile_lowered(lw)
        assert err is None, err
        return wp.predict_lowered(lw, compiled, secs), compiled.as_text()

    (fused, text), (dot, dot_text) = run("auto"), run("dot")
    r, d = fused.record, dot.record
    assert r["attention"] == "splash" and d["attention"] == "dot" and r["compiler"] == "libtpu"
    calls = [u for u in hlo.custom_calls(text) if u.target == "tpu_custom_call"]
    assert sorted(re.search(r"splash_mha_(\w+?):", u.note).group(1) for u in calls) == ["dkv", "dq", "fwd"]
    assert all(u.priced and u.count == 2 and "analytic" in u.note and "causal" in u.note for u in calls)
    assert "tpu_custom_call" not in r["unpriced_custom_calls"]
    assert _widest_score_rows(text, 1024) < 128 <= _widest_score_rows(dot_text, 1024)
    assert r["memory_breakdown"]["temp_bytes"] < d["memory_breakdown"]["temp_bytes"]
    # the kernels' analytic count: 2 layers × (2 + 3 + 4) products of 2·b·n·t·s·h over 3 of the 4 (512 × 512) blocks
    splash = sum(k.flops * k.count for k in fused.cost.kernels if "splash" in k.name)
    b, n, t, h = 8 // 4, 4, 1024, 16
    assert splash == pytest.approx(2 * 9 * 2 * b * n * t * t * h * 3 / 4 + 2 * 3 * b * n * t * t * 3 / 4)
    assert r["flop_counts"]["used_source"] == "hlo" and dict(fused.cost.analytic_custom_calls)["tpu_custom_call"] == 6
    # splash runs at least the dot form's work (it recomputes Q·Kᵀ and dO·Vᵀ, and its 512-blocks skip less of the
    # mask than the dot form's 128-row blocks): at 1024 positions of a d_model-64 model attention is most of the step
    assert d["flops_per_device"] < r["flops_per_device"] < 1.6 * d["flops_per_device"]
    assert r["predicted_step_s"] > 0


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


@pytest.mark.compile_heavy
@pytest.mark.skipif(not topo.gpu_compiler_available(), reason="needs the JAX CUDA plugin (requirements.lock)")
def test_flash_compiles_for_xla_gpu_and_is_priced(results_dir):
    """attention=flash (Pallas GPU, Triton) compiles deviceless for an H200: per layer a forward, a preprocessing and
    a backward kernel, each priced by the reader's analytic count over the causal mask's blocks."""
    from workbench.programs import predict as wp

    spec = wp.PredictSpec("tiny", "h200:1", "dp", mesh="data=1", batch=8, seq=256, policy="bf16", remat="none",
                          overrides="attention=flash,seq_len=256", gpu_compiler="xla-gpu")
    p = wp.predict(spec, store=False)
    assert p.record["attention"] == "flash" and not p.record["unpriced_custom_calls"]
    assert dict(p.cost.analytic_custom_calls) == {"__gpu$xla.gpu.triton": 6}
    fwd = [k for k in p.cost.kernels if k.dot_flops and "pallas" in k.name]
    assert len(fwd) == 4 and p.record["flop_counts"]["used_source"] == "hlo"
