"""`workbench sweep FILE.toml [--dry-run] [--retry-failed] [--json]`: a grid of experiments over any recording
command, one record per point, resumable (workbench/programs/sweep.py has the file format)."""
from __future__ import annotations

import sys

import typer

from workbench.errors import WorkbenchError
from workbench.results.console import emit_json, print_table, stderr_console


def register(app: typer.Typer) -> None:
    @app.command("sweep")
    def sweep_cmd(
        file: str = typer.Argument(..., help="sweep file (TOML: [sweep] name, command; [fixed]; [grid]; [[points]])"),
        dry_run: bool = typer.Option(False, "--dry-run", help="list the points and their command lines; run nothing"),
        retry_failed: bool = typer.Option(False, "--retry-failed", help="run the points that failed before again"),
        json_out: bool = typer.Option(False, "--json", help="JSON summary on stdout"),
    ):
        """Run every point of a sweep not yet in the results store; failed points are reported and skipped."""
        import typer.main
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        from workbench.programs import sweep as program

        spec = program.load_sweep(file)
        node = typer.main.get_command(app)
        for word in spec.command:
            sub = getattr(node, "commands", {}).get(word)
            if sub is None:
                have = ", ".join(sorted(getattr(node, "commands", {})))
                raise WorkbenchError(f"{file}: unknown command {' '.join(spec.command)!r}; commands: {have}")
            node = sub
        if hasattr(node, "commands"):
            raise WorkbenchError(f"{file}: {' '.join(spec.command)!r} is a command group; name one of: "
                                         f"{', '.join(sorted(node.commands))}")
        if dry_run:
            res = program.run_sweep(spec, node.params, dry_run=True)
            rows = [{"#": o.point.index, "point": o.point.label(), "key": o.point.key,
                     "command line": (o.error or "workbench " + " ".join(
                         [*spec.command, *program.point_argv(spec.command, o.point.params, node.params)]))}
                    for o in res.outcomes]
            emit_json(res.to_record()) if json_out else print_table(rows, title=f"sweep {spec.name}: {len(rows)} points")
            return
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=stderr_console(), transient=True) as bar:
            task = bar.add_task(f"sweep {spec.name}", total=None)

            def on_point(done, total, point, status):
                bar.update(task, completed=done, total=total, description=f"sweep {spec.name}: {point.label()[:50]}")
                if status == "failed":
                    bar.console.print(f"point {point.index} ({point.label()}) failed")

            res = program.run_sweep(spec, node.params, retry_failed=retry_failed, on_point=on_point)
        for o in res.failed:
            print(f"workbench: point {o.point.index} ({o.point.label()}): {o.error}", file=sys.stderr)
        out = res.to_record()
        if json_out:
            emit_json(out)
        else:
            print(f"sweep {spec.name} ({spec.sweep_id}): {out['ran']} ran, {out['skipped']} already recorded, "
                  f"{out['failed']} failed, of {out['points']} points")
        if res.failed:
            raise typer.Exit(1)
