# ruff: noqa: E501
"""Reading libtpu's optimized HLO (no compile): loop trip counts from the condition, dots written as windowed
convolutions, collectives hidden in kCustom fusions and async start/done fusion pairs, dot precision. The same
forms compiled by libtpu are tested in tests/programs/test_tpu_programs.py."""
from partitioning.collectives import collective_time
from workbench.cost import hlo
from workbench.hardware.spec import catalogue_spec
from workbench.roofline import pricing

TPU_HLO = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%all-reduce-scatter.4 (input.12: f32[512,2048]) -> f32[128,2048] {
  %input.12 = f32[512,2048]{1,0} parameter(0)
  %all-reduce.66 = f32[512,2048]{1,0} all-reduce(%input.12), channel_id=55, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=%add
  %pid = u32[] partition-id()
  %c128 = u32[] constant(128)
  %off = u32[] multiply(%pid, %c128)
  %c0 = u32[] constant(0)
  ROOT %dynamic-slice.259 = f32[128,2048]{1,0} dynamic-slice(%all-reduce.66, %off, %c0), dynamic_slice_sizes={128,2048}
}

%ag_start (param_0.1: bf16[128,2048]) -> (bf16[128,2048], bf16[512,2048], u32[]) {
  %param_0.1 = bf16[128,2048]{1,0} parameter(0)
  %all-gather.252 = bf16[512,2048]{1,0} all-gather(%param_0.1), channel_id=107, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
  ROOT %custom-call.53 = (bf16[128,2048]{1,0}, bf16[512,2048]{1,0}, u32[]) custom-call(%all-gather.252), custom_call_target="AsyncCollectiveStart"
}

%ag_compute (param_0.2: bf16[128,2048], param_1.2: bf16[16,512], param_2.2: bf16[512,2048]) -> (f32[16,2048], bf16[512,2048]) {
  %param_0.2 = bf16[128,2048]{1,0} parameter(0)
  %param_1.2 = bf16[16,512]{1,0} parameter(1)
  %param_2.2 = bf16[512,2048]{1,0} parameter(2)
  %all-gather.254 = bf16[512,2048]{1,0} all-gather(%param_0.2), channel_id=107, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
  %convolution.1 = f32[16,2048]{1,0} convolution(%param_1.2, %param_2.2), dim_labels=bf_io->bf
  ROOT %t = (f32[16,2048]{1,0}, bf16[512,2048]{1,0}) tuple(%convolution.1, %all-gather.254)
}

%ag_softmax (param_0.4: bf16[128,2048], param_1.4: f32[16,2048]) -> (f32[16,2048], bf16[512,2048]) {
  %param_0.4 = bf16[128,2048]{1,0} parameter(0)
  %param_1.4 = f32[16,2048]{1,0} parameter(1)
  %all-gather.255 = bf16[512,2048]{1,0} all-gather(%param_0.4), channel_id=107, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
  %exponential.1 = f32[16,2048]{1,0} exponential(%param_1.4)
  ROOT %t4 = (f32[16,2048]{1,0}, bf16[512,2048]{1,0}) tuple(%exponential.1, %all-gather.255)
}

%ag_done (param_0.3: bf16[128,2048], param_1.3: bf16[512,2048]) -> bf16[512,2048] {
  %param_0.3 = bf16[128,2048]{1,0} parameter(0)
  %param_1.3 = bf16[512,2048]{1,0} parameter(1)
  %all-gather.256 = bf16[512,2048]{1,0} all-gather(%param_0.3), channel_id=107, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
  ROOT %custom-call.55 = bf16[512,2048]{1,0} custom-call(%param_0.3, %param_1.3, %all-gather.256), custom_call_target="AsyncCollectiveDone"
}

%head_conv (p0: bf16[1,4,64,1], p1: bf16[64,8,32,1]) -> f32[1,4,8,32] {
  %p0 = bf16[1,4,64,1]{3,2,1,0} parameter(0)
  %p1 = bf16[64,8,32,1]{3,2,1,0} parameter(1)
  ROOT %convolution.30 = f32[1,4,8,32]{3,2,1,0} convolution(%p0, %p1), window={size=1x8 pad=0_0x7_7 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f
}

%body (p: (s32[], bf16[128,2048], f32[512,2048])) -> (s32[], bf16[128,2048], f32[512,2048]) {
  %p = (s32[], bf16[128,2048]{1,0}, f32[512,2048]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = bf16[128,2048]{1,0} get-tuple-element(%p), index=1
  %g = f32[512,2048]{1,0} get-tuple-element(%p), index=2
  %x = bf16[16,512]{1,0} constant({...})
  %start = (bf16[128,2048]{1,0}, bf16[512,2048]{1,0}, u32[]) fusion(%w), kind=kCustom, calls=%ag_start
  %s0 = bf16[128,2048]{1,0} get-tuple-element(%start), index=0
  %s1 = bf16[512,2048]{1,0} get-tuple-element(%start), index=1
  %mm = (f32[16,2048]{1,0}, bf16[512,2048]{1,0}) fusion(%s0, %x, %s1), kind=kOutput, calls=%ag_compute
  %mm0 = f32[16,2048]{1,0} get-tuple-element(%mm), index=0
  %sm = (f32[16,2048]{1,0}, bf16[512,2048]{1,0}) fusion(%s0, %mm0), kind=kLoop, calls=%ag_softmax
  %done = bf16[512,2048]{1,0} fusion(%s0, %s1), kind=kCustom, calls=%ag_done
  %rs = f32[128,2048]{1,0} fusion(%g), kind=kCustom, calls=%all-reduce-scatter.4
  %hc0 = bf16[1,4,64,1]{3,2,1,0} constant({...})
  %hc1 = bf16[64,8,32,1]{3,2,1,0} constant({...})
  %heads = f32[1,4,8,32]{3,2,1,0} fusion(%hc0, %hc1), kind=kOutput, calls=%head_conv
  %one = s32[] constant(1)
  %i1 = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[128,2048]{1,0}, f32[512,2048]{1,0}) tuple(%i1, %w, %g)
}

%cond (cp: (s32[], bf16[128,2048], f32[512,2048])) -> pred[] {
  %c6 = s32[] constant(6)
  %cp = (s32[], bf16[128,2048]{1,0}, f32[512,2048]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%cp), index=0
  ROOT %lt = pred[] compare(%ci, %c6), direction=LT
}

ENTRY %main (w0: bf16[128,2048], g0: f32[512,2048]) -> (s32[], bf16[128,2048], f32[512,2048]) {
  %w0 = bf16[128,2048]{1,0} parameter(0)
  %g0 = f32[512,2048]{1,0} parameter(1)
  %z = s32[] constant(0)
  %init = (s32[], bf16[128,2048]{1,0}, f32[512,2048]{1,0}) tuple(%z, %w0, %g0)
  ROOT %loop = (s32[], bf16[128,2048]{1,0}, f32[512,2048]{1,0}) while(%init), condition=%cond, body=%body
}
"""


def test_trip_count_read_from_the_loop_condition():
    """libtpu's HLO has no known_trip_count: `i < 6` from 0 runs the body 6 times."""
    runs = hlo.runs_per_computation(hlo.parse_module(TPU_HLO))
    assert runs["body"] == 6


UNROLLED_HLO = """HloModule u

%body (p: (u32[], f32[8])) -> (u32[], f32[8]) {
  %p = (u32[], f32[8]{0}) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %two = u32[] constant(STEP)
  %next = u32[] add(%i, %two)
  %y = f32[8]{0} add(%x, %x)
  ROOT %t = (u32[], f32[8]{0}) tuple(%next, %y)
}

%cond (p: (u32[], f32[8])) -> pred[] {
  %cp = (u32[], f32[8]{0}) parameter(0)
  %ci = u32[] get-tuple-element(%cp), index=0
  %n = u32[] constant(8)
  ROOT %lt = pred[] compare(%ci, %n), direction=DIR
}

ENTRY %main (a: f32[8]) -> (u32[], f32[8]) {
  %a = f32[8]{0} parameter(0)
  %z = u32[] constant(START)
  %init = (u32[], f32[8]{0}) tuple(%z, %a)
  ROOT %loop = (u32[], f32[8]{0}) while(%init), condition=%cond, body=%body
}
"""


def test_trip_count_reads_the_counters_step_and_start():
    """A windowed einsum's loop unrolled by two counts 0, 2, 4, 6 to 8: 4 runs, not 8 (reading only the bound
    priced every collective matmul of a TPU program twice). A counter from 1: 7 runs; `i <= 8` by 2: 5."""
    def runs(step, start, direction):
        text = UNROLLED_HLO.replace("STEP", str(step)).replace("START", str(start)).replace("DIR", direction)
        return hlo.runs_per_computation(hlo.parse_module(text))["body"]
    assert runs(2, 0, "LT") == 4
    assert runs(1, 0, "LT") == 8
    assert runs(1, 1, "LT") == 7
    assert runs(3, 0, "LT") == 3
    assert runs(2, 0, "LE") == 5


def test_trip_count_reads_a_counter_copied_before_its_step():
    """libtpu copies the loop counter into scalar memory before it adds the step (`add(copy(gte(p, 0)), 2)`) and
    may copy the start and the bound too: the counter is read through copies and bitcasts, 4 runs, not 8."""
    text = UNROLLED_HLO.replace("STEP", "2").replace("START", "0").replace("DIR", "LT")
    text = text.replace("  %next = u32[] add(%i, %two)",
                        "  %ic = u32[] copy(%i)\n  %ib = u32[] bitcast(%ic)\n  %next = u32[] add(%ib, %two)")
    text = text.replace("  %init = (u32[], f32[8]{0}) tuple(%z, %a)",
                        "  %zc = u32[] copy(%z)\n  %init = (u32[], f32[8]{0}) tuple(%zc, %a)")
    text = text.replace("ROOT %lt = pred[] compare(%ci, %n)", "%cc = u32[] copy(%ci)\n  ROOT %lt = pred[] compare(%cc, %n)")
    assert "copy(%i)" in text and "copy(%z)" in text and "copy(%ci)" in text
    assert hlo.runs_per_computation(hlo.parse_module(text))["body"] == 4
    # a start that only a copy makes constant is read too: from 2 by 2 below 8, 3 runs
    assert hlo.runs_per_computation(hlo.parse_module(text.replace("constant(0)", "constant(2)")))["body"] == 3


PERMUTE_HLO = """HloModule p, is_scheduled=true

ENTRY %main (a: bf16[64,1024], b: bf16[64,1024]) -> (bf16[64,1024], bf16[64,1024]) {
  %a = bf16[64,1024]{1,0} parameter(0)
  %b = bf16[64,1024]{1,0} parameter(1)
  %fwd = (bf16[64,1024]{1,0}, bf16[64,1024]{1,0}, u32[], u32[]) collective-permute-start(%a), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %bwd = (bf16[64,1024]{1,0}, bf16[64,1024]{1,0}, u32[], u32[]) collective-permute-start(%b), channel_id=2, source_target_pairs=SECOND
  %fd = bf16[64,1024]{1,0} collective-permute-done(%fwd)
  %bd = bf16[64,1024]{1,0} collective-permute-done(%bwd)
  ROOT %t = (bf16[64,1024]{1,0}, bf16[64,1024]{1,0}) tuple(%fd, %bd)
}
"""


def test_a_bidirectional_ring_step_is_priced_as_one_permute_on_a_torus_only():
    """Two permutes in flight together whose pairs are each other's reverse use opposite links at once: on ICI the
    step costs one permute's time; on NVLink (a switch port: each direction has its own bandwidth already) both count.
    Two permutes the same way, or one that finishes before the other starts, stay two."""

    both = PERMUTE_HLO.replace("SECOND", "{{1,0},{2,1},{3,2},{0,3}}")
    ops = hlo.parse_collectives(both, n_devices=4)
    assert [o.kind for o in ops] == ["collective-permute"] * 2 and all(o.bidirectional for o in ops)
    same_way = hlo.parse_collectives(PERMUTE_HLO.replace("SECOND", "{{0,1},{1,2},{2,3},{3,0}}"), n_devices=4)
    assert not any(o.bidirectional for o in same_way)
    one_after_other = both.replace("  %fd = bf16[64,1024]{1,0} collective-permute-done(%fwd)\n", "").replace(
        "  %bwd =", "  %fd = bf16[64,1024]{1,0} collective-permute-done(%fwd)\n  %bwd =")
    assert not any(o.bidirectional for o in hlo.parse_collectives(one_after_other, n_devices=4))

    nbytes = ops[0].payload_bytes
    for name, halves in (("tpu-v5p", True), ("h100-sxm", False)):
        ic = catalogue_spec(name).interconnect
        one = collective_time("collective-permute", nbytes, 4, ic)
        two_way = collective_time("collective-permute", nbytes, 4, ic, bidirectional=True)
        assert one > 0
        assert two_way == (one / 2 if halves else one), name


def test_fused_collectives_counted_once_as_the_kind_they_implement():
    cs = hlo.parse_collectives(TPU_HLO, n_devices=4)
    kinds = sorted((c.kind, c.payload_bytes, c.count) for c in cs)
    # reduce-scatter: the all-reduce of the whole f32[512,2048] array, then this device's slice
    # all-gather: start fusion counted; the compute fusions' copies (same channel) and the done fusion are not
    assert kinds == [("all-gather", 512 * 2048 * 2, 6), ("reduce-scatter", 512 * 2048 * 4, 6)]
    rs = next(c for c in cs if c.kind == "reduce-scatter")
    assert rs.group_size == 4 and rs.dtype == "float32"


def test_collective_fusions_are_not_kernels():
    names = {k.name for k in hlo.parse_kernels(TPU_HLO)}
    assert "rs" not in names and "start" not in names and "done" not in names
    assert {"mm", "sm"} <= names, "compute fusions carrying an in-flight collective are still kernels"


def test_windowed_convolution_counts_only_taps_on_real_input():
    """window 8, padding 7 on both sides, one real input position: each of the 8 outputs meets one input, so the
    flops are those of the plain matmul (4 × 8 × 32 outputs × 64 features), not 8× them."""
    ks = {k.name: k for k in hlo.parse_kernels(TPU_HLO)}
    assert ks["heads"].dot_flops == 2 * 4 * 8 * 32 * 64
    assert ks["mm"].dot_flops == 2 * 16 * 2048 * 512
    assert ks["heads"].count == 6


def test_dot_passes_from_operand_dtypes_and_precision():
    mod = hlo.parse_module(TPU_HLO)
    shapes = hlo.array_shapes(mod)
    conv = next(i for i in mod.computations["ag_compute"] if i.opcode == "convolution")
    assert pricing.dot_passes(conv, shapes) == 1  # bf16 operands
    f32 = hlo.Shape("f32", (16, 512)), hlo.Shape("f32", (512, 2048))
    shapes = {**shapes, "a": f32[0], "b": f32[1]}
    hi = hlo.Instr("d", "f32[16,2048]", "convolution", ["a", "b"], ", dim_labels=bf_io->bf, operand_precision={highest,highest}", False)
    de = hlo.Instr("d", "f32[16,2048]", "convolution", ["a", "b"], ", dim_labels=bf_io->bf", False)
    assert pricing.dot_passes(hi, shapes) == 6 and pricing.dot_passes(de, shapes) == 1
    assert pricing.dot_forms(TPU_HLO)["mean_passes"] == 1.0


CARRIED_HLO = """HloModule c, is_scheduled=true

%ag_start (param_0.1: bf16[128,2048]) -> (bf16[128,2048], bf16[512,2048], u32[]) {
  %param_0.1 = bf16[128,2048]{1,0} parameter(0)
  %all-gather.1 = bf16[512,2048]{1,0} all-gather(%param_0.1), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
  ROOT %custom-call.1 = (bf16[128,2048]{1,0}, bf16[512,2048]{1,0}, u32[]) custom-call(%all-gather.1), custom_call_target="AsyncCollectiveStart"
}

%ag_done (param_0.3: bf16[128,2048], param_1.3: bf16[512,2048]) -> bf16[512,2048] {
  %param_0.3 = bf16[128,2048]{1,0} parameter(0)
  %param_1.3 = bf16[512,2048]{1,0} parameter(1)
  %all-gather.3 = bf16[512,2048]{1,0} all-gather(%param_0.3), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
  ROOT %custom-call.3 = bf16[512,2048]{1,0} custom-call(%param_0.3, %param_1.3, %all-gather.3), custom_call_target="AsyncCollectiveDone"
}

%carry (p0: bf16[128,2048], p1: bf16[512,2048], x: bf16[16,512], w: bf16[512,64]) -> (f32[16,64], bf16[512,2048], bf16[512,2048]) {
  %p0 = bf16[128,2048]{1,0} parameter(0)
  %p1 = bf16[512,2048]{1,0} parameter(1)
  %x = bf16[16,512]{1,0} parameter(2)
  %w = bf16[512,64]{1,0} parameter(3)
  %all-gather.2 = bf16[512,2048]{1,0} all-gather(%p0), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
  %conv = f32[16,64]{1,0} convolution(%x, %w), dim_labels=bf_io->bf
  ROOT %t = (f32[16,64]{1,0}, bf16[512,2048]{1,0}, bf16[512,2048]{1,0}) tuple(%conv, %all-gather.2, %p1)
}

%body (p: (s32[], bf16[128,2048], bf16[512,2048])) -> (s32[], bf16[128,2048], bf16[512,2048]) {
  %p = (s32[], bf16[128,2048]{1,0}, bf16[512,2048]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %s0 = bf16[128,2048]{1,0} get-tuple-element(%p), index=1
  %s1 = bf16[512,2048]{1,0} get-tuple-element(%p), index=2
  %x = bf16[16,512]{1,0} constant({...})
  %w = bf16[512,64]{1,0} constant({...})
  %mm = (f32[16,64]{1,0}, bf16[512,2048]{1,0}, bf16[512,2048]{1,0}) fusion(%s0, %s1, %x, %w), kind=kOutput, calls=%carry
  %g = bf16[512,2048]{1,0} get-tuple-element(%mm), index=1
  %one = s32[] constant(1)
  %i1 = s32[] add(%i, %one)
  ROOT %r = (s32[], bf16[128,2048]{1,0}, bf16[512,2048]{1,0}) tuple(%i1, %s0, %g)
}

%cond (cp: (s32[], bf16[128,2048], bf16[512,2048])) -> pred[] {
  %cp = (s32[], bf16[128,2048]{1,0}, bf16[512,2048]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%cp), index=0
  %c4 = s32[] constant(4)
  ROOT %lt = pred[] compare(%ci, %c4), direction=LT
}

ENTRY %main (w0: bf16[128,2048]) -> bf16[512,2048] {
  %w0 = bf16[128,2048]{1,0} parameter(0)
  %start = (bf16[128,2048]{1,0}, bf16[512,2048]{1,0}, u32[]) fusion(%w0), kind=kCustom, calls=%ag_start
  %s0 = bf16[128,2048]{1,0} get-tuple-element(%start), index=0
  %s1 = bf16[512,2048]{1,0} get-tuple-element(%start), index=1
  %z = s32[] constant(0)
  %init = (s32[], bf16[128,2048]{1,0}, bf16[512,2048]{1,0}) tuple(%z, %s0, %s1)
  %loop = (s32[], bf16[128,2048]{1,0}, bf16[512,2048]{1,0}) while(%init), condition=%cond, body=%body
  %l2 = bf16[512,2048]{1,0} get-tuple-element(%loop), index=2
  ROOT %done = bf16[512,2048]{1,0} fusion(%s0, %l2), kind=kCustom, calls=%ag_done
}
"""


def test_a_collective_carried_through_a_loop_counts_once_and_moves_no_kernel_bytes():
    """An all-gather started before a loop and continued by a compute fusion in its body (libtpu's windowed
    einsums): one all-gather, not one per trip, and the fusion's HBM traffic is its own operands and result only
    (the gathered buffer passes through it, the interconnect writes the gather)."""
    colls = hlo.parse_collectives(CARRIED_HLO, n_devices=4)
    assert [(c.kind, c.count, c.payload_bytes) for c in colls] == [("all-gather", 1, 512 * 2048 * 2)]
    (mm,) = [k for k in hlo.parse_kernels(CARRIED_HLO) if k.name == "mm"]
    assert mm.count == 4
    assert mm.bytes_in == 16 * 512 * 2 + 512 * 64 * 2
    assert mm.bytes_out == 16 * 64 * 4
