"""The one results store: append-only JSON Lines, one record per experiment.

record = {id, kind, time, spec, costs, prediction, measurement, extra, provenance}
provenance carries the software (`versions()`: jax, jaxlib, libtpu, flax, optax, orbax-checkpoint, the CUDA plugin
when installed, Python); `Store.compare()` lines up the same experiment (kind + spec) across them.
Writes take an exclusive lock and go out as one write() of one complete line followed by fsync, so a crash never
leaves a half record; a file whose last line is incomplete (a crash from outside, a hand edit) is refused with a
one-line error rather than appended to or silently skipped.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import fcntl
import hashlib
import json
import math
import os
import platform
import socket
import subprocess
import sys
import uuid
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from workbench.errors import WorkbenchError
from workbench.hardware import hostmem
from workbench.hardware.devices import device_info

SCHEMA = 1
FILENAME = "records.jsonl"
OUTBOX_ENV = "WORKBENCH_OUTBOX"  # set by `workbench sweep` in a point's process: records go there, not to the store


def default_dir() -> str:
    return os.environ.get("WORKBENCH_RESULTS", os.path.join(os.getcwd(), "results"))


def clean(o: Any):
    """A JSON-ready copy: non-finite floats become None, numpy scalars and objects with to_dict() plain values."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {str(k): clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [clean(v) for v in o]
    if hasattr(o, "to_dict") and callable(o.to_dict):
        return clean(o.to_dict())
    if hasattr(o, "item") and callable(o.item):
        return clean(o.item())
    return o


class RecordView(Mapping):
    """A typed result that reads like its JSON record: subclasses (frozen dataclasses) keep the record in `record`
    beside their typed parts; `r["key"]`, `r.get(...)`, `dict(r)` and `to_record()` read the record, and the store
    and the console serialise it through `to_dict()`."""

    record: Mapping[str, Any]

    def __getitem__(self, key: str):
        return self.record[key]

    def __iter__(self):
        return iter(self.record)

    def __len__(self) -> int:
        return len(self.record)

    def to_record(self) -> dict[str, Any]:
        return dict(self.record)

    def to_dict(self) -> dict[str, Any]:
        return self.to_record()


class Store:
    def __init__(self, path: str | None = None):
        path = path or default_dir()
        self.path = path if path.endswith(".jsonl") else os.path.join(path, FILENAME)

    def append(self, record: dict) -> dict:
        """Append one record atomically (one complete line). Returns the record as stored. Inside a fanned-out sweep
        point ($WORKBENCH_OUTBOX set) the record goes to that file instead: the sweep's parent reads it back and
        writes it to the store once (`append_point`)."""
        line = json.dumps(clean(record), default=str, allow_nan=False) + "\n"
        outbox = os.environ.get(OUTBOX_ENV)
        self._write_lines(outbox or self.path, [line], None)
        return json.loads(line)

    def append_point(self, records: list[dict], sweep_id: str, point: str) -> bool:
        """Write a sweep point's records exactly once: under the store's lock, unless a record of that sweep and point
        key is already there (a retried task, a second sweep over the same file); all of them in one write(), so a
        point is either wholly recorded or not at all. Returns whether they were written."""
        lines = [json.dumps(clean(r), default=str, allow_nan=False) + "\n" for r in records]

        def recorded(fd: int, size: int) -> bool:
            os.lseek(fd, 0, os.SEEK_SET)
            with os.fdopen(os.dup(fd), "rb", closefd=True) as f:
                for raw in f:
                    if point.encode() not in raw or not raw.endswith(b"\n"):
                        continue
                    try:
                        sw = (json.loads(raw).get("provenance") or {}).get("sweep") or {}
                    except (json.JSONDecodeError, AttributeError):
                        continue
                    if sw.get("id") == sweep_id and sw.get("point") == point:
                        return True
            return False

        return bool(lines) and self._write_lines(self.path, lines, recorded)

    def _write_lines(self, path: str, lines: list[str], skip_if) -> bool:
        """Append complete lines with one write() under an exclusive lock (`skip_if(fd, size)`: checked under the
        lock; True writes nothing). Returns whether they were written."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            size = os.lseek(fd, 0, os.SEEK_END)
            if size > 0:
                os.lseek(fd, size - 1, os.SEEK_SET)
                if os.read(fd, 1) != b"\n":
                    size = self._set_aside_torn_tail(fd, size, path)
            if skip_if is not None and skip_if(fd, size):
                return False
            data = "".join(lines).encode()
            written = os.write(fd, data)
            if written != len(data):
                os.ftruncate(fd, size)
                raise WorkbenchError(f"short write to {path}; the partial record was removed")
            os.fsync(fd)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        return True

    def _set_aside_torn_tail(self, fd: int, size: int, path: str | None = None) -> int:
        """The file ends in part of a record (a writer killed mid-append: a write of many pages can stop between two
        when the process gets SIGKILL): copy that part to `<path>.torn-<time>` (nothing is lost), cut it off, and
        return the new size. Called with the store's lock held, so no live writer is mid-record."""
        os.lseek(fd, 0, os.SEEK_SET)
        data = b""
        while len(data) < size:
            chunk = os.read(fd, size - len(data))
            if not chunk:
                break
            data += chunk
        keep = data.rfind(b"\n") + 1
        path = path or self.path
        aside = f"{path}.torn-{_dt.datetime.now(_dt.timezone.utc).strftime('%Y%m%dT%H%M%S%f')}"
        with open(aside, "wb") as f:
            f.write(data[keep:])
        os.ftruncate(fd, keep)
        print(f"workbench: {path} ended in an incomplete record (a writer was killed mid-append); its "
              f"{size - keep} bytes were moved to {aside}", file=sys.stderr)
        return keep

    def records(self, kind: str | None = None) -> list[dict]:
        """Every complete record (of `kind`). A last line without its newline is a record still being written, or
        one whose writer was killed: it is skipped (the next append sets it aside); any other line that is not a
        record is a one-line error naming it."""
        if not os.path.exists(self.path):
            return []
        out = []
        try:
            with open(self.path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    if not line.endswith("\n"):  # the torn or unfinished last line
                        break
                    try:
                        r = json.loads(line)
                    except json.JSONDecodeError:
                        raise WorkbenchError(f"{self.path}:{n} is not a JSON record (corrupt results file); "
                                             "fix or remove that line") from None
                    if not isinstance(r, dict):
                        raise WorkbenchError(f"{self.path}:{n} is not a record object; fix or remove that line")
                    if kind is None or r.get("kind") == kind:
                        out.append(r)
        except UnicodeDecodeError:
            raise WorkbenchError(f"{self.path} is not UTF-8 text (corrupt results file)") from None
        except OSError as e:
            raise WorkbenchError(f"cannot read {self.path}: {e.strerror}") from None
        return out

    def query(self, kind: str | None = None, sweep: str | None = None, since: str | None = None, **spec):
        """Records as a DataFrame (see load), filtered: `kind`; `sweep` (a sweep's name or id); `since` (ISO date or
        time, compared with provenance.time); any other keyword must equal that key of the record's spec
        (`op="matmul"`). Every notebook reads the store through this."""
        import pandas as pd  # noqa: PLC0415

        recs = []
        for r in self.records(kind):
            prov = r.get("provenance") or {}
            sw = prov.get("sweep") or {}
            if sweep is not None and sweep not in (sw.get("name"), sw.get("id")):
                continue
            if since is not None and str(prov.get("time", "")) < since:
                continue
            if any((r.get("spec") or {}).get(k) != v for k, v in spec.items()):
                continue
            recs.append(r)
        return self._frame(recs) if recs else pd.DataFrame()

    def load(self, kind: str | None = None):
        """Records as a pandas DataFrame, nested fields flattened with dots (costs.flops, prediction.bound...)."""
        import pandas as pd  # noqa: PLC0415

        recs = self.records(kind)
        return self._frame(recs) if recs else pd.DataFrame()

    @staticmethod
    def _frame(recs: list[dict]):
        import pandas as pd  # noqa: PLC0415

        slim = []
        for r in recs:
            r = dict(r)
            if isinstance(r.get("costs"), dict):
                r["costs"] = {k: v for k, v in r["costs"].items() if k not in ("kernels", "collectives")}
            slim.append(r)
        return pd.json_normalize(slim, max_level=2)

    def compare(self, *, experiment: str | None = None, kind: str | None = None,
                metrics: tuple[str, ...] | None = None, every: bool = False) -> list[Comparison]:
        """The same experiment under different software: records grouped by experiment_key (kind + spec), then by
        the VERSION_KEYS of their provenance; each metric (a dotted path into the record) is the median over that
        group's records. `experiment`: a key or a record id (prefix) whose experiment to show. Without it, only
        experiments recorded under two or more version sets are returned (every=True: all)."""
        recs = self.records(kind)
        if experiment:
            hit = [r for r in recs if experiment_key(r) == experiment or str(r.get("id", "")).startswith(experiment)]
            if not hit:
                raise WorkbenchError(f"no record or experiment {experiment!r} in {self.path}; `workbench results "
                                     "list` shows record ids")
            key = experiment_key(hit[0])
            recs = [r for r in recs if experiment_key(r) == key]
        metrics = tuple(metrics or DEFAULT_METRICS)
        groups: dict[str, list[dict]] = {}
        for r in recs:
            groups.setdefault(experiment_key(r), []).append(r)
        out = []
        for key, rs in groups.items():
            by_v: dict[tuple, list[dict]] = {}
            for r in rs:
                by_v.setdefault(version_tuple(r), []).append(r)
            if len(by_v) < 2 and not (every or experiment):
                continue
            rows = []
            for vt, group in sorted(by_v.items(), key=lambda kv: _version_sort_key(kv[0])):
                vals = {}
                for m in metrics:
                    xs = [x for x in (_dig(r, m) for r in group) if isinstance(x, (int, float)) and math.isfinite(x)]
                    if xs:
                        xs.sort()
                        mid = len(xs) // 2
                        vals[m] = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
                rows.append(VersionRow(dict(zip(VERSION_KEYS, vt)), len(group), vals,
                                       tuple(str(r.get("id")) for r in group)))
            out.append(Comparison(key, str(rs[0].get("kind")), rs[0].get("spec") or {}, tuple(rows)))
        return out


VERSION_KEYS = ("jax", "jaxlib", "libtpu", "flax")
DEFAULT_METRICS = ("measurement.median_s", "prediction.predicted_s", "costs.flops", "costs.bytes_accessed",
                   "costs.memory.peak_bytes", "extra.predicted_step_s", "extra.memory_per_device_bytes",
                   "extra.xla_estimate_s", "extra.tokens_per_s")


@dataclasses.dataclass(frozen=True)
class VersionRow:
    """One software version set of one experiment: how many records, and each metric's median over them."""

    versions: dict  # VERSION_KEYS -> version string (None: not installed / not recorded)
    n: int
    metrics: dict  # dotted metric path -> median
    record_ids: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One experiment (kind + spec) across the software it was recorded with, oldest jax first."""

    experiment: str
    kind: str
    spec: dict
    rows: tuple[VersionRow, ...]

    def ratios(self) -> dict[str, float]:
        """Each metric of the newest version set over the oldest's (where both have it)."""
        if len(self.rows) < 2:
            return {}
        a, b = self.rows[0].metrics, self.rows[-1].metrics
        return {m: b[m] / a[m] for m in a if m in b and a[m]}

    def to_record(self) -> dict:
        return {"experiment": self.experiment, "kind": self.kind, "spec": self.spec,
                "rows": [dataclasses.asdict(r) for r in self.rows], "newest_over_oldest": self.ratios()}


def experiment_key(record: dict) -> str:
    """What makes two records the same experiment: their kind and spec (12 hex digits of a hash)."""
    blob = json.dumps({"kind": record.get("kind"), "spec": record.get("spec")}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def version_tuple(record: dict) -> tuple:
    prov = record.get("provenance") or {}
    return tuple(prov.get(k) for k in VERSION_KEYS)


def _version_sort_key(vt: tuple) -> tuple:
    def num(v):
        return tuple(int(p) if p.isdigit() else 0 for p in str(v).split(".")) if v else ()
    return tuple(num(v) for v in vt)


def _dig(record: dict, path: str):
    cur: Any = record
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def git_info() -> dict:
    """The code's commit and whether the work tree has uncommitted changes to tracked files (None outside git)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=5).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                    capture_output=True, text=True, timeout=5).stdout.strip())
        return {"git_sha": sha, "git_dirty": dirty}
    except Exception:
        return {"git_sha": None, "git_dirty": None}


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


# the software a record was produced with (None: not installed); keys are distribution names with '-' as '_'
VERSIONED = ("jax", "jaxlib", "libtpu", "flax", "optax", "orbax-checkpoint", "chex", "numpy")
VERSIONED_IF_PRESENT = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt")


def versions() -> dict:
    """Python and the JAX stack, from the installed distributions (no JAX import): what every record's provenance
    carries and what Store.compare groups by (VERSION_KEYS)."""
    out = {"python": platform.python_version()}
    for pkg in VERSIONED + VERSIONED_IF_PRESENT:
        v = _version(pkg)
        if v is not None or pkg in VERSIONED:
            out[pkg.replace("-", "_")] = v
    return out


def provenance(seed: int | None = None) -> dict:
    """Where a record came from: code (commit, dirty flag), packages (jax, jaxlib, libtpu, flax), XLA flags, host and
    its calibration fingerprint, devices, date; and, inside `workbench sweep`, the sweep and point it belongs to."""
    import jax  # noqa: PLC0415 - the store itself stays importable without JAX (fast CLI start-up)

    dev = device_info()
    return {
        **versions(),
        "backend": jax.default_backend(), "platform": dev["platform"], "device_kind": dev["device_kind"],
        "device_count": dev["device_count"], "platform_version": dev.get("platform_version"),
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "host": socket.gethostname(),
        "cpu": platform.processor() or platform.machine(), "allocator": hostmem.describe(),
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "seed": seed, **git_info(),
        "host_fingerprint": host_fingerprint(),
        **({"sweep": json.loads(os.environ["WORKBENCH_SWEEP"])} if os.environ.get("WORKBENCH_SWEEP") else {}),
    }


def host_fingerprint() -> str:
    """A short id of this host's CPU, cores and memory (the calibration cache is keyed by it plus the jax version)."""
    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "mem": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None}
    try:
        with open("/proc/cpuinfo") as f:
            info["model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:12]


def make_record(kind: str, spec: dict, cost=None, prediction=None, measurement=None, extra: dict | None = None,
                seed: int | None = None) -> dict:
    """One record: spec + CostReport + Prediction + Measurement + provenance (+ study-specific extra)."""
    return {
        "schema": SCHEMA, "id": uuid.uuid4().hex[:12], "kind": kind, "spec": spec,
        "costs": cost.to_dict() if hasattr(cost, "to_dict") else cost,
        "prediction": prediction.to_dict() if hasattr(prediction, "to_dict") else prediction,
        "measurement": measurement.to_dict() if hasattr(measurement, "to_dict") else measurement,
        "extra": extra or {}, "provenance": provenance(seed),
    }
