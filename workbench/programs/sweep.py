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
environment). The process appends its record(s) to the results store with `provenance.sweep` = {name, id, point}.

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
import time
import tomllib
from typing import Any, Callable

from workbench.errors import WorkbenchError
from workbench.results.store import Store, git_info

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
    return SweepSpec(name.strip(), tuple(command.split()), dict(fixed), {k: list(v) for k, v in grid.items()},
                     tuple(dict(p) for p in pts), path)


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


@dataclasses.dataclass(frozen=True)
class SweepResult:
    name: str
    sweep_id: str
    outcomes: tuple[PointOutcome, ...]

    @property
    def failed(self) -> list[PointOutcome]:
        return [o for o in self.outcomes if o.status == "failed"]

    def to_record(self) -> dict:
        return {"sweep": self.name, "sweep_id": self.sweep_id, "points": len(self.outcomes),
                "ran": sum(o.status == "done" for o in self.outcomes),
                "skipped": sum(o.status == "skipped" for o in self.outcomes), "failed": len(self.failed),
                "outcomes": [{"index": o.point.index, "params": o.point.params, "key": o.point.key, "status": o.status,
                              "error": o.error, "seconds": o.seconds} for o in self.outcomes]}


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


def run_point(spec: SweepSpec, point: Point, argv: list[str], timeout: float | None = None) -> tuple[bool, str | None]:
    """Run one point in a fresh process; (ok, the last line it printed on stderr when it failed)."""
    env = dict(os.environ)
    env["WORKBENCH_SWEEP"] = json.dumps({"name": spec.name, "id": spec.sweep_id, "point": point.key,
                                         "index": point.index, "params": point.params}, default=str)
    env.setdefault("JAX_PLATFORMS", "cpu")
    if "xla_flags" in point.params:
        env["XLA_FLAGS"] = str(point.params["xla_flags"])
    p = subprocess.run([sys.executable, "-m", "workbench", *spec.command, *argv], env=env, capture_output=True,
                       text=True, timeout=timeout)
    if p.returncode == 0:
        return True, None
    lines = [ln for ln in (p.stderr or p.stdout or "").strip().splitlines() if ln.strip()]
    return False, (lines[-1] if lines else f"exit {p.returncode}")[:300]


def run_sweep(spec: SweepSpec, cparams: list, *, store: Store | None = None, dry_run: bool = False,
              retry_failed: bool = False, on_point: Callable[[int, int, Point, str], None] | None = None) -> SweepResult:
    """Run every point not yet recorded (see the module docstring); `cparams` are the command's click parameters;
    `on_point(done, total, point, status)` reports progress."""
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
    outcomes = []
    for i, pt in enumerate(points):
        if pt.key in done:
            outcomes.append(PointOutcome(pt, "skipped"))
        elif pt.key in failed_before and not retry_failed:
            outcomes.append(PointOutcome(pt, "failed", failed_before[pt.key]))
        elif pt.key in errors:
            outcomes.append(PointOutcome(pt, "failed", errors[pt.key]))
            _log(flog, {"key": pt.key, "params": pt.params, "status": "failed", "error": errors[pt.key]})
        else:
            t0 = time.perf_counter()
            ok, err = run_point(spec, pt, argvs[pt.key])
            secs = time.perf_counter() - t0
            if ok and pt.key not in recorded_keys(store, spec.sweep_id):
                ok, err = False, f"`workbench {' '.join(spec.command)}` ran but recorded nothing (does it record?)"
            outcomes.append(PointOutcome(pt, "done" if ok else "failed", err, secs))
            _log(flog, {"key": pt.key, "params": pt.params, "status": "done" if ok else "failed", "error": err})
        if on_point:
            on_point(i + 1, len(points), pt, outcomes[-1].status)
    return SweepResult(spec.name, spec.sweep_id, tuple(outcomes))
