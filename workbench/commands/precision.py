"""`workbench precision ...`: what each number format costs in accuracy (study a, quick) and what the policies are.

    workbench precision error [--json]      matmul error of every policy against a float64 reference
    workbench precision list [--json]       the policies, their formats and scaling recipes
"""
from __future__ import annotations

from typing import Optional

import typer

from workbench.commands.options import platform_option
from workbench.errors import WorkbenchError
from workbench.hardware.devices import request_devices
from workbench.results.console import emit_json, print_table


def register(app: typer.Typer) -> None:
    prec = typer.Typer(help="Precision policies: accuracy of each number format, the policies themselves.",
                       no_args_is_help=True)
    app.add_typer(prec, name="precision")

    @prec.command("error")
    def error_cmd(
        platform: str = platform_option(),
        json_out: bool = typer.Option(False, "--json", help="JSON rows (one per policy) on stdout"),
        policies: Optional[str] = typer.Option(None, "--policies", help="comma list (default: all)"),
        inputs: str = typer.Option("normal", "--inputs", help="normal | outliers | outlier_damage | all"),
        m: int = typer.Option(256, "--m"), k: int = typer.Option(1024, "--k"), n: int = typer.Option(256, "--n"),
        seed: int = typer.Option(0, "--seed"),
        steps: int = typer.Option(3, "--steps", help="calls per policy; the last is reported (delayed scaling warms)"),
        record: bool = typer.Option(False, "--record", help="also append the rows to the results store"),
    ):
        """Relative error of each policy's matmul against a float64 reference (study a, quick)."""
        from workbench.programs import precision as program

        request_devices(None, platform)
        kinds = list(program.INPUTS) if inputs == "all" else [inputs]
        for kd in kinds:
            if kd not in program.INPUTS:
                raise WorkbenchError(f"--inputs must be one of {', '.join(program.INPUTS)} or all, got {inputs!r}")
        rows = program.error_table(program.policies(policies), kinds, m, k, n, seed, steps, progress=True)
        if record:
            program.record_rows(rows)
        if json_out:
            emit_json(rows)
        else:
            print_table(rows, ["policy", "inputs", "rel_error", "max_abs_error", "matmul_element", "matmul_bits",
                               "scale", "emulated"], title=f"matmul error vs float64, (m,k,n)=({m},{k},{n})")

    @prec.command("list")
    def list_cmd(json_out: bool = typer.Option(False, "--json")):
        """The registered precision policies."""
        from workbench.programs import precision as program


        rows = program.policy_rows()
        if json_out:
            emit_json(rows)
        else:
            print_table(rows, ["policy", "compute_dtype", "matmul_element", "matmul_bits", "scale", "loss_scaling",
                               "description"], title="precision policies")


