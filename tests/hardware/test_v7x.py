"""TPU v7x (Ironwood): the catalogue entry, per-chip vs per-device figures, `tpu-v7x:` targets through libtpu's
`tpu7x` topologies (two devices per chip), and a small program predicted on it. Also the newest GPUs' entries."""
import pytest

from partitioning import topology as topo
from workbench.errors import WorkbenchError
from workbench.hardware.spec import catalogue_spec as get_spec
from workbench.programs import predict as wp

needs_libtpu = pytest.mark.skipif(not topo.libtpu_available(), reason="libtpu not installed (pip install -e .[tpu])")


def test_v7x_catalogue_entry_has_sourced_figures():
    s = get_spec("tpu-v7x")
    assert get_spec("ironwood").name == get_spec("tpu7x").name == "tpu-v7x"
    assert s.peak("bfloat16") == pytest.approx(2.307e15) and s.peak("float8_e4m3fn") == pytest.approx(4.614e15)
    assert s.peak_dtype("float8_e5m2") == "float8_e5m2"  # native fp8: not the bf16 fallback
    assert s.peak_dtype("int8") == "bfloat16"  # no int8 MXU path on TPU7x
    assert s.hbm_bytes == 192 * 2**30 and s.hbm_bw == pytest.approx(7.38e12)
    assert s.cores_per_chip == 2 and s.matrix_unit == (256, 256) and s.interconnect.kind == "ici-torus-3d"
    for key in ("peak_flops.bfloat16", "peak_flops.float8_e4m3fn", "hbm_bytes", "hbm_bw", "interconnect.link_bw",
                "interconnect.links", "cores_per_chip", "matrix_unit"):
        assert s.sources[key].source.startswith(("https://", "jax ")) and s.sources[key].date == "2026-12-01"


def test_per_device_figures_are_the_chip_halved():
    chip = get_spec("tpu-v7x")
    dev = chip.per_device(2)
    assert dev.peak("bfloat16") * 2 == pytest.approx(chip.peak("bfloat16"))
    assert dev.hbm_bytes * 2 == chip.hbm_bytes and dev.hbm_bw * 2 == pytest.approx(chip.hbm_bw)
    assert dev.interconnect.link_bw * 2 == chip.interconnect.link_bw and dev.devices_per_chip == 2
    assert dev.ridge("bfloat16") == pytest.approx(chip.ridge("bfloat16"))  # intensity is per-device invariant
    assert chip.per_device(1) is chip
    with pytest.raises(WorkbenchError):
        chip.per_device(0)


def test_v7x_targets_parse_with_two_devices_per_chip():
    t = topo.parse_target("tpu-v7x:4x4x4")
    assert (t.n_chips, t.devices_per_chip, t.n_devices, t.topology_name) == (64, 2, 128, "tpu7x:4x4x4")
    assert topo.parse_target("tpu7x:2x2x1").name == topo.parse_target("ironwood:2x2x1").name == "tpu-v7x:2x2x1"
    assert topo.parse_target("tpu-v5p:2x2x1").n_devices == 4  # megacore chips stay one device each
    assert wp.target_spec(t).name == "tpu-v7x/device" and wp.chip_spec(t).name == "tpu-v7x"
    with pytest.raises(WorkbenchError, match="3D tori"):
        topo.parse_target("tpu-v7x:4x4")


@needs_libtpu
def test_libtpu_gives_two_devices_per_v7x_chip():
    t = topo.parse_target("tpu-v7x:2x2x1")
    devs = topo.target_devices(t)
    assert len(devs) == 8 and devs[0].device_kind == "TPU7x" and topo.devices_per_chip_of(devs) == 2
    assert {tuple(d.coords) for d in devs} == {(x, y, 0) for x in (0, 1) for y in (0, 1)}
    assert topo.devices_per_chip_of(topo.target_devices(topo.parse_target("tpu-v5p:2x2x1"))) == 1


@needs_libtpu
@pytest.mark.compile_heavy
def test_tiny_predicted_on_v7x(results_dir):
    """The whole predict path on 8 TensorCore devices: mesh over devices, per-device costs against the
    per-device spec, the floor over chips × chip peak (the same number)."""
    r = wp.predict(wp.PredictSpec("tiny", "tpu-v7x:2x2x1", "fsdp", batch=16))
    assert r["compiled"] and r["fits"] and r["compiler"] == "libtpu"
    assert (r["n_chips"], r["n_devices"], r["devices_per_chip"]) == (4, 8, 2) and r["mesh"] == "data=8"
    chip = get_spec("tpu-v7x")
    assert r["hbm_bytes"] == chip.hbm_bytes / 2  # the memory a device may use
    assert r["analytic_floor_s"] == pytest.approx(r["model_flops_per_step"] / (4 * chip.peak("bfloat16")))
    assert r["predicted_step_s"] >= r["analytic_floor_s"] and 0 < r["predicted_mfu"] <= 1
    assert r["flops_per_device"] > 0 and r["collectives"]


def test_newest_gpus_in_the_catalogue_with_sparse_flags():
    b300, gb300, mi = get_spec("b300"), get_spec("gb300"), get_spec("mi355x")
    assert b300.peak("float4_e2m1fn") == pytest.approx(1.35e16) and b300.peak("bfloat16") == pytest.approx(2.25e15)
    assert gb300.peak("float4_e2m1fn") > b300.peak("float4_e2m1fn")  # the NVL72 part runs faster
    assert b300.peak_dtype("float6_e2m3fn") == "float6_e2m3fn" and b300.peak("float6_e2m3fn") == b300.peak("fp8")
    assert mi.peak("float6_e2m3fn") == mi.peak("float4_e2m1fn") == pytest.approx(2 * mi.peak("fp8"))
    assert mi.hbm_bytes == 288e9 and mi.interconnect.kind == "infinity-fabric"
    for s in (b300, gb300):
        assert any("SPARSE-ONLY" in n for n in s.notes)
        assert "sparse" in s.sources["peak_flops.bfloat16"].note.lower()
    for s in (b300, gb300, mi):
        for key in ("peak_flops.bfloat16", "hbm_bytes", "hbm_bw", "interconnect.link_bw"):
            assert s.sources[key].source and s.sources[key].date == "2026-12-01"


def test_plan_enumerates_meshes_over_v7x_devices():
    import math

    from workbench.programs.plan import enumerate_candidates

    cands = enumerate_candidates("tiny", "tpu-v7x:2x2x1", strategies=["fsdp", "tp"])
    meshes = {c.mesh for c in cands}
    assert "data=8" in meshes and "data=4,model=2" in meshes
    assert all(math.prod(int(a.split("=")[1]) for a in m.split(",")) == 8 for m in meshes)
