"""The fan-out executor's back-ends (in-process, local pool, Ray) and the store's write-once of a sweep point. Tasks
here are stdlib functions (nothing to compile); the sweeps over workers and Ray are in
tests/commands/test_sweep_paper.py."""
import json
import operator
import os

import pytest

from workbench.errors import WorkbenchError
from workbench.programs import executor as ex
from workbench.results.store import OUTBOX_ENV, Store, make_record

TASKS = [ex.Task("add", "add", operator.add, (1, 2)), ex.Task("div", "div", operator.truediv, (1, 0)),
         ex.Task("mul", "mul", operator.mul, (3, 4))]


def _check(results):
    by = {r.task.key: r for r in results}
    assert set(by) == {"add", "div", "mul"}
    assert by["add"].ok and by["add"].value == 3 and by["mul"].value == 12
    bad = by["div"]
    assert not bad.ok and bad.error.startswith("ZeroDivisionError") and "\n" not in bad.error
    assert bad.worker.count(":") == 1  # host:pid it ran on
    return by


def test_in_process_runs_each_task_here_and_reports_failures_with_their_worker():
    started = []
    by = _check(list(ex.InProcessExecutor().run(TASKS, on_start=lambda t: started.append(t.key))))
    assert started == ["add", "div", "mul"] and by["add"].worker.endswith(f":{os.getpid()}")


def test_local_pool_runs_tasks_in_other_processes():
    with ex.make_executor(workers=2) as pool:
        assert isinstance(pool, ex.PoolExecutor) and pool.slots() == 2
        by = _check(list(pool.run(TASKS)))
    assert not by["add"].worker.endswith(f":{os.getpid()}")
    rows = ex.worker_rows(by.values())
    assert sum(r["tasks"] for r in rows) == 3 and sum(r["failed"] for r in rows) == 1


def test_a_pool_found_broken_when_submitting_is_started_again():
    """A worker that dies after its pool's last task ended leaves the pool broken for the next submit: the task is
    put back (no try counted), the pool started again, and every task still runs once."""
    class BreaksOnce(ex.PoolExecutor):
        broke = False

        def _pool(self):
            pool = super()._pool()
            if not BreaksOnce.broke:
                BreaksOnce.broke = True
                pool.shutdown(wait=True)
                pool._broken = "a worker died"  # what the pool's manager thread sets when a worker is killed
            return pool

    started = []
    with BreaksOnce(workers=2) as pool:
        by = _check(list(pool.run(TASKS, on_start=lambda t: started.append(t.key))))
    assert sorted(started) == ["add", "div", "mul"] and all(r.attempts == 1 for r in by.values())


@pytest.mark.parametrize("workers,ray,msg", [(0, None, "positive whole number"), (-3, None, "positive"),
                                             (2, "auto", "give one"), (None, "127.0.0.1:1", "no Ray cluster answers"),
                                             (None, "not-an-address", "not an address")])
def test_bad_options_are_one_line_errors(workers, ray, msg):
    if ray and ray != "auto":
        pytest.importorskip("ray")
    with pytest.raises(WorkbenchError, match=msg) as e:
        ex.make_executor(workers, ray)
    assert "\n" not in str(e.value)


def test_append_point_writes_a_point_once(tmp_path, monkeypatch):
    store = Store(str(tmp_path))
    monkeypatch.setenv("WORKBENCH_SWEEP", json.dumps({"name": "s", "id": "sid", "point": "p1"}))
    recs = [make_record("roofline-op", {"op": "matmul", "i": i}) for i in range(2)]
    monkeypatch.delenv("WORKBENCH_SWEEP")
    assert store.append_point(recs, "sid", "p1") is True
    assert store.append_point(recs, "sid", "p1") is False  # a retried task: nothing written again
    assert store.append_point(recs, "other-sweep", "p1") is True
    assert len(store.records()) == 4
    # inside a point's process, appends go to its outbox, not the store
    monkeypatch.setenv(OUTBOX_ENV, str(tmp_path / "outbox.jsonl"))
    store.append(make_record("roofline-op", {"op": "softmax"}))
    monkeypatch.delenv(OUTBOX_ENV)
    assert len(store.records()) == 4 and len(Store(str(tmp_path / "outbox.jsonl")).records()) == 1


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # Ray starts its daemons from this (JAX) process
def test_ray_tasks_on_a_local_two_cpu_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with ex.make_executor(ray="auto") as r:
            assert r.slots() == 2 and not r.started  # joined the cluster the test started; leaves it running
            tasks = [ex.Task(t.key, t.label, t.fn, t.args, memory_bytes=64 * 2**20) for t in TASKS]
            _check(list(r.run(tasks)))
    finally:
        ray.shutdown()


@pytest.mark.compile_heavy
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_plan_on_ray_ranks_as_in_process_and_shares_the_outcome_cache(results_dir, tmp_path, monkeypatch):
    """Each candidate compiled as a Ray task (a fresh worker process each); the outcome cache the workers fill is
    the one the in-process planner reads, so the same plan here compiles nothing and ranks the same."""
    ray = pytest.importorskip("ray")
    from partitioning import topology as topo
    from workbench.programs import plan as wplan

    if not topo.libtpu_available():
        pytest.skip("libtpu not installed (pip install -e .[tpu])")
    monkeypatch.setenv("WORKBENCH_PLAN_CACHE", str(tmp_path / "plan-cache"))
    kw = dict(batch=8, strategies=["dp", "fsdp"], max_candidates=2)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        r = wplan.plan("tiny", "tpu-v5e:2x2", executor=ex.RayExecutor("auto"), **kw)
    finally:
        ray.shutdown()
    assert r["backend"] == "ray" and r["n_feasible"] == 2 and r["compiled_fresh"] == 2
    here = wplan.plan("tiny", "tpu-v5e:2x2", workers=1, **kw)
    assert here["compiled_fresh"] == 0 and all(x["cached"] for x in here["ranking"])
    rank = lambda res: [(x["strategy"], x["mesh"], x["predicted_step_s"]) for x in res["ranking"]]  # noqa: E731
    assert rank(here) == rank(r)
    assert [rec["kind"] for rec in Store().records()].count("predict") == 4  # written here, once per candidate


def _tiny_runs_table(path):
    """Two published-run rows reshaped to a tiny model on tpu-v5e:2x2 (compiles in seconds)."""
    import csv

    from workbench.programs.validation import TABLE
    with open(TABLE, encoding="utf-8") as f:
        base = next(csv.DictReader(f))
    rows = [dict(base, name=f"tiny-{i}", target="tpu-v5e:2x2", n_chips="4", n_layers="2", d_model="64", n_heads="4",
                 n_kv_heads="4", head_dim="16", d_ff="256", vocab_size="256", global_batch="8", per_device_batch="2",
                 seq="64", parallelism=par, mesh=mesh, remat="none")
            for i, (par, mesh) in enumerate((("fsdp", "data=4"), ("fsdp+tp", "data=2,model=2")))]
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(base))
        w.writeheader()
        w.writerows(rows)


@pytest.mark.compile_heavy
def test_published_validation_over_workers_predicts_as_serial(tmp_path):
    import subprocess
    import sys

    from partitioning import topology as topo
    if not topo.libtpu_available():
        pytest.skip("libtpu not installed (pip install -e .[tpu])")
    _tiny_runs_table(tmp_path / "runs.csv")
    env = dict(os.environ, WORKBENCH_RESULTS=str(tmp_path / "store"))
    out = {}
    for name, extra in (("serial", []), ("workers", ["--workers", "2"])):
        p = subprocess.run([sys.executable, "-m", "benchmarks.published_validation", "--table", str(tmp_path / "runs.csv"),
                            "--out", str(tmp_path / f"{name}.json"), "--json", *extra], env=env, capture_output=True,
                           text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-500:]
        out[name] = json.loads(p.stdout)["runs"]
    pred = lambda rows: [(r["name"], r["predicted_step_s"], r["memory_per_device_bytes"]) for r in rows]  # noqa: E731
    assert pred(out["workers"]) == pred(out["serial"]) and all(r["predicted_step_s"] for r in out["serial"])
    assert len({r["worker"] for r in out["workers"]}) >= 1 and out["workers"][0]["worker"] != out["serial"][0]["worker"]
