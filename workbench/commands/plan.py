"""`workbench plan`: search strategies × meshes × remat × microbatching for a model on a target; rank what fits.

    workbench plan --preset small --target tpu-v5e:4x4
    workbench plan --preset llama3-8b --target tpu-v5e:4x4 --batch 16 --seq 2048 --max-candidates 8 --json
"""
from __future__ import annotations

from typing import Optional

import typer

from workbench.errors import positive_int
from workbench.results.console import emit_json, fmt, stderr_console


def table(rows: list[dict], title: str) -> None:
    """The ranking as a rich table on stdout, wide enough to read when stdout is not a terminal."""
    import sys

    from rich.console import Console
    from rich.table import Table

    if not rows:
        print("(no feasible candidate)")
        return
    t = Table(title=title)
    for c in rows[0]:
        t.add_column(c, no_wrap=True)
    for r in rows:
        t.add_row(*[fmt(v) for v in r.values()])
    Console(width=None if sys.stdout.isatty() else 160).print(t)


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan_cmd(
        preset: str = typer.Option(..., "--preset", help="model preset"),
        target: str = typer.Option(..., "--target", help="tpu-v5e:4x4, tpu-v4:2x2x1, h100:8, ... (docs/targets.md)"),
        batch: Optional[int] = typer.Option(None, "--batch", help="global batch in sequences (default 4 per chip)"),
        seq: Optional[int] = typer.Option(None, "--seq", help="sequence length (default: the preset's)"),
        max_candidates: int = typer.Option(24, "--max-candidates", help="compile at most this many candidates"),
        strategies: Optional[str] = typer.Option(None, "--strategies", help="comma list (default: all that apply)"),
        policy: str = typer.Option("bf16", "--policy", help="precision policy"),
        set_: Optional[str] = typer.Option(None, "--set", help="model config overrides k=v,k=v"),
        workers: Optional[int] = typer.Option(None, "--workers", help="parallel compiles (default: cores, max 4)"),
        ray: Optional[str] = typer.Option(None, "--ray", help="compile each candidate as a Ray task: auto (the cluster "
                                          "on this machine, or a local one) or the head's address HOST:6379"),
        no_cache: bool = typer.Option(False, "--no-cache", help="ignore cached candidate outcomes"),
        exhaustive: bool = typer.Option(False, "--exhaustive",
                                        help="also compile remat/microbatched variants of programs that already fit"),
        gpu_compiler: str = typer.Option("auto", "--gpu-compiler", help="GPU targets: auto | xla-gpu | cpu-sim"),
        top: int = typer.Option(12, "--top", help="rows of the ranking table"),
        as_json: bool = typer.Option(False, "--json", help="JSON on stdout"),
    ):
        """Compile every candidate partitioning for the target, drop what does not fit, rank by predicted step."""
        from partitioning.topology import setup_target_devices
        from workbench.commands.options import check_inputs

        strats = [s.strip() for s in strategies.split(",") if s.strip()] if strategies else None
        check_inputs(batch=batch, seq=seq)
        positive_int("--max-candidates", max_candidates)
        positive_int("--top", top)
        if workers is not None:
            positive_int("--workers", workers)
        from workbench.programs.executor import check_options, make_executor

        check_options(workers, ray)
        tgt = setup_target_devices(target, gpu_compiler)
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from workbench.programs.plan import plan

        executor = make_executor(ray=ray) if ray is not None else None
        try:
            with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=stderr_console(), transient=True) as prog:
                task = prog.add_task(f"planning {preset} on {tgt.name}", total=None)

                def on_progress(done, total, msg):
                    prog.update(task, completed=done, total=total, description=f"{msg[:60]}")

                r = plan(preset, tgt, batch=batch, seq=seq, max_candidates=max_candidates, strategies=strats,
                         policy=policy, overrides=set_, workers=workers, use_cache=not no_cache,
                         exhaustive=exhaustive, gpu_compiler=gpu_compiler, on_progress=on_progress, executor=executor)
        finally:
            if executor is not None:
                executor.close()
        if as_json:
            emit_json(r)
            return
        err = r.get("prediction_error") or {}
        err_col = f"±{err['median_error']:.0%}" if err.get("median_error") is not None else "unknown"
        rows = [{"#": x["rank"], "strategy": x["strategy"], "mesh": x["mesh"], "remat": x["remat"],
                 "mb": x["microbatches"], "step s": x["predicted_step_s"], "error": err_col,
                 "compute s": x["compute_s"], "MFU": x["predicted_mfu"],
                 "GiB/dev": x["memory_per_device_bytes"] / 2**30, "bound": x["bound"],
                 "comm s": x["comm_s"], "cached": "yes" if x["cached"] else ""} for x in r["ranking"][:top]]
        table(rows, f"workbench plan · {preset} on {tgt.name} · batch {r['batch']} × seq {r['seq']}")
        print(f"{r['n_feasible']} feasible of {r['candidates_tried']} tried ({r['candidates_enumerated']} enumerated; "
              f"{r['n_does_not_fit']} do not fit, {r['n_invalid']} invalid, {r['n_pruned']} pruned: remat/"
              f"microbatching of programs that already fit) in {fmt(r['elapsed_s'])}s with {r['workers']} workers "
              f"({r['backend']})")
        print(r["explanation"])
        print(f"predicted step times: {err.get('text')}")
