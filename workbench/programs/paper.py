"""Rebuild a paper's figures and tables from stored results: execute every notebook headless, then LaTeX.

    build(notebooks="notebooks", out="paper")   # each notebooks/*.py (jupytext percent format) run by nbclient

Each notebook reads only the results store (`Store().query(...)`; $WORKBENCH_RESULTS) and writes its figures
(PDF + PNG) and tables (LaTeX booktabs + Markdown) under $WORKBENCH_PAPER_OUT through workbench.results.paper. A
notebook that fails is reported with the cell that failed and its first error line; the others still run.
`paper/main.tex` includes the figures and tables; it is built with latexmk when a TeX toolchain is installed.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import subprocess
import tempfile
import time

import jupytext
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from workbench.errors import WorkbenchError


@dataclasses.dataclass(frozen=True)
class NotebookOutcome:
    name: str
    ok: bool
    seconds: float
    error: str | None = None       # "cell N: first line of the error"


@dataclasses.dataclass(frozen=True)
class PaperResult:
    notebooks: tuple[NotebookOutcome, ...]
    figures: tuple[str, ...]
    tables: tuple[str, ...]
    pdf: str | None
    latex_note: str

    @property
    def failed(self) -> list[NotebookOutcome]:
        return [n for n in self.notebooks if not n.ok]

    def to_record(self) -> dict:
        return {"notebooks": [dataclasses.asdict(n) for n in self.notebooks], "figures": list(self.figures),
                "tables": list(self.tables), "pdf": self.pdf, "latex": self.latex_note}


def notebook_paths(notebooks: str, only: list[str] | None = None) -> list[str]:
    paths = sorted(glob.glob(os.path.join(notebooks, "*.py")))
    if not paths:
        raise WorkbenchError(f"no notebooks (*.py, jupytext percent format) in {notebooks!r}")
    if only:
        names = {os.path.splitext(os.path.basename(p))[0]: p for p in paths}
        missing = [n for n in only if n not in names]
        if missing:
            raise WorkbenchError(f"no notebook {', '.join(missing)} in {notebooks}; have {', '.join(sorted(names))}")
        paths = [names[n] for n in only]
    return paths


def run_notebook(path: str, timeout: int = 600) -> NotebookOutcome:
    """Execute one jupytext notebook in a fresh kernel (the environment, store and output folder are inherited)."""
    name = os.path.splitext(os.path.basename(path))[0]
    nb = jupytext.read(path)
    t0 = time.perf_counter()
    sockets = tempfile.mkdtemp(prefix="workbench-kernel-")   # the kernel's local sockets, not TCP and not the cwd
    km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(sockets, "kernel-ipc"))
    client = NotebookClient(nb, km=km, timeout=timeout, resources={"metadata": {"path": os.getcwd()}})
    try:
        client.execute()
    except CellExecutionError as e:
        cell = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                     and any(o.get("output_type") == "error" for o in c.get("outputs", []))), None)
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # the kernel's traceback is coloured
        words = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(("-", " "))]
        err = next((ln for ln in reversed(words) if "Error" in ln or "Exception" in ln), words[-1] if words else "?")
        return NotebookOutcome(name, False, time.perf_counter() - t0, f"cell {cell}: {err.strip()[:200]}")
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    return NotebookOutcome(name, True, time.perf_counter() - t0)


def build_latex(out: str) -> tuple[str | None, str]:
    tex = os.path.join(out, "main.tex")
    if not os.path.exists(tex):
        return None, f"no {tex}: LaTeX skipped"
    exe = shutil.which("latexmk")
    if exe is None:
        return None, "latexmk not installed: figures and tables rebuilt, main.tex not compiled (apt-get install latexmk)"
    p = subprocess.run([exe, "-pdf", "-interaction=nonstopmode", "-halt-on-error", "main.tex"], cwd=out,
                       capture_output=True, text=True)
    if p.returncode != 0:
        last = [ln for ln in p.stdout.splitlines() if ln.startswith("!")]
        return None, f"latexmk failed: {(last[0] if last else p.stdout.strip().splitlines()[-1])[:200]}"
    return os.path.join(out, "main.pdf"), "built with latexmk"


def build(notebooks: str = "notebooks", out: str = "paper", only: list[str] | None = None,
          on_notebook=None) -> PaperResult:
    paths = notebook_paths(notebooks, only)
    os.environ["WORKBENCH_PAPER_OUT"] = os.path.abspath(out)   # the kernels inherit it
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    outcomes = []
    for i, p in enumerate(paths):
        outcomes.append(run_notebook(p))
        if on_notebook:
            on_notebook(i + 1, len(paths), outcomes[-1])
    figs = tuple(sorted(glob.glob(os.path.join(out, "figures", "*.pdf"))))
    tabs = tuple(sorted(glob.glob(os.path.join(out, "tables", "*.tex"))))
    pdf, note = build_latex(out)
    return PaperResult(tuple(outcomes), figs, tabs, pdf, note)
