"""The serving engine against plain references: the cached forward against the full forward, speculative decoding
against greedy decoding, continuous batching against one request at a time, the decode step's cache written in place
(read from the compiled program), quantized weights against float32 ones."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import inference
from models.presets import get_config
from models.serving import Engine, Request, Sampling, Steps, greedy_generate, sample, speculative_generate, weight_bytes
from models.transformer import Transformer
from partitioning import topology as topo
from workbench.cost import hlo
from workbench.errors import WorkbenchError
from workbench.testing import assert_close

LLAMA_TINY = "mlp=swiglu,norm=rmsnorm,pos=rope,bias=false,tie_embeddings=false,n_kv_heads=2"


def _model(overrides=None, seed=0):
    return Transformer(get_config("tiny", overrides), "float32", nnx.Rngs(seed))


@pytest.mark.parametrize("overrides", ["scan_layers=true", LLAMA_TINY])
def test_ragged_prefill_then_decode_matches_the_full_forward(overrides):
    """Rows of one batch hold prompts of different lengths (right-padded): each row's logits equal the full forward's
    at its own positions; a scanned model unrolled for serving computes the same."""
    model = _model(overrides)
    tok = jax.random.randint(jax.random.key(1), (2, 12), 0, 256).astype(jnp.int32)
    full, _ = model(tok)
    u = inference.unrolled(model)
    padded = tok[:, :8].at[1, 5:].set(0)
    logits, cache = inference.prefill(u, padded, max_len=16, lengths_b=jnp.array([8, 5]), last_only=True)
    assert_close(logits[:, 0], jnp.stack([full[0, 7], full[1, 4]]), "float32")
    assert cache["lengths"].tolist() == [8, 5]
    logits, cache = inference.decode_step(u, jnp.stack([tok[0, 8], tok[1, 5]])[:, None], cache)
    assert_close(logits[:, 0], jnp.stack([full[0, 8], full[1, 5]]), "float32")
    assert cache["lengths"].tolist() == [9, 6]


@pytest.mark.parametrize("kv,dtype", [("bfloat16", "bfloat16"), ("float8", "float8_e4m3fn"), ("int8", "bfloat16")])
def test_quantized_kv_cache_stays_close(kv, dtype):
    model = _model(LLAMA_TINY)
    tok = jax.random.randint(jax.random.key(2), (2, 9), 0, 256).astype(jnp.int32)
    full, _ = model(tok)
    _, cache = inference.prefill(model, tok[:, :8], max_len=16, kv_dtype=kv)
    logits, _ = inference.decode_step(model, tok[:, 8:9], cache)
    assert_close(logits[:, 0], full[:, 8], dtype, scale=3)


def _decode_bytes_slope(st, batch, keys_transposed=None):
    """(bytes the compiled decode step moves per byte of cache, its bytes at the smaller cache): two caches of 64
    and 256 positions; each compiled step must alias every cache buffer to its output."""
    from workbench.cost.compile import compile_program
    from workbench.programs.serve import kernel_bytes

    moved, kv = [], []
    for s in (64, 256):
        cache = inference.init_cache(st._template, batch, s, st.kv_dtype, keys_transposed=keys_transposed)
        comp = compile_program(jax.jit(st.decode, donate_argnums=3), st.params, st.rest,
                               jnp.zeros((batch,), jnp.int32), cache)
        header = comp.hlo_text.split("input_output_alias={", 1)[1].split("entry_computation_layout", 1)[0]
        assert header.count("-alias)") >= 2 * st.cfg.n_layers
        moved.append(kernel_bytes(comp.cost))
        kv.append(inference.cache_bytes(cache))
    return (moved[1] - moved[0]) / (kv[1] - kv[0]), moved[0]


@pytest.mark.parametrize("batch", [1, 16])
def test_decode_writes_the_cache_in_place(batch):
    """The compiled decode step aliases every cache buffer to its output, and its bytes grow with the cache by about
    one read of it (attention), never by the read and write a copy of the cache per token would add. On the CPU a
    cache of few rows keeps its keys transposed (the default there): kept like the values, XLA:CPU copies every
    layer's keys into the score product's order at batch 1 (three reads of them per step); at 16 rows it reads them
    in place."""
    st = Steps(_model(LLAMA_TINY + ",d_model=128,d_ff=512"))
    assert jax.default_backend() == "cpu"
    assert ("k_t" in st.init_cache(batch, 8)) == (batch <= inference.TRANSPOSED_KEYS_ROWS)
    slope, moved = _decode_bytes_slope(st, batch)
    assert 0.9 < slope < 1.6, slope
    assert moved > weight_bytes(st.params)
    if batch == 1:
        assert _decode_bytes_slope(st, batch, keys_transposed=False)[0] > 2.0


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_transposed_keys_decode_like_keys_kept_as_the_values(kv):
    """Both key layouts of the cache (models/inference.py) give the same logits and the same keys, prefill and
    decode, float32 and int8."""
    model = inference.unrolled(_model(LLAMA_TINY))
    tok = jax.random.randint(jax.random.key(4), (2, 11), 0, 256).astype(jnp.int32)
    out = {}
    for kt in (True, False):
        cache = inference.init_cache(model, 2, 16, kv, keys_transposed=kt)
        logits, cache = inference.prefill(model, tok[:, :8], cache=cache, lengths_b=jnp.array([8, 6]), fresh=True)
        steps = [logits[:, -1]]
        for i in range(8, 11):
            logits, cache = inference.decode_step(model, tok[:, i:i + 1], cache)
            steps.append(logits[:, 0])
        keys = [c if kt else jnp.swapaxes(c, 2, 3) for c in cache["k_t" if kt else "k"]]
        out[kt] = (jnp.stack(steps), keys)
    assert_close(out[True][0], out[False][0], "float32")
    for a, b in zip(out[True][1], out[False][1]):
        assert_close(a.astype(jnp.float32), b.astype(jnp.float32), "float32")


def test_speculative_decoding_gives_the_target_greedy_tokens():
    target = Steps(_model("seq_len=128"))
    draft = Steps(_model("seq_len=128,n_layers=1", seed=7))
    prompts = jax.random.randint(jax.random.key(3), (2, 10), 0, 256).astype(jnp.int32)
    ref = greedy_generate(target, prompts, 20, 64)
    out, stats = speculative_generate(target, draft, prompts, 20, 3, 64)
    np.testing.assert_array_equal(out, ref)
    assert 0.0 <= stats["acceptance_rate"] <= 1.0 and 1.0 <= stats["tokens_per_round"] <= 4.0
    ref_plain = inference.generate(target._template, prompts, 20, max_len=64)
    np.testing.assert_array_equal(out, np.asarray(ref_plain))


def test_continuous_batching_equals_one_request_at_a_time_and_is_deterministic():
    model = _model("seq_len=64")
    rng = np.random.default_rng(0)
    reqs = [Request(i, rng.integers(0, 256, size=3 + 2 * i).astype(np.int32), 2 + 3 * (i % 3)) for i in range(5)]
    runs = [Engine(model, slots=2, max_len=32).serve(reqs) for _ in range(2)]
    assert [(d.id, d.admitted_step, d.finished_step) for d in runs[0]] == \
           [(d.id, d.admitted_step, d.finished_step) for d in runs[1]]
    for d in runs[0]:
        r = reqs[d.id]
        alone = inference.generate(model, jnp.asarray(r.prompt)[None], r.max_new, max_len=32)
        assert d.tokens == np.asarray(alone[0, len(r.prompt):]).tolist(), d.id
    with pytest.raises(WorkbenchError, match="do not fit"):
        Engine(model, slots=1, max_len=8).serve([Request(0, np.zeros(6, np.int32), 4)])


@pytest.mark.parametrize("quant,ratio", [("int8", 0.3), ("int4", 0.2), ("fp8", 0.3)])
def test_quantized_weights_are_smaller_and_close(quant, ratio):
    model = _model(LLAMA_TINY)
    base, q = Steps(model), Steps(model, quant=quant)
    tok = jax.random.randint(jax.random.key(4), (2, 8), 0, 256).astype(jnp.int32)
    cache = base.init_cache(2, 16)
    ref, _ = base.prefill(base.params, base.rest, tok, jnp.array([8, 8]), cache)
    got, _ = q.prefill(q.params, q.rest, tok, jnp.array([8, 8]), q.init_cache(2, 16))
    err = float(jnp.abs(got - ref).max() / jnp.abs(ref).max())
    assert err < {"int8": 0.02, "int4": 0.2, "fp8": 0.08}[quant], err
    # the matmul weights shrink 4x (int8, fp8) or 8x (int4) from float32; embeddings and norms do not
    assert weight_bytes(q.params) < (1 - ratio) * weight_bytes(base.params)


def _reference_dequantized(w, bound, group_axes, group):
    """float64 reference of symmetric absmax quantization: a scale per output channel (the last axis) and per group
    of `group` consecutive elements of the flattened input axes (the leading `group_axes` axes); the absmax maps to
    qmax + 0.5 (Qwix's convention). Returns the dequantized weight, each element's scale, and where w / scale lies
    within float32 rounding of a half (a tie the float32 quantizer may round either way: the -absmax element of
    every group is one)."""
    w64 = np.asarray(w, np.float64)
    k = int(np.prod(w64.shape[:group_axes]))
    g = w64.reshape(k // group, group, -1)
    scale = np.abs(g).max(axis=1, keepdims=True) / bound
    x = g / scale
    q = np.clip(np.round(x), -np.ceil(bound), np.floor(bound))  # the integer type's range: [-128, 127]
    tie = np.abs(np.abs(x) % 1 - 0.5) < 1e-4
    return ((q * scale).reshape(w64.shape), np.broadcast_to(scale, g.shape).reshape(w64.shape),
            tie.reshape(w64.shape))


@pytest.mark.parametrize("quant,bound", [("int8", 127.5), ("int8:g16", 127.5), ("int4:g32", 7.5), ("int4:g8", 7.5)])
def test_qwix_weights_match_a_float64_per_group_reference(quant, bound):
    """Each matmul weight, quantized by Qwix and dequantized in the step, equals a float64 reference of per-channel or
    per-group symmetric quantization (ties within one step); w_nhd's groups run over heads x head_dim flattened."""
    from models.serving import dequantize_params, parse_quant, quantize_params

    model = _model(LLAMA_TINY)
    s = Steps(model)
    deq = dequantize_params(quantize_params(s.params, quant), jnp.float32)
    flat, got = dict(nnx.to_flat_state(s.params)), dict(nnx.to_flat_state(deq))
    group = parse_quant(quant)[1]
    for path, n_in in [(("blocks", 0, "mlp", "w_df"), 1), (("blocks", 1, "mlp", "w_fd"), 1),
                       (("blocks", 0, "attn", "w_nhd"), 2), (("blocks", 1, "attn", "w_dnh"), 1)]:
        w = flat[path].get_value()
        ref, scale, tie = _reference_dequantized(w, bound, n_in, group or int(np.prod(w.shape[:n_in])))
        out = np.asarray(got[path].get_value(), np.float64)
        assert_close(out[~tie], ref[~tie], "float32")
        assert np.all(np.abs(out - ref)[tie] <= scale[tie] * 1.0001), path
    # embeddings and norms are not quantized
    np.testing.assert_array_equal(got[("w_vd",)].get_value(), flat[("w_vd",)].get_value())


def test_int4_groups_bring_a_dot_closer_to_float64():
    """x . W with int4 weights against the float64 product: groups of 32 inputs beat one scale per output channel."""
    from models.serving import dequantize_params, quantize_params

    model = _model(LLAMA_TINY)
    s = Steps(model)
    x = np.asarray(jax.random.normal(jax.random.key(7), (8, 64)), np.float64)
    path = ("blocks", 0, "mlp", "w_df")
    w = np.asarray(dict(nnx.to_flat_state(s.params))[path].get_value(), np.float64)
    ref = x @ w
    err = {}
    for quant in ("int8", "int4", "int4:g32", "int4:g8"):
        wq = dict(nnx.to_flat_state(dequantize_params(quantize_params(s.params, quant), jnp.float32)))[path]
        got = np.asarray(jnp.asarray(x, jnp.float32) @ wq.get_value(), np.float64)
        err[quant] = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err["int8"] < 0.01 < err["int4"] < 0.2, err
    assert err["int4:g8"] < err["int4:g32"] < err["int4"], err


@pytest.mark.parametrize("quant,msg", [("int3", "unknown weight quantization"), ("int4:g0", "positive integer"),
                                       ("none:g8", "positive integer"), ("int4:gx", "positive integer"),
                                       ("int4:g48", "does not tile")])
def test_bad_quantization_names_the_fix(quant, msg):
    from models.serving import quantize_params

    with pytest.raises(WorkbenchError, match=msg):
        quantize_params(Steps(_model(LLAMA_TINY)).params, quant)


def test_sampling_limits():
    logits = jnp.log(jnp.array([[0.05, 0.6, 0.3, 0.05]] * 4))
    key = jax.random.key(0)
    greedy = sample(logits, key, Sampling())
    assert greedy.tolist() == [1] * 4
    assert sample(logits, key, Sampling(temperature=1.0, top_k=1)).tolist() == [1] * 4
    assert sample(logits, key, Sampling(temperature=1.0, top_p=0.5)).tolist() == [1] * 4
    draws = sample(jnp.repeat(logits, 256, axis=0), key, Sampling(temperature=1.0, top_k=2))
    assert set(np.asarray(draws).tolist()) == {1, 2}
    with pytest.raises(WorkbenchError):
        Sampling(top_p=0.0)


def test_paged_cache_equals_the_contiguous_one():
    """Rows whose pages are scattered over the pool (a shuffled page table) give the contiguous cache's logits, in
    prefill and over several decode steps."""
    from models import paged

    model = inference.unrolled(_model(LLAMA_TINY))
    tok = jax.random.randint(jax.random.key(5), (2, 14), 0, 256).astype(jnp.int32)
    pc = paged.init_paged(model, 2, 32, page_size=4, n_pages=20)
    pc["page_table"] = jnp.asarray(np.random.default_rng(0).permutation(20)[:16].reshape(2, 8), jnp.int32)
    cc = inference.init_cache(model, 2, 32)
    lp, pc = paged.paged_forward(model, tok[:, :10], pc)
    lc, cc = inference.forward(model, tok[:, :10], cc)
    assert_close(lp, lc, "float32")
    pc["lengths"] = cc["lengths"] = jnp.array([10, 10])
    for i in range(10, 14):
        lp, pc = paged.paged_forward(model, tok[:, i:i + 1], pc)
        lc, cc = inference.forward(model, tok[:, i:i + 1], cc)
        assert_close(lp, lc, "float32")
        pc["lengths"] = cc["lengths"] = cc["lengths"] + 1
    frag = paged.fragmentation([(5, 0, 3), (30, 0, 10), (8, 4, 12)], slots=2, max_len=64, page_size=4)
    assert frag["paged_positions_peak"] < frag["contiguous_positions"]


def test_the_paged_attention_kernel_decodes_like_the_contiguous_cache():
    """JAX's Pallas TPU paged attention (TPU interpret mode on the CPU) over a shuffled page table, rows of different
    lengths, grouped-query heads: each decode step's logits equal the contiguous cache's (to the kernel's matmul
    precision), and the pages hold the same keys and values as the gather form writes."""
    from models import paged

    model = inference.unrolled(_model(LLAMA_TINY + ",head_dim=128"))
    tok = jax.random.randint(jax.random.key(6), (2, 14), 0, 256).astype(jnp.int32)
    lengths = jnp.array([6, 10], jnp.int32)
    table = jnp.asarray(np.random.default_rng(1).permutation(16).reshape(2, 8), jnp.int32)
    pk = paged.init_paged(model, 2, 32, page_size=4)
    pk["page_table"] = table
    cc = inference.init_cache(model, 2, 32)
    _, pk = paged.paged_forward(model, tok[:, :10], pk)
    _, cc = inference.forward(model, tok[:, :10], cc)
    pg = dict(pk)
    pk["lengths"] = pg["lengths"] = cc["lengths"] = lengths
    for i in range(10, 13):
        lk, pk = paged.paged_decode(model, tok[:, i], pk, interpret=True)
        lg, pg = paged.paged_forward(model, tok[:, i:i + 1], pg)
        lc, cc = inference.forward(model, tok[:, i:i + 1], cc)
        # the kernel's products are not float32-exact (interpret mode as on a TPU at its default matmul precision:
        # 8e-3 on unit-scale inputs against a float64 reference, as bf16 operands give): the bf16 tolerance
        assert_close(lk, lc, "bfloat16")
        assert_close(lg, lc, "float32")
        for layer, (a, b) in enumerate(zip(pk["k"] + pk["v"], pg["k"] + pg["v"])):
            # the first layer's new keys and values come from the embedding alone; later ones carry the difference
            assert_close(a, b, "float32" if layer % len(pk["k"]) == 0 else "bfloat16")
        pk["lengths"] = pg["lengths"] = cc["lengths"] = cc["lengths"] + 1
    with pytest.raises(WorkbenchError, match="one token per row"):
        paged.paged_decode(model, tok[:, :2], pk, interpret=True)


@pytest.mark.compile_heavy
@pytest.mark.skipif(not topo.libtpu_available(), reason="libtpu not installed (pip install -e .[tpu])")
def test_a_tpu_decode_step_attends_its_pages_with_one_priced_kernel_per_layer():
    """Compiled by libtpu for tpu-v5e:2x2 (deviceless, tp: each chip one of the 4 heads): the paged decode step runs
    one Pallas paged-attention kernel per layer, priced by the analytic count (marked as such), its bytes those of
    the contiguous cache's decode within 10 % (the pages are read once, as the cache is), and it fits."""
    from workbench.programs import predict as wp

    topo.setup_target_devices("tpu-v5e:2x2")

    def run(page_size):
        spec = wp.PredictSpec("tiny", "tpu-v5e:2x2", "tp", batch=8, seq=64, mode="decode", overrides="head_dim=128",
                              page_size=page_size)
        lw = wp.lower(spec)
        compiled, secs, err = wp.compile_lowered(lw)
        assert err is None, err
        return wp.predict_lowered(lw, compiled, secs), compiled.as_text()

    (pg, text), (cont, _) = run(16), run(0)
    calls = [u for u in hlo.custom_calls(text) if u.target == "tpu_custom_call"]
    assert len(calls) == 1 and calls[0].count == 2 and calls[0].priced and calls[0].analytic, calls
    assert "paged attention" in calls[0].note and "tpu_custom_call" not in pg.record["unpriced_custom_calls"]
    kernel = sum(k.flops * k.count for k in pg.cost.kernels if k.library == "tpu_custom_call")
    rows, heads, positions, h = 8, 1, 64, 128  # per chip: every row, one of the 4 heads, 4 pages of 16
    assert kernel == 2 * (2 * 2 * rows * heads * positions * h + rows * heads * positions)
    kernel_bytes = lambda p: sum(k.bytes * k.count for k in p.cost.kernels)  # the reader's: updates in place
    assert pg.record["fits"] and abs(kernel_bytes(pg) / kernel_bytes(cont) - 1) < 0.1


def test_speculative_sampling_keeps_the_target_distribution():
    """Rejection sampling: over 2,000 independent rows on an 8-token vocabulary, the second generated token (decided
    inside a speculative round) follows the target's exact marginal, which differs widely from the draft's."""
    cfg = get_config("tiny", LLAMA_TINY.replace(",n_kv_heads=2", "") + ",vocab_size=8,seq_len=32")
    target = Steps(Transformer(cfg, "float32", nnx.Rngs(0)))
    draft = Steps(Transformer(cfg.replace(n_layers=1), "float32", nnx.Rngs(5)))
    temp, n, prompt = 0.1, 2000, [1, 2, 3, 4]
    out, stats = speculative_generate(target, draft, jnp.tile(jnp.array([prompt], jnp.int32), (n, 1)), 3, 2, 16,
                                      temperature=temp, seed=1)
    assert 0 < stats["acceptance_rate"] < 1

    def probs(model, seq):
        logits, _ = model(jnp.asarray(seq)[None])
        return np.asarray(jax.nn.softmax(logits[0, -1] / temp), np.float64)

    p1 = probs(target._template, prompt)
    p2 = sum(p1[x] * probs(target._template, prompt + [x]) for x in range(8))
    q2 = sum(p1[x] * probs(draft._template, prompt + [x]) for x in range(8))
    tv = lambda a, b: 0.5 * np.abs(a - b).sum()
    assert tv(np.bincount(out[:, 4], minlength=8) / n, p1) < 0.06
    assert tv(np.bincount(out[:, 5], minlength=8) / n, p2) < 0.06
    assert tv(q2, p2) > 0.3  # a sampler that kept the draft's proposals would fail the line above
