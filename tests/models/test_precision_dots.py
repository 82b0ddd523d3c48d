"""bf16 dots on XLA:CPU's fast form: float32 accumulation and result, forward and backward (models/precision.py)."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.precision import (
    Einsum,
    _f32_on_narrow,
    einsum_f32,
    elementwise_f32,
    finish_dot,
    get_policy,
    ragged_dot_f32,
    transposed_equations,
)
from models.presets import get_config
from partitioning.mesh import make_mesh
from workbench.compat import shard_map
from workbench.cost.hlo import parse_dots
from workbench.programs.data import Batches, shard_batch
from workbench.programs.step import build_train_step
from workbench.testing import assert_close


def _round(a, dtype):
    """a rounded to `dtype` and back to float64: the operand values a `dtype` dot actually multiplies."""
    return np.asarray(jnp.asarray(a).astype(dtype).astype(jnp.float32), np.float64)


def test_transposed_equations_and_bad_equations():
    assert transposed_equations("btd,df->btf") == ("btf,df->btd", "btd,btf->df")
    assert transposed_equations("bkgth,bksh->bkgts") == ("bkgts,bksh->bkgth", "bkgth,bkgts->bksh")
    for bad in ("btd,df", "...d,df->...f", "btt,tf->bf", "btd,df->bf", "btd,df->btfz", "a,b,c->abc"):
        with pytest.raises(ValueError):
            transposed_equations(bad)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_backward_products_accumulate_in_float32(dtype):
    """Both backward products take compute-dtype operands and return their float32 accumulation: against float64
    products of the same rounded operands they are exact to float32 rounding, where the form JAX derives (a narrow
    result, or float32 operands promoted from the cotangent) is not. Gradients come back in the primals' dtypes."""
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (4, 32, 64), jnp.float32)
    w = jax.random.normal(k[1], (64, 48), jnp.float32)
    ct = jax.random.normal(k[2], (4, 32, 48), jnp.float32)

    def loss(x, w):
        y = einsum_f32("btd,df->btf", x, w, dtype).astype(dtype)  # what the policy's Einsum module returns
        return jnp.sum(y.astype(jnp.float32) * ct)

    dx, dw = jax.grad(loss, (0, 1))(x, w)
    assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32
    xr, wr, cr = _round(x, dtype), _round(w, dtype), _round(ct, dtype)
    assert_close(dx, np.einsum("btf,df->btd", cr, wr), "float32", scale=10)
    assert_close(dw, np.einsum("btd,btf->df", xr, cr), "float32", scale=10)
    # the forward result is the float32 accumulation too
    y = einsum_f32("btd,df->btf", x, w, dtype)
    assert y.dtype == jnp.float32
    assert_close(y, np.einsum("btd,df->btf", xr, wr), "float32", scale=10)
    # a narrow-result weight gradient (the dot JAX would derive with bf16 output) misses by the format's rounding
    narrow = np.asarray(jnp.einsum("btd,btf->df", x.astype(dtype), ct.astype(dtype)).astype(jnp.float32), np.float64)
    ref = np.einsum("btd,btf->df", xr, cr)
    assert np.abs(narrow - ref).max() > 10 * np.abs(np.asarray(dw, np.float64) - ref).max()


@pytest.mark.parametrize("eq,xs,ws", [("btd,df->btf", (2, 16, 8), (8, 64)),   # d/dw: the cotangent is larger
                                       ("btd,df->btf", (2, 16, 64), (64, 8)),  # d/dw: the input is larger
                                       ("btd,dnh->btnh", (2, 16, 32), (32, 4, 8))])
def test_weight_gradient_either_operand_order(eq, xs, ws):
    """d/dw puts the larger operand second (a dot kernel then transposes only the smaller one and the weight-sized
    result): either order gives the float64 product of the rounded operands, in the weight's own label order."""
    k = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(k[0], xs, jnp.float32)
    w = jax.random.normal(k[1], ws, jnp.float32)
    y_shape = jax.eval_shape(lambda: jnp.einsum(eq, x, w)).shape
    ct = jax.random.normal(k[2], y_shape, jnp.float32)
    eq_dx, eq_dw = transposed_equations(eq)
    for dtype in (jnp.bfloat16, jnp.float32):
        dw = jax.grad(lambda w: jnp.sum(einsum_f32(eq, x, w, dtype) * ct))(w)
        assert dw.shape == w.shape and dw.dtype == jnp.float32
        assert_close(dw, np.einsum(eq_dw, _round(x, dtype), _round(ct, dtype)), "float32", scale=10)


def test_epilogue_rounds_once():
    """bias + GELU on the float32 accumulator, one rounding to bf16 (finish_dot): exactly round(gelu(acc + b)) of
    the float32 computation, and closer to the float64 result than the op-by-op bf16 chain it replaced."""
    k = jax.random.split(jax.random.key(4), 3)
    x = jax.random.normal(k[0], (4, 32, 64), jnp.float32)
    w = jax.random.normal(k[1], (64, 128), jnp.float32) / 8
    b = jax.random.normal(k[2], (128,), jnp.float32)
    gelu = lambda u: jax.nn.gelu(u, approximate=True)  # noqa: E731
    y = Einsum(jnp.bfloat16)("btd,df->btf", x, w, bias=b, epilogue=gelu)
    assert y.dtype == jnp.bfloat16
    acc = einsum_f32("btd,df->btf", x, w, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(gelu(acc + b).astype(jnp.bfloat16), np.float32))
    u64 = np.einsum("btd,df->btf", _round(x, jnp.bfloat16), _round(w, jnp.bfloat16)) + np.asarray(b, np.float64)
    ref = 0.5 * u64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (u64 + 0.044715 * u64 ** 3)))
    chain = gelu(acc.astype(jnp.bfloat16) + b.astype(jnp.bfloat16))  # the bf16 chain: a rounding after every op
    err_once = np.abs(np.asarray(y, np.float64) - ref).mean()
    err_chain = np.abs(np.asarray(chain.astype(jnp.float32), np.float64) - ref).mean()
    assert err_once < err_chain
    # no bias, no epilogue: a plain cast; a float32 out_dtype keeps the accumulator
    np.testing.assert_array_equal(finish_dot(acc, jnp.float32), acc)


def test_accelerators_round_the_dot_before_its_epilogue():
    """On a CPU the epilogue runs on the float32 accumulator (one rounding); lowered for an accelerator the dot's
    output is rounded to the compute dtype first, so a remat policy that saves dot outputs saves them in the compute
    dtype (MaxText's 32B recipe on v5p-128 needed 137 GB of temporaries with float32 dot outputs, and fits with
    bf16 ones). The choice is made at lowering (jax.lax.platform_dependent): an ahead-of-time TPU compile from a CPU
    host takes the accelerator form."""
    e = Einsum(jnp.bfloat16)
    x, w, b = jnp.ones((4, 8, 16)), jnp.ones((16, 32)), jnp.ones((32,))

    def between_dot_and_tanh(platform):
        text = jax.jit(lambda x, w, b: e("btd,df->btf", x, w, bias=b, epilogue=jnp.tanh)).trace(x, w, b).lower(
            lowering_platforms=(platform,)).as_text()
        lines = text.splitlines()
        i = next(n for n, ln in enumerate(lines) if "stablehlo.dot_general" in ln)
        j = next(n for n, ln in enumerate(lines) if "stablehlo.tanh" in ln)
        return [ln for ln in lines[i:j] if "stablehlo.convert" in ln and "bf16>" in ln.split("->")[-1]]

    assert between_dot_and_tanh("cpu") == []
    assert len(between_dot_and_tanh("tpu")) == 1
    # float32 compute: nothing to round
    f = Einsum(jnp.float32)
    text = jax.jit(lambda x, w: f("btd,df->btf", x, w, epilogue=jnp.tanh)).trace(x, w).lower(
        lowering_platforms=("tpu",)).as_text()
    assert "bf16" not in text


def _silu_gate(g, u):
    return jax.nn.silu(g) * u


def test_an_activation_between_dots_keeps_its_narrow_inputs_for_the_backward_pass():
    """The accelerator form of elementwise_f32 (SwiGLU's silu(gate) * up): float32 arithmetic on the compute-dtype
    inputs, and the backward pass keeps those bf16 inputs, not the float32 copies plain autodiff keeps (three
    float32 tensors of tokens × d_ff per layer without remat: NeMo's Llama 3 8B did not fit an H100). Values and
    gradients against float64 on the same bf16 inputs; on a CPU the plain form."""
    rng = np.random.default_rng(0)
    g64, u64, dy64 = (rng.standard_normal((64, 96)) for _ in range(3))
    g, u, dy = (jnp.asarray(a, jnp.bfloat16) for a in (g64, u64, dy64))
    y, vjp = jax.vjp(lambda g, u: _f32_on_narrow(_silu_gate, jnp.bfloat16, (g, u)), g, u)
    assert {leaf.dtype for leaf in jax.tree.leaves(vjp) if leaf.size} == {jnp.dtype(jnp.bfloat16)}
    _, vjp_plain = jax.vjp(lambda g, u: _silu_gate(g.astype(jnp.float32), u.astype(jnp.float32)).astype(jnp.bfloat16),
                           g, u)
    assert any(leaf.dtype == jnp.float32 and leaf.size == g.size for leaf in jax.tree.leaves(vjp_plain))
    # float64 reference on the values the bf16 inputs hold
    gr, ur, dyr = (_round(a, jnp.bfloat16) for a in (g64, u64, dy64))
    s = 1 / (1 + np.exp(-gr))
    assert_close(y, gr * s * ur, "bfloat16")
    dg, du = vjp(dy)
    assert dg.dtype == du.dtype == jnp.bfloat16
    assert_close(du, dyr * gr * s, "bfloat16")
    assert_close(dg, dyr * ur * s * (1 + gr * (1 - s)), "bfloat16")
    # on a CPU: the plain float32 form, one rounding
    out = elementwise_f32(_silu_gate, jnp.bfloat16, jnp.bfloat16, g64.astype(np.float32), u64.astype(np.float32))
    assert_close(out, g64 / (1 + np.exp(-g64)) * u64, "bfloat16")


def test_custom_vjp_gradients_inside_shard_map():
    """Inside shard_map the weight is the same on every shard of the batch axis, its per-shard gradients differ: the
    custom VJP sums them over that axis (what JAX's own transpose of the implicit pvary does), so the gradient
    equals the unsharded one."""
    mesh = make_mesh("data=8")
    P = jax.sharding.PartitionSpec
    k = jax.random.split(jax.random.key(5), 2)
    x = jax.random.normal(k[0], (16, 8, 16), jnp.float32)
    w = jax.random.normal(k[1], (16, 8), jnp.float32)
    for dtype in (jnp.bfloat16, jnp.float32):
        def loss(x, w, dtype=dtype):
            y = shard_map(lambda xs, ws: einsum_f32("btd,df->btf", xs, ws, dtype), mesh=mesh,
                          in_specs=(P("data"), P()), out_specs=P("data"))(x, w)
            return jnp.sum(y ** 2)

        def ref(x, w, dtype=dtype):
            return jnp.sum(einsum_f32("btd,df->btf", x, w, dtype) ** 2)

        for a, r in zip(jax.jit(jax.grad(loss, (0, 1)))(x, w), jax.grad(ref, (0, 1))(x, w)):
            assert_close(a, r, "float32", scale=10)


def test_einsum_f32_float32_gradients_equal_plain_einsum():
    x = jax.random.normal(jax.random.key(1), (8, 16))
    w = jax.random.normal(jax.random.key(2), (16, 4))
    g = jax.grad(lambda x, w: jnp.sum(einsum_f32("md,dn->mn", x, w) ** 2), (0, 1))(x, w)
    g_ref = jax.grad(lambda x, w: jnp.sum(jnp.einsum("md,dn->mn", x, w) ** 2), (0, 1))(x, w)
    for a, b in zip(g, g_ref):
        assert_close(a, b, "float32")


def test_ragged_dot_f32_gradients_against_float64():
    """Grouped matmul (rows sorted by group, an empty group included): forward and both gradients against float64
    ragged products of the same rounded operands."""
    k = jax.random.split(jax.random.key(3), 3)
    E, R, D, F = 3, 40, 16, 24
    x = jax.random.normal(k[0], (R, D), jnp.float32)
    w = jax.random.normal(k[1], (E, D, F), jnp.float32)
    ct = jax.random.normal(k[2], (R, F), jnp.float32)
    gs = jnp.array([10, 0, 30], jnp.int32)
    dx, dw = jax.grad(lambda a, b: jnp.sum(ragged_dot_f32(a, b, gs, jnp.bfloat16) * ct), (0, 1))(x, w)
    assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32
    xr, wr, cr = _round(x, jnp.bfloat16), _round(w, jnp.bfloat16), _round(ct, jnp.bfloat16)
    group = np.repeat(np.arange(E), np.asarray(gs))  # the group of each row
    assert_close(dx, np.einsum("rf,rdf->rd", cr, wr[group]), "float32", scale=10)
    dw_ref = np.stack([xr[group == e].T @ cr[group == e] for e in range(E)])
    assert_close(dw, dw_ref, "float32", scale=10)
    assert np.all(np.asarray(dw[1]) == 0)  # the empty group's weight gets no gradient


def _train_step_dots(preset, overrides=None, policy="bf16"):
    cfg = get_config(preset, overrides)
    prog = build_train_step(cfg, policy=policy, mesh=make_mesh("data=1", jax.devices()[:1]), strategy="dp",
                            batch_size=4, abstract=True)
    text = prog.step.lower(prog.state, prog.batch).compile().as_text()
    return parse_dots(text)


def test_accelerators_take_the_dot_in_the_compute_dtype():
    """Lowered for a TPU or GPU the Einsum's dot returns the compute dtype (the matrix unit's rounding, the same bits
    finish_dot would round to), and so does d/dx (as JAX's derivative of the cast to bf16 would): what a split
    contraction reduces across devices is then bf16 partial sums, as in MaxText's programs. d/dw stays float32 (the
    float32 master weight's gradient). On a CPU every product returns float32."""
    e = Einsum(jnp.bfloat16)
    x, w = jnp.ones((4, 8, 16), jnp.bfloat16), jnp.ones((16, 32), jnp.float32)
    # the loss's value too: a gradient alone needs no forward product (it would be dropped)
    grad = jax.value_and_grad(lambda x, w: e("btd,df->btf", x, w).astype(jnp.float32).sum(), (0, 1))

    def dot_results(platform):
        text = jax.jit(grad).trace(x, w).lower(lowering_platforms=(platform,)).as_text()
        return sorted(ln.rsplit("x", 1)[-1].rstrip(">") for ln in text.splitlines() if "stablehlo.dot_general" in ln)

    assert dot_results("cpu") == ["f32", "f32", "f32"]
    assert dot_results("tpu") == ["bf16", "bf16", "f32"]
    assert dot_results("cuda") == ["bf16", "bf16", "f32"]
    # x in float32 (a norm's float32 output): rounded the same, returned to x in float32
    x32 = x.astype(jnp.float32)
    text = jax.jit(grad).trace(x32, w).lower(lowering_platforms=("tpu",)).as_text()
    assert sorted(ln.rsplit("x", 1)[-1].rstrip(">") for ln in text.splitlines()
                  if "stablehlo.dot_general" in ln) == ["bf16", "bf16", "f32"]
    assert jax.jit(grad)(x32, w)[1][0].dtype == jnp.float32


@pytest.mark.compile_heavy
@pytest.mark.parametrize("policy", ["bf16", "bf16-f32act"])
def test_bf16_training_step_has_no_bf16_result_dot(policy):
    """The compiled bf16 training step of a `small`-shaped model (scanned layers, remat=dots, tied head): every dot,
    forward and backward (attention products, head, weight gradients), multiplies bf16 operands into a float32
    result. Before the custom VJP the 2/3 of dots JAX derives for the backward were float32 x float32 (jax 0.10:
    the bf16 operand promoted to the float32 cotangent) or bf16-result dots (later versions)."""
    dots = _train_step_dots("tiny", "scan_layers=true,remat=dots", policy)
    forms = collections.Counter((d.lhs.dtype, d.rhs.dtype, d.out.dtype) for d in dots)
    assert not [d for d in dots if d.out.dtype == "bf16"], forms
    assert set(forms) == {("bf16", "bf16", "f32")}, forms
    # forward and backward: three products per forward dot (attention 6 + MLP 2 per layer, the head)
    assert sum(d.count for d in dots) == 3 * (2 * 8 + 1), forms


@pytest.mark.compile_heavy
@pytest.mark.parametrize("overrides", [None, "capacity_factor=none"])
def test_bf16_moe_training_step_has_no_bf16_result_dot(overrides):
    """MoE (capacity buffers, and dropless ragged_dot): no dot of the bf16 step returns bf16. The router and the
    top-k combine are float32 by design (models/moe.py); XLA:CPU widens some batched expert weight-gradient dots to
    float32 operands, which keeps their float32 result."""
    dots = _train_step_dots("tiny-moe", overrides)
    forms = collections.Counter((d.lhs.dtype, d.rhs.dtype, d.out.dtype) for d in dots)
    assert not [d for d in dots if d.out.dtype == "bf16"], forms
    assert forms[("bf16", "bf16", "f32")] > forms[("f32", "f32", "f32")], forms


def test_f32act_policy_returns_float32_between_dots():
    """bf16-f32act: bf16 dot operands, float32 results; bf16: the compute dtype back."""
    x, w = jnp.ones((4, 8)), jnp.ones((8, 2))
    assert get_policy("bf16-f32act").einsum_module()("md,dn->mn", x, w).dtype == jnp.float32
    assert get_policy("bf16").einsum_module()("md,dn->mn", x, w).dtype == jnp.bfloat16


@pytest.mark.compile_heavy
def test_bf16_policies_train_like_float32():
    """60 steps of `tiny` on the same batches: bf16 and bf16-f32act end within the precision study's 2 % of float32's
    loss (benchmarks.precision_training's target), having learnt (the loss fell by > 0.5 nats)."""
    cfg = get_config("tiny")
    mesh = make_mesh("data=1", jax.devices()[:1])
    final = {}
    for policy in ("float32", "bf16", "bf16-f32act"):
        prog = build_train_step(cfg, policy=policy, mesh=mesh, strategy="dp", batch_size=4, total_steps=60)
        batches, state, losses = Batches(4, cfg.seq_len, 0), prog.state, []
        for i in range(60):
            state, m = prog.step(state, shard_batch(batches.train(i), prog.batch_sharding))
            losses.append(float(m["loss"]))
        assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, (policy, losses)
        final[policy] = np.mean(losses[-5:])
    for policy in ("bf16", "bf16-f32act"):
        assert abs(final[policy] / final["float32"] - 1) <= 0.02, final

