"""MoE routing and expert parallelism (models/moe.py): every check against a plain loop or a stated convention."""
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from models import moe
from models.config import ModelConfig
from models.precision import get_policy
from workbench.errors import WorkbenchError
from workbench.testing import assert_close, tol

F32 = get_policy("float32")


def _cfg(**kw):
    """A ModelConfig, plus the optional MoE fields the block reads with getattr (router_jitter, router_bias_rate)."""
    base = dict(d_model=8, d_ff=16, n_experts=4, top_k=2, capacity_factor=None, mlp="swiglu", bias=True)
    base.update(kw)
    extra = {k: base.pop(k) for k in list(base) if k not in ModelConfig.__dataclass_fields__}
    cfg = ModelConfig(**base)
    return types.SimpleNamespace(**cfg.to_dict(), **extra) if extra else cfg


def _local(blk, x_td, groups=1):
    """moe_local under jit (eager op-by-op dispatch is slow on this host)."""
    fn = jax.jit(lambda p, x: moe.moe_local(p, x, blk.opt, blk.dot, jnp.float32, groups=groups))
    return fn(blk.param_dict(), x_td)


def _gelu(h):  # jax.nn.gelu's default tanh approximation, in float64
    return 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))


def _logits(T, E, seed=0, skew=0.0):
    l = jax.random.normal(jax.random.key(seed), (T, E), jnp.float32)
    return l - skew * jnp.log1p(jnp.arange(E, dtype=jnp.float32))


def _opt(**kw):
    base = dict(n_experts=4, top_k=2, capacity_factor=None, router="token-choice", score="softmax", mlp="swiglu")
    base.update(kw)
    return moe.MoEOptions(**base)


# ----- routing invariants -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cf", [0.5, 1.0, 1.25])
def test_dispatched_plus_dropped_is_tokens_times_k_and_capacity_holds(cf):
    T, E, K, D = 64, 4, 2, 3
    logits = _logits(T, E, skew=1.0)
    C = moe.expert_capacity(T, E, K, cf)
    assert C == math.ceil(cf * T * K / E)
    r = moe.top_k_route(logits, K)
    pos, keep = moe.assign_slots(r.expert_tk, E, C)
    # tokens with distinct, nonzero rows: count the rows that land in the (E, C, D) buffer
    x = jnp.arange(1, T + 1, dtype=jnp.float32)[:, None] * jnp.ones((T, D))
    buf = moe.dispatch(x, r.expert_tk, pos, keep, E, C)
    dispatched = int(jnp.sum(jnp.any(buf != 0, axis=-1)))
    _, sums = moe.route_group(logits, _opt(capacity_factor=cf), C)
    assert dispatched + int(sums["dropped"]) == T * K
    assert int(sums["dropped"]) > 0  # skewed logits at these factors must drop something
    # no expert above capacity, and each kept assignment has its own slot
    kept_per_expert = np.bincount(np.asarray(r.expert_tk)[np.asarray(keep)], minlength=E)
    assert kept_per_expert.max() <= C
    slots = np.asarray(r.expert_tk * C + pos)[np.asarray(keep)]
    assert len(set(slots.tolist())) == len(slots)


def test_drop_priority_first_choices_then_token_order():
    # 3 tokens all prefer expert 0 first, expert 1 second; capacity 2
    expert_tk = jnp.array([[0, 1], [0, 1], [0, 1]], jnp.int32)
    pos, keep = moe.assign_slots(expert_tk, 2, 2)
    np.testing.assert_array_equal(np.asarray(pos), [[0, 0], [1, 1], [2, 2]])
    # token 2 loses its first choice (late in the queue); second choices queue after every first choice
    np.testing.assert_array_equal(np.asarray(keep), [[True, True], [True, True], [False, False]])
    # mixed ranks: token 0's second choice (expert 0) queues behind token 1's first choice (expert 0)
    expert_tk = jnp.array([[1, 0], [0, 1]], jnp.int32)
    pos, keep = moe.assign_slots(expert_tk, 2, 1)
    np.testing.assert_array_equal(np.asarray(keep), [[True, False], [True, False]])


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_combine_weights_sum_to_one_and_identity_experts_return_the_input(score):
    T, E, K, D = 32, 4, 2, 5
    r = moe.top_k_route(_logits(T, E), K, score)
    assert_close(jnp.sum(r.weight_tk, -1), np.ones(T), jnp.float32)
    assert_close(jnp.sum(r.probs_te, -1), np.ones(T), jnp.float32)
    x = jax.random.normal(jax.random.key(3), (T, D))
    C = moe.expert_capacity(T, E, K, 8.0)
    pos, keep = moe.assign_slots(r.expert_tk, E, C)
    assert bool(jnp.all(keep))
    y = moe.combine(moe.dispatch(x, r.expert_tk, pos, keep, E, C), r.expert_tk, pos, keep, r.weight_tk)
    assert_close(y, x, jnp.float32)
    # top-1 keeps the raw score (Switch) so the router still gets a gradient
    r1 = moe.top_k_route(_logits(T, E), 1, score)
    assert float(jnp.max(r1.weight_tk)) < 1.0


def test_uniform_logits_give_the_documented_aux_losses():
    T, E = 48, 8
    _, sums = moe.route_group(jnp.zeros((T, E)), _opt(n_experts=E, top_k=2), None)
    s = moe.finalize_stats(sums, 0.01, 0.001)
    assert float(s["lb_loss"]) == pytest.approx(1.0, abs=1e-6)  # Switch convention: uniform -> exactly 1
    assert float(s["z_loss"]) == pytest.approx(math.log(E) ** 2, rel=1e-6)
    assert float(s["router_entropy"]) == pytest.approx(math.log(E), rel=1e-6)
    assert float(s["loss"]) == pytest.approx(0.01 * 1.0 + 0.001 * math.log(E) ** 2, rel=1e-6)
    # and the direct function agrees; collapse onto one expert approaches E
    r = moe.top_k_route(jnp.zeros((T, E)), 1)
    assert float(moe.load_balancing_loss(r.probs_te, r.expert_tk, E)) == pytest.approx(1.0, abs=1e-6)
    hot = jnp.zeros((T, E)).at[:, 0].set(30.0)
    r = moe.top_k_route(hot, 1)
    assert float(moe.load_balancing_loss(r.probs_te, r.expert_tk, E)) == pytest.approx(E, rel=1e-4)


# ----- expert compute against a per-expert loop -----------------------------------------------------------------
def _reference(params, x, opt):
    """float64 numpy: each token, each chosen expert, its FFN, weighted sum (capacity handled by the same slots)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    xs = np.asarray(x, np.float64)
    logits = xs @ p["w_router_de"]
    T = xs.shape[0]
    r = moe.top_k_route(jnp.asarray(logits, jnp.float32), opt.top_k, opt.score)
    C = None if opt.capacity_factor is None else moe.expert_capacity(T, opt.n_experts, opt.top_k, opt.capacity_factor)
    _, keep = moe.assign_slots(r.expert_tk, opt.n_experts, C)
    idx, w, keep = np.asarray(r.expert_tk), np.asarray(r.weight_tk, np.float64), np.asarray(keep)
    y = np.zeros_like(xs)
    for e in range(opt.n_experts):
        for t in range(T):
            for k in range(opt.top_k):
                if idx[t, k] != e or not keep[t, k]:
                    continue
                h = xs[t] @ p["w_in_edf"][e] + p["b_in_ef"][e]
                if opt.mlp == "swiglu":
                    g = xs[t] @ p["w_gate_edf"][e]
                    a = g / (1 + np.exp(-g)) * h
                else:
                    a = _gelu(h)
                y[t] += w[t, k] * (a @ p["w_out_efd"][e] + p["b_out_ed"][e])
    return y


def _block(**kw):
    blk = moe.MoEBlock(_cfg(**kw), F32, rngs=nnx.Rngs(0))
    # order-one weights and nonzero biases (the 0.02 init makes every path nearly linear and every router uniform)
    for i, (name, v) in enumerate(sorted(blk.param_dict().items())):
        std = 0.1 if name.startswith("b_") else (1.0 if name == "w_router_de" else 0.5)
        getattr(blk, name)[...] = std * jax.random.normal(jax.random.key(100 + i), v.shape)
    return blk


@pytest.mark.parametrize("mlp,score", [("swiglu", "softmax"), ("gelu", "sigmoid")])
def test_dropless_equals_per_expert_loop(mlp, score):
    blk = _block(mlp=mlp, router_score=score)
    x = jax.random.normal(jax.random.key(1), (24, 8))
    y, sums = _local(blk, x)
    assert float(sums["dropped"]) == 0
    assert_close(y, _reference(blk.param_dict(), x, blk.opt), jnp.float32, scale=10)


def test_capacity_path_equals_loop_and_large_capacity_equals_dropless():
    x = jax.random.normal(jax.random.key(2), (32, 8))
    tight = _block(capacity_factor=0.75)
    y_t, s_t = _local(tight, x)
    assert float(s_t["dropped"]) > 0
    assert_close(y_t, _reference(tight.param_dict(), x, tight.opt), jnp.float32, scale=10)
    loose = _block(capacity_factor=4.0)  # C = min(T, ceil(4·T·2/4)) = T: nothing can be dropped
    dropless = _block(capacity_factor=None)
    y_l, s_l = _local(loose, x)
    y_d, _ = _local(dropless, x)
    assert float(s_l["dropped"]) == 0
    assert_close(y_l, y_d, jnp.float32)


def test_expert_choice_each_expert_takes_capacity_tokens_and_matches_loop():
    T, E, D = 16, 4, 8
    blk = _block(router="expert-choice", capacity_factor=1.0, mlp="gelu")
    x = jax.random.normal(jax.random.key(4), (T, D))
    y, sums = _local(blk, x)
    C = moe.expert_capacity(T, E, 2, 1.0)
    p = {k: np.asarray(v, np.float64) for k, v in blk.param_dict().items()}
    xs = np.asarray(x, np.float64)
    probs = np.asarray(jax.nn.softmax(jnp.asarray(xs @ p["w_router_de"], jnp.float32), -1), np.float64)
    ref = np.zeros_like(xs)
    chosen = np.zeros(T, int)
    for e in range(E):
        top = np.argsort(-probs[:, e], kind="stable")[:C]
        for t in top:
            chosen[t] += 1
            h = _gelu(xs[t] @ p["w_in_edf"][e] + p["b_in_ef"][e])
            ref[t] += probs[t, e] * (h @ p["w_out_efd"][e] + p["b_out_ed"][e])
    assert_close(y, ref, jnp.float32, scale=10)
    assert int(sums["dropped"]) == int(np.sum(chosen == 0))


# ----- gradients, balancing, jitter --------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(), dict(capacity_factor=1.0, top_k=1), dict(router="expert-choice",
                                                                                  capacity_factor=1.0)])
def test_gradients_flow_through_the_router(kw):
    blk = _block(aux_loss_coef=0.0, z_loss_coef=0.0, **kw)  # only the output path can carry the gradient
    x = jax.random.normal(jax.random.key(5), (2, 8, 8))

    def loss(b):
        y, aux = b(x)
        return jnp.mean(y ** 2) + aux["loss"]

    g = nnx.jit(nnx.grad(loss))(blk)
    jloss = nnx.jit(loss)
    gr = np.asarray(g["w_router_de"][...])
    assert np.all(np.isfinite(gr)) and np.abs(gr).max() > 1e-6
    # the gradient is right: directional derivative against a central difference
    d = jax.random.normal(jax.random.key(6), gr.shape)
    eps = 1e-3

    def at(s):
        b2 = nnx.clone(blk)
        b2.w_router_de[...] = blk.w_router_de[...] + s * d
        return float(jloss(b2))

    fd = (at(eps) - at(-eps)) / (2 * eps)
    assert fd == pytest.approx(float(jnp.sum(gr * d)), rel=5e-2, abs=1e-6)


def test_loss_free_bias_steers_selection_not_weights_and_moves_toward_balance():
    logits = _logits(64, 4, skew=1.5)
    r0 = moe.top_k_route(logits, 1)
    bias = jnp.array([-1.0, 0.0, 0.0, 1.0])
    r1 = moe.top_k_route(logits, 1, bias_e=bias)
    load0 = np.bincount(np.asarray(r0.expert_tk).ravel(), minlength=4)
    load1 = np.bincount(np.asarray(r1.expert_tk).ravel(), minlength=4)
    assert load1[3] > load0[3] and load1[0] < load0[0]
    # weights are the unbiased scores of the chosen experts
    scores = jax.nn.softmax(logits, -1)
    assert_close(r1.weight_tk, jnp.take_along_axis(scores, r1.expert_tk, -1), jnp.float32)
    # in the block, the bias update lowers the busiest expert's bias
    blk = moe.MoEBlock(_cfg(router_bias_rate=0.01), F32, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(9), (2, 16, 8))
    _, aux = blk(x)
    _, sums = moe.moe_local(blk.param_dict(), x.reshape(-1, 8), blk.opt, blk.dot, jnp.float32)
    busiest = int(jnp.argmax(sums["load_e"]))
    assert float(blk.expert_bias[...][busiest]) < 0


def test_block_output_shape_aux_keys_and_jitter():
    blk = _block(capacity_factor=1.0)
    x = jax.random.normal(jax.random.key(10), (2, 8, 8))
    y, aux = blk(x)
    assert y.shape == x.shape
    assert set(aux) >= {"loss", "dropped_fraction", "load_max_over_mean", "router_entropy", "lb_loss", "z_loss"}
    assert all(v.dtype == jnp.float32 and v.shape == () for v in aux.values())
    # expert weights carry logical axis names, 'experts' first
    assert blk.w_in_edf.get_metadata()["out_sharding"] == ("experts", "embed", "mlp")
    jb = moe.MoEBlock(_cfg(capacity_factor=1.0, router_jitter=0.1), F32, rngs=nnx.Rngs(0, dropout=1))
    for name, v in blk.param_dict().items():
        getattr(jb, name)[...] = v
    y1, _ = jb(x)
    assert not np.allclose(np.asarray(y1), np.asarray(y))  # jitter changes the routing input in training
    jb.deterministic = True
    y2, _ = jb(x)
    assert_close(y2, y, jnp.float32)


# ----- bad input ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,msg", [
    ((4, 0, 1.0, "token-choice"), "top-k"), ((4, 5, 1.0, "token-choice"), "top-k"),
    ((4, 2, 0.0, "token-choice"), "capacity"), ((4, 2, -1.0, "token-choice"), "capacity"),
    ((4, 2, 1.0, "hash"), "unknown router"), ((4, 2, None, "expert-choice"), "capacity"),
])
def test_bad_routing_requests_are_one_line_errors(args, msg):
    with pytest.raises(WorkbenchError, match=msg) as e:
        moe.check_routing_args(*args)
    assert "\n" not in str(e.value)


def test_experts_not_divisible_by_the_expert_axis():
    with pytest.raises(WorkbenchError, match="not divisible by the expert axis"):
        moe.check_routing_args(6, 2, 1.0, "token-choice", expert_axis_size=4)
    mesh = jax.make_mesh((4, 2), ("expert", "data"), axis_types=(AxisType.Auto,) * 2)
    opt = _opt(n_experts=6)
    with pytest.raises(WorkbenchError, match="not divisible"):
        moe.ep_forward({}, jnp.zeros((16, 8)), opt, None, jnp.float32, mesh=mesh)


# ----- expert parallelism ------------------------------------------------------------------------------------------
@pytest.mark.compile_heavy
@pytest.mark.parametrize("shape,names", [((8,), ("expert",)), ((2, 4), ("data", "expert"))])
@pytest.mark.parametrize("kw", [dict(), dict(capacity_factor=1.0), dict(router="expert-choice", capacity_factor=1.0)])
def test_expert_parallel_equals_unsharded(shape, names, kw):
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
    blk = _block(n_experts=8, **kw)
    x = jax.random.normal(jax.random.key(11), (4, 8, 8))
    x_td = x.reshape(-1, 8)
    # one routing group per device reproduces the per-device capacity of the EP path
    y0, s0 = _local(blk, x_td, groups=8)
    with jax.set_mesh(mesh):
        y1, aux1 = nnx.jit(lambda b, x: b(x))(blk, x)
    assert_close(y1.reshape(-1, 8), y0, jnp.float32)
    a0 = moe.finalize_stats(s0, blk.opt.aux_loss_coef, blk.opt.z_loss_coef)
    for k in a0:
        assert_close(aux1[k], a0[k], jnp.float32)
    if kw.get("capacity_factor") and "router" not in kw:
        assert float(s0["dropped"]) > 0  # the check covers dropping, not only the easy case


@pytest.mark.compile_heavy
def test_expert_parallel_with_tensor_axis_and_gradients_match():
    mesh = jax.make_mesh((2, 2, 2), ("data", "expert", "tensor"), axis_types=(AxisType.Auto,) * 3)
    blk = _block(n_experts=4, capacity_factor=1.0)
    x = jax.random.normal(jax.random.key(12), (4, 8, 8))

    def loss(b, x):
        y, aux = b(x)
        return jnp.mean(y ** 2) + aux["loss"]

    blk_local = nnx.clone(blk)
    blk_local.groups = 4  # token shards = data × expert
    g0 = nnx.jit(nnx.grad(loss))(blk_local, x)
    with jax.set_mesh(mesh):
        g1 = nnx.jit(nnx.grad(loss))(blk, x)
    for name in ("w_router_de", "w_in_edf", "w_gate_edf", "w_out_efd", "b_out_ed"):
        assert_close(g1[name][...], g0[name][...], jnp.float32, scale=10)


@pytest.mark.compile_heavy
@pytest.mark.parametrize("shape,names", [((2, 4), ("data", "expert"))])
def test_ragged_exchange_equals_unsharded_dropless(shape, names):
    """The ragged all-to-all EP path (offsets, receiver layout, ragged_dot on received rows, the way back), run on
    CPU through the emulated collective (XLA:CPU has no ragged-all-to-all), against the unsharded dropless layer."""
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
    blk = _block(n_experts=8, top_k=3)
    x_td = jax.random.normal(jax.random.key(13), (64, 8))
    p = blk.param_dict()

    def ep(p, x):
        return moe.ep_forward(p, x, blk.opt, blk.dot, jnp.float32, mesh=mesh, a2a="ragged-emulated")

    def loss_ep(p, x):
        return jnp.mean(ep(p, x)[0] ** 2)

    def loss_local(p, x):
        return jnp.mean(moe.moe_local(p, x, blk.opt, blk.dot, jnp.float32)[0] ** 2)

    y0, s0 = _local(blk, x_td)
    y1, s1 = jax.jit(ep)(p, x_td)
    assert_close(y1, y0, jnp.float32, scale=10)
    assert float(s1["dropped"]) == 0 and float(s1["assignments"]) == 64 * 3
    g0 = jax.jit(jax.grad(loss_local))(p, x_td)
    g1 = jax.jit(jax.grad(loss_ep))(p, x_td)
    for k in g0:
        assert_close(g1[k], g0[k], jnp.float32, scale=10)


def test_ragged_a2a_mode_choice_and_errors():
    assert moe.choose_a2a("auto", _opt(), "cpu") == "padded"  # XLA:CPU: ragged-all-to-all UNIMPLEMENTED
    assert moe.choose_a2a("auto", _opt(), "tpu") == "ragged"
    assert moe.choose_a2a("auto", _opt(capacity_factor=1.0), "tpu") == "padded"
    with pytest.raises(WorkbenchError, match="dropless"):
        moe.choose_a2a("ragged", _opt(capacity_factor=1.0), "tpu")
    with pytest.raises(WorkbenchError, match="unknown all-to-all"):
        moe.choose_a2a("nccl", _opt(), "gpu")


@pytest.mark.compile_heavy
def test_real_ragged_all_to_all_compiles_for_a_tpu_slice():
    """The non-emulated ragged path is what TPU/GPU run: compile it for a v5e 2x4 slice with libtpu (no TPU needed)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from partitioning import topology

    if not topology.libtpu_available():
        pytest.skip("libtpu not installed: cannot compile for a TPU topology")
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,),
                         devices=topology.tpu_devices("tpu-v5e:2x4"))
    blk = _block(n_experts=8)
    p = blk.param_dict()
    specs = {"w_router_de": P(), "w_in_edf": P("expert"), "w_gate_edf": P("expert"), "w_out_efd": P("expert"),
             "b_in_ef": P("expert"), "b_out_ed": P("expert")}
    abs_p = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[k])) for k, v in p.items()}
    abs_x = jax.ShapeDtypeStruct((128, 8), jnp.float32, sharding=NamedSharding(mesh, P("expert")))
    fn = jax.jit(lambda p, x: moe.ep_forward(p, x, blk.opt, blk.dot, jnp.float32, mesh=mesh)[0])  # a2a='auto'
    text = fn.lower(abs_p, abs_x).compile().as_text()
    assert "ragged-all-to-all" in text


def test_bf16_policy_routes_identically_and_stays_within_the_bf16_tolerance():
    """Router in float32 whatever the policy: the same choices; experts in bfloat16 against the float32 block."""
    x = jax.random.normal(jax.random.key(14), (2, 8, 8))
    f32 = _block(capacity_factor=1.0)
    b16 = moe.MoEBlock(_cfg(capacity_factor=1.0), get_policy("bf16"), rngs=nnx.Rngs(0))
    for name, v in f32.param_dict().items():
        getattr(b16, name)[...] = v
    y32, a32 = nnx.jit(lambda b, x: b(x))(f32, x)
    y16, a16 = nnx.jit(lambda b, x: b(x))(b16, x)
    assert y16.dtype == jnp.bfloat16
    for k in ("dropped_fraction", "load_max_over_mean", "lb_loss"):
        assert float(a16[k]) == float(a32[k])
    # three chained bfloat16 matmuls with cancellation: judge the error against the output's norm, not per element
    rtol, _ = tol(jnp.bfloat16)
    err = np.linalg.norm(np.asarray(y16, np.float64) - np.asarray(y32, np.float64)) / np.linalg.norm(np.asarray(y32))
    assert 0 < err < rtol


@pytest.mark.compile_heavy
@pytest.mark.parametrize("strategy,spec,groups,kw", [("dp", "data=8", 8, dict(capacity_factor=1.0)),
                                                    ("tp", "data=2,model=4", 2, dict())])
def test_dp_and_tp_route_per_device_like_local_groups(strategy, spec, groups, kw):
    """Without an expert axis, under the partitioning rules each device routes its own tokens (ep = 1, no
    all-to-all; the tensor axis splits d_ff): equal to the local layer with one routing group per token shard."""
    from partitioning.mesh import make_mesh
    from partitioning.shard import activation_sharding

    mesh = make_mesh(spec)
    blk = _block(n_experts=4, **kw)
    x = jax.random.normal(jax.random.key(15), (8, 4, 8))

    def loss(b, x):
        y, aux = b(x)
        return jnp.mean(y ** 2) + aux["loss"], (y, aux)

    ref = nnx.clone(blk)
    ref.groups = groups
    (l0, (y0, a0)), g0 = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(ref, x)

    @nnx.jit
    def sharded(b, x):
        with activation_sharding(mesh, strategy), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return nnx.value_and_grad(loss, has_aux=True)(b, x)

    (l1, (y1, a1)), g1 = sharded(blk, x)
    assert_close(y1, y0, jnp.float32)
    for k in a0:
        assert_close(a1[k], a0[k], jnp.float32)
    for name in ("w_router_de", "w_in_edf", "w_out_efd"):
        assert_close(g1[name][...], g0[name][...], jnp.float32, scale=10)
