"""MoE at scale (issue 19): routing per token group under every strategy, the grouped matmul forms, the MoE memory
model, shared experts. Every check against a plain loop, the unpartitioned layer or the compiled program."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import moe
from models.analytics import analytics, moe_layer_memory, moe_memory_fused
from models.config import ModelConfig
from models.kernels import grouped
from models.precision import get_policy
from models.presets import get_config
from models.transformer import Transformer, count_params
from partitioning import topology
from partitioning.mesh import make_mesh
from partitioning.shard import activation_sharding
from workbench.cost.hlo import parse_module
from workbench.errors import WorkbenchError
from workbench.testing import assert_close

F32 = get_policy("float32")


def _block(**kw):
    base = dict(d_model=8, d_ff=16, n_experts=4, top_k=2, capacity_factor=None, mlp="swiglu", bias=True)
    base.update(kw)
    return moe.MoEBlock(ModelConfig(**base), F32, rngs=nnx.Rngs(0))


def _sorted_problem(R=96, D=16, F=24, G=4, seed=0, empty=None):
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (R, D), jnp.float32)
    w = jax.random.normal(k[1], (G, D, F), jnp.float32) / math.sqrt(D)
    sizes = np.asarray(jax.random.multinomial(k[2], R - 8, jnp.full((G,), 1.0 / G)), np.int32)  # 8 rows unused
    if empty is not None:
        sizes[0] += sizes[empty]
        sizes[empty] = 0
    return x, w, jnp.asarray(sizes)


def _loop(x, w, sizes):
    """Reference: each group's rows times its matrix, in float64; rows past the groups are zero."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[-1]))
    s = 0
    for g, n in enumerate(np.asarray(sizes)):
        out[s:s + n] = x[s:s + n] @ w[g]
        s += n
    return out


# ----- grouped matmul forms ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["ragged_dot", "blocked"])
@pytest.mark.parametrize("empty", [None, 2])
def test_grouped_matmul_forms_equal_the_per_group_loop_with_gradients(impl, empty):
    x, w, sizes = _sorted_problem(empty=empty)
    used = int(np.sum(sizes))
    fn = jax.jit(lambda x, w: grouped.grouped_matmul(x, w, sizes, jnp.float32, impl, block=8))
    y = fn(x, w)
    assert_close(y[:used], _loop(x, w, sizes)[:used], jnp.float32)
    # gradients against ragged_dot (itself checked above)
    loss = lambda impl: (lambda x, w: jnp.sum(jnp.sin(grouped.grouped_matmul(x, w, sizes, jnp.float32, impl,
                                                                              block=8)[:used])))
    g0 = jax.jit(jax.grad(loss("ragged_dot"), argnums=(0, 1)))(x, w)
    g1 = jax.jit(jax.grad(loss(impl), argnums=(0, 1)))(x, w)
    for a, b in zip(g1, g0):
        assert_close(a, b, jnp.float32)


def test_megablox_gmm_in_interpret_mode_equals_the_loop():
    """The TPU kernel's semantics (and our custom VJP around it) checked on CPU in Pallas interpret mode."""
    x, w, sizes = _sorted_problem(R=64, D=128, F=128, G=4, seed=3)
    used = int(np.sum(sizes))
    y = jax.jit(lambda x, w: grouped.megablox_matmul(x, w, sizes, jnp.float32, interpret=True))(x, w)
    assert_close(y[:used], _loop(x, w, sizes)[:used], jnp.float32)
    loss = lambda f: (lambda x, w: jnp.sum(jnp.sin(f(x, w)[:used])))
    gm = jax.jit(jax.grad(loss(lambda x, w: grouped.megablox_matmul(x, w, sizes, jnp.float32, interpret=True)),
                          argnums=(0, 1)))(x, w)
    gr = jax.jit(jax.grad(loss(lambda x, w: grouped.grouped_matmul(x, w, sizes, jnp.float32)), argnums=(0, 1)))(x, w)
    for a, b in zip(gm, gr):
        assert_close(a, b, jnp.float32)


def test_blocked_form_does_at_most_the_padding_extra_flops():
    """Compiled on XLA:CPU: the blocked form's counted flops are within (1 + G*block/R) of the useful 2*R*D*F, while
    ragged_dot is lowered densely (G x). Counted = kernel sums x trip counts (the scan)."""
    from workbench.cost.compile import compile_program

    R, D, F, G = 1024, 64, 128, 8
    args = (jax.ShapeDtypeStruct((R, D), jnp.float32), jax.ShapeDtypeStruct((G, D, F), jnp.float32),
            jax.ShapeDtypeStruct((G,), jnp.int32))
    useful = 2.0 * R * D * F
    block = grouped.default_block(R, G)
    out = {}
    for impl in ("ragged_dot", "blocked"):
        c = compile_program(lambda x, w, s, impl=impl: grouped.grouped_matmul(x, w, s, jnp.float32, impl),
                            *args, analytic=False).cost
        out[impl] = c.counted_flops / useful
    assert 1.0 <= out["blocked"] <= 1 + (G + 1) * block / R + 0.02
    assert out["blocked"] <= 1.3
    assert out["ragged_dot"] > 2 * out["blocked"]  # XLA:CPU: dense over all groups
    assert grouped.choose_impl("auto", "cpu") == "blocked" and grouped.choose_impl("auto", "tpu") == "gmm"
    with pytest.raises(WorkbenchError, match="TPU"):
        grouped.choose_impl("gmm", "cpu")


# ----- routing per token group ------------------------------------------------------------------------------------
def _groups_one_by_one(blk, x_td, G):
    """Reference: route and compute each token group with its own call (no shared state between groups)."""
    p = blk.param_dict()
    T = x_td.shape[0]
    fn = jax.jit(lambda p, x: moe.moe_group(p, x, moe.router_logits(x, p["w_router_de"]), blk.opt, blk.dot,
                                            jnp.float32, platform="cpu"))
    ys, sums = [], []
    for g in range(G):
        y, s = fn(p, x_td[g * T // G:(g + 1) * T // G])
        ys.append(y)
        sums.append(s)
    return jnp.concatenate(ys), jax.tree.map(lambda *a: sum(a), *sums)


@pytest.mark.parametrize("G", [2, 4])
@pytest.mark.parametrize("kw", [dict(), dict(capacity_factor=1.0)])
def test_routing_per_group_equals_routing_the_groups_one_by_one(G, kw):
    blk = _block(**kw)
    x_td = jax.random.normal(jax.random.key(21), (64, 8))
    y0, s0 = _groups_one_by_one(blk, x_td, G)
    y1, s1 = jax.jit(lambda p, x: moe.moe_local(p, x, blk.opt, blk.dot, jnp.float32, groups=G, platform="cpu"))(
        blk.param_dict(), x_td)
    assert_close(y1, y0, jnp.float32)
    for k in s0:
        assert_close(s1[k], s0[k], jnp.float32)
    if kw:
        assert float(s0["dropped"]) > 0  # capacity per group really drops


def test_dropless_routing_is_invariant_to_the_group_count():
    """Dropless token-choice has no capacity, so how the tokens are grouped cannot change a token's output; the
    statistics are sums over groups, so the losses are the same too."""
    blk = _block()
    x_td = jax.random.normal(jax.random.key(22), (64, 8))
    ref = None
    for G in (1, 2, 4, 8):
        y, s = jax.jit(lambda p, x, G=G: moe.moe_local(p, x, blk.opt, blk.dot, jnp.float32, groups=G,
                                                        platform="cpu"))(blk.param_dict(), x_td)
        aux = moe.finalize_stats(s, 0.01, 0.001)
        if ref is None:
            ref = (y, aux)
            continue
        assert_close(y, ref[0], jnp.float32)
        for k in aux:
            assert_close(aux[k], ref[1][k], jnp.float32)


@pytest.mark.parametrize("kw", [dict(), dict(capacity_factor=1.0)])
def test_chunked_experts_equal_the_whole_buffer_with_gradients(kw):
    """experts_scan (one expert per scan step) and experts_ragged_chunked (row slices) against the one-shot FFN."""
    blk = _block(**kw)
    x_td = jax.random.normal(jax.random.key(25), (64, 8))
    chunked = dataclasses.replace(blk.opt, chunk_bytes=1)  # every buffer "too big": chunk everything

    def loss(opt):
        return lambda p, x: jnp.sum(jnp.sin(moe.moe_local(p, x, opt, blk.dot, jnp.float32, platform="cpu")[0]))

    p = blk.param_dict()
    y0 = jax.jit(lambda p, x: moe.moe_local(p, x, blk.opt, blk.dot, jnp.float32, platform="cpu")[0])(p, x_td)
    y1 = jax.jit(lambda p, x: moe.moe_local(p, x, chunked, blk.dot, jnp.float32, platform="cpu")[0])(p, x_td)
    assert_close(y1, y0, jnp.float32)
    g0 = jax.jit(jax.grad(loss(blk.opt)))(p, x_td)
    g1 = jax.jit(jax.grad(loss(chunked)))(p, x_td)
    for k in g0:
        assert_close(g1[k], g0[k], jnp.float32, scale=10)
    assert moe.row_chunks(128, 16, 4, 2048) == 4 and moe.row_chunks(96, 16, 4, 1) == 96


@pytest.mark.compile_heavy
@pytest.mark.parametrize("strategy,spec,groups,chunk", [("fsdp", "data=8", 8, False), ("fsdp", "data=8", 8, True),
                                                        ("fsdp+tp", "data=4,model=2", 4, True)])
def test_fsdp_layer_routes_per_shard_and_reduce_scatters_gradients(strategy, spec, groups, chunk):
    """fsdp keeps the expert weights sharded into the shard_map and gathers them inside (per expert when chunked):
    the same outputs, losses and gradients as routing each shard's tokens as its own group, unpartitioned."""
    mesh = make_mesh(spec)
    blk = _block(capacity_factor=1.0)
    if chunk:
        blk.opt = dataclasses.replace(blk.opt, chunk_bytes=1)
    x = jax.random.normal(jax.random.key(23), (8, 4, 8))

    def loss(b, x):
        y, aux = b(x)
        return jnp.mean(y ** 2) + aux["loss"], (y, aux)

    ref = nnx.clone(blk)
    ref.groups = groups
    (_, (y0, a0)), g0 = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(ref, x)
    y_loop, _ = _groups_one_by_one(blk, x.reshape(-1, 8), groups)
    assert_close(y0.reshape(-1, 8), y_loop, jnp.float32)

    @nnx.jit
    def sharded(b, x):
        with activation_sharding(mesh, strategy), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return nnx.value_and_grad(loss, has_aux=True)(b, x)

    (_, (y1, a1)), g1 = sharded(blk, x)
    assert_close(y1, y0, jnp.float32)
    for k in a0:
        assert_close(a1[k], a0[k], jnp.float32)
    for name in ("w_router_de", "w_in_edf", "w_gate_edf", "w_out_efd", "b_in_ef", "b_out_ed"):
        assert_close(g1[name][...], g0[name][...], jnp.float32, scale=10)


def _step_hlo(strategy, mesh_spec, overrides):
    from workbench.programs.step import build_train_step

    cfg = get_config("tiny-moe", overrides)
    prog = build_train_step(cfg, policy="float32", mesh=make_mesh(mesh_spec), strategy=strategy, batch_size=16,
                            seq_len=32, abstract=True)
    step, state, batch = prog
    return step.lower(state, batch).compile().as_text(), cfg


@pytest.mark.compile_heavy
@pytest.mark.parametrize("overrides", ["capacity_factor=None", "capacity_factor=1.25"])
def test_compiled_fsdp_step_has_no_sort_or_collective_over_the_global_token_set(overrides):
    """Read from the optimized HLO of a whole fsdp training step on data=8: every sort runs on one shard's T/8·k
    assignments, and no collective carries an array with a dimension of the global token count (T or T·k)."""
    text, cfg = _step_hlo("fsdp", "data=8", overrides)
    T = 16 * 32
    k = cfg.top_k
    mod = parse_module(text)
    instrs = [i for body in mod.computations.values() for i in body]
    sorts = [i for i in instrs if i.opcode == "sort"]
    if cfg.capacity_factor is None:
        assert sorts, "the dropless step sorts its assignments"
    for i in sorts:
        for s in i.shapes:
            assert s.elements <= T // 8 * k * cfg.n_experts, f"sort over more than one shard: {i.type_str}"
            assert T not in s.dims and T * k not in s.dims, i.type_str
    coll = [i for i in instrs if i.opcode.split("-start")[0] in ("all-gather", "all-reduce", "all-to-all",
                                                                 "reduce-scatter", "collective-permute")]
    assert coll, "fsdp gathers parameters"
    for i in coll:
        for s in i.shapes:
            assert T not in s.dims and T * k not in s.dims, f"collective over the global tokens: {i.type_str}"


# ----- memory model -----------------------------------------------------------------------------------------------
def test_moe_memory_model_counts_by_hand():
    cfg = get_config("mixtral-8x7b", "capacity_factor=1.25")
    m = moe_layer_memory(cfg, 32768, compute_bytes=2, fsdp=256)
    C = math.ceil(1.25 * 32768 * 2 / 8)
    assert m["capacity_per_expert"] == C == 10240
    assert m["dispatch_buffer_bytes"] == 8 * C * 4096 * 2 + 32768 * 2 * 4096 * 2
    # (E·C, F) bf16 = 2.2 GiB per array > 256 MiB: the layer runs expert by expert, one expert's pieces alive
    assert m["expert_chunks"] == 8
    assert m["expert_activation_bytes"] == C * 14336 * 2 * 3
    assert m["gathered_weight_bytes"] == 4096 * 14336 * 3 * 2
    whole = moe_layer_memory(cfg, 32768, compute_bytes=2, fsdp=256, chunk_bytes=2 ** 40)
    assert whole["expert_activation_bytes"] == 8 * C * 14336 * 2 * 3 and whole["expert_chunks"] == 1
    d = moe_layer_memory(cfg.replace(capacity_factor=None), 32768, compute_bytes=2)
    assert d["capacity_per_expert"] is None and d["expert_rows_per_group"] == 65536
    assert d["expert_chunks"] == 7 + 1  # ceil(65536·14336·2 / 2^28) = 7 does not divide 65536: 8 slices
    assert d["gathered_weight_bytes"] == 0
    assert moe_layer_memory(get_config("tiny"), 64) == {}
    with pytest.raises(WorkbenchError, match="groups"):
        moe_layer_memory(cfg, 100, groups_per_device=3)


# ----- shared experts and the DeepSeek-style preset ---------------------------------------------------------------
@pytest.mark.parametrize("preset,overrides", [("tiny", "n_experts=4,top_k=2,n_shared_experts=2,mlp=swiglu"),
                                              ("deepseek-moe-16b", "")])
def test_shared_expert_params_equal_analytics(preset, overrides):
    cfg = get_config(preset, overrides)
    model = nnx.eval_shape(lambda: Transformer(cfg, None, nnx.Rngs(0)))
    assert count_params(model) == analytics(cfg)["params_total"]


def test_deepseek_preset_counts():
    a = analytics(get_config("deepseek-moe-16b"))
    # DeepSeekMoE 16B: 16.4B total, 2.8B active (Dai et al. 2024, Table 6); this config has every layer MoE (the
    # real first layer is dense) and no biases, so the totals agree to a few per cent
    assert 16.0e9 < a["params_total"] < 17.2e9
    assert 2.6e9 < a["params_active"] < 3.0e9


def test_shared_experts_add_a_dense_mlp_on_every_token():
    blk = _block(n_shared_experts=1, bias=False)
    x = jax.random.normal(jax.random.key(24), (2, 8, 8))
    y, _ = nnx.jit(lambda b, x: b(x))(blk, x)
    routed = nnx.clone(blk)
    routed.n_shared = 0  # the same block without its shared expert
    y0, _ = nnx.jit(lambda b, x: b(x))(routed, x)
    h = x @ blk.w_sh_in_df[...]
    g = x @ blk.w_sh_gate_df[...]
    shared = (jax.nn.silu(g) * h) @ blk.w_sh_out_fd[...]
    assert_close(y - y0, shared, jnp.float32)


def _layer_temp_bytes(cfg, tokens, device=None):
    """memory_analysis temporaries of one MoE layer's forward+backward (small-moe shapes) on one device (a TPU
    device compiles with libtpu: the mesh context tells the layer its platform, as predict's does)."""
    from jax.sharding import Mesh, SingleDeviceSharding

    from partitioning.strategy import get_strategy
    from workbench.cost.compile import compile_program

    policy = get_policy("bf16")
    blk = nnx.eval_shape(lambda: moe.MoEBlock(cfg, policy, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(blk)
    dev = device or jax.devices()[0]
    sh = SingleDeviceSharding(dev)
    abs_state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), state)
    x = jax.ShapeDtypeStruct((tokens // cfg.seq_len, cfg.seq_len, cfg.d_model), jnp.bfloat16, sharding=sh)

    def fwd_bwd(state, x):
        def loss(state, x):
            y, aux = nnx.merge(graphdef, state)(x)
            return jnp.sum(y.astype(jnp.float32) ** 2) + aux["loss"]
        return jax.grad(loss, argnums=(0, 1))(state, x)

    with activation_sharding(Mesh(np.array([dev]), ("data",)), get_strategy("dp").rules):
        return compile_program(fwd_bwd, abs_state, x, analytic=False).cost.temp_bytes


@pytest.mark.compile_heavy
def test_moe_memory_model_within_25_percent_of_memory_analysis_on_cpu():
    """Capacity routing (small-moe's own), XLA:CPU: every array materialised (fused=False). The dropless layer on
    XLA:CPU (the blocked grouped matmul's scan) holds 3.3x what the model counts: not modelled, see docs/moe.md."""
    cfg = get_config("small-moe")
    tokens = 4 * cfg.seq_len
    compiled = _layer_temp_bytes(cfg, tokens)
    model = moe_layer_memory(cfg, tokens, compute_bytes=2, fused=moe_memory_fused(cfg, "cpu"))["peak_bytes"]
    assert 0.75 <= model / compiled <= 1.25, (model, compiled)


@pytest.mark.compile_heavy
@pytest.mark.skipif(not topology.libtpu_available(), reason="libtpu not installed (pip install -e .[tpu])")
@pytest.mark.parametrize("overrides", ["", "capacity_factor=None"])
def test_moe_memory_model_within_25_percent_of_memory_analysis_on_tpu(overrides):
    """libtpu (v6e) at the pod recipe's 32768 tokens per device (Mixtral on v6e-256: 8 x 4096). Capacity: the fused
    buffer set; dropless: megablox gmm, counted as written (a Pallas kernel is opaque to fusion). At small token
    counts the TPU compiler keeps the layer's buffers in VMEM, which memory_analysis (HBM) does not count: there the
    HBM temporaries are a fraction of any buffer count (docs/moe.md)."""
    cfg = get_config("small-moe", overrides or None)
    tokens = 128 * cfg.seq_len
    compiled = _layer_temp_bytes(cfg, tokens, topology.tpu_devices("tpu-v6e:1x1")[0])
    model = moe_layer_memory(cfg, tokens, compute_bytes=2, fused=moe_memory_fused(cfg, "tpu"))["peak_bytes"]
    assert 0.75 <= model / compiled <= 1.25, (model, compiled)


def test_fused_buffer_set_counts_by_hand():
    """fused (libtpu): the gated product lives inside the down projection, the combine gather stays bf16."""
    cfg = get_config("small-moe")
    S, k, E, D, F = 32768, 2, 8, 256, 512
    C = math.ceil(1.25 * S * k / E)
    plain = moe_layer_memory(cfg, S, compute_bytes=2)
    fused = moe_layer_memory(cfg, S, compute_bytes=2, fused=True)
    assert plain["expert_activation_bytes"] == E * C * F * 2 * 3 and fused["expert_activation_bytes"] == E * C * F * 2 * 2
    assert plain["expert_output_bytes"] - fused["expert_output_bytes"] == S * k * D * (4 - 2)
    assert fused["dispatch_buffer_bytes"] == plain["dispatch_buffer_bytes"]
    assert moe_memory_fused(cfg, "tpu") and not moe_memory_fused(cfg, "cpu")
    assert not moe_memory_fused(cfg.replace(capacity_factor=None), "tpu")  # megablox: opaque to fusion
    assert moe_memory_fused(cfg.replace(capacity_factor=None, moe_gmm="blocked"), "tpu")


def test_megablox_tiles_fit_the_scoped_vmem_budget():
    """(512, 1024, 1024) tgmm tiles need ~16 MiB of scoped VMEM (libtpu asked 17.02M against v5p's 16M limit for
    DeepSeek-MoE's d_model 2048 x d_ff 1408): every tiling chosen stays under the budget."""
    for m, k, n in ((65536, 2048, 1408), (65536, 1408, 2048), (65536, 4096, 14336), (4096, 1024, 2048), (96, 64, 64)):
        for transposed in (False, True):
            t = grouped._tiling(m, k, n, transposed)
            assert grouped.megablox_vmem_bytes(t, transposed) <= grouped.MEGABLOX_VMEM_BUDGET, (m, k, n, t)
    assert grouped.megablox_vmem_bytes((512, 1024, 1024), transposed=True) > grouped.MEGABLOX_VMEM_BUDGET


@pytest.mark.compile_heavy
@pytest.mark.skipif(not topology.libtpu_available(), reason="libtpu not installed (pip install -e .[tpu])")
def test_megablox_forward_and_backward_compile_for_v5p_at_deepseek_widths():
    from jax.sharding import SingleDeviceSharding

    sh = SingleDeviceSharding(topology.tpu_devices("tpu-v5p:2x2x1")[0])
    x = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16, sharding=sh)
    w = jax.ShapeDtypeStruct((8, 2048, 1408), jnp.float32, sharding=sh)
    gs = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=sh)

    def f(x, w, gs):
        loss = lambda x, w: jnp.sum(grouped.megablox_matmul(x, w, gs, jnp.bfloat16) ** 2)
        return jax.grad(loss, argnums=(0, 1))(x, w)

    jax.jit(f).lower(x, w, gs).compile()  # raised CompileTimeScopedVmemOom with the (512, 1024, 1024) tgmm tiles
