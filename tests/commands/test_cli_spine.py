"""The spine's CLI as a user runs it: catalogue, roofline on the host and on a target, bad input, demo, GPU script."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    e = dict(os.environ, JAX_PLATFORMS="cpu", WORKBENCH_CACHE_DIR=str(d / "cache"),
             WORKBENCH_RESULTS=str(d / "results"))
    r = subprocess.run([sys.executable, "-m", "workbench", "calibrate", "--quick", "--json"], env=e, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    cal = json.loads(r.stdout)
    # the physical peak is the derivation it prints: cores × float32 lanes × FMA pipes × 2 FLOP × clock
    d = cal["physical"]["derivation"]
    assert cal["physical"]["peak_flops"]["float32"] == pytest.approx(
        d["cores"] * d["f32_lanes"] * d["fma_pipes"] * 2 * d["clock_ghz"] * 1e9, rel=1e-9)
    # a measured float32 matmul is positive and below what these cores could do at 2 FMA pipes and 6 GHz
    assert 0 < cal["matmul"]["float32"]["flops_per_s"] <= d["cores"] * d["f32_lanes"] * 2 * 2 * 6e9
    assert cal["stream"]["bytes_per_s"] > 0
    # bfloat16 has a rate curve of its own, in its ceiling's result form, at the float32 curve's sizes up to the
    # ceiling's n, each point at or below the bf16 peak the spec takes
    bf = cal["matmul_curves"]["bfloat16"]
    assert [r["n"] for r in bf] == [r["n"] for r in cal["matmul_curve"] if r["n"] <= cal["matmul"]["bfloat16"]["n"]]
    assert all(r["flops_per_s"] > 0 and r["result_dtype"] == cal["matmul"]["bfloat16"]["result_dtype"] for r in bf)
    return e


def wb(env, *args, ok=True):
    r = subprocess.run([sys.executable, "-m", "workbench", *args], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    if ok:
        assert r.returncode == 0, r.stderr[-2000:]
    return r


def test_hw_list_and_show(env):
    chips = json.loads(wb(env, "hw", "list", "--json").stdout)
    names = [c["name"] for c in chips]
    assert len(names) >= 10 and "host" in names and "tpu-v5e" in names
    v5e = json.loads(wb(env, "hw", "show", "v5e", "--json").stdout)
    assert v5e["peak_flops"]["bfloat16"] == pytest.approx(1.97e14)
    assert v5e["sources"]["hbm_bw"]["source"]
    host = json.loads(wb(env, "hw", "show", "host", "--json").stdout)
    assert host["physical_peak_flops"]["float32"] > 0


def test_roofline_matmul_on_host_records(env):
    n = 256
    r = json.loads(wb(env, "roofline", "matmul", "--m", str(n), "--n", str(n), "--k", str(n), "--json").stdout)
    assert r["flops"] == 2 * n**3 and r["analytic_flops"] == 2 * n**3
    assert r["measured_s"] > 0 and r["predicted_s"] > 0 and r["target"] == "host"
    recs = [json.loads(line) for line in open(os.path.join(env["WORKBENCH_RESULTS"], "records.jsonl"))]
    assert recs[-1]["id"] == r["record_id"] and recs[-1]["measurement"]["repeats"] == 10


def test_roofline_target_predicts_without_running(env):
    n = 8192
    r = json.loads(wb(env, "roofline", "matmul", "--m", str(n), "--n", str(n), "--k", str(n), "--dtype", "bfloat16",
                      "--target", "h100-sxm", "--json").stdout)
    # NVIDIA's published H100 SXM figures (https://www.nvidia.com/en-us/data-center/h100/): BF16 1,979 TFLOPS with
    # sparsity (989.5 dense), 3.35 TB/s
    peak, bw = 1979e12 / 2, 3.35e12
    assert r["measured_s"] is None and r["target"] == "h100-sxm"
    assert r["formula_flops"] == r["analytic_flops"] == r["hlo_flops"] == 2 * n**3
    assert r["compute_s"] == pytest.approx(r["flops"] / peak, rel=1e-9)
    assert r["memory_s"] == pytest.approx(r["bytes"] / bw, rel=1e-9)
    assert r["comm_s"] == 0 and r["predicted_serial_s"] == pytest.approx(r["predicted_s"], rel=1e-12)
    # the program (the dot plus XLA:CPU's bf16 converts) is priced within 1.5x of the dot alone at the peak
    floor = 2 * n**3 / peak
    assert floor * (1 - 1e-9) <= r["predicted_s"] <= floor * 1.5 and r["bound"] == "compute"


def test_elementwise_is_memory_bound(env):
    r = json.loads(wb(env, "roofline", "elementwise", "--n", "1048576", "--json").stdout)
    assert r["bound"] == "memory" and r["intensity"] < 1


@pytest.mark.parametrize("args,needle", [
    (["roofline", "matmul", "--m", "-5", "--n", "4", "--k", "4"], "--m must be a positive whole number"),
    (["roofline", "matmul", "--m", "2.5"], "--m must be a positive whole number"),
    (["roofline", "conv"], "unknown op"),
    (["roofline", "matmul", "--dtype", "int3"], "unsupported dtype"),
    (["roofline", "matmul", "--target", "tpu-v9"], "unknown chip"),
    (["roofline", "softmax", "--m", "4"], "softmax takes sizes"),
    (["roofline", "elementwise", "--n", "4000000000000"], "available"),
    (["hw", "show", "nope"], "unknown chip"),
])
def test_bad_input_one_line_exit_2(env, args, needle):
    r = wb(env, *args, ok=False)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_corrupt_results_file_exit_2(env, tmp_path):
    bad = dict(env, WORKBENCH_RESULTS=str(tmp_path))
    (tmp_path / "records.jsonl").write_text('{"id": "a"}\nnot json\n')
    r = wb(bad, "results", "list", ok=False)
    assert r.returncode == 2 and "records.jsonl:2" in r.stderr


def test_demo_tiny_writes_report(env, tmp_path):
    out = tmp_path / "report"
    wb(env, "demo", "--tiny", "--out", str(out))
    assert (out / "roofline.png").stat().st_size > 10_000
    text = (out / "README.md").read_text()
    assert "| op |" in text and "Median prediction error" in text
    rows = json.loads((out / "results.json").read_text())
    for r in rows:  # each row's own spread, and whether the miss lies inside it
        assert r["spread"] == pytest.approx(r["measured_iqr_s"] / r["measured_s"])
        assert r["within_spread"] == ("yes" if r["error"] <= r["spread"] else "no")


def test_gpu_check_script_tiny_on_cpu(env, tmp_path):
    # as on a GPU host: from the source tree's root, `-m` (nothing installed needed but jax); each section in a
    # process of its own, the results merged into one summary, the artifacts packed for the device tool
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--tiny", str(tmp_path)],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    sections = json.loads((tmp_path / "summary.json").read_text())["sections"]
    assert sections["calibrate"]["matmul"]["bfloat16"]["flops_per_s"] > 0
    assert all("failed" not in row for row in sections["ops"]["ops"]), sections["ops"]
    progs = sections["programs"]["programs"]
    assert len(progs) >= 4 and all(p["measured_s"] > 0 and p["predicted_s"] > 0 for p in progs), progs
    assert progs[0]["kernel_trace"]["kernel_events"] > 0  # the first program traced kernel by kernel
    assert sections["run"]["platform"] == "cpu" and sections["run"]["step_s"] > 0
    assert (tmp_path / "table.md").exists() and (tmp_path / "artifacts.tar.gz").exists()
    assert len(list((tmp_path / "hlo").glob("*.txt.gz"))) == len(progs)  # the compiled programs, kept to re-read
    tiling = sections["tiling"]
    assert "failed" not in tiling, tiling
    assert all(p["measured_s"] > 0 for p in tiling["sawtooth"]) and tiling["search"]["top"]


def test_calibrate_prints_the_memory_figures_the_roofline_prices_with(env):
    """The console form of the cached calibration names every memory figure a host kernel is priced with: the
    stream, the in-place stream and what it says of write-allocate, the in-cache stream, the reduction, conversion and
    strided-transpose rates."""
    out = wb(env, "calibrate", "--quick").stdout
    for line in ("stream bandwidth", "in-place stream", "in-cache stream", "reduction", "f32<->bf16 convert",
                 "strided transpose"):
        assert line in out, out
    assert ("write-allocate" in out) or ("reads and writes priced alike" in out)
