"""Model family: configs, presets, analytic counts, forward pass against a float64 NumPy reference, KV cache."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.analytics import analytics
from models.config import ModelConfig, parse_overrides
from models.inference import decode_step, prefill
from models.mlp import MLPModel
from models.presets import PRESETS, get_config
from models.transformer import Transformer, count_params
from workbench.errors import WorkbenchError
from workbench.testing import assert_close

LLAMA_TINY = "pos=rope,norm=rmsnorm,mlp=swiglu,n_kv_heads=2,bias=false,tie_embeddings=false"


# ------------------------------------------------------------------------------------------- presets and analytics
@pytest.mark.parametrize("preset,total", [("llama2-7b", 6738415616), ("llama3-8b", 8030261248),
                                          ("llama3-70b", 70553706496), ("mixtral-8x7b", 46702792704)])
def test_preset_params_total_exact(preset, total):
    assert analytics(get_config(preset))["params_total"] == total


def test_mixtral_active_params():
    assert analytics(get_config("mixtral-8x7b"))["params_active"] == 12879925248


def test_every_preset_cites_a_source_and_small_is_demo_sized():
    for name, (_, src) in PRESETS.items():
        assert len(src) > 20, name
    assert 10e6 <= analytics(get_config("small"))["params_total"] <= 15e6


VARIANTS = [("tiny", ""), ("small", ""), ("tiny", LLAMA_TINY), ("tiny", "bias=true,mlp=swiglu,tie_embeddings=false"),
            ("gpt2-small", ""), ("tiny", "n_experts=4,top_k=2"), ("tiny", LLAMA_TINY + ",n_experts=4,top_k=1"),
            ("tiny", LLAMA_TINY + ",block=parallel")]


@pytest.mark.parametrize("preset,overrides", VARIANTS)
def test_instantiated_params_equal_analytics(preset, overrides):
    cfg = get_config(preset, overrides)
    model = nnx.eval_shape(lambda: Transformer(cfg, None, nnx.Rngs(0)))  # abstract: no memory
    assert count_params(model) == analytics(cfg)["params_total"]


def test_flops_formula_by_hand():
    cfg = get_config("tiny", "tie_embeddings=false")
    L, d, f, v, s = 2, 64, 256, 256, 64
    n_matmul = L * (4 * d * d + 2 * d * f) + v * d
    a = analytics(cfg)
    assert a["train_flops_per_token"] == 6 * n_matmul + 12 * L * d * s
    assert a["train_flops_per_token_causal"] == 6 * n_matmul + 6 * L * d * s
    assert a["forward_flops_per_token"] * 3 == a["train_flops_per_token"]
    assert a["kv_cache_bytes_per_token"]["bfloat16"] == 2 * L * d * 2


def test_forward_flops_match_compiled_program():
    """Analytic forward FLOPs (matmuls + full attention) vs XLA's count of the compiled forward, within 10%."""
    cfg = get_config("tiny", "d_model=128,d_ff=512,tie_embeddings=false")
    model = Transformer(cfg, None, nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((2, cfg.seq_len), jnp.int32)
    fwd = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t)[0])
    cost = fwd.lower(state, tokens).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    expected = analytics(cfg)["forward_flops_per_token"] * 2 * cfg.seq_len
    assert abs(cost["flops"] - expected) / expected < 0.10, (cost["flops"], expected)


def test_config_validation_is_one_line():
    for bad in [dict(n_heads=3), dict(n_layers=0), dict(mlp="relu"), dict(n_kv_heads=3), dict(n_experts=1),
                dict(n_experts=4, top_k=5), dict(pos="rope", head_dim=15, n_heads=4), dict(capacity_factor=0.0)]:
        with pytest.raises(WorkbenchError) as e:
            ModelConfig(**bad)
        assert "\n" not in str(e.value)
    with pytest.raises(WorkbenchError, match="unknown model config key 'n_layer'"):
        get_config("tiny", "n_layer=3")
    with pytest.raises(WorkbenchError, match="unknown model preset"):
        get_config("gpt5")
    with pytest.raises(WorkbenchError, match="true or false"):
        get_config("tiny", "bias=maybe")
    assert parse_overrides("n_layers=3, bias=false,capacity_factor=none") == {
        "n_layers": 3, "bias": False, "capacity_factor": None}
    assert get_config("tiny", {"d_model": 32}).head_dim == 8


# ------------------------------------------------------------------------------------------- forward vs reference
def _np(x):
    return np.asarray(x, np.float64)


def _reference_forward(model, tokens):
    """Plain float64 NumPy forward pass of models.transformer.Transformer (loops over heads, no einsum tricks)."""
    cfg = model.cfg
    b, t = tokens.shape
    n, k, h = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def norm(x, mod):
        if cfg.norm == "layernorm":
            mu = x.mean(-1, keepdims=True)
            var = ((x - mu) ** 2).mean(-1, keepdims=True)
            return (x - mu) / np.sqrt(var + cfg.norm_eps) * _np(mod.scale_d[...]) + _np(mod.bias_d[...])
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + cfg.norm_eps) * _np(mod.scale_d[...])

    def rope(x):  # x (b, t, heads, h)
        freq = 1.0 / cfg.rope_theta ** (np.arange(0, h, 2) / h)
        ang = np.arange(t)[:, None] * freq[None, :]
        c, s = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
        x1, x2 = x[..., : h // 2], x[..., h // 2:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    x = _np(model.w_vd[...])[tokens]
    if cfg.pos == "learned":
        x = x + _np(model.w_sd[...])[:t][None]
    for blk in model.blocks:
        a = blk.attn
        y = norm(x, blk.norm_attn)
        q = np.einsum("btd,dnh->btnh", y, _np(a.w_dnh[...]))
        kk = np.einsum("btd,dkh->btkh", y, _np(a.w_dkh_k[...]))
        vv = np.einsum("btd,dkh->btkh", y, _np(a.w_dkh_v[...]))
        if cfg.bias:
            q, kk, vv = q + _np(a.b_nh[...]), kk + _np(a.b_kh_k[...]), vv + _np(a.b_kh_v[...])
        if cfg.pos == "rope":
            q, kk = rope(q), rope(kk)
        o = np.zeros((b, t, n, h))
        for head in range(n):
            kv = head // (n // k)
            for bi in range(b):
                for ti in range(t):
                    sc = kk[bi, : ti + 1, kv] @ q[bi, ti, head] / math.sqrt(h)
                    p = np.exp(sc - sc.max())
                    p /= p.sum()
                    o[bi, ti, head] = p @ vv[bi, : ti + 1, kv]
        att = np.einsum("btnh,nhd->btd", o, _np(a.w_nhd[...]))
        x = x + att + (_np(a.b_d[...]) if cfg.bias else 0)
        m = blk.mlp
        y = norm(x, blk.norm_mlp)
        u = y @ _np(m.w_df[...]) + (_np(m.b_f[...]) if cfg.bias else 0)
        if cfg.mlp == "gelu":
            act = 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
        else:
            g = y @ _np(m.w_df_gate[...])
            act = g / (1 + np.exp(-g)) * u
        x = x + act @ _np(m.w_fd[...]) + (_np(m.b_d[...]) if cfg.bias else 0)
    x = norm(x, model.norm_f)
    w = _np(model.w_vd[...]).T if cfg.tie_embeddings else _np(model.w_dv[...])
    return x @ w


@pytest.mark.parametrize("overrides", ["n_layers=1,seq_len=16", LLAMA_TINY + ",n_layers=1,seq_len=16"])
def test_forward_matches_float64_reference(overrides):
    cfg = get_config("tiny", overrides)
    model = Transformer(cfg, "float32", nnx.Rngs(3))
    # larger weights than the init so the test sees non-trivial attention patterns
    for path, v in nnx.iter_graph(model):
        if isinstance(v, nnx.Param) and v[...].ndim >= 2:
            v[...] = v[...] * 10
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size))
    logits, aux = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens))
    assert aux == {}
    ref = _reference_forward(model, tokens)
    assert_close(logits, ref, "float32", scale=10)


def test_causal_future_tokens_do_not_leak():
    cfg = get_config("tiny", LLAMA_TINY)
    model = Transformer(cfg, None, nnx.Rngs(0))
    t = jax.random.randint(jax.random.key(2), (1, 32), 0, 256)
    t2 = t.at[0, 20:].set((t[0, 20:] + 7) % 256)
    fwd = nnx.jit(lambda m, t: m(t)[0])
    a, b = fwd(model, t), fwd(model, t2)
    np.testing.assert_array_equal(np.asarray(a[0, :20]), np.asarray(b[0, :20]))
    assert not np.allclose(np.asarray(a[0, 20:]), np.asarray(b[0, 20:]))


@pytest.mark.parametrize("overrides", ["n_layers=1,seq_len=256", LLAMA_TINY + ",n_layers=1,seq_len=512"])
def test_causal_row_blocks_match_full_attention(overrides):
    """Row-blocked causal attention (keys past each block never computed) equals the full masked softmax, values and
    gradients; 256 positions split into 2 blocks, 512 into 4 (with grouped-query heads)."""
    cfg = get_config("tiny", overrides)
    attn = Transformer(cfg, None, nnx.Rngs(0)).blocks[0].attn
    t = cfg.seq_len
    assert attn.causal_blocks(t) == t // 128
    b, n, k, h = 2, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q, kk, v = (jax.random.normal(jax.random.key(i), (b, t, m, h)) for i, m in ((1, n), (2, k), (3, k)))
    causal = jnp.tril(jnp.ones((t, t), bool))[None]
    w = jax.random.normal(jax.random.key(4), (b, t, n, h))

    def loss(q, kk, v, blocks):
        return (attn.attend(q, kk, v, causal, causal_blocks=blocks) * w).sum()

    full = jax.jit(jax.value_and_grad(lambda *a: loss(*a, 1), argnums=(0, 1, 2)))(q, kk, v)
    split = jax.jit(jax.value_and_grad(lambda *a: loss(*a, t // 128), argnums=(0, 1, 2)))(q, kk, v)
    assert_close(split[0], full[0], "float32", scale=10)
    for gs, gf in zip(split[1], full[1]):
        assert_close(gs, gf, "float32", scale=10)


@pytest.mark.parametrize("overrides", ["n_layers=1", LLAMA_TINY + ",n_layers=1"])
def test_kv_cache_decode_matches_full_forward(overrides):
    cfg = get_config("tiny", overrides)
    model = Transformer(cfg, None, nnx.Rngs(0))
    tok = jax.random.randint(jax.random.key(1), (2, 12), 0, 256)
    full, _ = nnx.jit(lambda m, t: m(t))(model, tok)
    logits, cache = nnx.jit(lambda m, t: prefill(m, t, max_len=16))(model, tok[:, :10])
    assert_close(logits, full[:, :10], "float32")
    decode = nnx.jit(decode_step)
    l1, cache = decode(model, tok[:, 10:11], cache)
    l2, cache = decode(model, tok[:, 11:12], cache)
    assert_close(l1[:, 0], full[:, 10], "float32")
    assert_close(l2[:, 0], full[:, 11], "float32")
    assert cache["lengths"].tolist() == [12, 12]
    if cfg.pos == "learned":
        with pytest.raises(WorkbenchError, match="learned positions"):
            prefill(model, tok, max_len=1000)


@pytest.mark.parametrize("remat,scan", [("per-layer", False), ("dots", False), ("dots", True), ("minimal", True)])
def test_remat_gives_the_same_gradients(remat, scan):
    cfg = get_config("tiny", f"n_layers=2,seq_len=16,scan_layers={str(scan).lower()}")
    tok = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)

    def grads(c):
        m = Transformer(c, None, nnx.Rngs(0))
        return nnx.jit(nnx.grad(lambda m: jnp.square(m(tok)[0].astype(jnp.float32)).mean()))(m)

    g0, g1 = grads(cfg), grads(cfg.replace(remat=remat))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        assert_close(a, b, "float32")


def test_mlp_model_matches_reference():
    model = MLPModel(d_model=16, d_ff=32, n_layers=2, rngs=nnx.Rngs(0))
    x = np.asarray(jax.random.normal(jax.random.key(0), (4, 16)))
    y, aux = model(jnp.asarray(x))
    ref = x.astype(np.float64)
    for blk in model.blocks:
        u = ref @ _np(blk.w_df[...]) + _np(blk.b_f[...])
        act = 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
        ref = ref + act @ _np(blk.w_fd[...]) + _np(blk.b_d[...])
    assert_close(y, ref, "float32")
    assert aux == {}


def test_parameters_carry_logical_axes():
    from partitioning.rules import LOGICAL_AXES

    model = nnx.eval_shape(lambda: Transformer(get_config("tiny", LLAMA_TINY), None, nnx.Rngs(0)))
    for path, v in nnx.iter_graph(model):
        if isinstance(v, nnx.Param):
            axes = v.get_metadata().get("out_sharding")
            assert axes is not None and len(axes) == v.ndim, path
            assert all(a is None or a in LOGICAL_AXES for a in axes), path


def _stack_loop_params_into(loop_model, scan_model):
    """Copy an unrolled model's per-layer parameters into a scanned model's stacked ones."""
    pure = nnx.to_pure_dict(nnx.state(loop_model, nnx.Param))
    blocks = pure.pop("blocks")
    pure["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *[blocks[i] for i in sorted(blocks)])
    state = nnx.state(scan_model, nnx.Param)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(scan_model, state)


@pytest.mark.parametrize("overrides", [LLAMA_TINY])
def test_scanned_layers_match_unrolled(overrides):
    cfg = get_config("tiny", overrides + ",seq_len=16" if overrides else "seq_len=16")
    loop = Transformer(cfg, None, nnx.Rngs(0))
    scan = Transformer(cfg.replace(scan_layers=True), None, nnx.Rngs(1))
    assert count_params(scan) == count_params(loop) == analytics(cfg)["params_total"]
    _stack_loop_params_into(loop, scan)
    tok = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    loss = lambda m: jnp.square(m(tok)[0].astype(jnp.float32)).mean()
    g_loop = nnx.jit(nnx.grad(loss))(loop)
    g_scan = nnx.jit(nnx.grad(loss))(scan)
    assert_close(nnx.jit(loss)(scan), nnx.jit(loss)(loop), "float32")
    gl = nnx.to_pure_dict(g_loop)
    gs = nnx.to_pure_dict(g_scan)
    for i in sorted(gl["blocks"]):
        jax.tree.map(lambda a, b: assert_close(b[i], a, "float32", scale=10), gl["blocks"][i], gs["blocks"])
    assert_close(gs["w_vd"], gl["w_vd"], "float32", scale=10)
    # KV-cache decoding works on stacked layers too
    logits, cache = nnx.jit(lambda m, t: prefill(m, t, max_len=16))(scan, tok[:, :15])
    l1, _ = nnx.jit(decode_step)(scan, tok[:, 15:16], cache)
    full, _ = nnx.jit(lambda m, t: m(t))(scan, tok)
    assert_close(l1[:, 0], full[:, 15], "float32")


def test_a_parallel_block_adds_attention_and_mlp_of_one_normed_input():
    """block=parallel (GPT-J, PaLM, MaxText's default decoder layer): x + attn(norm(x)) + mlp(norm(x)) with one norm,
    against the block's own sublayers applied by hand in float64; a sequential block differs."""
    from models.layers import Block
    from models.precision import get_policy
    cfg = get_config("tiny", LLAMA_TINY + ",block=parallel")
    blk = Block(cfg, get_policy("float32"), nnx.Rngs(3))
    assert not hasattr(blk, "norm_mlp")
    x = jax.random.normal(jax.random.key(0), (2, 16, cfg.d_model), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
    h = blk.norm_attn(x)
    want = _np(x).astype(np.float64) + _np(blk.attn(h, pos)) + _np(blk.mlp(h)[0])
    got, _ = blk(x, pos)
    assert_close(_np(got), want, jnp.float32)
    seq = Block(get_config("tiny", LLAMA_TINY), get_policy("float32"), nnx.Rngs(3))
    assert np.abs(_np(seq(x, pos)[0]) - want).max() > 1e-3


@pytest.mark.parametrize("block", ["sequential", "parallel"])
def test_a_block_adds_in_the_residual_streams_dtype_or_in_float32(block):
    """residual_add=stream (the default): a bf16 stream gets bf16 adds (no float32 tensor of the stream's shape in
    the block's program), as MaxText, Megatron and torchtitan add; residual_add=float32 adds in float32."""
    from models.layers import Block
    from models.precision import get_policy

    def adds_of_the_input(residual_add):
        cfg = get_config("tiny", f"block={block},residual_add={residual_add}")
        blk = Block(cfg, get_policy("bf16"), nnx.Rngs(0))
        x = jnp.zeros((2, 16, cfg.d_model), jnp.bfloat16)
        pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
        closed = jax.make_jaxpr(lambda x: blk(x, pos)[0])(x)
        x_in = closed.jaxpr.invars[0]
        adds = [str(e.outvars[0].aval.dtype) for e in closed.jaxpr.eqns if e.primitive.name == "add" and x_in in e.invars]
        return adds, closed.out_avals[0].dtype

    assert adds_of_the_input("stream") == (["bfloat16"], jnp.bfloat16)  # x itself added, in bf16
    assert adds_of_the_input("float32") == ([], jnp.float32)  # x widened first
