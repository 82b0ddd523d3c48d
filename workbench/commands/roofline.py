"""`workbench roofline OP [sizes] [--dtype D] [--target CHIP] [--json]`."""
from __future__ import annotations

from typing import Optional

import typer

from workbench.commands.options import platform_option
from workbench.errors import WorkbenchError
from workbench.hardware.devices import request_devices
from workbench.hardware.spec import resolve_name
from workbench.programs.ops import build
from workbench.results.console import emit_json, print_table


def register(app: typer.Typer) -> None:
    @app.command("roofline")
    def roofline_cmd(
        op: str = typer.Argument(..., help="matmul | elementwise | softmax | layernorm | attention"),
        m: Optional[str] = typer.Option(None, "--m", help="matmul rows"),
        n: Optional[str] = typer.Option(None, "--n", help="matmul columns; elementwise element count"),
        k: Optional[str] = typer.Option(None, "--k", help="matmul contracting size"),
        rows: Optional[str] = typer.Option(None, help="softmax/layernorm rows"),
        cols: Optional[str] = typer.Option(None, help="softmax/layernorm columns"),
        batch: Optional[str] = typer.Option(None, help="attention batch"),
        heads: Optional[str] = typer.Option(None, help="attention heads"),
        seq: Optional[str] = typer.Option(None, help="attention sequence length"),
        head_dim: Optional[str] = typer.Option(None, help="attention head dimension"),
        dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16"),
        target: Optional[str] = typer.Option(None, help="catalogue chip to predict for (no run); default: this host"),
        repeats: int = typer.Option(10, help="timed repeats"),
        platform: str = platform_option(),
        json_out: bool = typer.Option(False, "--json", help="print JSON"),
    ):
        """Compile a built-in op; predict it on the host (and measure it) or on a catalogue chip."""
        from workbench.programs.experiment import run_program, summary

        if repeats < 1:
            raise WorkbenchError(f"--repeats must be >= 1, got {repeats}")
        sizes = dict(m=m, n=n, k=k, rows=rows, cols=cols, batch=batch, heads=heads, seq=seq, head_dim=head_dim)
        if op == "elementwise" and n is not None:
            sizes["n"] = n
        o = build(op, dtype, **sizes)
        tgt = resolve_name(target) if target else None
        request_devices(None, platform)
        rec = run_program(o.fn, o.args, kind="roofline-op", target=tgt, run=tgt in (None, "host"),
                          repeats=repeats, spec={"op": op, "sizes": o.sizes, "dtype": o.dtype,
                                                 "description": o.description},
                          extra={"formula_flops": o.formula_flops, "formula_bytes": o.formula_bytes},
                          compute_dtype=o.dtype)
        s = summary(rec)
        s.update(op=op, sizes=o.sizes, dtype=o.dtype, formula_flops=o.formula_flops, formula_bytes=o.formula_bytes)
        if json_out:
            emit_json(s)
        else:
            print(o.description)
            print_table([{"target": s["target"], "flops": s["flops"], "bytes": s["bytes"],
                          "intensity": s["intensity"], "ridge": s["ridge"], "bound": s["bound"],
                          "predicted_s": s["predicted_s"], "measured_s": s["measured_s"], "error": s["error"]}])
            for note in s["notes"]:
                print("note:", note)
