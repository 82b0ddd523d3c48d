"""Sweeps (resumable, kill-safe, one record per point), the store's query API, and the paper notebooks executed on a
small store these tests make. The sweeps predict for a TPU chip (`roofline --target tpu-v5e`): compiled here, not
run, so no calibration is needed."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from workbench.errors import WorkbenchError
from workbench.programs import sweep as sw
from workbench.results.store import Store, make_record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GRID = """# a grid over matmul sizes, predicted for a TPU chip
[sweep]
name = "{name}"
command = "roofline"
[fixed]
op = "matmul"
target = "tpu-v5e"
n = 128
k = 128
[grid]
m = [{ms}]
"""


def _env(tmp_path):
    return dict(os.environ, JAX_PLATFORMS="cpu", WORKBENCH_RESULTS=str(tmp_path / "records.jsonl"),
                WORKBENCH_CACHE_DIR=str(tmp_path / "cache"))


def _sweep(tmp_path, *args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "workbench", "sweep", *args], cwd=ROOT, env=env or _env(tmp_path),
                          capture_output=True, text=True, timeout=timeout)


def _records(tmp_path):
    path = tmp_path / "records.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_grid_points_and_argv():
    spec = sw.SweepSpec("g", ("roofline",), {"op": "matmul", "n": 8}, {"m": [1, 2], "k": [3, 4]}, ({"m": 9, "k": 9},))
    pts = spec.points(basis={"git_sha": "x"})
    assert [p.params for p in pts] == [{"op": "matmul", "n": 8, "m": m, "k": k} for m in (1, 2) for k in (3, 4)] + [
        {"op": "matmul", "n": 8, "m": 9, "k": 9}]
    assert len({p.key for p in pts}) == 5
    # the same experiment on other code is another point
    assert {p.key for p in spec.points(basis={"git_sha": "y"})}.isdisjoint({p.key for p in pts})


def test_malformed_toml_is_one_line_with_its_line_number(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text('[sweep]\nname = "x"\ncommand = "roofline"\n[grid]\nm = [1, 2\n')
    with pytest.raises(WorkbenchError, match="line"):
        sw.load_sweep(str(f))
    p = _sweep(tmp_path, str(f))
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "line" in p.stderr


def test_sweep_resumes_after_sigkill_with_one_record_per_point(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(GRID.format(name="kill", ms="128, 256, 384, 512"))
    env = _env(tmp_path)
    p = subprocess.Popen([sys.executable, "-m", "workbench", "sweep", str(f)], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    t0 = time.time()
    while time.time() - t0 < 300 and len(_records(tmp_path)) < 1 and p.poll() is None:
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGKILL)  # mid-sweep: the parent and the point running now
    p.wait()
    first = len(_records(tmp_path))
    assert 1 <= first < 4
    q = _sweep(tmp_path, str(f))
    assert q.returncode == 0, q.stderr[-500:]
    recs = _records(tmp_path)
    keys = [r["provenance"]["sweep"]["point"] for r in recs]
    assert len(recs) == 4 and len(set(keys)) == 4
    assert sorted(r["spec"]["sizes"]["m"] for r in recs) == [128, 256, 384, 512]
    again = _sweep(tmp_path, str(f), "--json")
    assert json.loads(again.stdout)["ran"] == 0 and len(_records(tmp_path)) == 4


def test_invalid_point_is_reported_and_the_rest_recorded(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(GRID.format(name="bad-point", ms="128, -5"))
    p = _sweep(tmp_path, str(f))
    assert p.returncode == 1
    assert "point 1" in p.stderr and "m" in p.stderr
    assert [r["spec"]["sizes"]["m"] for r in _records(tmp_path)] == [128]
    dry = _sweep(tmp_path, str(f), "--dry-run", "--json")
    assert dry.returncode == 0 and len(json.loads(dry.stdout)["outcomes"]) == 2


def test_query_filters_kind_sweep_since_and_spec(tmp_path):
    store = Store(str(tmp_path / "q"))
    os.environ["WORKBENCH_SWEEP"] = json.dumps({"name": "s1", "id": "abc", "point": "p1"})
    try:
        store.append(make_record("roofline-op", {"op": "matmul"}))
    finally:
        del os.environ["WORKBENCH_SWEEP"]
    store.append(make_record("roofline-op", {"op": "softmax"}))
    store.append(make_record("train", {"op": "matmul"}))
    assert len(store.query()) == 3
    assert list(store.query(kind="roofline-op")["spec.op"]) == ["matmul", "softmax"]
    assert list(store.query(sweep="s1")["spec.op"]) == ["matmul"] == list(store.query(sweep="abc")["spec.op"])
    assert len(store.query(op="matmul")) == 2 and len(store.query(kind="train", op="softmax")) == 0
    assert len(store.query(since="2999-01-01")) == 0 and len(store.query(since="2000-01-01")) == 3
    prov = store.records()[0]["provenance"]
    assert {"git_sha", "git_dirty", "jax", "jaxlib", "libtpu", "flax", "xla_flags", "host_fingerprint", "device_kind",
            "device_count", "time"} <= set(prov)


@pytest.mark.compile_heavy
def test_notebooks_execute_on_a_small_store(tmp_path):
    """Every notebook runs headless against a store of real records (a TPU-predicted op sweep, precision errors, a
    model served on the host) and writes its figures (PDF + PNG) and tables (.tex + .md), each naming its commit and
    records."""
    f = tmp_path / "s.toml"
    f.write_text(GRID.format(name="nb", ms="128, 256"))
    assert _sweep(tmp_path, str(f)).returncode == 0
    env = _env(tmp_path)
    p = subprocess.run([sys.executable, "-m", "workbench", "precision", "error", "--policies", "float32,bf16",
                        "--m", "32", "--k", "64", "--n", "32", "--steps", "1", "--record", "--json"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-500:]
    p = subprocess.run([sys.executable, "-m", "workbench", "serve", "--preset", "tiny", "--target", "host", "--batch",
                        "1,2", "--prompt-len", "16", "--gen-len", "8", "--quant", "int8", "--json"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-500:]
    out = tmp_path / "paper"
    litter = set(glob.glob(os.path.join(ROOT, "kernel-ipc-*")))
    p = subprocess.run([sys.executable, "-m", "workbench", "paper", "build", "--out", str(out), "--json"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-1500:]
    assert set(glob.glob(os.path.join(ROOT, "kernel-ipc-*"))) == litter, "the kernels' sockets were left in the cwd"
    res = json.loads(p.stdout)
    notebooks = [n for n in os.listdir(os.path.join(ROOT, "notebooks")) if n.endswith(".py")]
    assert all(n["ok"] for n in res["notebooks"]) and len(res["notebooks"]) == len(notebooks)
    for tex in res["tables"]:
        text = open(tex).read()
        assert text.startswith("% provenance: commit ") and r"\toprule" in text
    prec = open(out / "tables" / "precision_error.tex").read()
    assert "float32" in prec and "bf16" in prec and "2 records" in prec
    serving = open(out / "tables" / "serving.md").read()
    assert "tiny · host int8 | 1 |" in serving and "tiny · host int8 | 2 |" in serving, serving
    for pdf in res["figures"]:
        assert os.path.getsize(pdf) > 1000 and os.path.exists(pdf[:-4] + ".png")


def test_sweep_over_workers_survives_a_killed_worker_with_one_record_per_point(tmp_path):
    """--workers 2: a worker process killed mid-point takes its point with it; the point is run again on a new
    worker, the sweep ends with exactly one record per point, and a rerun has nothing left to do."""
    psutil = pytest.importorskip("psutil")
    f = tmp_path / "s.toml"
    f.write_text(GRID.format(name="workers", ms="128, 256, 384"))
    p = subprocess.Popen([sys.executable, "-m", "workbench", "sweep", str(f), "--workers", "2", "--json"], cwd=ROOT,
                         env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed, t0 = None, time.time()
    while killed is None and p.poll() is None and time.time() - t0 < 300:
        for w in psutil.Process(p.pid).children():  # the pool's workers; a busy one runs its point's process
            try:
                if any("workbench" in " ".join(c.cmdline()) for c in w.children()):
                    w.kill()
                    killed = w.pid
                    break
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.1)
    out, err = p.communicate(timeout=600)
    assert killed is not None, "no worker was caught mid-point"
    assert p.returncode == 0, err[-500:]
    res = json.loads(out)
    assert res["ran"] == 3 and res["backend"] == "local pool"
    assert all(o["worker"] and str(killed) not in o["worker"] for o in res["outcomes"])
    keys = [r["provenance"]["sweep"]["point"] for r in _records(tmp_path)]
    assert len(keys) == 3 and len(set(keys)) == 3
    again = _sweep(tmp_path, str(f), "--workers", "2")
    assert again.returncode == 0 and "nothing left to do" in again.stdout and len(_records(tmp_path)) == 3


def test_bad_back_end_options_are_one_line_exit_2(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(GRID.format(name="opts", ms="128"))
    for args in (("--workers", "0"), ("--workers", "2", "--ray", "auto")):
        p = _sweep(tmp_path, str(f), *args)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not _records(tmp_path)


@pytest.mark.compile_heavy
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # Ray starts its daemons from this (JAX) process
def test_sweep_on_a_local_ray_cluster_records_each_point_once(tmp_path):
    ray = pytest.importorskip("ray")
    from workbench.programs.executor import RayExecutor

    f = tmp_path / "s.toml"
    f.write_text(GRID.format(name="ray", ms="128, 256"))
    spec = sw.load_sweep(str(f))
    import typer.main

    from workbench.cli import app
    cparams = typer.main.get_command(app).commands["roofline"].params
    store = Store(str(tmp_path / "records.jsonl"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        res = sw.run_sweep(spec, cparams, store=store, executor=RayExecutor("auto"))
    finally:
        ray.shutdown()
    assert res.backend == "ray" and [o.status for o in res.outcomes] == ["done", "done"], res.to_record()
    keys = [r["provenance"]["sweep"]["point"] for r in _records(tmp_path)]
    assert sorted(keys) == sorted(pt.key for pt in spec.points())
