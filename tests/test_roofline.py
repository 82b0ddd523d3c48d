"""Roofline prediction and collective models against hand arithmetic."""
import dataclasses

import pytest

from partitioning.collectives import collective_time
from workbench.cost.hlo import CollectiveOp, KernelCost
from workbench.cost.report import CostReport
from workbench.hardware.spec import HardwareSpec, Interconnect, get_spec

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
    assert p.kernel_s == pytest.approx(2e11 / 100e12 + 8e9 / 1e12)
    assert p.predicted_s >= max(p.compute_s, p.memory_s)


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
    assert p.comm_s == pytest.approx(2 * collective_time("all-reduce", 1e9, 4, CHIP.interconnect))
    assert p.bound == "communication"
    assert p.predicted_serial_s == pytest.approx(p.kernel_s + p.comm_s)
    assert p.predicted_s == pytest.approx(max(p.kernel_s, p.comm_s))


def test_simulated_mesh_whole_mesh_on_host():
    from workbench.roofline.prediction import predict

    host = dataclasses.replace(CHIP, name="host", kind="cpu", interconnect=Interconnect("host-memory", 1e12, 1))
    cost = CostReport(flops=1e12, transcendentals=0, bytes_accessed=1e6, n_devices=8)
    p = predict(cost, host)
    assert p.scope == "whole_mesh_on_host"
    assert p.flops == 8e12
    assert any("share this host" in n for n in p.notes)


def test_fp8_falls_back_where_chip_lacks_units():
    from workbench.roofline.prediction import predict

    cost = CostReport(flops=1e12, transcendentals=0, bytes_accessed=1e6, compute_dtype="float8_e4m3fn")
    p = predict(cost, CHIP)
    assert p.peak_dtype == "bfloat16" and any("no float8_e4m3fn units" in n for n in p.notes)
    h100 = get_spec("h100-sxm")
    assert h100.peak_dtype("float8_e4m3fn") == "float8_e4m3fn"


def test_catalogue_sources_everywhere():
    from workbench.hardware.spec import catalogue

    cat = catalogue()
    assert len(cat) >= 9
    for spec in cat.values():
        assert "bfloat16" in spec.peak_flops and spec.hbm_bw > 0 and spec.hbm_bytes > 0
        for key in ("hbm_bw", "hbm_bytes", "peak_flops.bfloat16", "interconnect.link_bw"):
            src = spec.sources[key]
            assert src.source and src.date, f"{spec.name}.{key} has no source/date"


def test_matmul_rate_curve_interpolates_and_scales_by_dtype():
    spec = dataclasses.replace(CHIP, matmul_curve=((128, 1e12), (1024, 4e12), (4096, 5e12)))
    assert spec.matmul_rate(64, "float32") == pytest.approx(1e12 * 10e12 / 5e12)
    mid = spec.matmul_rate(362, "float32")  # ~halfway between 128 and 1024 in log space
    assert 2e12 * 2 < mid < 3e12 * 2
    assert spec.matmul_rate(8192, "bfloat16") == pytest.approx(100e12)  # the top of the curve is the dtype's peak


def test_small_matmul_kernels_priced_on_the_curve():
    from workbench.roofline.prediction import predict

    spec = dataclasses.replace(CHIP, matmul_curve=((64, 1e12), (4096, 10e12)))
    k = KernelCost("mm", "kOutput", "", 0.0, 0.0, 2e9, 0, 1, 2e9, 64.0)
    cost = CostReport(flops=2e9, transcendentals=0, bytes_accessed=1.0, kernels=(k,))
    p = predict(cost, spec)
    assert p.kernel_s == pytest.approx(2e9 / 1e12)  # the rate a 64³ matmul reaches, not the 10 TFLOP/s peak
    assert p.compute_s == pytest.approx(2e9 / 10e12)  # the program-level roofline still uses the peak


def test_batched_dot_size_excludes_batch():
    import jax
    import jax.numpy as jnp

    from workbench.cost.compile import compile_program

    b, m, k, n = 16, 64, 32, 64
    c = compile_program(lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y), jax.ShapeDtypeStruct((b, m, k), jnp.float32),
                        jax.ShapeDtypeStruct((b, k, n), jnp.float32))
    dots = [kk for kk in c.cost.kernels if kk.dot_flops]
    assert sum(kk.dot_flops for kk in dots) == 2 * b * m * k * n
    assert max(kk.dot_size for kk in dots) == pytest.approx((m * n * k) ** (1 / 3))


def test_warns_when_compiler_bytes_dwarf_the_kernels():
    from workbench.roofline.prediction import predict

    k = KernelCost("f", "kLoop", "", 1e6, 1e6, 1e6, 0)
    p = predict(CostReport(flops=1e6, transcendentals=0, bytes_accessed=1e9, kernels=(k,)), CHIP)
    assert any("mispriced" in n for n in p.notes)
    p = predict(CostReport(flops=1e6, transcendentals=0, bytes_accessed=2e6, kernels=(k,)), CHIP)
    assert not any("mispriced" in n for n in p.notes)
