"""The catalogue against the vendors' published figures; HardwareSpec's dtype fallbacks and matmul-rate curve."""
import dataclasses

import pytest

from workbench.hardware.spec import HardwareSpec, Interconnect

CHIP = HardwareSpec(name="toy", kind="tpu", vendor="test", peak_flops={"bfloat16": 100e12, "float32": 10e12},
                    hbm_bytes=16e9, hbm_bw=1e12, interconnect=Interconnect("ici-torus-2d", 50e9, 4, 0.0),
                    transcendentals_per_s=1e12)


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
