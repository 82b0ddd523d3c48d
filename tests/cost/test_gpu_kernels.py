# ruff: noqa: E501
"""The HLO reader prices the custom calls XLA:GPU emits: cuBLAS gemms (bf16, fp8), cuDNN fused attention (forward and
backward), Triton gemm fusions; a call it cannot price is listed, never silently zero; XLA:GPU's missing
cost_analysis (-1) is recorded as unavailable and the reader's count used.

The fixtures under tests/data/gpu_hlo/ are optimized HLO of deviceless XLA:GPU compiles for an H200 (regenerate with
tests/data/gpu_hlo/make_fixtures.py, which needs the JAX CUDA plugin); the tests that compile live skip without it."""
import gzip
import json
import pathlib

import pytest

from partitioning import topology as topo
from workbench.cost import hlo
from workbench.cost.report import costs_from_compiled

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "gpu_hlo"
MANIFEST = json.loads((DATA / "fixtures.json").read_text())["fixtures"]
M = N = K = 1024
BF16, FP8 = 2, 1
needs_plugin = pytest.mark.skipif(
    not topo.gpu_compiler_available(),
    reason="JAX CUDA plugin not installed: `pip install -e '.[gpu-aot]'` (the plugin matching the pinned jaxlib; "
           "not in the locks, see docs/targets.md)")


def fixture_text(name: str) -> str:
    path = DATA / MANIFEST[name]["file"]
    return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()


def totals(text: str) -> tuple[float, float, float]:
    """(flops, dot flops, bytes) summed over the kernels × their runs."""
    ks = hlo.parse_kernels(text)
    return (sum(k.flops * k.count for k in ks), sum(k.dot_flops * k.count for k in ks),
            sum(k.bytes * k.count for k in ks))


def close(x: float, want: float, tol: float = 0.02) -> bool:
    return abs(x / want - 1) <= tol


class _Compiled:
    """A compiled program as XLA:GPU answers for it: cost_analysis -1 (or `ca`), no memory analysis."""

    def __init__(self, text: str, ca=None):
        self._text, self._ca = text, ca if ca is not None else {"flops": -1.0, "bytes accessed": -1.0}

    def cost_analysis(self):
        return self._ca

    def memory_analysis(self):
        return None

    def as_text(self):
        return self._text


# ---- cuBLAS ---------------------------------------------------------------------------------------------------------


def test_a_cublas_gemm_is_priced_from_its_dot_dimensions_and_its_workspace_is_not_traffic():
    text = fixture_text("matmul_bf16_cublas")
    (k,) = [k for k in hlo.parse_kernels(text) if k.library.startswith("__cublas")]
    assert k.library == "__cublas$lt$matmul" and k.kind == "custom-call"
    assert close(k.flops, 2 * M * N * K) and k.dot_flops == k.flops and k.dot_size == pytest.approx(1024)
    # operands + result; the s8[4194304] workspace the call returns beside its result is scratch, not traffic
    assert k.bytes_in == BF16 * (M * K + K * N) and k.bytes_out == BF16 * M * N
    assert hlo.unpriced_custom_calls(text) == {}
    (d,) = hlo.parse_dots(text)
    assert d.flops == k.flops and (d.lhs.dtype, d.out.dims) == ("bf16", (M, N))


def test_an_fp8_cublas_gemm_counts_its_product_not_its_scale_operands():
    text = fixture_text("matmul_fp8_cublas")
    (k,) = [k for k in hlo.parse_kernels(text) if k.library == "__cublas$lt$matmul$f8"]
    assert close(k.flops, 2 * M * N * K)
    f8_in = FP8 * (M * K + K * N)
    assert f8_in <= k.bytes_in <= f8_in + 64 and k.bytes_out == BF16 * M * N  # + the f32 scales
    flops, _, nbytes = totals(text)
    assert close(flops, 2 * M * N * K) and f8_in + BF16 * M * N <= nbytes <= 2 * (f8_in + BF16 * M * N)
    assert hlo.unpriced_custom_calls(text) == {}


def test_the_default_gpu_matmul_is_counted_through_its_triton_gemm_fusion():
    """Default flags: XLA:GPU emits a Triton gemm fusion (kCustom); its fused computation holds the dot."""
    text = fixture_text("matmul_bf16_default")
    flops, dot_flops, nbytes = totals(text)
    assert close(flops, 2 * M * N * K) and dot_flops == flops
    assert nbytes == BF16 * (M * K + K * N + M * N)
    assert any(k.library.startswith("__triton") for k in hlo.parse_kernels(text))
    assert hlo.unpriced_custom_calls(text) == {}


TRITON_GEMM = """HloModule m, is_scheduled=true

%triton_gemm_dot (p0: bf16[8,256,512], p1: bf16[8,512,128]) -> bf16[8,256,128] {
  %p0 = bf16[8,256,512]{2,1,0} parameter(0)
  %p1 = bf16[8,512,128]{2,1,0} parameter(1)
  ROOT %dot.1 = bf16[8,256,128]{2,1,0} dot(%p0, %p1), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}

ENTRY %main (a: bf16[8,256,512], b: bf16[8,512,128]) -> bf16[8,256,128] {
  %a = bf16[8,256,512]{2,1,0} parameter(0)
  %b = bf16[8,512,128]{2,1,0} parameter(1)
  ROOT %triton_gemm_dot.1 = bf16[8,256,128]{2,1,0} fusion(%a, %b), kind=kCustom, calls=%triton_gemm_dot, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"64","block_n":"64","block_k":"32","split_k":"1","num_stages":"3","num_warps":"4","num_ctas":"1"}}}
}
"""


def test_a_triton_gemm_fusion_is_counted_and_named():
    (k,) = hlo.parse_kernels(TRITON_GEMM)
    assert k.kind == "kCustom" and k.library == "__triton_gemm"
    assert k.flops == k.dot_flops == 2 * 8 * 256 * 128 * 512


BATCHED_CUBLAS = """HloModule m, is_scheduled=true

ENTRY %main (a: bf16[8,256,512], b: bf16[8,128,512], c: bf16[8,256,128]) -> bf16[8,256,128] {
  %a = bf16[8,256,512]{2,1,0} parameter(0)
  %b = bf16[8,128,512]{2,1,0} parameter(1)
  %c = bf16[8,256,128]{2,1,0} parameter(2)
  %gemm = (bf16[8,256,128]{2,1,0}, s8[33554432]{0}) custom-call(%a, %b, %c), custom_call_target="__cublas$gemm", output_to_operand_aliasing={{0}: (2, {})}, backend_config="{\\"gemm_backend_config\\":{\\"alpha_real\\":1,\\"beta\\":1,\\"dot_dimension_numbers\\":{\\"lhs_contracting_dimensions\\":[\\"2\\"],\\"rhs_contracting_dimensions\\":[\\"2\\"],\\"lhs_batch_dimensions\\":[\\"0\\"],\\"rhs_batch_dimensions\\":[\\"0\\"]},\\"epilogue\\":\\"BIAS_GELU\\"}}"
  ROOT %r = bf16[8,256,128]{2,1,0} get-tuple-element(%gemm), index=0
}
"""


def test_a_batched_gemm_with_a_transposed_rhs_an_epilogue_and_beta_in_a_quoted_config():
    (k,) = hlo.parse_kernels(BATCHED_CUBLAS)
    out = 8 * 256 * 128
    assert k.dot_flops == 2 * 8 * 256 * 128 * 512
    assert k.flops == k.dot_flops + 3 * out and k.transcendentals == out  # bias, GELU, beta·C; GELU's tanh
    assert k.bytes_out == BF16 * out
    (d,) = hlo.parse_dots(BATCHED_CUBLAS)  # the dot list (measure's dot floor) has the gemm with its dimensions
    assert d.flops == k.dot_flops and (d.lhs_batch, d.rhs_contracting) == ((0,), (2,)) and d.out.dims == (8, 256, 128)


CUDNN_CONV = """HloModule m, is_scheduled=true

ENTRY %main (x: f32[4,32,32,16], w: f32[3,3,16,64]) -> f32[4,32,32,64] {
  %x = f32[4,32,32,16]{3,2,1,0} parameter(0)
  %w = f32[3,3,16,64]{3,2,1,0} parameter(1)
  %conv = (f32[4,32,32,64]{3,2,1,0}, u8[0]{0}) custom-call(%x, %w), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f, custom_call_target="__cudnn$convForward", backend_config={"cudnn_conv_backend_config":{"conv_result_scale":1}}
  ROOT %r = f32[4,32,32,64]{3,2,1,0} get-tuple-element(%conv), index=0
}
"""


def test_a_cudnn_convolution_is_priced_by_the_taps_that_meet_real_input():
    (k,) = hlo.parse_kernels(CUDNN_CONV)
    taps = sum(min(i + 1, 31) - max(i - 1, 0) + 1 for i in range(32)) ** 2  # 3x3 window, padding excluded
    assert k.flops == k.dot_flops == 2 * 4 * 64 * 16 * taps


# ---- cuDNN attention ------------------------------------------------------------------------------------------------


def attention_flops(name: str, products: int) -> float:
    """products × 2·B·H·S·S·D: forward 2 (Q·Kᵀ, P·V), backward 4 more (dQ, dK, dV, dP)."""
    a = MANIFEST[name]
    return products * 2.0 * a["batch"] * a["heads"] * a["seq"] ** 2 * a["head_dim"]


def test_cudnn_attention_forward_is_its_two_batched_products_and_its_causal_mask_is_noted():
    text = fixture_text("attention_cudnn_fwd")
    flops, dot_flops, nbytes = totals(text)
    assert close(flops, attention_flops("attention_cudnn_fwd", 2)) and dot_flops == attention_flops("attention_cudnn_fwd", 2)
    a = MANIFEST["attention_cudnn_fwd"]
    qkv = BF16 * a["batch"] * a["seq"] * a["heads"] * a["head_dim"]
    (k,) = [k for k in hlo.parse_kernels(text) if k.library == "__cudnn$fmhaSoftmax"]
    assert k.bytes_in == 3 * qkv and k.bytes_out == qkv  # the u8 workspace is no traffic
    assert k.transcendentals == a["batch"] * a["heads"] * a["seq"] ** 2  # one exp per score
    assert 4 * qkv <= nbytes <= 8 * qkv
    (use,) = hlo.custom_calls(text)
    assert use.priced and "causal" in use.note and hlo.unpriced_custom_calls(text) == {}


def test_cudnn_attention_gradient_is_the_forward_and_four_backward_products():
    text = fixture_text("attention_cudnn_grad")
    flops, dot_flops, _ = totals(text)
    assert close(flops, attention_flops("attention_cudnn_grad", 6)) and close(dot_flops, flops)
    targets = {u.target for u in hlo.custom_calls(text)}
    assert targets == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
    assert hlo.unpriced_custom_calls(text) == {}


# ---- a training step ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["train_step_tiny", "train_step_tiny_cublas"])
def test_a_training_step_counts_the_model_flops_in_triton_or_cublas_form(name):
    from models.presets import get_config
    from workbench.programs.flop_counts import remat_factor
    from workbench.programs.predict import model_flops

    a = MANIFEST[name]
    cfg = get_config(a["preset"])
    expected = model_flops(cfg, "train", a["batch"], a["seq"])[0] * remat_factor(cfg, "train", a["seq"])
    text = fixture_text(name)
    flops, dot_flops, nbytes = totals(text)
    assert close(dot_flops, expected)
    assert expected <= flops <= 1.15 * expected  # + the elementwise work (norms, softmax, AdamW)
    mod = hlo.parse_module(text)
    params = sum(i.out_bytes for i in mod.computations[mod.entry] if i.opcode == "parameter")
    assert params <= nbytes <= 100 * params
    assert hlo.unpriced_custom_calls(text) == {}
    if a["compiler_options"]:  # triton gemm off: every dot a cuBLAS call, attention's batched dots included
        assert {u.target for u in hlo.custom_calls(text)} == {"__cublas$lt$matmul"}


# ---- what cannot be priced, and XLA:GPU's missing cost_analysis -----------------------------------------------------

UNKNOWN_CALL = """HloModule m, is_scheduled=true

%body (p: (s32[], f32[64,64])) -> (s32[], f32[64,64]) {
  %p = (s32[], f32[64,64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[64,64]{1,0} get-tuple-element(%p), index=1
  %y = f32[64,64]{1,0} custom-call(%x), custom_call_target="my_library$mystery_kernel"
  %z = f32[64,64]{1,0} custom-call(%y), custom_call_target="Sharding", sharding={replicated}
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[64,64]) tuple(%j, %z)
}

%cond (p: (s32[], f32[64,64])) -> pred[] {
  %p = (s32[], f32[64,64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[64,64]) -> f32[64,64] {
  %x = f32[64,64]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %t = (s32[], f32[64,64]) tuple(%zero, %x)
  %w = (s32[], f32[64,64]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %gemm = (f32[64,64]{1,0}, s8[1024]{0}) custom-call(%x, %x), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{}}
  ROOT %r = f32[64,64]{1,0} get-tuple-element(%w), index=1
}
"""


def test_a_custom_call_the_reader_cannot_price_is_listed_with_its_executions():
    """An unknown target (×3 in a loop) and a gemm whose config lacks its dot dimensions are listed; a Sharding
    annotation (no arithmetic) is not."""
    assert hlo.unpriced_custom_calls(UNKNOWN_CALL) == {"my_library$mystery_kernel": 3, "__cublas$gemm": 1}
    rep = costs_from_compiled(_Compiled(UNKNOWN_CALL, {"flops": 10.0, "bytes accessed": 100.0}))
    assert rep.unpriced_custom_calls == (("__cublas$gemm", 1), ("my_library$mystery_kernel", 3))
    assert rep.to_dict()["unpriced_custom_calls"] == {"__cublas$gemm": 1, "my_library$mystery_kernel": 3}
    assert any("cannot price" in n and "my_library$mystery_kernel ×3" in n for n in rep.notes)
    assert (rep + rep).unpriced_custom_calls == (("__cublas$gemm", 2), ("my_library$mystery_kernel", 6))
    assert rep.cost_analysis_unavailable == () and rep.flops == 10.0


def test_calls_that_do_no_arithmetic_or_declare_their_cost_are_not_unpriced():
    for target in sorted(hlo.ZERO_FLOP_CUSTOM_CALLS):
        text = UNKNOWN_CALL.replace("my_library$mystery_kernel", target).replace(
            'custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{}}', 'custom_call_target="Sharding"')
        assert hlo.unpriced_custom_calls(text) == {}, target
    mosaic = UNKNOWN_CALL.replace('custom_call_target="my_library$mystery_kernel"',
                                  'custom_call_target="mosaic_gpu_v2", backend_config={cost_estimate_json = "{\\"flops\\": 4096, \\"transcendentals\\": 0, \\"bytes_accessed\\": 32768}", kernel_hash = "x"}')
    assert hlo.unpriced_custom_calls(mosaic) == {"__cublas$gemm": 1}
    assert sum(k.flops * k.count for k in hlo.parse_kernels(mosaic) if k.library == "mosaic_gpu_v2") == 3 * 4096


def test_xla_gpu_cost_analysis_of_minus_one_is_recorded_unavailable_and_the_readers_count_is_used():
    rep = costs_from_compiled(_Compiled(fixture_text("matmul_bf16_cublas")), compute_dtype="bfloat16")
    assert rep.cost_analysis_unavailable == ("flops", "bytes accessed", "transcendentals")
    assert close(rep.flops, 2 * M * N * K) and rep.bytes_accessed == BF16 * (M * K + K * N + M * N)
    assert rep.uses_hlo_counts and rep.counted_flops == rep.flops
    d = rep.to_dict()
    assert d["cost_analysis"]["flops"] == "unavailable" and d["cost_analysis"]["bytes accessed"] == "unavailable"
    assert d["flops"] == rep.flops and d["cost_analysis_unavailable"] == list(rep.cost_analysis_unavailable)
    assert any("'flops' = -1 is invalid" in n and "unavailable" in n for n in rep.notes)
    assert any("summed from the optimized HLO" in n for n in rep.notes)
    nothing = costs_from_compiled(_Compiled(fixture_text("matmul_bf16_cublas"), ca={}))  # None / {}: no keys at all
    assert nothing.cost_analysis_unavailable == ("flops", "bytes accessed", "transcendentals")
    assert close(nothing.flops, 2 * M * N * K)


def test_a_positive_total_beside_negative_entries_is_not_trusted():
    """XLA:GPU sums its -1 per uncosted instruction into the totals; what an H200 answered for the cuDNN attention
    gradient (jax 0.11.2): flops -2, bytes accessed positive but missing both calls' bytes."""
    ca = {"flops": -2.0, "optimal_seconds": -2.0, "bytes accessed": 4194326.0, "bytes accessed1{}": -2.0,
          "bytes accessed4{}": -1.0, "bytes accessedout{}": 4194326.0, "utilization0{}": 13.0}
    text = fixture_text("attention_cudnn_grad")
    rep = costs_from_compiled(_Compiled(text, ca))
    assert rep.cost_analysis_unavailable == ("flops", "bytes accessed", "transcendentals")
    assert rep.bytes_accessed == totals(text)[2] > 10 * 4194326
    assert any("negative entries (bytes accessed1{}, bytes accessed4{}, flops, optimal_seconds)" in n for n in rep.notes)
    half = costs_from_compiled(_Compiled(text, {"flops": 7.0e10, "bytes accessed": 5.0e7, "bytes accessed0{}": -1.0}))
    assert half.cost_analysis_unavailable == ("flops", "bytes accessed", "transcendentals")
    assert close(half.flops, attention_flops("attention_cudnn_grad", 6))


def test_an_8192_cubed_bf16_cublas_matmul_on_an_h200_is_predicted_at_its_compute_time():
    """The case that motivated the reader (H200, measured 1.56 ms): with the gemm unpriced and cost_analysis -1
    taken as 0, the roofline said 0.09 ms (its bytes alone); 2·8192³ at the bf16 peak is 1.11 ms."""
    from workbench.hardware.spec import catalogue_spec as get_spec
    from workbench.roofline.prediction import predict

    text = fixture_text("matmul_bf16_cublas").replace("1024,1024", "8192,8192").replace("[1048576]", "[67108864]")
    rep = costs_from_compiled(_Compiled(text), compute_dtype="bfloat16")
    assert close(rep.flops, 2 * 8192**3)
    p = predict(rep, get_spec("h200"))
    assert p.predicted_s >= 1.0e-3 and p.bound == "compute"


# ---- live compiles (need the JAX CUDA plugin) -----------------------------------------------------------------------


@needs_plugin
def test_a_live_deviceless_cublas_matmul_reads_as_the_fixture_does():
    import jax
    import jax.numpy as jnp

    sh = jax.sharding.SingleDeviceSharding(topo.xla_gpu_devices("h200:1")[0])
    a = jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=sh)
    compiled = jax.jit(jnp.matmul).lower(a, a).compile(compiler_options={"xla_gpu_enable_triton_gemm": False})
    rep = costs_from_compiled(compiled, compute_dtype="bfloat16")
    assert "flops" in rep.cost_analysis_unavailable and rep.unpriced_custom_calls == ()
    assert close(rep.flops, 2 * M * N * K)
    assert any(k.library.startswith("__cublas") for k in rep.kernels)


_ASYNC_SLICES = """HloModule m

%fused_dynamic_update_slice (p0: bf16[32,8,128], p1: s32[], p2: bf16[8,128]) -> bf16[32,8,128] {
  %p0 = bf16[32,8,128]{2,1,0} parameter(0)
  %p2 = bf16[8,128]{1,0} parameter(2)
  %b = bf16[1,8,128]{2,1,0} bitcast(%p2)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %dus = bf16[32,8,128]{2,1,0} dynamic-update-slice(%p0, %b, %p1, %z, %z)
}

%fused_dynamic_slice (q0: bf16[32,8,128], q1: s32[]) -> bf16[1,8,128] {
  %q0 = bf16[32,8,128]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = bf16[1,8,128]{2,1,0} dynamic-slice(%q0, %q1, %z, %z), dynamic_slice_sizes={1,8,128}
}

ENTRY %main (a: bf16[32,8,128], i: s32[], u: bf16[8,128]) -> (bf16[32,8,128], bf16[1,8,128]) {
  %a = bf16[32,8,128]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %u = bf16[8,128]{1,0} parameter(2)
  %fusion-start = ((bf16[32,8,128]{2,1,0}, s32[], bf16[8,128]{1,0}), bf16[32,8,128]{2,1,0}, u32[]) fusion-start(%a, %i, %u), kind=kLoop, calls=%fused_dynamic_update_slice
  %fusion-done = bf16[32,8,128]{2,1,0} fusion-done(%fusion-start)
  %fusion-start.1 = ((bf16[32,8,128]{2,1,0}, s32[]), bf16[1,8,128]{2,1,0}, u32[]) fusion-start(%fusion-done, %i), kind=kLoop, calls=%fused_dynamic_slice
  %fusion-done.1 = bf16[1,8,128]{2,1,0} fusion-done(%fusion-start.1)
  ROOT %t = (bf16[32,8,128]{2,1,0}, bf16[1,8,128]{2,1,0}) tuple(%fusion-done, %fusion-done.1)
}
"""


def _synchronous(text: str) -> str:
    """The same module with each fusion-start / fusion-done pair written as one plain fusion."""
    out = []
    for line in text.splitlines():
        if "fusion-done(" in line:
            name, start = line.split(" = ")[0].strip(), line.split("(%")[1].rstrip(")")
            out.append(f"  {name} = bf16[1,1]{{1,0}} bitcast(%{start})")
        elif "fusion-start(" in line:
            head, rest = line.split(" fusion-start(")
            name = head.split(" = ")[0]
            result = "bf16[32,8,128]{2,1,0}" if "update" in rest else "bf16[1,8,128]{2,1,0}"
            out.append(f"{name} = {result} fusion({rest}")
        else:
            out.append(line)
    return "\n".join(out)


def test_an_asynchronous_slice_fusion_costs_its_slice_not_the_stacked_buffer():
    """XLA:GPU runs the dynamic-slice and dynamic-update-slice fusions of a scanned layer stack on a second stream
    (fusion-start / fusion-done, seen in the optimized HLO of the published NeMo and torchtitan programs). Each is
    the fusion it calls: the update writes one (8, 128) bf16 slice into the (32, 8, 128) stack in place, the read
    takes one slice out (2,048 B each way, and the 4-byte index), as the same fusions written synchronously. Read as
    an opaque op, each cost the whole stack, its operands and result again (~64× per call)."""
    slice_b, index_b = 8 * 128 * 2, 4
    async_k = hlo.parse_kernels(_ASYNC_SLICES)
    sync_k = hlo.parse_kernels(_synchronous(_ASYNC_SLICES))
    assert [k.kind for k in async_k] == ["kLoop", "kLoop"]
    assert [(k.bytes_in, k.bytes_out) for k in async_k] == [(k.bytes_in, k.bytes_out) for k in sync_k]
    assert [(k.bytes_in, k.bytes_out) for k in async_k] == [(slice_b + index_b, slice_b), (slice_b + index_b, slice_b)]
