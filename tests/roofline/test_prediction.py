"""Roofline prediction and collective models against hand arithmetic."""
import dataclasses

import pytest

from partitioning.collectives import collective_time
from workbench.cost.hlo import CollectiveOp, KernelCost
from workbench.cost.report import CostReport
from workbench.hardware.spec import HardwareSpec, Interconnect
from workbench.hardware.spec import catalogue_spec as get_spec

CHIP = HardwareSpec(name="toy", kind="tpu", vendor="test", peak_flops={"bfloat16": 100e12, "float32": 10e12},
                    hbm_bytes=16e9, hbm_bw=1e12, interconnect=Interconnect("ici-torus-2d", 50e9, 4, 0.0),
                    transcendentals_per_s=1e12)


def test_compute_bound_matmul():
    n = 4096
    cost = CostReport(flops=2 * n**3, transcendentals=0, bytes_accessed=3 * n * n * 2, compute_dtype="bfloat16")
    from workbench.roofline.prediction import predict

    p = predict(cost, CHIP)
    assert p.bound == "compute"
    assert p.compute_s == pytest.approx(2 * n**3 / 100e12)
    assert p.memory_s == pytest.approx(3 * n * n * 2 / 1e12)
    assert p.predicted_s == pytest.approx(p.compute_s)
    assert p.intensity == pytest.approx(2 * n**3 / (6 * n * n))
    assert p.ridge == pytest.approx(100.0)


def test_memory_bound_and_kernel_sum():
    from workbench.roofline.prediction import predict

    ks = (KernelCost("mm", "kOutput", "", 1e6, 1e6, 2e11, 0), KernelCost("ew", "kLoop", "", 4e9, 4e9, 1e9, 0))
    cost = CostReport(flops=2e11 + 1e9, transcendentals=0, bytes_accessed=8e9 + 2e6, kernels=ks,
                      compute_dtype="bfloat16")
    p = predict(cost, CHIP)
    assert p.bound == "memory"
    # each kernel bounded by its own roof: matmul 2 ms of compute + elementwise 8 ms of memory
    assert p.kernel_s == pytest.approx(2e11 / 100e12 + 8e9 / 1e12, rel=1e-12)
    assert p.compute_s == pytest.approx((2e11 + 1e9) / 100e12, rel=1e-12)  # program level: 2.01 ms
    assert p.memory_s == pytest.approx((8e9 + 2e6) / 1e12, rel=1e-12)  # 8.002 ms
    assert p.predicted_s == pytest.approx(10e-3, rel=1e-12)  # no communication: the kernel sum


def test_collective_formulas():
    ic = Interconnect("ici-torus-2d", 50e9, 4, 0.0)
    V, g = 1e9, 4
    assert collective_time("all-gather", V, g, ic) == pytest.approx(V * 3 / 4 / (2 * 50e9))
    assert collective_time("all-reduce", V, g, ic) == pytest.approx(2 * V * 3 / 4 / (2 * 50e9))
    assert collective_time("all-gather", V, 1, ic) == 0.0
    nv = Interconnect("nvlink", 25e9, 18, 0.0, scale_out_bw=50e9)
    assert collective_time("reduce-scatter", V, 8, nv) == pytest.approx(V * 7 / 8 / 450e9)
    assert collective_time("reduce-scatter", V, 16, nv) == pytest.approx(V * 15 / 16 / 50e9)


def test_comm_term_and_overlap():
    from workbench.roofline.prediction import predict

    c = CollectiveOp("ar", "all-reduce", "float32", 1e9, 4, 1, False, count=2)
    cost = CostReport(flops=1e9, transcendentals=0, bytes_accessed=1e6, collectives=(c,), n_devices=4)
    p = predict(cost, CHIP)
    # ring all-reduce on a 2D torus, one axis: 2·V·(g-1)/g over 2 links one way of 50 GB/s = 15 ms, run twice
    assert p.comm_s == pytest.approx(2 * (2 * 1e9 * 3 / 4 / (2 * 50e9)), rel=1e-12)
    assert p.bound == "communication"
    # no kernels: the program-level roofline, float32 compute 1e9 / 10e12 = 0.1 ms (memory 1e6 / 1e12 = 1 µs)
    assert p.kernel_s == pytest.approx(1e9 / 10e12, rel=1e-12)
    assert p.predicted_serial_s == pytest.approx(0.03 + 1e-4, rel=1e-12)
    assert p.predicted_s == pytest.approx(0.03, rel=1e-12)  # perfect overlap: the communication


def test_simulated_mesh_whole_mesh_on_host():
    from workbench.roofline.prediction import predict

    host = dataclasses.replace(CHIP, name="host", kind="cpu", interconnect=Interconnect("host-memory", 1e12, 1))
    cost = CostReport(flops=1e12, transcendentals=0, bytes_accessed=1e6, n_devices=8)
    p = predict(cost, host)
    assert p.scope == "whole_mesh_on_host"
    assert p.flops == 8e12
    assert p.compute_s == pytest.approx(8e12 / 10e12, rel=1e-12) and p.memory_s == pytest.approx(8e6 / 1e12)
    assert any("share this host" in n for n in p.notes)


def test_fp8_falls_back_where_chip_lacks_units():
    from workbench.roofline.prediction import predict

    cost = CostReport(flops=1e12, transcendentals=0, bytes_accessed=1e6, compute_dtype="float8_e4m3fn")
    p = predict(cost, CHIP)
    assert p.peak_dtype == "bfloat16" and any("no float8_e4m3fn units" in n for n in p.notes)
    h100 = get_spec("h100-sxm")
    assert h100.peak_dtype("float8_e4m3fn") == "float8_e4m3fn"


def test_small_matmul_kernels_priced_on_the_curve():
    from workbench.roofline.prediction import predict

    spec = CHIP.with_measured(matmul_curve=((64, 1e12), (4096, 10e12)))
    k = KernelCost("mm", "kOutput", "", 0.0, 0.0, 2e9, 0, 1, 2e9, 64.0)
    cost = CostReport(flops=2e9, transcendentals=0, bytes_accessed=1.0, kernels=(k,))
    p = predict(cost, spec)
    assert p.kernel_s == pytest.approx(2e9 / 1e12)  # the rate a 64³ matmul reaches, not the 10 TFLOP/s peak
    assert p.compute_s == pytest.approx(2e9 / 10e12)  # the program-level roofline still uses the peak


def test_batched_dot_size_is_the_whole_products_work():
    """A batched dot is sized by batch·m·n·k: the cores split it over its batch elements, so its call and threading
    costs amortise over the whole product (16 × 128³ ran at 92 GFLOP/s here where one 128³ ran at 44)."""
    import jax
    import jax.numpy as jnp

    from workbench.cost.compile import compile_program

    b, m, k, n = 16, 64, 32, 64
    c = compile_program(lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y), jax.ShapeDtypeStruct((b, m, k), jnp.float32),
                        jax.ShapeDtypeStruct((b, k, n), jnp.float32))
    dots = [kk for kk in c.cost.kernels if kk.dot_flops]
    assert sum(kk.dot_flops for kk in dots) == 2 * b * m * k * n
    assert max(kk.dot_size for kk in dots) == pytest.approx((b * m * n * k) ** (1 / 3))


def test_warns_when_compiler_bytes_dwarf_the_kernels():
    from workbench.roofline.prediction import predict

    k = KernelCost("f", "kLoop", "", 1e6, 1e6, 1e6, 0)
    p = predict(CostReport(flops=1e6, transcendentals=0, bytes_accessed=1e9, kernels=(k,)), CHIP)
    assert any("mispriced" in n for n in p.notes)
    p = predict(CostReport(flops=1e6, transcendentals=0, bytes_accessed=2e6, kernels=(k,)), CHIP)
    assert not any("mispriced" in n for n in p.notes)


def test_a_matmul_on_a_catalogue_chip_by_hand():
    """A float32 (256×512)·(512×128) matmul compiled here and priced for an H100 SXM: flops 2·m·n·k, bytes the two
    operands and the result, priced at NVIDIA's published figures (https://www.nvidia.com/en-us/data-center/h100/:
    FP32 67 teraFLOPS, 3.35 TB/s) to 1e-9."""
    import jax
    import jax.numpy as jnp

    from workbench.cost.compile import compile_program
    from workbench.roofline.prediction import predict

    m, k, n = 256, 512, 128
    c = compile_program(lambda x, y: x @ y, jax.ShapeDtypeStruct((m, k), jnp.float32),
                        jax.ShapeDtypeStruct((k, n), jnp.float32))
    p = predict(c.cost, get_spec("h100-sxm"))
    assert p.flops == 2 * m * n * k and p.bytes == 4 * (m * k + k * n + m * n)
    assert p.compute_s == pytest.approx(2 * m * n * k / 67e12, rel=1e-9)
    assert p.memory_s == pytest.approx(4 * (m * k + k * n + m * n) / 3.35e12, rel=1e-9)
    assert p.bound == "compute" and p.comm_s == 0.0
    assert p.predicted_s == pytest.approx(2 * m * n * k / 67e12, rel=1e-9)  # one kernel, compute-bound


def test_reductions_and_conversions_bound_a_host_kernel_by_their_throughput():
    """A kernel's compute is the slowest of its arithmetic, its reductions (elements at the calibrated reduction
    rate: from the cache when it is priced at the in-cache bandwidth) and its float32 <-> bf16 conversions."""
    from workbench.roofline.prediction import kernel_roof

    host = dataclasses.replace(CHIP, kind="cpu").with_measured(reduce_per_s=1e9, reduce_per_s_cached=4e9, convert_per_s=2e9, onchip_bw=4e12)
    red = KernelCost("r", "kInput", "", 4e8, 4e2, 1e8, 0, reduce_elements=1e8)
    assert kernel_roof(red, host, "float32", 1e12) == pytest.approx((1e8 / 1e9, 4e8 / 1e12))
    assert kernel_roof(red, host, "float32", 4e12)[0] == pytest.approx(1e8 / 4e9)
    conv = KernelCost("c", "kLoop", "", 2e8, 2e8, 7e8, 0, convert_elements=1.4e9)
    assert kernel_roof(conv, host, "float32", 1e12)[0] == pytest.approx(1.4e9 / 2e9)
    # a write-allocating host prices a reduction from memory by its bytes: its adds at the in-cache rate
    wa = host.with_measured(write_allocate=True)
    assert kernel_roof(red, wa, "float32", 1e12)[0] == pytest.approx(1e8 / 4e9)
    # not calibrated (a catalogue chip): arithmetic only
    assert kernel_roof(conv, CHIP, "float32", 1e12)[0] == pytest.approx(7e8 / 10e12)


def test_a_library_fusion_adds_its_loops_where_the_library_was_measured():
    """A YNN fusion's arithmetic, where the calibration timed the library's own loops: its reductions, the pass that
    writes each computed operand it reduces, its other elementwise flops and its special functions add, one vector
    loop after another. Without those figures, or for XLA's own kernels, the slowest term bounds it as before."""
    from workbench.roofline.prediction import kernel_roof

    host = dataclasses.replace(CHIP, kind="cpu").with_measured(reduce_per_s=1e9, reduce_per_s_cached=4e9,
                                                               onchip_bw=4e12, transcendentals_per_s_library=2e9)
    # a softmax over 1e8 elements: max and sum (2e8 reduced), exp (1e8), subtract and divide (2e8 flops)
    k = KernelCost("s", "kCustom", "", 4e8, 4e8, 5e8, 1e8, library="__ynn_fusion", reduce_elements=2e8,
                   produced_reduce_elements=1e8)
    bound = max(2e8 / 4e9, 5e8 / host.peak_flops["float32"] + 1e8 / 2e9)
    assert kernel_roof(k, host, "float32", 4e12)[0] == pytest.approx(bound)
    lib = host.with_measured(library_pass_per_s=5e9, library_ops_per_s=50e9)
    assert kernel_roof(k, lib, "float32", 4e12)[0] == pytest.approx(2e8 / 4e9 + 1e8 / 5e9 + 2e8 / 50e9 + 1e8 / 2e9)
    xla = dataclasses.replace(k, library="")
    assert kernel_roof(xla, lib, "float32", 4e12) == kernel_roof(xla, host, "float32", 4e12)


def test_a_kernel_counts_the_reductions_over_operands_it_computes():
    """produced_reduce_elements: a layernorm's variance reduces an operand the kernel computes; its mean, or a sum
    over the input through a conversion, reduce what the kernel reads."""
    import jax
    import jax.numpy as jnp

    from workbench.cost.hlo import parse_kernels
    from workbench.programs import ops

    def produced(f, *args):  # (elements reduced, of them over computed operands), over the program's kernels
        ks = parse_kernels(jax.jit(f).lower(*args).compile().as_text())
        return sum(k.reduce_elements for k in ks), sum(k.produced_reduce_elements for k in ks)

    n = 256 * 512
    fn, args, *_ = ops.layernorm(256, 512, "float32")
    assert produced(fn, *args) == (2 * n, n)  # the variance's (x − mean)²; the mean reads x
    x = jnp.ones((256, 512), jnp.bfloat16)
    assert produced(lambda v: v.astype(jnp.float32).sum(-1), x) == (n, 0)
    assert produced(lambda v: (v * v).sum(-1), x) == (n, n)


def test_the_matmul_curve_is_read_as_its_monotone_fit():
    from workbench.hardware.measured import monotone_curve

    # a dip is pooled with the point before it (their mean), not priced alone nor lifted to the higher neighbour
    dip = CHIP.with_measured(matmul_curve=((512, 8e12), (1024, 5e12), (2048, 10e12)))
    assert dip.matmul_rate(1024, "float32") == pytest.approx(6.5e12)
    assert dip.matmul_rate(512, "float32") == pytest.approx(6.5e12)
    # a high point between lower larger ones does not lift them: the three pool at their mean (a running maximum
    # priced every size from 1024 on at 196)
    bump = ((512, 178e9), (1024, 196e9), (2048, 178e9), (4096, 178e9))
    assert [r for _, r in monotone_curve(bump)] == pytest.approx([178e9, 184e9, 184e9, 184e9])
    host = dataclasses.replace(CHIP, kind="cpu", peak_flops={"float32": 196e9, "bfloat16": 368e9}).with_measured(matmul_curve=bump)
    assert host.matmul_rate(2048, "float32") == pytest.approx(184e9)
    # another dtype takes the curve's shape with its top at the dtype's ceiling
    assert host.matmul_rate(4096, "bfloat16") == pytest.approx(368e9)
    assert host.matmul_rate(512, "bfloat16") == pytest.approx(368e9 * 178 / 184)
    # an increasing curve is its own fit
    assert monotone_curve(((256, 1.0), (128, 0.5), (512, 2.0))) == [(128, 0.5), (256, 1.0), (512, 2.0)]


def test_a_product_with_few_rows_is_priced_on_the_skinny_curve():
    """A dot whose smallest side has fewer rows than the skinny curve's last point runs at that curve's rate
    (interpolated in log rows) where it is below the square curve's; from the last point on, and for dtypes other
    than float32, the square curve alone prices it."""
    from workbench.roofline.pricing import arithmetic_seconds

    host = dataclasses.replace(CHIP, kind="cpu", peak_flops={"float32": 200e9, "bfloat16": 400e9}).with_measured(
        matmul_curve=((64, 100e9), (4096, 200e9)), skinny_curve=((1, 20e9), (8, 50e9), (64, 150e9)))
    few = KernelCost("mm", "kOutput", "", 0.0, 0.0, 1e9, 0, 1, 1e9, 512.0, dot_rows=8.0)
    assert arithmetic_seconds(few, host, "float32") == pytest.approx(1e9 / 50e9)
    four = dataclasses.replace(few, dot_rows=4.0)  # two thirds of the way from 1 to 8 in log rows: 40 GFLOP/s
    assert arithmetic_seconds(four, host, "float32") == pytest.approx(1e9 / 40e9)
    many = dataclasses.replace(few, dot_rows=64.0)
    assert arithmetic_seconds(many, host, "float32") == pytest.approx(1e9 / host.matmul_rate(512.0, "float32"))
    assert arithmetic_seconds(few, host, "bfloat16") == pytest.approx(1e9 / host.matmul_rate(512.0, "bfloat16"))
    assert arithmetic_seconds(few, CHIP.with_measured(matmul_curve=((64, 1e12), (4096, 10e12))), "float32") == \
        pytest.approx(1e9 / CHIP.with_measured(matmul_curve=((64, 1e12), (4096, 10e12))).matmul_rate(512.0, "float32"))


def test_a_few_row_product_packs_a_weight_the_program_keeps_out_of_the_cache():
    """A product with 2 to 63 rows reading a weight straight from the program's parameters, in a program whose
    footprint exceeds the last-level cache, adds the weight's packing (read from memory, written into the cache: a
    call's sweep over a footprint beyond the cache leaves none of it there) to its arithmetic; a single row, a program
    that fits the cache, a weight computed in the program or a many-row product add nothing."""
    from workbench.hardware.measured import MemoryLevel
    from workbench.roofline.host import weight_packing_seconds
    from workbench.roofline.prediction import kernel_roof
    from workbench.roofline.pricing import arithmetic_seconds

    llc, mem = MemoryLevel("L3", 32e6, 80e9, 1.0), MemoryLevel("memory", float("inf"), 20e9, 1.5)
    host = dataclasses.replace(CHIP, kind="cpu", peak_flops={"float32": 200e9}).with_measured(
        matmul_curve=((64, 100e9), (4096, 200e9)), skinny_curve=((1, 20e9), (8, 50e9), (64, 150e9)),
        cache_levels=(llc,), memory_read_ratio=1.5)
    w = 4e6
    few = KernelCost("mm", "kOutput", "", w + 16e3, 64e3, 1.7e7, 0, 1, 1.7e7, 256.0, dot_rows=8.0, param_bytes=w)
    pack = mem.seconds(w, 0) + llc.seconds(0, w)
    assert pack == pytest.approx(w / 30e9 + w / 80e9)
    assert weight_packing_seconds(few, host, 20e9, 320e6) == pytest.approx(pack)
    assert weight_packing_seconds(few, host, 20e9, 48e6) == pytest.approx(pack)
    assert kernel_roof(few, host, "float32", 20e9, program_bytes=320e6)[0] == pytest.approx(
        arithmetic_seconds(few, host, "float32") + pack)
    for k, prog in [(few, 30e6), (dataclasses.replace(few, dot_rows=1.0), 320e6),
                    (dataclasses.replace(few, param_bytes=0.0), 320e6),
                    (dataclasses.replace(few, dot_rows=64.0), 320e6)]:
        assert weight_packing_seconds(k, host, 20e9, prog) == 0.0
    assert kernel_roof(few, host, "float32", 20e9)[0] == pytest.approx(arithmetic_seconds(few, host, "float32"))


def test_a_kernels_reads_of_the_programs_parameters_are_placed_by_the_programs_footprint():
    """Bytes a kernel reads straight from the program's parameters are placed by the program's footprint where it is
    larger than the kernel's own arrays (a 4 MB weight of a 320 MB program, or of a 40 MB one beside a 32 MB cache,
    comes from memory: a call's sweep keeps none of it), the rest of its bytes by its own (a cyclic sweep under
    random replacement); a host with a measured start of a stream from memory adds it in the share read there."""
    from workbench.hardware.measured import MemoryLevel
    from workbench.roofline.host import host_memory_seconds, residency, sweep_hit_rate

    llc = MemoryLevel("L3", 32e6, 80e9, 1.0)
    host = dataclasses.replace(CHIP, kind="cpu").with_measured(cache_levels=(llc,), memory_read_ratio=1.5)
    mem = MemoryLevel("memory", float("inf"), 20e9, 1.5)
    k = KernelCost("mv", "dot", "", 4e6 + 8e3, 8e3, 1e6, 0, dot_flops=1e6, footprint=4.02e6, dot_rows=8.0,
                   param_bytes=4e6)
    own = llc.seconds(8e3, 8e3)
    for program in (320e6, 40e6):
        t, share = host_memory_seconds(k, host, 20e9, program_bytes=program)
        assert t == pytest.approx(own + mem.seconds(4e6, 0))
        assert share == pytest.approx(4e6 / k.bytes)
    started = host.with_measured(memory_start_s=30e-6)
    assert host_memory_seconds(k, started, 20e9, program_bytes=320e6)[0] == pytest.approx(t + share * 30e-6)
    h = sweep_hit_rate(10.0)
    # the program fits its cache, or no program footprint: the kernel's own working set places everything
    assert host_memory_seconds(k, host, 20e9, program_bytes=30e6)[0] == pytest.approx(llc.seconds(k.bytes_in, 8e3))
    assert host_memory_seconds(k, host, 20e9)[0] == pytest.approx(llc.seconds(k.bytes_in, 8e3))
    assert residency(320e6, [llc, mem])[0][1] == pytest.approx(h)


def test_a_one_row_product_reads_its_weight_at_the_measured_row_product_rate():
    """A product with one row reads the share of its weight that comes from memory at the memory's read rate times
    the calibrated row-product ratio (XLA:CPU's matrix-vector kernel); the share from the cache, its own arrays, a
    product of more rows and a host without the figure are priced as before. The figure comes from a calibration
    with both a row product and a measured read ratio, else none."""
    from workbench.hardware.measured import MemoryLevel
    from workbench.measure.calibrate import row_product_read_ratio
    from workbench.roofline.host import host_memory_seconds

    llc, mem = MemoryLevel("L3", 32e6, 80e9, 1.0), MemoryLevel("memory", float("inf"), 20e9, 1.5)
    plain = dataclasses.replace(CHIP, kind="cpu").with_measured(cache_levels=(llc,), memory_read_ratio=1.5)
    host = plain.with_measured(row_product_read_ratio=0.75)
    one = KernelCost("mv", "dot", "", 4e6 + 2e3, 8e3, 8e6, 0, dot_flops=8e6, footprint=4.01e6, dot_rows=1.0,
                     param_bytes=4e6)
    before = llc.seconds(2e3, 8e3) + mem.seconds(4e6, 0)
    assert host_memory_seconds(one, plain, 20e9, program_bytes=320e6)[0] == pytest.approx(before)
    assert host_memory_seconds(one, host, 20e9, program_bytes=320e6)[0] == pytest.approx(
        before + mem.seconds(4e6, 0) * (1 / 0.75 - 1))
    for k in (dataclasses.replace(one, dot_rows=8.0), dataclasses.replace(one, dot_flops=0.0, flops=0.0)):
        assert host_memory_seconds(k, host, 20e9, program_bytes=320e6)[0] == pytest.approx(
            host_memory_seconds(k, plain, 20e9, program_bytes=320e6)[0])
    stream = {"samples": [20e9, 20e9, 20e9], "samples_read": [30e9, 30e9, 30e9], "bytes_per_s": 20e9}
    assert row_product_read_ratio({"stream": stream, "row_product": {"read_ratio": 0.74}}) == 0.74
    assert row_product_read_ratio({"stream": stream}) is None
    assert row_product_read_ratio({"stream": {"bytes_per_s": 20e9}, "row_product": {"read_ratio": 0.74}}) is None


def test_a_kernel_counts_the_bytes_it_reads_from_the_programs_parameters():
    """param_bytes: the operands the entry computation hands a kernel straight from its parameters; a product of
    computed arrays reads none."""
    import jax
    import jax.numpy as jnp

    from workbench.cost.hlo import parse_kernels

    def mlp(x, w1, w2):
        return jnp.tanh(x @ w1) @ w2

    args = (jnp.ones((8, 256)), jnp.ones((256, 1024)), jnp.ones((1024, 256)))
    ks = parse_kernels(jax.jit(mlp).lower(*args).compile().as_text())
    dots = sorted((k for k in ks if k.dot_flops), key=lambda k: k.name)
    assert sum(k.param_bytes for k in ks) >= 4 * (8 * 256 + 2 * 256 * 1024)
    assert all(k.param_bytes <= k.bytes_in for k in ks)
    assert {round(k.param_bytes) for k in dots} >= {4 * 256 * 1024}
    from workbench.programs.ops import program

    fn, abstract = program("weight_stream", {"rows": 4, "d": 64, "f": 128, "layers": 3})
    ks = parse_kernels(jax.jit(fn).lower(*abstract).compile().as_text())
    reads = [k.param_bytes for k in ks if k.dot_flops and k.param_bytes >= 4 * 64 * 128]
    # every weight read straight from the program's parameters (the first product reads x, a parameter, too)
    assert len(reads) == 6 and all(4 * 64 * 128 <= r <= 4 * 64 * 128 + 4 * 4 * 64 for r in reads), reads
    inner = parse_kernels(jax.jit(lambda x, w: jax.lax.fori_loop(0, 3, lambda i, y: jnp.tanh(y @ w), x))
                          .lower(jnp.ones((8, 256)), jnp.ones((256, 256))).compile().as_text())
    assert all(k.param_bytes == 0 for k in inner if k.dot_flops)


def test_the_rows_of_a_dot_are_its_lhs_free_side_where_that_is_the_smaller():
    import jax
    import jax.numpy as jnp

    from workbench.cost.hlo import parse_kernels

    def rows(f, *shapes):
        text = jax.jit(f).lower(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)).compile().as_text()
        return [k.dot_rows for k in parse_kernels(text) if k.dot_flops]

    assert rows(jnp.dot, (8, 768), (768, 3072)) == [8]  # a decode step's product: one row per sequence
    assert rows(jnp.dot, (8192, 4096), (4096, 16)) == [0]  # few columns: the square curve's path
    assert rows(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b), (16, 256, 512), (16, 512, 384)) == [256]


def test_the_kernel_sum_is_checked_against_cost_analysis_in_its_convention():
    """XLA's cost_analysis counts a convert as a flop and an exp only as a transcendental: a bf16 elementwise chain
    (converts around every op) and a softmax are priced kernel by kernel, not by the program-level fallback."""
    import jax
    import jax.numpy as jnp

    from workbench.cost.compile import compile_program
    from workbench.roofline.prediction import predict

    for fn, arg in ((lambda x: x * 1.5 + 0.5, jax.ShapeDtypeStruct((1 << 12,), jnp.bfloat16)),
                    (lambda x: jax.nn.softmax(x, -1), jax.ShapeDtypeStruct((64, 96), jnp.float32))):
        c = compile_program(fn, arg)
        p = predict(c.cost, CHIP)
        assert not any("program-level roofline used" in n for n in p.notes), p.notes


def test_dependent_passes_add_compute_and_memory_on_a_cpu_only():
    """A kernel that walks its rows in dependent passes (a fused softmax, or one fused with the dot that consumes it)
    is priced compute + memory on a CPU, where a core streams the row in and then computes the passes over it from
    cache one after the other (with a dot, its reductions and special functions adding to its arithmetic); on an
    accelerator the terms overlap."""
    from workbench.roofline.prediction import kernel_roof, roof_seconds

    host = dataclasses.replace(CHIP, kind="cpu").with_measured(reduce_per_s=1e9, reduce_per_s_cached=1e9)
    soft = KernelCost("s", "kCustom", "", 4e8, 4e8, 1e8, 1e8, dependent_passes=True)
    plain = dataclasses.replace(soft, dependent_passes=False)
    dotted = dataclasses.replace(soft, dot_flops=1e6)
    assert roof_seconds(soft, host, 2.0, 3.0) == pytest.approx(5.0)
    assert roof_seconds(plain, host, 2.0, 3.0) == pytest.approx(3.0)
    assert roof_seconds(dotted, host, 2.0, 3.0) == pytest.approx(5.0)
    assert roof_seconds(soft, CHIP, 2.0, 3.0) == pytest.approx(3.0)
    red = dataclasses.replace(soft, reduce_elements=2e8)
    arith = 1e8 / 10e12 + 1e8 / host.transcendentals_per_s
    # a softmax alone overlaps its special functions with its reductions; fused with a dot, the passes add
    assert kernel_roof(red, host, "float32", 1e12)[0] == pytest.approx(max(arith, 0.2))
    red_dot = dataclasses.replace(red, dot_flops=1e6, flops=1e8 + 1e6)
    assert kernel_roof(red_dot, host, "float32", 1e12)[0] == pytest.approx(arith + 1e6 / 10e12 + 0.2)
    assert kernel_roof(dataclasses.replace(red, dependent_passes=False), host, "float32", 1e12)[0] == \
        pytest.approx(max(arith, 0.2))


def test_simulated_devices_pay_a_rendezvous_per_array_of_a_combined_all_reduce():
    """On host memory each array of a tuple all-reduce meets the other devices once (XLA:CPU's in-process
    collectives); on a real interconnect the combined all-reduce is one transfer, and an all-to-all's per-peer
    operands share one rendezvous everywhere."""
    ic = Interconnect("host-memory", 1e10, 1, latency_s=1e-4)
    one = collective_time("all-reduce", 1e6, 8, ic)
    assert collective_time("all-reduce", 1e6, 8, ic, operands=5) == pytest.approx(one + 4e-4)
    assert collective_time("all-to-all", 1e6, 8, ic, operands=8) == pytest.approx(collective_time("all-to-all", 1e6, 8, ic))
    assert collective_time("all-reduce", 1e6, 8, CHIP.interconnect, operands=5) == pytest.approx(
        collective_time("all-reduce", 1e6, 8, CHIP.interconnect))


def test_simulated_devices_pay_the_rendezvous_of_their_group_size():
    """Where the calibration measured the rendezvous per group size, a host-memory collective pays its own group's
    (the nearest measured size in log scale); without it, the single figure; real interconnects keep latency_s."""
    ic = Interconnect("host-memory", 1e10, 1, latency_s=4e-5, latency_by_group=((2, 1e-5), (4, 2e-5), (8, 4e-5)))
    bare = Interconnect("host-memory", 1e10, 1)
    for g, a in ((2, 1e-5), (4, 2e-5), (8, 4e-5), (16, 4e-5), (3, 2e-5)):
        assert collective_time("all-reduce", 1e6, g, ic) == pytest.approx(collective_time("all-reduce", 1e6, g, bare) + a)
    assert collective_time("all-reduce", 1e6, 2, ic, operands=3) == pytest.approx(
        collective_time("all-reduce", 1e6, 2, bare) + 3e-5)
    flat = Interconnect("host-memory", 1e10, 1, latency_s=4e-5)
    assert flat.latency_for(2) == 4e-5
    ici = dataclasses.replace(CHIP.interconnect, latency_by_group=((2, 1.0),))
    assert collective_time("all-gather", 1e6, 2, ici) == pytest.approx(collective_time("all-gather", 1e6, 2, CHIP.interconnect))


def test_write_allocating_hosts_move_a_written_byte_twice():
    """On a host whose caches write-allocate, a kernel from memory moves bytes_in + 2·bytes_out at 1.5× the
    calibrated out-of-place stream: the stream's own 1:1 kernel prices as before, a reduction (reads only) at 2/3,
    a broadcast (writes only) at 4/3; in the cache, and on a host without write-allocate, bytes in + out at bw."""
    from workbench.roofline.host import moved_seconds

    host = dataclasses.replace(CHIP, kind="cpu").with_measured(write_allocate=True)
    stream = KernelCost("s", "kLoop", "", 4e8, 4e8, 0, 0)
    read = KernelCost("r", "kInput", "", 4e8, 0, 0, 0)
    write = KernelCost("w", "kLoop", "", 0, 4e8, 0, 0)
    bw = 1e10
    assert moved_seconds(stream, host, bw) == pytest.approx(8e8 / bw)
    assert moved_seconds(read, host, bw) == pytest.approx(4e8 / bw * 2 / 3)
    assert moved_seconds(write, host, bw) == pytest.approx(4e8 / bw * 4 / 3)
    assert moved_seconds(read, host, bw, in_cache=True) == pytest.approx(4e8 / bw)
    assert moved_seconds(read, CHIP, bw) == pytest.approx(4e8 / bw)


def test_strided_transposes_bound_a_host_kernels_memory_term_at_the_calibrated_rate():
    """A kernel's strided transpose elements at the calibrated transpose rate bound its memory term: the in-cache
    rate when its input fits in half the last-level cache (or the program runs from the cache), else the from-memory
    one; a spec without the rates prices the bytes only."""
    from workbench.roofline.host import transpose_seconds
    from workbench.roofline.prediction import kernel_roof

    host = dataclasses.replace(CHIP, kind="cpu", onchip_bytes=32e6).with_measured(transpose_per_s=4e8, transpose_per_s_cached=1.6e9)
    small = KernelCost("t", "kLoop", "", 4e6, 4e6, 0, 0, transpose_elements=1e6)
    big = KernelCost("T", "kLoop", "", 64e6, 64e6, 0, 0, transpose_elements=16e6)
    assert transpose_seconds(small, host) == pytest.approx(1e6 / 1.6e9)
    assert transpose_seconds(dataclasses.replace(big, bytes_in=16e6), host) == pytest.approx(16e6 / 1.6e9)
    assert transpose_seconds(big, host) == pytest.approx(16e6 / 4e8)
    assert transpose_seconds(big, host, in_cache=True) == pytest.approx(16e6 / 1.6e9)
    assert kernel_roof(big, host, "float32", 1e12)[1] == pytest.approx(16e6 / 4e8)
    assert kernel_roof(big, CHIP, "float32", 1e12)[1] == pytest.approx(128e6 / 1e12)
    assert transpose_seconds(dataclasses.replace(big, transpose_elements=0), host) == 0.0


def test_a_host_kernel_is_priced_at_the_cache_level_its_arrays_fit():
    """A host kernel whose whole arrays (footprint), times the devices sharing the cache, fit the last-level cache
    moves its bytes at the in-cache bandwidth and reduces at the in-cache rate; a working set beyond it is served
    from the cache at the hit rate of a cyclic sweep under random replacement (1 − m = exp(−m·W/C)), the rest from
    memory; one slicing a stacked array several times the cache (small bytes, large footprint) is priced from memory
    (on a write-allocating host: its written bytes twice), as is every kernel of an accelerator."""
    from workbench.roofline.host import sweep_hit_rate
    from workbench.roofline.prediction import kernel_roof

    host = dataclasses.replace(CHIP, kind="cpu", onchip_bytes=32e6).with_measured(onchip_bw=4e10, reduce_per_s=1e9, reduce_per_s_cached=4e9)
    small = KernelCost("s", "kLoop", "", 4e6, 4e6, 0, 0, footprint=8e6, reduce_elements=1e6)
    assert kernel_roof(small, host, "float32", 1e10) == pytest.approx((1e6 / 4e9, 8e6 / 4e10))
    assert kernel_roof(dataclasses.replace(small, footprint=32e6), host, "float32", 1e10)[1] == pytest.approx(8e6 / 4e10)
    h = sweep_hit_rate(2.0)  # 8 devices × 8 MB over a 32 MB cache
    assert h == pytest.approx(1 - 0.7968, abs=1e-3)
    assert kernel_roof(small, host, "float32", 1e10, sharers=8) == pytest.approx(
        (1e6 / 1e9, h * 8e6 / 4e10 + (1 - h) * 8e6 / 1e10))
    sliced = dataclasses.replace(small, footprint=64e6 * 8)
    wa = host.with_measured(write_allocate=True)
    assert kernel_roof(sliced, wa, "float32", 1e10)[1] == pytest.approx(12e6 / 1.5e10, rel=1e-3)
    assert kernel_roof(small, CHIP, "float32", 1e12)[1] == pytest.approx(8e6 / 1e12)
