"""Quantizers, scaling recipes and the quantized einsums of models/quant.py, against NumPy/ml_dtypes references."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from models import quant as q
from models.precision import get_policy
from workbench.errors import WorkbenchError
from workbench.testing import assert_close, tol

# ---------------------------------------------------------------- the cast table


@pytest.mark.parametrize("fmt,fmax,ml", [(q.E4M3, 448.0, ml_dtypes.float8_e4m3fn), (q.E5M2, 57344.0, ml_dtypes.float8_e5m2),
                                         (q.E2M1, 6.0, ml_dtypes.float4_e2m1fn)])
def test_cast_table_and_saturation(fmt, fmax, ml):
    assert fmt.max == fmax == float(ml_dtypes.finfo(ml).max)
    x = jnp.array([1e30, -1e30, fmax * 1.01, -fmax * 3, 0.0, 1.0, np.nan], jnp.float32)
    y = np.asarray(q.saturating_cast(x, fmt).astype(jnp.float32))
    np.testing.assert_array_equal(y[:6], [fmax, -fmax, fmax, -fmax, 0.0, 1.0])
    if fmt is not q.E2M1:  # E2M1 has no NaN encoding (OCP MX: NaN lives in the block scale)
        assert np.isnan(y[6])  # NaN in, NaN out; finite in, finite out
    # values inside the range round exactly as ml_dtypes does (round to nearest even)
    v = np.linspace(-fmax, fmax, 1001).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(q.saturating_cast(v, fmt).astype(jnp.float32)),
                                  v.astype(ml).astype(np.float32))
    # through the scaled quantizer too: 1e30 stays finite, at the max times the scale
    scale = jnp.float32(0.25)
    assert float(q.dequantize(q.quantize(jnp.float32(1e30), fmt, scale), scale)) == fmax * 0.25


def test_plain_casts_do_overflow():
    """Why saturation is needed: the plain casts turn overflow into NaN (E4M3) and inf (E5M2)."""
    assert np.isnan(float(jnp.float32(1e30).astype(jnp.float8_e4m3fn).astype(jnp.float32)))
    assert np.isinf(float(jnp.float32(1e30).astype(jnp.float8_e5m2).astype(jnp.float32)))


def test_compute_scale_keeps_previous_on_zero_or_nonfinite_amax():
    prev = jnp.float32(0.5)
    for bad in (0.0, np.inf, -np.inf, np.nan, 1e-44):
        assert float(q.compute_scale(bad, prev, q.E4M3)) == 0.5
    assert float(q.compute_scale(448.0, prev, q.E4M3)) == 1.0
    assert float(q.compute_scale(448.0, prev, q.E4M3, margin=2)) == 4.0


# ---------------------------------------------------------------- delayed scaling vs NumPy, step by step

def _np_scale(amax, prev, fmax, margin):
    new = np.float32(amax) * np.float32(2.0 ** margin) / np.float32(fmax)
    ok = np.isfinite(amax) and amax > 0 and np.isfinite(new) and new > 0
    return np.float32(new) if ok else np.float32(prev)


def _np_delayed(amax_now, prev, hist, fmax, margin):
    a_hist = hist.max()
    a = a_hist if a_hist > 0 else amax_now
    scale = _np_scale(a, prev, fmax, margin)
    rec = amax_now if np.isfinite(amax_now) else 0.0
    ring = np.roll(hist, -1)  # a window of the last len(hist) amaxes, the newest at index 0
    ring[0] = rec
    return scale, ring.astype(np.float32)


def _np_quant(v, scale, ml, fmax):
    return np.clip(v.astype(np.float32) / scale, -fmax, fmax).astype(ml).astype(np.float32)


def test_delayed_scaling_matches_numpy_step_by_step():
    """Forward (x, w: E4M3) and backward (gradient: E5M2) state of fp8-delayed against a NumPy re-implementation,
    through a jitted train-like step with commit_grads; includes a zero step and an overflow step."""
    hist_len, margin = 3, 1.0
    policy = get_policy("fp8-delayed", history=hist_len, margin=margin)
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((32, 8)).astype(np.float32)

    class M(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.asarray(w0))
            self.dot = policy.einsum_module(rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.dot("bk,kn->bn", x, self.w[...]).astype(jnp.float32)

    model = M()
    wrt = q.grad_wrt(policy)

    @nnx.jit
    def step(model, x, gy):
        def loss(m):
            y = m(x)
            return jnp.sum(y * gy), y
        (_, y), g = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, wrt), has_aux=True)(model)
        return y, q.commit_grads(policy, model, g)

    e4, e5 = (ml_dtypes.float8_e4m3fn, 448.0), (ml_dtypes.float8_e5m2, 57344.0)
    sx = sw = sg = np.float32(1.0)
    hx, hw, hg = (np.zeros(hist_len, np.float32) for _ in range(3))
    mags = [1.0, 4.0, 0.0, 0.25, np.inf, 2.0]
    for i, mag in enumerate(mags):
        x = (rng.standard_normal((4, 32)) * (mag if np.isfinite(mag) else 1.0)).astype(np.float32)
        if not np.isfinite(mag):
            x[0, 0] = np.inf  # an overflowing activation: recorded as 0, quantized to the max
        gy = (rng.standard_normal((4, 8)) * 1e-3 * (i + 1)).astype(np.float32)
        y, grads = step(model, jnp.asarray(x), jnp.asarray(gy))
        # reference
        ax = np.float32(np.max(np.abs(x)))
        sx, hx = _np_delayed(ax, sx, hx, 448.0, margin)
        sw, hw = _np_delayed(np.float32(np.max(np.abs(w0))), sw, hw, 448.0, margin)
        qx, qw = _np_quant(x, sx, *e4), _np_quant(w0, sw, *e4)
        y_ref = (qx.astype(np.float64) @ qw.astype(np.float64)) * (np.float64(sx) * sw)
        gyb = gy.astype(ml_dtypes.bfloat16).astype(np.float32)  # the einsum returns bfloat16: its cotangent is too
        sg, hg = _np_delayed(np.float32(np.max(np.abs(gyb))), sg, hg, 57344.0, margin)
        qg = _np_quant(gyb, sg, *e5)
        dw_ref = (qx.astype(np.float64).T @ qg.astype(np.float64)) * (np.float64(sx) * sg)
        d = model.dot
        np.testing.assert_allclose(float(d.x_scale[...]), sx, rtol=1e-6, err_msg=f"x scale step {i}")
        np.testing.assert_allclose(np.asarray(d.x_amax_history[...]), hx, rtol=1e-6, err_msg=f"x history step {i}")
        np.testing.assert_allclose(float(d.w_scale[...]), sw, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(d.w_amax_history[...]), hw, rtol=1e-6)
        np.testing.assert_allclose(float(d.g_scale[...]), sg, rtol=1e-6, err_msg=f"grad scale step {i}")
        np.testing.assert_allclose(np.asarray(d.g_amax_history[...]), hg, rtol=1e-6, err_msg=f"grad hist step {i}")
        assert np.all(np.isfinite(np.asarray(y)))
        assert_close(y, y_ref, "bfloat16")  # same fp8 values and scales; the module returns bfloat16
        assert_close(grads["w"][...], dw_ref, "float32", scale=10)
    assert set(grads.keys()) == {"w"}  # commit_grads returned parameter gradients only


def test_fp8_current_scales_from_this_call():
    m = get_policy("fp8-current").einsum_module()
    x = jnp.full((2, 32), 3.0)
    w = jnp.full((32, 4), 0.5)
    sx, sw = m.scales(x, w)
    assert float(sx) == pytest.approx(3.0 / 448) and float(sw) == pytest.approx(0.5 / 448)
    assert not nnx.state(m, q.Fp8Meta)  # stateless


# ---------------------------------------------------------------- MX blocks


def test_mx_blocks_power_of_two_scales_and_saturation():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    x[0, :32] *= 1e30 / np.abs(x[0, :32]).max()  # an enormous but finite block
    x[1, 32:] = 0.0                               # a zero block
    for fmt in (q.E4M3, q.E2M1):
        qv, s = q.mx_quantize(jnp.asarray(x), fmt, 32)
        assert s.dtype == jnp.float8_e8m0fnu and s.shape == (3, 2)
        s32 = np.asarray(s.astype(jnp.float32))
        assert np.all(np.log2(s32) == np.round(np.log2(s32)))  # powers of two
        deq = np.asarray(q.mx_dequantize(qv, s, 32))
        assert np.all(np.isfinite(deq))
        np.testing.assert_array_equal(deq[1, 32:], 0.0)
        # OCP MX: shared exponent = floor(log2(block amax)) - emax(element)
        amax = np.abs(x.reshape(3, 2, 32)).max(-1)
        expect = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - fmt.emax, 0)
        np.testing.assert_array_equal(np.log2(s32), expect)
        # elements round as ml_dtypes does (after division by the exact power-of-two scale, saturating)
        ml = {"e4m3": ml_dtypes.float8_e4m3fn, "e2m1": ml_dtypes.float4_e2m1fn}[fmt.name]
        ref = np.clip(x.reshape(3, 2, 32) / s32[..., None], -fmt.max, fmt.max).astype(ml).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(qv.astype(jnp.float32)).reshape(3, 2, 32), ref)


def test_mx_block_size_must_divide_contracting_dim():
    m = get_policy("mxfp4").einsum_module()
    with pytest.raises(WorkbenchError, match="does not divide the contracting dimension 48"):
        m("bk,kn->bn", jnp.ones((2, 48)), jnp.ones((48, 4)))
    # smaller than one block (e.g. head_dim 16): one short block, like zero padding
    y = m("bk,kn->bn", jnp.ones((2, 16)), jnp.ones((16, 4)))
    np.testing.assert_array_equal(np.asarray(y, np.float32), 16.0)
    with pytest.raises(WorkbenchError, match="block_size"):
        get_policy("mxfp8", block_size=0)


# ---------------------------------------------------------------- gradients


def test_check_grads_float32_scaled_ops():
    """The custom VJPs (scales, transposed equations, E5M2 gradient path, MX re-quantization) with the identity
    float32 'format' against numerical differentiation."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 5)), jnp.float32)
    for recipe in ("current", "delayed"):
        spec = q.Fp8Spec(recipe=recipe, fwd="float32", grad="float32")
        f = jax.jit(lambda a, b: q.fp8_einsum("btk,kn->btn", spec, a, b, jnp.float32(0.37), jnp.float32(1.9),
                                      jnp.float32(1.0), jnp.zeros((4,), jnp.float32)))
        check_grads(f, (x, w), order=1, modes=["rev"], atol=tol("float32")[0] * 100, rtol=tol("float32")[0] * 100)
    mspec = q.MxSpec(fwd="float32", grad="float32", bwd_operand="float32", block_size=32)
    f = jax.jit(lambda a, b: q.mx_einsum("btk,kn->btn", mspec, a, b))
    check_grads(f, (x, w), order=1, modes=["rev"], atol=tol("float32")[0] * 100, rtol=tol("float32")[0] * 100)
    # a batched attention-style equation with two contracting labels
    a = jnp.asarray(rng.standard_normal((2, 4, 2, 16)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((2, 16, 3)), jnp.float32)
    f = jax.jit(lambda a, b: q.mx_einsum("bqhd,hdk->bqk", mspec, a, b))
    check_grads(f, (a, b), order=1, modes=["rev"], atol=tol("float32")[0] * 100, rtol=tol("float32")[0] * 100)


@pytest.mark.parametrize("name,dt", [("fp8-current", "float8_e4m3fn"), ("fp8-delayed", "float8_e4m3fn"),
                                     ("mxfp8", "float8_e4m3fn")])
def test_quantized_grads_close_to_float64(name, dt):
    """The real formats: forward and both gradients within the fp8 tolerance of the float64 result (norm-wise)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    w = (rng.standard_normal((64, 32)) / 8).astype(np.float32)
    gy = rng.standard_normal((16, 32)).astype(np.float32)
    mod = get_policy(name).einsum_module()

    def f(m, a, b):
        return jnp.sum(m("mk,kn->mn", a, b).astype(jnp.float32) * gy)

    dx, dw = nnx.grad(f, argnums=(1, 2))(mod, jnp.asarray(x), jnp.asarray(w))
    x64, w64, g64 = x.astype(np.float64), w.astype(np.float64), gy.astype(np.float64)
    rtol = tol(dt)[0]
    for got, ref in ((dx, g64 @ w64.T), (dw, x64.T @ g64)):
        got = np.asarray(got, np.float64)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < rtol


# ---------------------------------------------------------------- errors, loss scaling, sharding


def test_bad_policy_input_is_one_line_error():
    with pytest.raises(WorkbenchError, match="ambiguous"):
        get_policy("fp8")
    with pytest.raises(WorkbenchError, match="history length must be >= 1"):
        get_policy("fp8-delayed", history=0)
    with pytest.raises(WorkbenchError, match="margin must be >= 0"):
        get_policy("fp8-delayed", margin=-1)
    with pytest.raises(WorkbenchError, match="no option"):
        get_policy("fp8-current", history=4)
    with pytest.raises(WorkbenchError, match="explicit two-operand"):
        get_policy("mxfp8").einsum_module()("...k,kn->...n", jnp.ones((2, 32)), jnp.ones((32, 2)))
    for e in (WorkbenchError("x"),):
        assert "\n" not in str(e)


def test_dynamic_loss_scale_rules():
    ls = get_policy("fp16").loss_scaling
    assert ls is not None and get_policy("bf16").loss_scaling is None
    ls = q.DynamicLossScale(init_scale=8.0, growth_interval=2)
    st = ls.init()
    g, st, finite = ls.unscale_and_check({"a": jnp.array([8.0, 16.0])}, st)
    assert bool(finite) and float(st.scale) == 8.0 and int(st.good_steps) == 1
    np.testing.assert_array_equal(np.asarray(g["a"]), [1.0, 2.0])
    _, st, finite = ls.unscale_and_check({"a": jnp.array([1.0])}, st)  # second finite step: grows
    assert float(st.scale) == 16.0 and int(st.good_steps) == 0
    _, st, finite = ls.unscale_and_check({"a": jnp.array([jnp.inf])}, st)  # overflow: halves, resets
    assert not bool(finite) and float(st.scale) == 8.0 and int(st.good_steps) == 0
    kept = ls.select(finite, {"p": jnp.ones(2)}, {"p": jnp.zeros(2)})
    np.testing.assert_array_equal(np.asarray(kept["p"]), 0.0)
    assert float(ls.scale(jnp.float16(2.0), st)) == 16.0


def test_amax_and_state_under_sharding():
    """8 simulated devices: x sharded over its rows, the jitted delayed-scaling module sees the global amax and keeps
    replicated state equal to the unsharded run."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    x[13, 5] = 77.0  # the global max lives on one shard
    w = rng.standard_normal((32, 8)).astype(np.float32)
    policy = get_policy("fp8-delayed", history=2)
    call = nnx.jit(lambda m, a, b: m("bk,kn->bn", a, b))
    m1, m8 = policy.einsum_module(), policy.einsum_module()
    xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("data", None)))
    for _ in range(2):
        y1 = call(m1, jnp.asarray(x), jnp.asarray(w))
        y8 = call(m8, xs, jnp.asarray(w))
    assert float(m8.x_amax_history[...][1]) == 77.0
    np.testing.assert_array_equal(np.asarray(m8.x_amax_history[...]), np.asarray(m1.x_amax_history[...]))
    np.testing.assert_array_equal(np.asarray(y8, np.float32), np.asarray(y1, np.float32))


def test_grad_meta_protocol_with_split_states():
    """The jax.value_and_grad-over-split-states pattern (workbench/train.py) commits delayed gradient scaling with
    split_grad_meta / merge_grad_meta."""
    policy = get_policy("fp8-delayed", history=2)

    class M(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((32, 4)))
            self.dot = policy.einsum_module()

        def __call__(self, x):
            return jnp.sum(self.dot("bk,kn->bn", x, self.w[...]).astype(jnp.float32) * 3.0)

    graphdef, params, rest = nnx.split(M(), nnx.Param, ...)

    def loss(params, gmeta, other, x):
        model = nnx.merge(graphdef, params, gmeta, other)
        return model(x), nnx.split(model, nnx.Param, ...)[2]

    @jax.jit
    def step(params, rest, x):
        gmeta, other = q.split_grad_meta(rest)
        (_, new_rest), (g, gmeta_new) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, gmeta, other, x)
        return g, q.merge_grad_meta(new_rest, gmeta_new)

    for _ in range(2):
        g, rest = step(params, rest, jnp.ones((2, 32)))
    np.testing.assert_allclose(np.asarray(rest["dot"]["g_amax_history"][...]), [3.0, 3.0])
    assert float(rest["dot"]["g_scale"][...]) == pytest.approx(3.0 / 57344)
    assert float(rest["dot"]["x_amax_history"][...][0]) == 1.0
