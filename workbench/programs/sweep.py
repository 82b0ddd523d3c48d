"""Sweeps: a grid (or list) of experiments over any recording command's parameters, one record per point.

    [sweep]
    name = "matmul-sizes"
    command = "roofline"          # any workbench command that records ("moe layer" for a sub-command)
    [fixed]                       # every point gets these
    op = "matmul"
    n = 256
    [grid]                        # cross product of the lists (optional)
    m = [256, 384, 512]
    k = [256, 512]
    [[points]]                    # and/or an explicit list of points (each merged over [fixed])
    m = 1024
    k = 1024

Keys map to the command's options by name (`head_dim` -> `--head-dim`; `true` adds a flag, `false` leaves it out)
and to its positional arguments by their name (`op`). Each point runs in a fresh process (`python -m workbench ...`),
so points may ask for their own device count (`devices = 8`) or XLA flags (`xla_flags = "..."`, set in the point's
environment). That process writes its record(s), with `provenance.sweep` = {name, id, point}, to a private outbox
($WORKBENCH_OUTBOX); the worker hands them back and the sweep's own process writes them to the results store, once
per point key (Store.append_point). Points run one after the other here, in N local worker processes, or as Ray
tasks (workbench.programs.executor; `[sweep] memory_gb` sets what Ray reserves per point).

Resumable: a point whose key (command, parameters, code commit, jax version, host) already has a record in the store
is skipped, so killing a sweep at any moment loses nothing recorded (the store writes each record with one write()
of one complete line) and a rerun finishes the rest. A point that fails (its command exits non-zero) is written to
the sweep's failure log beside the store with its one-line error; the sweep goes on with the others, exits 1 at the
end, and `--retry-failed` runs those points again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import subprocess
import sys
import tomllib
from typing import Any, Callable

from workbench.errors import WorkbenchError
from workbench.programs import executor as ex
from workbench.results.store import OUTBOX_ENV, Store, git_info

SPECIAL = ("xla_flags",)  # keys that set the point's environment instead of an option


@dataclasses.dataclass(frozen=True)
class Point:
    index: int
    params: dict[str, Any]
    key: str                      # hash of command + params + code/version/host basis

    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.params.items())


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    name: str
    command: tuple[str, ...]      # e.g. ("roofline",) or ("moe", "layer")
    fixed: dict[str, Any]
    grid: dict[str, list]
    points_list: tuple[dict, ...]
    path: str = ""
    memory_gb: float | None = None  # [sweep] memory_gb: what one point needs (Ray requests it per task)

    @property
    def sweep_id(self) -> str:
        body = json.dumps({"name": self.name, "command": self.command, "fixed": self.fixed, "grid": self.grid,
                           "points": self.points_list}, sort_keys=True, default=str)
        return hashlib.sha256(body.encode()).hexdigest()[:12]

    def points(self, basis: dict | None = None) -> list[Point]:
        """Every point: the grid's cross product (over [fixed]), then the explicit [[points]]."""
        basis = basis if basis is not None else key_basis()
        combos: list[dict] = []
        if self.grid:
            names = list(self.grid)
            for values in itertools.product(*(self.grid[n] for n in names)):
                combos.append({**self.fixed, **dict(zip(names, values))})
        combos += [{**self.fixed, **p} for p in self.points_list]
        if not combos:
            combos = [dict(self.fixed)]
        out = []
        for i, params in enumerate(combos):
            body = json.dumps({"command": self.command, "params": params, "basis": basis}, sort_keys=True, default=str)
            out.append(Point(i, params, hashlib.sha256(body.encode()).hexdigest()[:16]))
        return out


def key_basis() -> dict:
    """What a recorded point must share with a new one to count as the same experiment: the code commit, the jax
    version and the host (a point measured by other code or on another machine is run again)."""
    import platform
    import socket
    from importlib.metadata import version

    return {"git_sha": git_info()["git_sha"], "jax": version("jax"), "host": socket.gethostname(),
            "python": platform.python_version()}


def load_sweep(path: str) -> SweepSpec:
    """Parse and validate a sweep file; a malformed file is a one-line error with its line number."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise WorkbenchError(f"no sweep file {path!r}") from None
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        if "end of document" in msg:  # name the line anyway: the last one
            with open(path, "rb") as f:
                msg = msg.replace("at end of document", f"at line {max(1, len(f.read().splitlines()))}, end of file")
        raise WorkbenchError(f"{path}: not valid TOML: {msg}") from None
    head = data.get("sweep")
    if not isinstance(head, dict):
        raise WorkbenchError(f"{path}: needs a [sweep] table with name and command")
    name, command = head.get("name"), head.get("command")
    if not isinstance(name, str) or not name.strip():
        raise WorkbenchError(f"{path}: [sweep] name must be a non-empty string")
    if not isinstance(command, str) or not command.split():
        raise WorkbenchError(f"{path}: [sweep] command must name a workbench command, e.g. \"roofline\"")
    unknown = set(data) - {"sweep", "fixed", "grid", "points"}
    if unknown:
        raise WorkbenchError(f"{path}: unknown table(s) {', '.join(sorted(unknown))}; use [sweep], [fixed], [grid], "
                             "[[points]]")
    fixed = data.get("fixed", {})
    grid = data.get("grid", {})
    pts = data.get("points", [])
    if not isinstance(fixed, dict) or not isinstance(grid, dict) or not isinstance(pts, list):
        raise WorkbenchError(f"{path}: [fixed] and [grid] must be tables, [[points]] an array of tables")
    for k, v in grid.items():
        if not isinstance(v, list) or not v:
            raise WorkbenchError(f"{path}: [grid] {k} must be a non-empty list, got {v!r}")
    mem = head.get("memory_gb")
    if mem is not None and (isinstance(mem, bool) or not isinstance(mem, (int, float)) or not mem > 0):
        raise WorkbenchError(f"{path}: [sweep] memory_gb must be a positive number (GiB one point needs), got {mem!r}")
    return SweepSpec(name.strip(), tuple(command.split()), dict(fixed), {k: list(v) for k, v in grid.items()},
                     tuple(dict(p) for p in pts), path, float(mem) if mem is not None else None)


def point_argv(command: tuple[str, ...], params: dict[str, Any], cparams: list) -> list[str]:
    """The command line of one point: positional arguments in their order, then --options. `cparams`: the command's
    click parameters (the CLI layer reads them from its own command table)."""
    by_name = {p.name: p for p in cparams}
    args, opts = [], []
    for k, v in params.items():
        if k in SPECIAL:
            continue
        p = by_name.get(k) or by_name.get(k.replace("-", "_"))
        if p is None:
            names = ", ".join(sorted(n for n in by_name if n not in ("json_out", "as_json")))
            raise WorkbenchError(f"`workbench {' '.join(command)}` has no parameter {k!r}; its parameters: {names}")
        if p.param_type_name == "argument":
            args.append((cparams.index(p), str(v)))
        elif getattr(p, "is_flag", False):
            if isinstance(v, bool) and v:
                opts.append(p.opts[0])
            elif isinstance(v, bool) and not v and p.secondary_opts:
                opts.append(p.secondary_opts[0])
            elif not isinstance(v, bool):
                raise WorkbenchError(f"sweep parameter {k!r} is a flag: give true or false, got {v!r}")
        else:
            opts += [p.opts[0], str(v)]
    return [a for _, a in sorted(args)] + opts


@dataclasses.dataclass(frozen=True)
class PointOutcome:
    point: Point
    status: str                   # "done" (ran now) | "skipped" (already recorded) | "failed"
    error: str | None = None
    seconds: float | None = None
    worker: str | None = None     # host:pid of the worker it ran on


@dataclasses.dataclass(frozen=True)
class SweepResult:
    name: str
    sweep_id: str
    outcomes: tuple[PointOutcome, ...]
    backend: str = "in-process"
    workers: tuple = ()           # executor.worker_rows: per worker, tasks, failed, busy seconds

    @property
    def failed(self) -> list[PointOutcome]:
        return [o for o in self.outcomes if o.status == "failed"]

    def to_record(self) -> dict:
        return {"sweep": self.name, "sweep_id": self.sweep_id, "points": len(self.outcomes),
                "ran": sum(o.status == "done" for o in self.outcomes),
                "skipped": sum(o.status == "skipped" for o in self.outcomes), "failed": len(self.failed),
                "backend": self.backend, "workers": list(self.workers),
                "outcomes": [{"index": o.point.index, "params": o.point.params, "key": o.point.key, "status": o.status,
                              "error": o.error, "seconds": o.seconds, "worker": o.worker} for o in self.outcomes]}


def recorded_keys(store: Store, sweep_id: str) -> set[str]:
    keys = set()
    for r in store.records():
        sw = (r.get("provenance") or {}).get("sweep") or {}
        if sw.get("id") == sweep_id and sw.get("point"):
            keys.add(sw["point"])
    return keys


def failure_log(store: Store, spec: SweepSpec) -> str:
    return os.path.join(os.path.dirname(store.path), "sweeps", f"{spec.name}-{spec.sweep_id}.failures.jsonl")


def _failed_keys(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill: the point is simply run again
                if r.get("status") == "failed":
                    out[r["key"]] = r.get("error", "")
                else:
                    out.pop(r.get("key"), None)
    return out


def _log(path: str, entry: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def memory_estimate(spec: SweepSpec, params: dict[str, Any]) -> int:
    """Bytes a point's process needs (Ray requests this much per task): `memory_gb` in [sweep] when given, else a
    fresh workbench process (1 GiB: Python, JAX, XLA) plus three float32 arrays of the largest product of two of the
    point's sizes (a matmul's m x k, a softmax's rows x cols), doubled for the compiler's temporaries."""
    if spec.memory_gb:
        return int(spec.memory_gb * 2**30)
    sizes = [int(v) for v in params.values() if isinstance(v, int) and not isinstance(v, bool) and v > 1]
    biggest = max([a * b for a, b in itertools.combinations(sizes, 2)] + sizes + [0])
    return 2**30 + 2 * 3 * 4 * biggest


def execute_point(name: str, sweep_id: str, command: tuple[str, ...], index: int, key: str, params: dict[str, Any],
                  argv: list[str], timeout: float | None = None) -> dict:
    """One point, on whichever worker runs it: the command in a fresh process whose records go to a private outbox
    file ($WORKBENCH_OUTBOX), not the store; returns {"ok", "error", "records"} for the parent to write once."""
    import tempfile


    env = dict(os.environ)
    env["WORKBENCH_SWEEP"] = json.dumps({"name": name, "id": sweep_id, "point": key, "index": index,
                                         "params": params}, default=str)
    env.setdefault("JAX_PLATFORMS", "cpu")
    if "xla_flags" in params:
        env["XLA_FLAGS"] = str(params["xla_flags"])
    with tempfile.TemporaryDirectory(prefix="workbench-point-") as tmp:
        outbox = env[OUTBOX_ENV] = os.path.join(tmp, "records.jsonl")
        p = subprocess.run([sys.executable, "-m", "workbench", *command, *argv], env=env, capture_output=True,
                           text=True, timeout=timeout)
        records = Store(outbox).records() if os.path.exists(outbox) else []
    if p.returncode != 0:
        lines = [ln for ln in (p.stderr or p.stdout or "").strip().splitlines() if ln.strip()]
        return {"ok": False, "error": (lines[-1] if lines else f"exit {p.returncode}")[:300], "records": []}
    if not records:
        return {"ok": False, "error": f"`workbench {' '.join(command)}` ran but recorded nothing (does it record?)",
                "records": []}
    return {"ok": True, "error": None, "records": records}


def run_point(spec: SweepSpec, point: Point, argv: list[str], timeout: float | None = None,
              store: Store | None = None) -> tuple[bool, str | None]:
    """Run one point here and write its records; (ok, its one-line error when it failed)."""
    out = execute_point(spec.name, spec.sweep_id, spec.command, point.index, point.key, point.params, argv, timeout)
    if out["ok"]:
        (store or Store()).append_point(out["records"], spec.sweep_id, point.key)
    return out["ok"], out["error"]


def run_sweep(spec: SweepSpec, cparams: list, *, store: Store | None = None, dry_run: bool = False,
              retry_failed: bool = False, on_point: Callable[[int, int, Point, str], None] | None = None,
              executor=None, on_start: Callable[[Point], None] | None = None,
              on_result: Callable[[Point, Any], None] | None = None,
              on_todo: Callable[[int], None] | None = None) -> SweepResult:
    """Run every point not yet recorded (see the module docstring) on `executor` (workbench.programs.executor;
    default in-process, one point after the other); `cparams` are the command's click parameters. Workers return
    each point's records and this process writes them, once per point key. `on_start(point)` as a point is handed
    to a worker, `on_result(point, executor.Result)` as it comes back, `on_point(done, total, point, status)` for
    every point, recorded ones included; `on_todo(n)` once, with the number of points that will run."""
    store = store or Store()
    points = spec.points()
    argvs = {}
    errors = {}
    for pt in points:
        try:
            argvs[pt.key] = point_argv(spec.command, pt.params, cparams)
        except WorkbenchError as e:
            errors[pt.key] = str(e)
    if dry_run:
        return SweepResult(spec.name, spec.sweep_id, tuple(
            PointOutcome(pt, "planned" if pt.key not in errors else "invalid", errors.get(pt.key)) for pt in points))
    done = recorded_keys(store, spec.sweep_id)
    flog = failure_log(store, spec)
    failed_before = _failed_keys(flog)
    outcomes: dict[str, PointOutcome] = {}
    todo: list[Point] = []
    finished = 0

    def report(pt: Point):
        nonlocal finished
        finished += 1
        if on_point:
            on_point(finished, len(points), pt, outcomes[pt.key].status)

    for pt in points:
        if pt.key in done:
            outcomes[pt.key] = PointOutcome(pt, "skipped")
        elif pt.key in failed_before and not retry_failed:
            outcomes[pt.key] = PointOutcome(pt, "failed", failed_before[pt.key])
        elif pt.key in errors:
            outcomes[pt.key] = PointOutcome(pt, "failed", errors[pt.key])
            _log(flog, {"key": pt.key, "params": pt.params, "status": "failed", "error": errors[pt.key]})
        else:
            todo.append(pt)
            continue
        report(pt)
    if on_todo:
        on_todo(len(todo))
    executor = executor or ex.InProcessExecutor()
    by_key = {pt.key: pt for pt in todo}
    tasks = [ex.Task(pt.key, f"point {pt.index} ({pt.label()})", execute_point,
                     (spec.name, spec.sweep_id, spec.command, pt.index, pt.key, pt.params, argvs[pt.key]),
                     memory_estimate(spec, pt.params)) for pt in todo]
    results = []
    for r in executor.run(tasks, on_start=(lambda t: on_start(by_key[t.key])) if on_start else None):
        pt = by_key[r.task.key]
        ok, err = r.ok, r.error
        if ok:
            ok, err = r.value["ok"], r.value["error"]
        if ok:
            store.append_point(r.value["records"], spec.sweep_id, pt.key)  # exactly once, by the point's key
        r = dataclasses.replace(r, ok=ok, error=err)
        results.append(r)
        outcomes[pt.key] = PointOutcome(pt, "done" if ok else "failed", err, r.seconds, r.worker)
        _log(flog, {"key": pt.key, "params": pt.params, "status": "done" if ok else "failed", "error": err,
                    "worker": r.worker})
        if on_result:
            on_result(pt, r)
        report(pt)
    return SweepResult(spec.name, spec.sweep_id, tuple(outcomes[pt.key] for pt in points), executor.name,
                       tuple(ex.worker_rows(results)))
