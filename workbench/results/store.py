"""The one results store: append-only JSON Lines, one record per experiment.

record = {id, kind, time, spec, costs, prediction, measurement, extra, provenance}
Writes take an exclusive lock and go out as one write() of one complete line followed by fsync, so a crash never
leaves a half record; a file whose last line is incomplete (a crash from outside, a hand edit) is refused with a
one-line error rather than appended to or silently skipped.
"""
from __future__ import annotations

import datetime as _dt
import fcntl
import json
import math
import os
import platform
import socket
import subprocess
import uuid
from typing import Any

from workbench.errors import WorkbenchError
from workbench.hardware import hostmem

SCHEMA = 1
FILENAME = "records.jsonl"


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


class Store:
    def __init__(self, path: str | None = None):
        path = path or default_dir()
        self.path = path if path.endswith(".jsonl") else os.path.join(path, FILENAME)

    def append(self, record: dict) -> dict:
        """Append one record atomically (one complete line). Returns the record as stored."""
        line = json.dumps(clean(record), default=str, allow_nan=False) + "\n"
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            size = os.lseek(fd, 0, os.SEEK_END)
            if size > 0:
                os.lseek(fd, size - 1, os.SEEK_SET)
                if os.read(fd, 1) != b"\n":
                    raise WorkbenchError(f"{self.path} ends in an incomplete record; move it aside or delete its "
                                         "last line, then rerun (nothing was written)")
            data = line.encode()
            written = os.write(fd, data)
            if written != len(data):
                os.ftruncate(fd, size)
                raise WorkbenchError(f"short write to {self.path}; the partial record was removed")
            os.fsync(fd)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        return json.loads(line)

    def records(self, kind: str | None = None) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        out = []
        try:
            with open(self.path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
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

    def load(self, kind: str | None = None):
        """Records as a pandas DataFrame, nested fields flattened with dots (costs.flops, prediction.bound...)."""
        import pandas as pd

        recs = self.records(kind)
        if not recs:
            return pd.DataFrame()
        slim = []
        for r in recs:
            r = dict(r)
            if isinstance(r.get("costs"), dict):
                r["costs"] = {k: v for k, v in r["costs"].items() if k not in ("kernels", "collectives")}
            slim.append(r)
        return pd.json_normalize(slim, max_level=2)


def _git() -> dict:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=5).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                    capture_output=True, text=True, timeout=5).stdout.strip())
        return {"git_sha": sha, "git_dirty": dirty}
    except Exception:
        return {"git_sha": None, "git_dirty": None}


def provenance(seed: int | None = None) -> dict:
    import jax
    import jaxlib

    try:
        import flax

        flax_v = flax.__version__
    except Exception:
        flax_v = None
    devs = jax.devices()
    return {
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax_v,
        "backend": jax.default_backend(), "device_kind": devs[0].device_kind, "device_count": len(devs),
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "host": socket.gethostname(), "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(), "allocator": hostmem.describe(),
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "seed": seed, **_git(),
    }


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
