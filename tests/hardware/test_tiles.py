"""Tile model (workbench/hardware/tiles.py): sources, agreement with jax's own TPU table, native tiles and granules,
padding arithmetic against hand-computed values."""
import pytest

from workbench.errors import WorkbenchError
from workbench.hardware import tiles

# ---------------------------------------------------------------------------------------------- tile model


def test_every_chip_has_sources_and_the_catalogue_names():
    from workbench.hardware.spec import catalogue

    for name in catalogue():
        assert name in tiles.TILES, f"{name} has no tile model"
    for name in ("tpu-v7x", "b300", "mi355x"):
        assert name in tiles.TILES
    for m in tiles.TILES.values():
        for fact in (m.matrix_unit, m.matrix_units, m.cores, m.vector_register, m.onchip_bytes):
            assert fact.source and fact.date
    assert tiles.chip_key("tpu-v5e:2x2") == "tpu-v5e" and tiles.chip_key("h100") == "h100-sxm"
    with pytest.raises(WorkbenchError, match="no tile model"):
        tiles.chip_key("tpu-v9z")


def test_tpu_facts_agree_with_jax_pallas_tpu_info():
    """A second source: the TpuInfo table shipped in this jax (per TensorCore)."""
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    if not hasattr(pltpu, "get_tpu_info_for_chip"):
        pytest.skip("this jax has no get_tpu_info_for_chip")
    for chip, version in (("tpu-v4", "TPU_V4"), ("tpu-v5e", "TPU_V5E"), ("tpu-v5p", "TPU_V5P"),
                          ("tpu-v6e", "TPU_V6E"), ("tpu-v7x", "TPU_7X")):
        info = pltpu.get_tpu_info_for_chip(getattr(pltpu.ChipVersion, version), 1)
        m = tiles.TILES[chip]
        assert m.onchip_bytes.value == info.vmem_capacity_bytes, chip
        assert m.scalar_bytes.value == info.smem_capacity_bytes, chip
        assert m.matrix_unit.value == (info.mxu_column_size,) * 2, chip
        assert m.matrix_units.value == info.num_mxus, chip
        assert tiles.native_tile(m, "float32") == (info.num_sublanes, info.num_lanes)


def test_native_tiles_and_granules():
    v5e, v6e, h100, mi = (tiles.TILES[c] for c in ("tpu-v5e", "tpu-v6e", "h100-sxm", "mi300x"))
    assert tiles.native_tile(v5e, "float32") == (8, 128)
    assert tiles.native_tile(v5e, "bfloat16") == (16, 128)
    assert tiles.native_tile(v5e, "int8") == (32, 128)
    assert tiles.pad_granule(v5e, "bfloat16") == (16, 128, 128)
    assert tiles.pad_granule(v6e, "bfloat16") == (16, 256, 256)
    assert tiles.pad_granule(h100, "bfloat16") == (64, 8, 16)   # wgmma m64nNk16
    assert tiles.pad_granule(h100, "float8_e4m3fn") == (64, 8, 32)
    assert tiles.pad_granule(mi, "bfloat16") == (32, 32, 8)
    with pytest.raises(WorkbenchError):
        tiles.native_tile(h100, "bfloat16")


def test_padding_arithmetic_by_hand():
    v6e = tiles.TILES["tpu-v6e"]
    p = tiles.pad_matmul(1000, 1000, 1000, v6e, "bfloat16")
    assert (p.m_pad, p.n_pad, p.k_pad) == (1008, 1024, 1024)
    assert p.utilization == pytest.approx(1000**3 / (1008 * 1024 * 1024))
    assert p.wasted_flops == 2 * (1008 * 1024 * 1024 - 1000**3)
    assert p.bytes == (1000 * 1000 * 2) * 2 + 1000 * 1000 * 2
    assert p.padded_bytes == (1008 * 1024 + 1024 * 1024) * 2 + 1008 * 1024 * 2
    q = tiles.pad_matmul(1024, 1024, 1024, v6e, "bfloat16")
    assert q.utilization == 1.0 and q.wasted_flops == 0
    h = tiles.pad_matmul(100, 100, 100, tiles.TILES["h100-sxm"], "bfloat16", batch=3)
    assert (h.m_pad, h.n_pad, h.k_pad) == (128, 104, 112)
    assert h.padded_flops == 2 * 3 * 128 * 104 * 112
    assert tiles.friendly(50257, 128) == (50176, 50304)
    assert tiles.friendly(64, 128) == (None, 128)
