"""`workbench sweep FILE.toml [--dry-run] [--retry-failed] [--workers N | --ray auto|ADDRESS] [--json]`: a grid of
experiments over any recording command, one record per point, resumable (workbench/programs/sweep.py has the file
format; workbench/programs/executor.py the back-ends)."""
from __future__ import annotations

import sys
from typing import Optional

import typer

from workbench.errors import WorkbenchError
from workbench.results.console import emit_json, print_table


def register(app: typer.Typer) -> None:
    @app.command("sweep")
    def sweep_cmd(
        file: str = typer.Argument(..., help="sweep file (TOML: [sweep] name, command; [fixed]; [grid]; [[points]])"),
        dry_run: bool = typer.Option(False, "--dry-run", help="list the points and their command lines; run nothing"),
        retry_failed: bool = typer.Option(False, "--retry-failed", help="run the points that failed before again"),
        workers: Optional[int] = typer.Option(None, "--workers", help="run the points in N local worker processes"),
        ray: Optional[str] = typer.Option(None, "--ray", help="run the points as Ray tasks: auto (the cluster on this "
                                          "machine, or a local one) or the head's address HOST:6379"),
        json_out: bool = typer.Option(False, "--json", help="JSON summary on stdout"),
    ):
        """Run every point of a sweep not yet in the results store; failed points are reported and skipped."""
        import typer.main

        from workbench.programs import sweep as program
        from workbench.programs.executor import FanOutProgress, check_options, make_executor

        check_options(workers, ray)
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
        from workbench.results.store import Store

        store = Store()
        pts = spec.points()
        left = len(pts) - len(program.recorded_keys(store, spec.sweep_id) & {p.key for p in pts})
        if left == 0:
            msg = f"sweep {spec.name} ({spec.sweep_id}): all {len(pts)} points are recorded; nothing left to do"
            if json_out:
                emit_json(program.run_sweep(spec, node.params, store=store).to_record())
                print(msg, file=sys.stderr)
            else:
                print(msg)
            return
        with make_executor(workers, ray) as executor:
            with FanOutProgress(left, f"sweep {spec.name}") as bar:
                res = program.run_sweep(spec, node.params, store=store, retry_failed=retry_failed, executor=executor,
                                        on_start=lambda pt: bar.start(f"point {pt.index} ({pt.label()})"),
                                        on_result=lambda pt, r: bar.finish(r), on_todo=bar.set_total)
                backend = executor.describe()
        out = res.to_record()
        if json_out:
            emit_json(out)
        else:
            if out["ran"] or out["failed"]:
                print_table(res.workers, title="points per worker")
            print(f"sweep {spec.name} ({spec.sweep_id}): {out['ran']} ran, {out['skipped']} already recorded, "
                  f"{out['failed']} failed, of {out['points']} points; on {backend}")
        for o in res.failed:
            where = f" on {o.worker}" if o.worker else ""
            print(f"workbench: point {o.point.index} ({o.point.label()}) failed{where}: {o.error}", file=sys.stderr)
        if res.failed:
            raise typer.Exit(1)
