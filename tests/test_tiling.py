"""Tile model (workbench/hardware/tiles.py), padding arithmetic against hand-computed values, layouts read from compiled HLO,
block enumeration against on-chip memory, the `workbench tiling` commands."""
import json
import os
import subprocess
import sys

import pytest

from partitioning import topology as topo
from workbench.hardware import tiles
from workbench.errors import WorkbenchError
from workbench.programs import tiling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


# ---------------------------------------------------------------------------------------------- shape


def test_shape_report_single_matmul():
    r = tiling.shape_report("tpu-v6e", m=1000, n=1000, k=1000).to_record()
    assert r["padded"] == {"m": 1008, "n": 1024, "k": 1024}
    assert r["utilization"] < 1 and r["wasted_flops"] > 0
    assert r["predicted_s"] > r["predicted_unpadded_s"] > 0
    assert [s["field"] for s in r["suggestions"]][:2] == ["n", "k"] or [s["field"] for s in r["suggestions"]][:2] == ["k", "n"]
    full = tiling.shape_report("tpu-v6e", m=1024, n=1024, k=1024).to_record()
    assert full["utilization"] == 1.0 and full["suggestions"] == []


def test_shape_report_preset_blames_the_right_dimensions():
    """gpt2-small on a 16-chip v5e slice: head_dim 64 half-fills the 128-wide MXU in attention (the largest waste);
    vocab 50257 is padded to 128 x 16 devices."""
    r = tiling.shape_report("tpu-v5e:4x4", preset="gpt2-small", step_batch=2, seq=256).to_record()
    fields = {s["field"]: s for s in r["suggestions"]}
    assert r["suggestions"][0]["field"] == "head_dim"
    assert fields["head_dim"]["friendly_up"] == 128
    assert fields["vocab_size"]["multiple"] == 128 * 16
    assert fields["vocab_size"]["friendly_up"] == 51200
    assert sum(s["share"] for s in r["suggestions"]) >= 0.99  # every role of every padded dim is attributed
    names = {m["name"] for m in r["matmuls"]}
    assert {"attn.scores", "head.dw", "mlp.up.dx"} <= names


def test_model_matmul_flops_match_the_analytic_count():
    """The matmul list covers the model: forward matmul flops = 2 · N_matmul · tokens + the attention term."""
    from models.analytics import matmul_params_active
    from models.presets import get_config

    cfg = get_config("gpt2-small")
    b, s = 2, 128
    fwd = tiling.model_matmuls(cfg, batch=b, seq=s, mode="forward")
    flops = sum(2 * x.m * x.n * x.k * x.batch * x.count for x in fwd)
    want = 2 * matmul_params_active(cfg) * b * s + 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * s * b * s
    assert flops == want


# ---------------------------------------------------------------------------------------------- layouts


def test_layouts_pad_the_tiled_dimensions():
    lay = tiling.parse_layouts("bf16[4096,1032]{0,1:T(8,128)(2,1)} f32[1000,300]{1,0:T(8,128)} s32[7]{0}")
    assert lay[0].padded_dims == (4096, 1032)      # dim 0 is minor (lanes: 4096), dim 1 second-minor (8)
    assert lay[1].padded_dims == (1000, 384)       # dim 1 minor -> 128, dim 0 -> 8
    assert lay[1].bytes_padded == 1000 * 384 * 4
    assert lay[2].padded_dims == (7,)
    hlo = ("HloModule jit_f, entry_computation_layout={(bf16[4096,1000]{0,1:T(8,128)(2,1)}, "
           "bf16[1000,4096]{1,0:T(8,128)(2,1)})->bf16[4096,4096]{1,0:T(8,128)(2,1)}}, allow_spmd=1\n"
           '  %fusion = f(...), backend_config={"estimated_cycles":"418800"}\n')
    params, results = tiling.entry_layouts(hlo)
    assert [p.padded_dims for p in params] == [(4096, 1000), (1000, 4096)]
    assert results[0].padded_dims == (4096, 4096)
    assert tiling.compiler_cycles(hlo) == 418800


@pytest.mark.compile_heavy
@pytest.mark.skipif(not topo.libtpu_available(), reason="libtpu not installed (pip install -e .[tpu])")
def test_sweep_reads_layouts_from_compiled_tpu_programs(tmp_path):
    """Two compiles for a v5e: k=128 fills the MXU, k=136 needs a second 128-wide pass."""
    r = tiling.sweep("tpu-v5e:1x1", 512, 512, 128, 136, 8, progress=False)
    a, b = r.points
    assert "T(8,128)" in a.layouts[0] and "T(8,128)" in b.layouts[1]
    assert a.mxu_padded["k"] == 128 and b.mxu_padded["k"] == 256
    assert b.predicted_s > a.predicted_s
    assert a.compiler_cycles and b.compiler_cycles


def test_sweep_on_the_host_measures(results_dir, tmp_path):
    r = tiling.sweep("host", 64, 64, 60, 68, 4, dtype="float32", repeats=3, plot=str(tmp_path / "s.png"),
                     progress=False)
    assert [p.k for p in r.points] == [60, 64, 68]
    assert all(p.measured_s and p.measured_s > 0 for p in r.points)
    assert all(p.padded["k"] == p.k for p in r.points)  # XLA:CPU layouts carry no tiles
    assert os.path.exists(r.figure)


# ---------------------------------------------------------------------------------------------- search


def test_block_enumeration_respects_onchip_memory():
    r = tiling.search("matmul", 4096, 4096, 4096, "tpu-v5e", top=0)
    cap = tiles.TILES["tpu-v5e"].onchip_bytes.value
    assert len(r.candidates) >= 3
    for c in r.candidates:
        assert c.onchip_bytes == tiling.onchip_footprint(c.block, 2, 2)
        assert c.fits == (c.onchip_bytes <= cap)
        if not c.fits:
            assert "MiB" in c.reason and c.predicted_s is None
    big = next(c for c in r.candidates if c.block == (4096, 4096, 4096))
    assert not big.fits and "VMEM" in big.reason
    fitting = [c.predicted_s for c in r.candidates if c.fits]
    assert fitting == sorted(fitting)
    # the hand count of one block: 2 x (512·128 + 128·512) bf16 inputs + 2 x 512·512 bf16 output + f32 accumulator
    assert tiling.onchip_footprint((512, 512, 128), 2, 2) == 2 * (2 * 512 * 128) * 2 + 2 * 512 * 512 * 2 + 512 * 512 * 4
    g = tiling.search("matmul", 4096, 4096, 4096, "h100", top=0)
    smem = tiles.TILES["h100-sxm"].onchip_bytes.value
    assert all(c.onchip_bytes <= smem for c in g.candidates if c.fits)
    assert any("register file" in c.reason for c in g.candidates if not c.fits)


def test_tile_roofline_prefers_compute_bound_blocks():
    """A 128x128 block on v5e reads 64 FLOP/B (below the 240 ridge): memory-bound; 512x512 is compute-bound."""
    spec_model = tiles.TILES["tpu-v5e"]
    from workbench.measure.calibrate import get_spec

    spec = get_spec("tpu-v5e")
    small = tiling.predict_block(4096, 4096, 4096, (128, 128, 128), spec_model, spec, "bfloat16", "bfloat16")
    large = tiling.predict_block(4096, 4096, 4096, (512, 512, 512), spec_model, spec, "bfloat16", "bfloat16")
    assert small["intensity"] == pytest.approx(64.0)
    assert small["hbm_s"] > small["compute_s"]
    assert large["predicted_s"] < small["predicted_s"]
    assert large["compute_s"] == pytest.approx(2 * 4096**3 / spec.peak("bfloat16"))


# ---------------------------------------------------------------------------------------------- CLI


def _cli(*args, timeout=600):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "workbench", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_shape_json_and_errors(results_dir):
    r = _cli("tiling", "shape", "--m", "1000", "--n", "1000", "--k", "1000", "--target", "tpu-v6e", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for key in ("padded", "utilization", "wasted_flops", "predicted_s", "suggestions"):
        assert key in d
    assert d["utilization"] < 1 and d["padded"]["k"] == 1024
    bad = _cli("tiling", "shape", "--m", "0", "--n", "8", "--k", "8", "--target", "tpu-v6e")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "m must be >= 1" in bad.stderr
    bad = _cli("tiling", "shape", "--m", "8", "--n", "8", "--k", "8", "--target", "host")
    assert bad.returncode == 2 and "no matrix-unit tile model" in bad.stderr
    bad = _cli("tiling", "search", "--m", "8", "--n", "8", "--k", "8", "--target", "tpu-v5e", "--kernel", "conv")
    assert bad.returncode == 2 and "unknown --kernel" in bad.stderr
