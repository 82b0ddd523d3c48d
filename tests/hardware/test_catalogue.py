"""The catalogue against the vendors' published figures; HardwareSpec's dtype fallbacks and matmul-rate curve."""
import dataclasses
import math

import pytest

from workbench.hardware.spec import HardwareSpec, Interconnect, catalogue

CHIP = HardwareSpec(name="toy", kind="tpu", vendor="test", peak_flops={"bfloat16": 100e12, "float32": 10e12},
                    hbm_bytes=16e9, hbm_bw=1e12, interconnect=Interconnect("ici-torus-2d", 50e9, 4, 0.0),
                    transcendentals_per_s=1e12)

GiB = 2**30
# Headline figures per chip, typed in from the vendors' pages (not from workbench/hardware/catalogue.py):
# (dense bf16 FLOP/s per chip, HBM bytes per chip, HBM bytes/s per chip). Units as printed: "GB" = 1e9, "GiB" = 2**30.
# NVIDIA prints tensor-core rates with 2:4 sparsity (footnote "*With sparsity"): the dense rate is half.
PUBLISHED = {
    # https://cloud.google.com/tpu/docs/v4 — "Peak compute per chip: 275 teraflops (bf16 or int8)";
    # "HBM2 capacity and bandwidth: 32 GiB, 1200 GBps"
    "tpu-v4": (275e12, 32 * GiB, 1200e9),
    # https://cloud.google.com/tpu/docs/v5e — "Peak compute per chip (bf16): 197 TFLOPs";
    # "HBM2 capacity and bandwidth: 16 GB, 819 GBps"
    "tpu-v5e": (197e12, 16e9, 819e9),
    # https://cloud.google.com/tpu/docs/v5p — "Peak compute per chip (bf16): 459 TFLOPs";
    # "HBM capacity per chip: 95 GiB"; "HBM bandwidth per chip: 2765 GBps"
    "tpu-v5p": (459e12, 95 * GiB, 2765e9),
    # https://cloud.google.com/tpu/docs/v6e — "Peak compute per chip (bf16): 918 TFLOPs";
    # "HBM capacity per chip: 32 GB"; "HBM bandwidth per chip: 1638 GBps"
    "tpu-v6e": (918e12, 32e9, 1638e9),
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
    # A100 80GB SXM — "BFLOAT16 Tensor Core 312 TFLOPS | 624 TFLOPS*"; "GPU Memory 80GB HBM2e";
    # "GPU Memory Bandwidth 2,039 GB/s"
    "a100-80gb": (312e12, 80e9, 2039e9),
    # https://www.nvidia.com/en-us/data-center/h100/ — H100 SXM "BF16 Tensor Core 1,979 teraFLOPS*" (sparse);
    # "GPU Memory 80GB"; "GPU Memory Bandwidth 3.35TB/s"
    "h100-sxm": (1979e12 / 2, 80e9, 3.35e12),
    # https://www.nvidia.com/en-us/data-center/h200/ — "BF16 Tensor Core 1,979 TFLOPS*" (sparse); "GPU Memory 141GB";
    # "GPU Memory Bandwidth 4.8TB/s"
    "h200": (1979e12 / 2, 141e9, 4.8e12),
    # https://www.nvidia.com/en-us/data-center/hgx/ — HGX B200 per-GPU figures: "FP16/BF16 Tensor Core 4.5 PFLOPS*"
    # (sparse); "GPU memory 180GB HBM3E"; "GPU memory bandwidth 7.7TB/s" (DGX B200 prints 8 TB/s per GPU)
    "b200": (4.5e15 / 2, 180e9, 7.7e12),
    # https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html — "Peak BFLOAT16 1307.4 TFLOPs"
    # (dense; 2614.9 with structured sparsity); "Memory Capacity 192 GB HBM3"; "Peak Memory Bandwidth 5.3 TB/s"
    "mi300x": (1307.4e12, 192e9, 5.3e12),
    # https://docs.cloud.google.com/tpu/docs/tpu7x — "Peak compute per chip (BF16) (TFLOPs): 2307";
    # "HBM capacity per chip (GiB): 192"; "HBM bandwidth per chip (GB/s): 7380"
    "tpu-v7x": (2307e12, 192 * GiB, 7380e9),
    # https://www.nvidia.com/en-us/data-center/hgx/ — HGX B300 "FP16/BF16 Tensor Core 36 PFLOPS*" for 8 GPUs
    # (sparse: 2.25 PFLOPS dense per GPU); "up to 2.1 TB" for 8 (270 GB per GPU in the per-GPU table); 7.7 TB/s per GPU
    "b300": (36e15 / 8 / 2, 270e9, 7.7e12),
    # https://www.nvidia.com/en-us/data-center/gb300-nvl72/ — "FP16/BF16 Tensor Core 360 PFLOPS*" for 72 GPUs
    # (sparse); per-GPU table: 279 GB HBM3E; rack "576 TB/s" for 72 GPUs
    "gb300": (360e15 / 72 / 2, 279e9, 576e12 / 72),
    # https://www.amd.com/en/products/accelerators/instinct/mi350/mi355x.html — "Peak BF16 ... 2.5 PFLOPs" (dense;
    # 5.0 with sparsity); "288 GB HBM3E"; "8 TB/s"
    "mi355x": (2.5e15, 288e9, 8e12),
}


def test_every_catalogue_chip_has_a_published_row():
    """A chip added to the catalogue needs its row above (typed in from its vendor's page)."""
    assert set(catalogue()) == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_catalogue_matches_the_published_figures(name):
    spec = catalogue()[name]
    bf16, hbm_bytes, hbm_bw = PUBLISHED[name]
    assert spec.peak("bfloat16") == pytest.approx(bf16, rel=1e-9)
    assert spec.hbm_bytes == pytest.approx(hbm_bytes, rel=1e-9)
    assert spec.hbm_bw == pytest.approx(hbm_bw, rel=1e-9)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_catalogue_cites_a_source_for_every_headline_figure(name):
    spec = catalogue()[name]
    for key in ("hbm_bw", "hbm_bytes", "peak_flops.bfloat16", "interconnect.link_bw"):
        src = spec.sources[key]
        assert src.source and src.date, f"{spec.name}.{key} has no source/date"
    # the headline figures cite the vendor's own page (the address typed in the table above)
    host = {"tpu": "cloud.google.com/tpu/docs/", "nvidia": "nvidia.com/", "amd": "amd.com/"}
    vendor = "tpu" if spec.kind == "tpu" else spec.vendor.lower()
    for key in ("hbm_bw", "hbm_bytes", "peak_flops.bfloat16"):
        if (name, key) in FROM_A_COPY:
            assert "NVIDIA" in spec.sources[key].source and "verda.com" in spec.sources[key].source
            continue
        assert host[vendor] in spec.sources[key].source, (name, key, spec.sources[key].source)


# Blackwell Ultra's per-GPU memory figures are in NVIDIA's tables, which the stored material lacks; the catalogue
# cites a copy of those tables and says so (the rows above use the same per-GPU figures)
FROM_A_COPY = {("b300", "hbm_bw"), ("b300", "hbm_bytes"), ("gb300", "hbm_bytes")}


def test_matmul_rate_curve_interpolates_and_scales_by_dtype():
    """Documented rule: linear in the rate, interpolated in log(size); float32 reads the curve (its own measurement,
    capped at the float32 peak), another dtype its shape scaled by peak(dtype) / the curve's top."""
    spec = CHIP.with_measured(matmul_curve=((128, 1e12), (1024, 4e12), (4096, 5e12)))
    assert spec.matmul_rate(64, "float32") == pytest.approx(1e12)  # below the curve: its first point
    # sqrt(128·1024) is halfway between 128 and 1024 in log(size): halfway between 1e12 and 4e12 in rate
    assert spec.matmul_rate(math.sqrt(128 * 1024), "float32") == pytest.approx(2.5e12, rel=1e-12)
    assert spec.matmul_rate(2048, "bfloat16") == pytest.approx((4e12 + 0.5 * 1e12) * 100e12 / 5e12, rel=1e-12)
    assert spec.matmul_rate(8192, "bfloat16") == pytest.approx(100e12)  # the top of the curve is the dtype's peak


def test_a_dtype_with_its_own_curve_reads_it_and_others_keep_float32s_shape():
    """A narrow dtype the calibration ran a curve for (matmul_curves) reads that curve as float32 reads its own:
    directly, capped at its peak; a dtype without one keeps float32's shape scaled to its peak."""
    spec = dataclasses.replace(CHIP, peak_flops={"float32": 5e12, "bfloat16": 9e12, "float16": 8e12}).with_measured(
        matmul_curve=((128, 1e12), (1024, 4e12), (4096, 5e12)),
        matmul_curves=(("bfloat16", ((128, 1.5e12), (1024, 8e12))),))
    assert spec.matmul_rate(128, "bfloat16") == pytest.approx(1.5e12)  # not float32's 1e12 scaled by 9/5
    assert spec.matmul_rate(math.sqrt(128 * 1024), "bfloat16") == pytest.approx((1.5e12 + 8e12) / 2, rel=1e-12)
    assert spec.matmul_rate(4096, "bfloat16") == pytest.approx(8e12)  # its top, below its peak
    assert spec.matmul_rate(128, "float16") == pytest.approx(1e12 * 8e12 / 5e12)
    assert spec.matmul_rate(128, "float32") == pytest.approx(1e12)


def test_physical_peak_follows_the_peak_fallback_chain():
    """A host spec's physical peak for a dtype: its own entry, else the next wider format's (as peak()); catalogue
    chips carry none (their peak is the physical one)."""
    chip = next(iter(catalogue().values()))
    assert chip.physical_peak("bfloat16") is None
    host = dataclasses.replace(chip, name="host", kind="cpu").with_measured(physical_peak_flops={"float32": 1e11, "bfloat16": 2e11})
    assert host.physical_peak("bfloat16") == 2e11 and host.physical_peak("float8_e4m3fn") == 2e11
    assert host.with_measured(physical_peak_flops={"float32": 1e11}).physical_peak("bfloat16") == 1e11
