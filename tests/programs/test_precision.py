"""Precision policies end to end: the error study and its CLI, training `tiny` under every added policy."""
import json
import math

import numpy as np
import pytest

from workbench.errors import WorkbenchError
from workbench.programs.precision import matmul_error


def test_error_ordering_on_normal_inputs():
    """float32 < bf16 < fp8 < mxfp4 against a float64 reference (normal inputs)."""
    e = {p: matmul_error(p, "normal", m=64, k=256, n=64, steps=2)["rel_error"]
         for p in ("float32", "bf16", "fp16", "fp8-current", "fp8-delayed", "mxfp8", "mxfp4")}
    assert e["float32"] < e["bf16"] < e["fp8-current"] < e["mxfp4"], e
    assert e["bf16"] < e["fp8-delayed"] < e["mxfp4"], e
    assert e["fp16"] < e["bf16"] and e["mxfp8"] < e["mxfp4"], e  # more mantissa bits, smaller error
    # the sizes are what the formats predict: bf16 ~ 2^-9, E4M3 ~ 2^-4, E2M1 ~ 2^-2 relative rounding per operand
    assert 1e-3 < e["bf16"] < 1e-2 and 1e-2 < e["fp8-delayed"] < 8e-2 and 5e-2 < e["mxfp4"] < 0.4, e


def test_outlier_inputs_stay_finite_and_are_reported():
    r = matmul_error("fp8-current", "outliers", m=32, k=64, n=32, steps=1)
    assert r["finite"] and r["inputs"] == "outliers" and r["rel_error"] > 0
    with pytest.raises(WorkbenchError, match="input kind"):
        matmul_error("bf16", "uniform")


def test_cli_precision_error_json(capsys):
    from workbench.cli import main

    main(["precision", "error", "--json", "--m", "32", "--k", "64", "--n", "32", "--steps", "1"])
    rows = json.loads(capsys.readouterr().out)
    by = {r["policy"]: r for r in rows}
    assert {"float32", "bf16", "fp8-delayed", "mxfp4"} <= set(by)
    assert all(math.isfinite(r["rel_error"]) for r in rows)
    assert by["float32"]["rel_error"] < by["bf16"]["rel_error"] < by["fp8-delayed"]["rel_error"] < \
        by["mxfp4"]["rel_error"]


def test_cli_precision_bad_names_one_line(capsys):
    from workbench.cli import main

    with pytest.raises(SystemExit) as ex:
        main(["precision", "error", "--policies", "fp8"])
    assert ex.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "ambiguous" in err


@pytest.mark.compile_heavy
@pytest.mark.parametrize("policy", ["fp16", "fp8-current", "fp8-delayed", "mxfp8", "mxfp4"])
def test_policy_trains_tiny_50_steps(policy):
    """Each added policy trains the `tiny` preset for 50 steps through workbench.programs.train's sharded step: finite losses
    that fall; fp8-delayed's amax histories advance under jit with donated state."""
    import jax

    from models.presets import get_config
    from partitioning.mesh import make_mesh
    from workbench.programs.data import Batches, shard_batch
    from workbench.programs.step import build_train_step

    cfg = get_config("tiny", None)
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    prog = build_train_step(cfg, policy=policy, mesh=mesh, strategy="dp", batch_size=4, seq_len=64, total_steps=50)
    batches = Batches(4, 64, 0)
    state, losses = prog.state, []
    for i in range(50):
        state, m = prog.step(state, shard_batch(batches.train(i), prog.batch_sharding))
        losses.append(m["loss"])
    losses = np.array([float(x) for x in losses])
    assert np.all(np.isfinite(losses)), losses
    assert losses[-5:].mean() < losses[:5].mean() - 0.5, losses
    if policy == "fp8-delayed":
        h = np.asarray(state["rest"]["head_dot"]["x_amax_history"][...])
        assert h.shape == (16,) and np.all(h > 0)  # 50 steps filled the 16-step window
    if policy == "fp16":
        assert float(state["loss_scale"].scale) >= 1.0


def test_gpu_precision_section_tiny_on_cpu(results_dir):
    """The GPU device-check section runs in its tiny mode here; on a CPU it must say the fp8 dots are emulated."""
    from benchmarks import gpu_precision
    from workbench.measure.calibrate import get_spec
    from workbench.results.store import Store

    out = gpu_precision.run(spec=get_spec("h200"), tiny=True, repeats=2)
    rows = {r["case"]: r for r in out["rows"]}
    assert set(rows) == {"bf16", "fp8_prequantized", "fp8_dequant_dot", "fp8_policy_fwd"}
    # NVIDIA's published H200 dense peaks (https://www.nvidia.com/en-us/data-center/h200/: BF16 1,979 and FP8 3,958
    # TFLOPS with sparsity, halved)
    h200 = {"bfloat16": 1979e12 / 2, "float8_e4m3fn": 3958e12 / 2}
    for r in rows.values():
        assert "failed" not in r, r
        assert r["flops_per_s"] == pytest.approx(2 * 256**3 / r["median_s"], rel=1e-9)  # tiny: a 256³ matmul
        assert r["fraction_of_peak"] == pytest.approx(r["flops_per_s"] / h200[r["peak_dtype"]], rel=1e-9)
    assert rows["fp8_prequantized"]["peak_dtype"] == "float8_e4m3fn"
    assert rows["fp8_prequantized"]["fp8_gemm_in_hlo"] is False and "emulated" in rows["fp8_prequantized"]["note"]
    assert rows["bf16"]["rel_error_vs_float64"] < rows["fp8_policy_fwd"]["rel_error_vs_float64"] < 0.1
    assert len(Store().records("gpu_precision_matmul")) == 4
