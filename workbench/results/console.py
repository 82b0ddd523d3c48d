"""Console output: JSON documents on stdout, tables, progress bars on stderr (used by commands, programs and benchmarks)."""
from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.progress import Progress, track
from rich.table import Table

from workbench.results.store import clean


def emit_json(obj: Any) -> None:
    """Print one JSON document to stdout (NaN/inf become null)."""
    sys.stdout.write(json.dumps(clean(obj), indent=2, default=str) + "\n")
    sys.stdout.flush()


def print_table(rows: list[dict], columns: list[str] | None = None, title: str | None = None) -> None:
    """A rich table on stdout."""
    if not rows:
        print("(no rows)")
        return
    columns = columns or list(rows[0])
    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*[fmt(r.get(c)) for c in columns])
    Console(width=160 if not sys.stdout.isatty() else None).print(t)


def fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        if v == 0:
            return "0"
        return f"{v:.3g}"
    return str(v)


def progress(iterable, total: int | None = None, desc: str = ""):
    """A progress bar on stderr (rich); plain iteration when stderr is not a terminal."""
    return track(iterable, total=total, description=desc, console=stderr_console(), transient=True)


def say(msg: str) -> None:
    """One line of progress on stderr (stdout stays clean for --json)."""
    print(msg, file=sys.stderr, flush=True)


def stderr_console():
    return Console(stderr=True)


class ProgressBar:
    """A progress bar on stderr (rich) advanced by hand, for loops that are not a simple iterable; or nothing."""

    def __init__(self, total: int, enabled: bool = True, desc: str = ""):
        self.total, self.enabled, self.desc, self.p, self.task = total, enabled, desc, None, None

    def __enter__(self):
        if self.enabled:
            self.p = Progress(console=stderr_console(), transient=True)
            self.p.__enter__()
            self.task = self.p.add_task(self.desc, total=self.total)
        return self

    def advance(self):
        if self.p is not None:
            self.p.advance(self.task)

    def __exit__(self, *exc):
        if self.p is not None:
            self.p.__exit__(*exc)
