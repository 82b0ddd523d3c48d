"""workbench/programs/tiling.py: padding of a matmul and of a preset's step, layouts read from compiled HLO, the
sweep (host measured; TPU compiled), block enumeration against on-chip memory, the tile roofline."""
import os

import pytest

from partitioning import topology as topo
from workbench.hardware import tiles
from workbench.programs import tiling

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
