"""workbench.programs.predict: bad input is one line; tiny compiles for TPU topologies and a GPU node; every term of the
prediction recomputed by hand from the record and the published peaks; memory that cannot fit is reported
(pre-check and compiler), never a crash."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.analytics import analytics
from partitioning import topology as topo
from partitioning.strategy import get_strategy
from workbench.cost.hlo import CollectiveOp, torus_axes_of_group
from workbench.cost.report import CostReport
from workbench.errors import WorkbenchError
from workbench.hardware.spec import catalogue_spec
from workbench.programs import predict as wp
from workbench.results.store import Store
from workbench.roofline.prediction import predict

from .roofline_by_hand import check_terms, hand_model_flops

needs_libtpu = pytest.mark.skipif(not topo.libtpu_available(), reason="libtpu not installed (pip install -e .[tpu])")


@pytest.mark.parametrize("kw,words", [
    (dict(batch=6), "not divisible by the data axes"),
    (dict(batch=8, microbatches=3), "does not divide the per-shard batch"),
    (dict(mode="serve"), "unknown mode"),
    (dict(mesh="data=2,model=4"), "has 4 chips"),
    (dict(mesh="dat=4"), "unknown mesh axis"),
    (dict(strategy="zero9"), "unknown strategy"),
    (dict(target="tpu-v5e:3x3"), "does not come in a 3x3"),
    (dict(preset="gpt5"), "unknown model preset"),
    (dict(strategy="ep"), "mixture-of-experts"),
    (dict(remat="sometimes"), "unknown remat policy 'sometimes'; choose none, full, per-layer, dots, minimal"),
    (dict(remat="query_proj=host"), "choose remat, device, offload"),
    (dict(shard_activations=True), "has none: use tp, fsdp+tp"),
])
def test_bad_input_is_one_line(kw, words):
    spec = wp.PredictSpec(**{**dict(preset="tiny", target="tpu-v5e:2x2", strategy="fsdp"), **kw})
    with pytest.raises(WorkbenchError) as e:
        wp.prepare(spec)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_seq_beyond_a_learned_table_grows_it_with_a_note():
    _, cfg, _, _, seq, notes = wp.prepare(wp.PredictSpec("tiny", "tpu-v5e:2x2", "fsdp", seq=512, remat="minimal"))
    assert seq == cfg.seq_len == 512 and cfg.remat == "minimal"
    assert any("learned position table (64 rows)" in n for n in notes)


def test_defaults():
    from models.presets import get_config

    cfg = get_config("small")
    assert get_strategy("fsdp").default_mesh(16, cfg) == {"data": 16}
    assert get_strategy("tp").default_mesh(16, cfg) == {"data": 2, "model": 8}  # small: 8 heads
    assert get_strategy("fsdp+tp").default_mesh(4, get_config("tiny")) == {"data": 1, "model": 4}
    assert get_strategy("ep").batch_ways({"data": 2, "expert": 4}) == 8
    target, cfg, axes, batch, seq, _ = wp.prepare(wp.PredictSpec("small", "tpu-v5e:4x4", "fsdp"))
    assert (axes, batch, seq) == ({"data": 16}, 64, 256)


def test_compiler_words_give_the_overshoot():
    need, have = wp._overshoot_from_words(
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (24.00G) "
        "exceeds available HBM (15.75G).")
    assert (need, have) == (24 * 2**30, 15.75 * 2**30)
    assert wp._overshoot_from_words("something else") is None


def test_precheck_skips_the_compile_when_the_state_alone_overflows(results_dir):
    # ~1.6e9 parameters replicated by dp: 16 B/param of state is ~26 GB per chip > 16 GB
    spec = wp.PredictSpec("tiny", "tpu-v5e:2x2", "dp", batch=4, overrides="d_model=8192,d_ff=32768,n_heads=64")
    if not topo.libtpu_available():
        pytest.skip("libtpu not installed")
    r = wp.predict(spec)
    assert r["fits"] is False and r["compiled"] is False and r["compile_s"] is None

    n = analytics(wp.prepare(spec)[1])["params_total"]
    # float32 params + AdamW m and v (12 B/param), replicated: the shard-shape sum is that, plus a few scalars
    assert 12 * n <= r["state_bytes_per_device"] <= 12 * n + 1024
    assert "not compiled" in r["reason"]
    from workbench.results.store import Store

    assert Store().records("predict")[-1]["extra"]["fits"] is False


@needs_libtpu
def test_resource_exhausted_compile_is_an_answer():
    """The TPU compiler's out-of-memory is fits=false with its words and the overshoot, not a crash."""
    t = topo.parse_target("tpu-v5e:2x2")
    devs = topo.target_devices(t)
    mesh = Mesh(np.array(devs).reshape(4), ("data",), axis_types=(AxisType.Auto,))
    x = jax.ShapeDtypeStruct((4 * 65536, 32768), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    lowered = jax.jit(lambda a: (a * 2, a + 1)).lower(x)  # 8 GiB in, 16 GiB out per chip
    lw = wp.Lowered(wp.resolve(wp.PredictSpec("tiny", t.name, "dp"), t), __import__("models.presets").presets.get_config("tiny"),
                    mesh, {"data": 4}, 4, 64, "libtpu", lowered, 0.0, 0.0, 0.0, [])
    compiled, secs, words = wp.compile_lowered(lw)
    assert compiled is None and "RESOURCE_EXHAUSTED" in words
    body = wp.predict_lowered(lw, None, secs, words)
    assert body["fits"] is False and body["overshoot_bytes"] > 0 and "ran out of memory" in body["reason"]


def _check_prediction(r):
    assert r["fits"] is True and r["compiled"] is True
    assert r["memory_per_device_bytes"] >= r["input_bytes_per_device"] - r["memory_breakdown"]["alias_bytes"]
    check_terms(r, Store().records("predict")[-1]["costs"]["collectives"])
    # the compiled per-device flops, summed over chips, cover the model's FLOPs (allowing the convention's full
    # attention term the causal program may skip) and do not repeat them many times over
    hand = hand_model_flops(r["preset"], r["mode"], r["batch"], r["seq"])
    assert r["replication"] == pytest.approx(r["flops_per_device"] * r["n_chips"] / hand, rel=1e-9)
    assert 0.8 <= r["replication"] <= 2.0, r["replication"]
    assert r["collectives"] and all(v["bytes"] > 0 for v in r["collectives"].values())
    assert set(r["explain"]) >= {"compute_s", "memory_s", "comm_s", "analytic_floor_s", "predicted_mfu"}


@needs_libtpu
@pytest.mark.compile_heavy
@pytest.mark.parametrize("target,kind", [("tpu-v5e:2x2", "TPU v5 lite"), ("tpu-v4:2x2x1", "TPU v4")])
def test_tiny_compiles_for_tpu_topologies(target, kind, results_dir):
    r = wp.predict(wp.PredictSpec("tiny", target, "fsdp", batch=8))
    _check_prediction(r)
    assert r["compiler"] == "libtpu" and r["chip"].startswith("tpu-")
    assert any(k.startswith(("all-gather", "reduce-scatter", "all-reduce")) for k in r["collectives"])
    rec = Store().records("predict")[-1]
    assert rec["spec"]["target"] == target and rec["costs"]["scope"] == "per_device"
    assert rec["prediction"]["target"] == r["chip"]


@pytest.mark.compile_heavy
def test_tiny_on_a_gpu_node_compiled_for_simulated_cpus(results_dir):
    r = wp.predict(wp.PredictSpec("tiny", "h100:8", "fsdp+tp", mesh="data=2,model=4", batch=8,
                                  gpu_compiler="cpu-sim"))
    _check_prediction(r)
    assert r["compiler"] == "xla-cpu" and r["chip"] == "h100-sxm"
    assert any("simulated CPU devices" in n for n in r["notes"])
    assert any(k.endswith("@model") for k in r["collectives"])  # tensor parallelism exchanges activations


@needs_libtpu
@pytest.mark.compile_heavy
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_inference_steps_compile_with_a_sharded_kv_cache(mode, results_dir):
    from models.presets import get_config

    cfg = get_config("tiny")
    r = wp.predict(wp.PredictSpec("tiny", "tpu-v5e:2x2", "tp", mode=mode, batch=8))
    assert r["fits"] and r["mode"] == mode
    check_terms(r, Store().records("predict")[-1]["costs"]["collectives"])
    assert any(k.startswith("all-reduce@model") for k in r["collectives"])  # Megatron row-parallel sums
    # arguments: bf16 weights sharded over model=4 (embedding table by vocab) plus the bf16 KV cache
    # (batch 8, seq 64, kv_heads over model=4); the cache is donated, so it is aliased to the output
    kv = 2 * cfg.n_layers * 8 * cfg.seq_len * (cfg.n_kv_heads // 4) * cfg.head_dim * 2
    assert r["memory_breakdown"]["alias_bytes"] >= kv
    assert r["tokens_per_step"] == (8 * cfg.seq_len if mode == "prefill" else 8)


@needs_libtpu
@pytest.mark.compile_heavy
def test_tensor_parallel_partial_sums_travel_in_the_compute_dtype_on_tpu(results_dir):
    """The bf16 step's dots return bf16 on a TPU (models/precision.py _rounded_on_device), so the partial sums a
    row-parallel product reduces over the model axis travel in bf16, as in the programs MaxText compiles (its dots
    return bf16); a float32 policy's travel in float32."""
    def sums(policy):  # bytes summed over the model axis, by dtype
        wp.predict(wp.PredictSpec("tiny", "tpu-v5e:2x2", "tp", batch=8, policy=policy))
        out = collections.Counter()
        for c in Store().records("predict")[-1]["costs"]["collectives"]:
            if c["kind"] in ("all-reduce", "reduce-scatter") and any(a.startswith("model") for a in c["mesh_axes"]):
                out[c["dtype"]] += c["payload_bytes"] * c["count"]
        return out

    # forward (attention and MLP outputs) and backward (their inputs' gradients) partial sums in bf16: about 5x the
    # float32 bytes left (the vocabulary-split head); with float32 dot results it was the other way round
    bf16 = sums("bf16")
    assert bf16["bfloat16"] > 3 * bf16["float32"], bf16
    assert set(sums("float32")) == {"float32"}


def test_torus_axes_from_device_coords():
    from types import SimpleNamespace as NS

    devs = [NS(coords=(x, y, 0)) for y in range(4) for x in range(4)]  # a 4x4 torus, ids in row-major order
    mesh = NS(devices=np.array(devs, dtype=object).reshape(4, 4))
    row = NS(groups=((0, 1, 2, 3),), payload_bytes=10.0, count=1)      # varies x only
    full = NS(groups=(tuple(range(16)),), payload_bytes=1.0, count=1)  # varies x and y
    assert wp.torus_axes_of(NS(collectives=(row,)), mesh) == 1
    assert wp.torus_axes_of(NS(collectives=(full,)), mesh) == 2
    assert wp.torus_axes_of(NS(collectives=(row, full)), mesh) == 1  # the heaviest collective decides
    assert wp.torus_axes_of(NS(collectives=()), mesh) == 1
    assert torus_axes_of_group((0, 1, 2, 3), mesh) == 1 and torus_axes_of_group(tuple(range(16)), mesh) == 2
    assert torus_axes_of_group((0, 1), None) == 0


def test_each_collective_is_priced_at_the_torus_axes_its_own_groups_span():
    """An all-gather whose groups span two torus dimensions rings over both (twice the links): half the transfer
    time of one along a single dimension, whatever the program's heaviest collective spans. A collective without
    coordinates (0) takes the program's figure."""
    spec = catalogue_spec("tpu-v5p")

    def comm(*axes, program_k=1):
        colls = tuple(CollectiveOp(f"ag{i}", "all-gather", "bfloat16", 64e6, 16, 1, True, torus_axes=k)
                      for i, k in enumerate(axes))
        return predict(CostReport(1e9, 0.0, 1e6, collectives=colls, n_devices=16, platform="tpu"), spec,
                       simulated_mesh=False, torus_axes=program_k).comm_s

    one, two = comm(1), comm(2)
    assert two < 0.6 * one  # the bandwidth term halves; the per-hop latency stays
    assert comm(1, 2) == pytest.approx(one + two)
    assert comm(0, program_k=2) == pytest.approx(two)


def test_xla_estimate_guards_non_positive_values():
    from types import SimpleNamespace as NS

    assert wp.xla_estimate(NS(cost_analysis=lambda: {"optimal_seconds": 2e-3})) == (2e-3, None)
    v, note = wp.xla_estimate(NS(cost_analysis=lambda: [{"optimal_seconds": -1470.0}]))
    assert v is None and "not positive: ignored" in note
    v, note = wp.xla_estimate(NS(cost_analysis=lambda: None))
    assert v is None and "no time estimate" in note


@pytest.mark.parametrize("policy", ["float32", "bf16"])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_inference_step_unrolls_scanned_layers_with_a_cache_per_layer(mode, policy):
    """The serving step runs a scanned preset's layers unrolled: one KV-cache buffer per layer, laid out
    (b, kv_heads, s, h) as models.inference.init_cache builds it, sharded on the batch axis, donated and returned in
    the same form."""
    from models.precision import get_policy
    from models.presets import get_config
    from partitioning.mesh import make_mesh

    cfg = get_config("tiny", "scan_layers=true")
    mesh = make_mesh("data=8")
    step, args, _ = wp.build_inference_step(cfg, get_policy(policy), mesh, "dp", 8, cfg.seq_len, mode)
    cache = args[3]
    assert len(cache["k_t"]) == cfg.n_layers and "k" not in cache
    assert cache["k_t"][0].shape == (8, cfg.n_kv_heads, cfg.head_dim, cfg.seq_len)  # a CPU mesh: keys transposed
    assert cache["k_t"][0].sharding.spec[0] == "data"
    logits, new_cache = jax.eval_shape(step, *args)
    assert logits.shape == (8, cfg.vocab_size) and new_cache["k_t"][0].shape == cache["k_t"][0].shape
