"""`workbench paper build [--rerun] [--only NAMES] [--json]`: every figure and table of the paper rebuilt from the
results store by executing the notebooks (workbench/programs/paper.py); `make paper` runs it."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
from typing import Optional

import typer

from workbench.results.console import emit_json, print_table


def register(app: typer.Typer) -> None:
    paper = typer.Typer(help="Papers from stored results: notebooks → paper/figures, paper/tables, main.tex.",
                        no_args_is_help=True)
    app.add_typer(paper, name="paper")

    @paper.command("build")
    def build_cmd(
        notebooks: str = typer.Option("notebooks", "--notebooks", help="folder of jupytext .py notebooks"),
        out: str = typer.Option("paper", "--out", help="output folder (figures/, tables/, main.tex)"),
        only: Optional[str] = typer.Option(None, "--only", help="comma list of notebook names"),
        rerun: bool = typer.Option(False, "--rerun", help="run the sweeps in NOTEBOOKS/sweeps/*.toml first"),
        json_out: bool = typer.Option(False, "--json"),
    ):
        """Execute every notebook headless against the results store; a failing notebook names its cell."""
        from workbench.programs import paper as program

        if rerun:
            for f in sorted(glob.glob(os.path.join(notebooks, "sweeps", "*.toml"))):
                print(f"sweep {f}", file=sys.stderr)
                subprocess.run([sys.executable, "-m", "workbench", "sweep", f], check=False)

        def on_notebook(done, total, o):
            print(f"[{done}/{total}] {o.name}: {'ok' if o.ok else 'FAILED ' + (o.error or '')} ({o.seconds:.1f} s)",
                  file=sys.stderr)

        res = program.build(notebooks, out, [s.strip() for s in only.split(",")] if only else None, on_notebook)
        if json_out:
            emit_json(res.to_record())
        else:
            print_table([{"notebook": n.name, "ok": n.ok, "seconds": n.seconds, "error": n.error or ""}
                         for n in res.notebooks], title=f"paper: {len(res.figures)} figures, {len(res.tables)} tables")
            print(res.latex_note)
        for n in res.failed:
            print(f"workbench: notebook {n.name} failed at {n.error}", file=sys.stderr)
        if res.failed:
            raise typer.Exit(1)
