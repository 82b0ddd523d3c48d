"""HLO reading: kernels and collectives (sync, async, iota and mesh replica groups) against hand counts."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.cost import hlo

ASYNC_HLO = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[64,128])) -> (s32[], f32[64,128]) {
  %p = (s32[], f32[64,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %bx = f32[64,128]{1,0} get-tuple-element(%p), index=1
  %ars = f32[64,128]{1,0} all-reduce-start(%bx), replica_groups=[2,4]<=[8], to_apply=%add
  %ard = f32[64,128]{1,0} all-reduce-done(%ars)
  ROOT %t = (s32[], f32[64,128]{1,0}) tuple(%i, %ard)
}

%cond (p: (s32[], f32[64,128])) -> pred[] {
  %cp0 = (s32[], f32[64,128]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%cp0), index=0
  %n = s32[] constant(12)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

ENTRY %main (x: bf16[16,256], y: f32[64,128]) -> (bf16[128,256], f32[64,128]) {
  %x = bf16[16,256]{1,0} parameter(0)
  %y = f32[64,128]{1,0} parameter(1)
  %ags = (bf16[16,256]{1,0}, bf16[128,256]{1,0}) all-gather-start(%x), replica_groups=[1,8]<=[8], dimensions={0}
  %agd = bf16[128,256]{1,0} all-gather-done(%ags)
  %cp = f32[64,128]{1,0} collective-permute(%y), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %z = s32[] constant(0)
  %init = (s32[], f32[64,128]{1,0}) tuple(%z, %cp)
  %w = (s32[], f32[64,128]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"12"}}
  %out = f32[64,128]{1,0} get-tuple-element(%w), index=1
  ROOT %r = (bf16[128,256]{1,0}, f32[64,128]{1,0}) tuple(%agd, %out)
}
"""


def test_async_iota_and_loop_collectives():
    cs = {c.kind: c for c in hlo.parse_collectives(ASYNC_HLO, n_devices=8)}
    ag = cs["all-gather"]
    assert ag.is_async and ag.payload_bytes == 128 * 256 * 2 and ag.group_size == 8 and ag.dtype == "bfloat16"
    ar = cs["all-reduce"]
    assert ar.is_async and ar.payload_bytes == 64 * 128 * 4 and ar.group_size == 4 and ar.n_groups == 2
    assert ar.count == 12, "collectives inside a while body run trip-count times"
    assert ar.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    cp = cs["collective-permute"]
    assert cp.payload_bytes == 64 * 128 * 4 and cp.count == 1


def _mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def test_sharded_matmul_collectives_and_axes():
    mesh = _mesh()
    m, k, n = 64, 128, 256

    def f(x, w):
        return jnp.tanh(x @ w)

    xs = jax.ShapeDtypeStruct((m, k), jnp.float32, sharding=NamedSharding(mesh, P("data", "model")))
    ws = jax.ShapeDtypeStruct((k, n), jnp.float32, sharding=NamedSharding(mesh, P("model", None)))
    c = jax.jit(f, out_shardings=NamedSharding(mesh, P("data", None))).lower(xs, ws).compile()
    text = c.as_text()
    colls = hlo.parse_collectives(text, mesh=mesh)
    # the contracting dim is sharded over 'model': each device holds a (m/2, n) float32 partial sum that is summed
    # over the 4 devices of its model group (2 groups, one per data row). XLA:CPU emits one all-reduce of it; the
    # other lowering XLA has for it is reduce-scatter + all-gather of the same (m/2, n) array. One of the two is
    # required, with exactly these bytes, and nothing else moves.
    partial = (m // 2) * n * 4
    by_kind = {}
    for c in colls:
        assert (c.mesh_axes, c.group_size, c.n_groups, c.dtype) == (("model",), 4, 2, "float32"), c
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + c.payload_bytes * c.count
    assert by_kind in ({"all-reduce": partial}, {"reduce-scatter": partial, "all-gather": partial}), by_kind
    kernels = hlo.parse_kernels(text)
    per_device_dot_flops = 2 * (m // 2) * (k // 4) * n
    assert sum(kk.dot_flops * kk.count for kk in kernels) == per_device_dot_flops
    # the rest is the tanh on the (m/2, n) result: one flop and one transcendental per element
    assert sum(kk.flops * kk.count for kk in kernels) == per_device_dot_flops + (m // 2) * n
    assert sum(kk.transcendentals * kk.count for kk in kernels) == (m // 2) * n


def test_mesh_replica_groups_format():
    spec = "mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}"
    groups = hlo._expand_groups(spec)
    assert groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert hlo.mesh_axes_of_groups(groups, _mesh()) == ("data",)


def test_mesh_axes_read_from_positions_not_device_ids():
    """Replica groups hold partition ids (positions in the mesh's flat device order). A mesh whose devices are not
    in id order (a TPU slice's physical mesh) must still name the axis the collective runs over: a sum over 'b' of
    a mesh laid out as ids (0 2 4 6 / 1 3 5 7) is over 'b', not parts of both axes."""
    devs = jax.devices()
    mesh = Mesh(np.array([devs[i] for i in (0, 2, 4, 6, 1, 3, 5, 7)]).reshape(2, 4), ("a", "b"))
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=NamedSharding(mesh, P("a", "b")))
    c = jax.jit(lambda v: v.sum(1), out_shardings=NamedSharding(mesh, P("a"))).lower(x).compile()
    (op,) = hlo.parse_collectives(c.as_text(), mesh=mesh)
    assert op.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and op.mesh_axes == ("b",)


def test_shape_bytes():
    (s,) = hlo.parse_shapes("bf16[4,8]{1,0}")
    assert s.bytes == 64 and s.elements == 32
    assert sum(x.bytes for x in hlo.parse_shapes("(f32[2]{0}, s8[3]{0})")) == 11
    assert np.isclose(hlo.parse_shapes("f32[]")[0].bytes, 4)


def test_in_place_update_and_sliced_reads_count_only_the_slices():
    """A scanned layer stack: each iteration reads one layer's slice and writes one slice in place."""
    L, d = 8, 128

    def f(ws, x):
        def body(carry, i):
            h, acc = carry
            w = jax.lax.dynamic_index_in_dim(ws, i, keepdims=False)
            h = jnp.tanh(h @ w)
            acc = jax.lax.dynamic_update_index_in_dim(acc, h, i, 0)
            return (h, acc), None

        (h, acc), _ = jax.lax.scan(body, (x, jnp.zeros((L, 16, d))), jnp.arange(L))
        return acc

    c = jax.jit(f).lower(jax.ShapeDtypeStruct((L, d, d), jnp.float32),
                         jax.ShapeDtypeStruct((16, d), jnp.float32)).compile()
    ks = hlo.parse_kernels(c.as_text())
    total = sum(k.bytes * k.count for k in ks)
    stack = L * d * d * 4
    # per iteration: the slice is read, materialised and read again by the matmul (~3 × the stack over the loop);
    # counting the whole stacked buffer per iteration instead would give ~13 × the stack
    assert total < 5 * stack, (total, stack)


def test_device_ids_mesh_groups():
    spec = "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}"
    assert hlo._expand_groups(spec) == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_tpu_style_convolution_flops_use_dim_labels():
    text = """HloModule m

ENTRY %main (a: bf16[4,64,64], b: bf16[256,64,1]) -> f32[4,64,256] {
  %a = bf16[4,64,64]{1,2,0} parameter(0)
  %b = bf16[256,64,1]{0,1,2} parameter(1)
  ROOT %c = f32[4,64,256]{2,1,0} convolution(%a, %b), window={size=1}, dim_labels=0bf_oi0->0bf
}
"""
    (k,) = hlo.parse_kernels(text)
    assert k.flops == 2 * (4 * 64 * 256) * 64


def test_parse_dots_reads_operand_shapes_dimensions_and_loop_counts():
    """A dot in a 3-iteration loop and one outside it, one of them batched with a transposed operand: each is found
    with its operand shapes and dimension numbers, the loop's runs 3 times, and the flops add up to 2·m·n·k each."""
    m, k, n = 64, 96, 80

    def f(x, w, p, q):
        def body(c, _):
            return jnp.tanh(c @ w), None

        y, _ = jax.lax.scan(body, x, None, length=3)
        z = jnp.einsum("bkm,bkn->bmn", p, q)  # contracts dim 1 of both: a transposed lhs
        return y, z

    args = (jnp.ones((m, k)), jnp.ones((k, k)), jnp.ones((4, k, m)), jnp.ones((4, k, n)))
    dots = hlo.parse_dots(jax.jit(f).lower(*args).compile().as_text())
    loop = [d for d in dots if not d.lhs_batch]
    batched = [d for d in dots if d.lhs_batch]
    assert sum(d.count for d in loop) == 3 and all(d.out.dims == (m, k) for d in loop)
    assert sum(d.count * d.flops for d in loop) == 3 * 2 * m * k * k
    (b,) = batched
    assert b.count == 1 and b.flops == 2 * 4 * m * n * k and b.out.dims == (4, m, n)
    assert len(b.lhs_batch) == len(b.rhs_batch) == 1 and b.lhs.dims[b.lhs_contracting[0]] == k


def test_a_custom_calls_declared_cost_is_read_in_either_json_form():
    """Pallas TPU kernels declare their work in the backend config; the optimized HLO prints the numbers quoted."""
    from workbench.cost.hlo import custom_call_cost

    quoted = 'custom_call_target="tpu_custom_call", backend_config={"cost_estimate":{"flops":"34144256",' \
             '"transcendentals":"65536","bytes_accessed":"656384"}}'
    assert custom_call_cost(quoted) == (34144256.0, 65536.0)
    assert custom_call_cost('backend_config="{\\"cost_estimate\\": {\\"flops\\": 7e3, \\"transcendentals\\": 0}}"') \
        == (7000.0, 0.0)
    assert custom_call_cost('custom_call_target="Sharding"') == (0.0, 0.0)


def test_reductions_and_narrow_float_conversions_are_counted_per_kernel():
    """A kernel's reduce_elements are its reduces' operand elements; convert_elements count converts between float32
    and bf16 (either way) per element, none for an int -> float convert."""
    import jax
    import jax.numpy as jnp

    from workbench.cost.hlo import parse_kernels

    n = 1 << 12
    ks = parse_kernels(jax.jit(lambda x: x.sum(1)).lower(jax.ShapeDtypeStruct((n, 32), jnp.float32)).compile().as_text())
    assert sum(k.reduce_elements * k.count for k in ks) == n * 32
    assert sum(k.convert_elements for k in ks) == 0
    f = jax.jit(lambda x: (x.astype(jnp.float32) * 3.0).astype(jnp.bfloat16))
    ks = parse_kernels(f.lower(jax.ShapeDtypeStruct((n,), jnp.bfloat16)).compile().as_text())
    assert sum(k.convert_elements * k.count for k in ks) == 2 * n
    ks = parse_kernels(jax.jit(lambda i: i.astype(jnp.float32) + 1).lower(
        jax.ShapeDtypeStruct((n,), jnp.int32)).compile().as_text())
    assert sum(k.convert_elements for k in ks) == 0


SOFTMAX_LIKE_HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%normalise (p: f32[64,96]) -> f32[64,96] {
  %p = f32[64,96]{1,0} parameter(0)
  %z = f32[] constant(0)
  %e = f32[64,96]{1,0} exponential(%p)
  %r = f32[64]{0} reduce(%e, %z), dimensions={1}, to_apply=%add
  %bc = f32[64,96]{1,0} broadcast(%r), dimensions={0}
  ROOT %d = f32[64,96]{1,0} divide(%e, %bc)
}

%rowsum (q: f32[64,96]) -> (f32[64], f32[64,96]) {
  %q = f32[64,96]{1,0} parameter(0)
  %z2 = f32[] constant(0)
  %r2 = f32[64]{0} reduce(%q, %z2), dimensions={1}, to_apply=%add
  %sq = f32[64,96]{1,0} multiply(%q, %q)
  ROOT %t = (f32[64]{0}, f32[64,96]{1,0}) tuple(%r2, %sq)
}

ENTRY %main (x: f32[64,96]) -> (f32[64,96], f32[64], f32[64,96]) {
  %x = f32[64,96]{1,0} parameter(0)
  %f = f32[64,96]{1,0} fusion(%x), kind=kLoop, calls=%normalise
  %g = (f32[64]{0}, f32[64,96]{1,0}) fusion(%x), kind=kInput, calls=%rowsum
  %g0 = f32[64]{0} get-tuple-element(%g), index=0
  %g1 = f32[64,96]{1,0} get-tuple-element(%g), index=1
  ROOT %o = (f32[64,96]{1,0}, f32[64]{0}, f32[64,96]{1,0}) tuple(%f, %g0, %g1)
}
"""


def test_a_reduction_the_kernel_consumes_again_marks_dependent_passes():
    """A fused softmax (sum of exponentials, then a divide by it over the same rows) walks each row in dependent
    passes; a multi-output fusion whose reduction is only written out, beside an elementwise sibling, does not."""
    ks = {k.name: k for k in hlo.parse_kernels(SOFTMAX_LIKE_HLO)}
    assert ks["f"].dependent_passes and ks["f"].reduce_elements == 64 * 96
    assert not ks["g"].dependent_passes


TUPLE_ALL_REDUCE_HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[64], y: f32[32,4], z: f32[16]) -> (f32[64], f32[32,4], f32[16]) {
  %x = f32[64]{0} parameter(0)
  %y = f32[32,4]{1,0} parameter(1)
  %z = f32[16]{0} parameter(2)
  ROOT %ar = (f32[64]{0}, f32[32,4]{1,0}, f32[16]{0}) all-reduce(%x, %y, %z), replica_groups={{0,1,2,3}}, to_apply=%add
}
"""


def test_a_combined_all_reduce_counts_its_arrays():
    """XLA's all-reduce combiner folds many gradients into one tuple all-reduce: one collective, its payload the sum
    of the arrays, and the arrays counted (on simulated devices each meets the others once)."""
    (c,) = hlo.parse_collectives(TUPLE_ALL_REDUCE_HLO, n_devices=4)
    assert c.kind == "all-reduce" and c.operands == 3
    assert c.payload_bytes == 4 * (64 + 128 + 16)


TRANSPOSE_HLO = """HloModule m

%moved (p: f32[2048,512]) -> f32[512,2048] {
  %p = f32[2048,512]{1,0} parameter(0)
  %c = f32[] constant(2)
  %b = f32[2048,512]{1,0} broadcast(%c), dimensions={}
  %m = f32[2048,512]{1,0} multiply(%p, %b)
  %t = f32[512,2048]{0,1} transpose(%m), dimensions={1,0}
  ROOT %cp = f32[512,2048]{1,0} copy(%t)
}

%kept (q: f32[8,256,8,64]) -> f32[8,8,256,64] {
  %q = f32[8,256,8,64]{3,2,1,0} parameter(0)
  ROOT %t2 = f32[8,8,256,64]{3,2,1,0} transpose(%q), dimensions={0,2,1,3}
}

%dotted (a: f32[64,32], w: f32[64,16]) -> f32[32,16] {
  %a = f32[64,32]{1,0} parameter(0)
  %w = f32[64,16]{1,0} parameter(1)
  %at = f32[32,64]{1,0} transpose(%a), dimensions={1,0}
  ROOT %d = f32[32,16]{1,0} dot(%at, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[2048,512], y: f32[8,256,8,64], a: f32[64,32], w: f32[64,16]) -> (f32[512,2048]) {
  %x = f32[2048,512]{1,0} parameter(0)
  %y = f32[8,256,8,64]{3,2,1,0} parameter(1)
  %a = f32[64,32]{1,0} parameter(2)
  %w = f32[64,16]{1,0} parameter(3)
  %f = f32[512,2048]{1,0} fusion(%x), kind=kLoop, calls=%moved
  %g = f32[8,8,256,64]{3,2,1,0} fusion(%y), kind=kLoop, calls=%kept
  %h = f32[32,16]{1,0} fusion(%a, %w), kind=kOutput, calls=%dotted
  %relaid = f32[2048,512]{0,1} copy(%x)
  ROOT %o = (f32[512,2048]{1,0}, f32[8,8,256,64]{3,2,1,0}, f32[32,16]{1,0}, f32[2048,512]{0,1}) tuple(%f, %g, %h, %relaid)
}
"""


def test_strided_transposes_are_counted_where_the_contiguous_dimension_moves():
    """A transpose or copy whose output is contiguous along another logical dimension than its input reads at a
    stride: the fused (a·x)ᵀ (a transpose whose layout makes it a bitcast, then the copy that moves the data) counts
    its elements once, as does an unfused copy to the other layout; swapping two outer dimensions keeps the
    contiguous one (0), and a kernel with a dot leaves its operand's transpose to the dot library (0)."""
    ks = {k.name: k for k in hlo.parse_kernels(TRANSPOSE_HLO)}
    assert ks["f"].transpose_elements == 2048 * 512
    assert ks["relaid"].transpose_elements == 2048 * 512
    assert ks["g"].transpose_elements == 0
    assert ks["h"].transpose_elements == 0
    assert hlo.minor_dim("f32[512,2048]{0,1}") == 0 and hlo.minor_dim("f32[4,1]{1,0}") == 0
    assert hlo.minor_dim("f32[3,5]") == 1 and hlo.minor_dim("f32[]") is None


def test_a_compiled_transpose_is_strided_and_a_head_swap_is_not():
    import jax
    import jax.numpy as jnp

    x = jax.ShapeDtypeStruct((256, 128), jnp.float32)
    ks = hlo.parse_kernels(jax.jit(lambda v: (v * 2.0).T).lower(x).compile().as_text())
    assert sum(k.transpose_elements * k.count for k in ks) == 256 * 128
    y = jax.ShapeDtypeStruct((2, 16, 4, 32), jnp.float32)
    ks = hlo.parse_kernels(jax.jit(lambda v: v.transpose(0, 2, 1, 3) * 2.0).lower(y).compile().as_text())
    assert sum(k.transpose_elements for k in ks) == 0


def test_a_kernels_footprint_is_its_whole_arrays_not_the_slices_it_moves():
    import jax
    import jax.numpy as jnp

    stacked = jax.ShapeDtypeStruct((16, 128, 128), jnp.float32)
    i = jax.ShapeDtypeStruct((), jnp.int32)
    f = jax.jit(lambda s, j: jax.lax.dynamic_index_in_dim(s, j, keepdims=False) * 2.0)
    ks = [k for k in hlo.parse_kernels(f.lower(stacked, i).compile().as_text()) if k.bytes]
    k = max(ks, key=lambda k: k.footprint)
    assert k.bytes_in < 2 * 128 * 128 * 4 and k.footprint >= 16 * 128 * 128 * 4


BITCAST_SLICES = """HloModule m

%fused_read (p0: bf16[20,64,32], p1: s32[]) -> f32[32,1,64] {
  %p0 = bf16[20,64,32]{1,0,2} parameter(0)
  %b = bf16[32,20,64]{2,1,0} bitcast(%p0)
  %z = s32[] constant(0)
  %p1 = s32[] parameter(1)
  %ds = bf16[32,1,64]{2,1,0} dynamic-slice(%b, %z, %p1, %z), dynamic_slice_sizes={32,1,64}
  ROOT %c = f32[32,1,64]{2,1,0} convert(%ds)
}

%fused_write (q0: bf16[20,64,32], q1: s32[], q2: bf16[32,1,64]) -> bf16[32,20,64] {
  %q0 = bf16[20,64,32]{1,0,2} parameter(0)
  %b = bf16[32,20,64]{2,1,0} bitcast(%q0)
  %q2 = bf16[32,1,64]{2,1,0} parameter(2)
  %z = s32[] constant(0)
  %q1 = s32[] parameter(1)
  ROOT %dus = bf16[32,20,64]{2,1,0} dynamic-update-slice(%b, %q2, %z, %q1, %z)
}

ENTRY %main (w: bf16[20,64,32], i: s32[], u: bf16[32,1,64]) -> (f32[32,1,64], bf16[32,20,64]) {
  %w = bf16[20,64,32]{1,0,2} parameter(0)
  %i = s32[] parameter(1)
  %u = bf16[32,1,64]{2,1,0} parameter(2)
  %r = f32[32,1,64]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%fused_read
  %x = bf16[32,20,64]{2,1,0} fusion(%w, %i, %u), kind=kLoop, calls=%fused_write
  ROOT %t = (f32[32,1,64]{2,1,0}, bf16[32,20,64]{2,1,0}) tuple(%r, %x)
}
"""


def test_a_slice_of_a_bitcast_stack_reads_the_slice_and_an_update_writes_in_place():
    """XLA:GPU relabels a pipeline stage's stacked weight (20 layers) with a bitcast before taking one layer's slice,
    and updates a stack through one: the bitcast moves no bytes, so the read costs one layer (32 × 64 bf16 = 4 KiB,
    and the 4-byte index) and the update writes its slice in place, as without the bitcast. Counted whole, each
    call cost the 80 KiB stack."""
    layer, index = 32 * 64 * 2, 4
    read, write = hlo.parse_kernels(BITCAST_SLICES)
    assert (read.bytes_in, read.bytes_out) == (layer + index, 32 * 64 * 4)
    assert (write.bytes_in, write.bytes_out) == (index + layer, layer)


NESTED_SLICE = """HloModule m

%fused_norm (n0: bf16[20,16,64], n1: s32[], n2: bf16[64]) -> bf16[16,64] {
  %n0 = bf16[20,16,64]{2,1,0} parameter(0)
  %n1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = bf16[1,16,64]{2,1,0} dynamic-slice(%n0, %n1, %z, %z), dynamic_slice_sizes={1,16,64}
  %r = bf16[16,64]{1,0} reshape(%ds)
  %n2 = bf16[64]{0} parameter(2)
  %s = bf16[16,64]{1,0} broadcast(%n2), dimensions={1}
  ROOT %m = bf16[16,64]{1,0} multiply(%r, %s)
}

%fused_dot (p0: bf16[20,16,64], p1: s32[], p2: bf16[64], p3: bf16[64,32]) -> bf16[16,32] {
  %p0 = bf16[20,16,64]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = bf16[64]{0} parameter(2)
  %x = bf16[16,64]{1,0} fusion(%p0, %p1, %p2), kind=kLoop, calls=%fused_norm
  %p3 = bf16[64,32]{1,0} parameter(3)
  ROOT %d = bf16[16,32]{1,0} dot(%x, %p3), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (w: bf16[20,16,64], i: s32[], g: bf16[64], v: bf16[64,32]) -> bf16[16,32] {
  %w = bf16[20,16,64]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %g = bf16[64]{0} parameter(2)
  %v = bf16[64,32]{1,0} parameter(3)
  ROOT %o = bf16[16,32]{1,0} fusion(%w, %i, %g, %v), kind=kOutput, calls=%fused_dot
}
"""


def test_a_slice_taken_in_a_nested_fusion_reads_the_slice():
    """libtpu nests a layer's normalisation of its slice of the stacked saved inputs (20 layers here) inside the
    output fusion of the dot that reads it: the stacked operand costs the one layer's slice (16 × 64 bf16), not the
    whole stack (MaxText's Llama 2 70B on v6e-256: seven such fusions per layer were priced at the 20 GiB stack each,
    a memory term of 10.0 s instead of 2.8)."""
    (k,) = hlo.parse_kernels(NESTED_SLICE)
    layer, index, scale, weight = 16 * 64 * 2, 4, 64 * 2, 64 * 32 * 2
    assert k.bytes_in == layer + index + scale + weight
    assert k.flops == 2 * 16 * 64 * 32 + 16 * 64  # the dot and the scale's multiply
