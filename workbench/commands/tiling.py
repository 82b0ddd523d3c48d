"""`workbench tiling shape|sweep|search`: padding to the matrix units, the shape sawtooth, the Pallas tile search."""
from __future__ import annotations

import time
from typing import Optional

import typer

from workbench.commands.options import platform_option
from workbench.errors import WorkbenchError
from workbench.hardware.devices import request_devices
from workbench.results.console import emit_json, print_table
from workbench.results.store import Store, make_record


def shape_cmd(
    target: str = typer.Option(..., help="chip (tpu-v6e, h100), slice (tpu-v5e:4x4) or node (h100:8)"),
    m: Optional[int] = typer.Option(None, "--m", help="matmul rows"),
    n: Optional[int] = typer.Option(None, "--n", help="matmul columns"),
    k: Optional[int] = typer.Option(None, "--k", help="matmul contraction"),
    batch: int = typer.Option(1, help="independent matmuls of that shape (batch dimension)"),
    preset: Optional[str] = typer.Option(None, help="every matmul of this preset's step instead"),
    set_: Optional[str] = typer.Option(None, "--set", help="config overrides k=v,... for --preset"),
    step_batch: int = typer.Option(8, "--step-batch", help="sequences per step for --preset"),
    seq: Optional[int] = typer.Option(None, help="sequence length for --preset (default: the config's)"),
    mode: str = typer.Option("train", help="train (forward + gradient matmuls) | forward"),
    dtype: str = typer.Option("bfloat16", help="operand dtype"),
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
):
    """Padded shapes, matrix-unit utilization, wasted flops and bytes, predicted time; friendlier dimensions."""
    from workbench.programs.tiling import shape_report

    r = shape_report(target, m=m, n=n, k=k, batch=batch, dtype=dtype, preset=preset, overrides=set_,
                     step_batch=step_batch, seq=seq, mode=mode)
    rec = r.to_record()
    if json_out:
        emit_json(rec)
        return
    print(f"{r.source} on {r.target} ({r.dtype}); granule (m, n, k) = {r.granule}")
    print_table([{k_: row[k_] for k_ in ("name", "m", "n", "k", "batch", "count", "utilization",
                                         "wasted_flops", "predicted_s")}
                 | {"padded": "x".join(str(row["padded"][d]) for d in "mnk")} for row in rec["matmuls"]])
    print(f"utilization {rec['utilization']:.4f}; wasted {rec['wasted_flops']:.3g} flops, "
          f"{rec['wasted_bytes']:.3g} bytes; predicted {rec['predicted_s']:.3g}s "
          f"(without padding {rec['predicted_unpadded_s']:.3g}s)")
    if rec["suggestions"]:
        print_table(rec["suggestions"], ["field", "value", "multiple", "friendly_down", "friendly_up",
                                         "wasted_flops", "share"], title="dimensions by the waste they cause")
    for note in rec["notes"]:
        print("note:", note)


def sweep_cmd(
    target: str = typer.Option(..., help="one-chip TPU slice (tpu-v5e:1x1) or host"),
    m: int = typer.Option(..., "--m", help="rows of x"),
    n: int = typer.Option(..., "--n", help="columns of y"),
    k_from: int = typer.Option(..., "--k-from", help="first contraction size"),
    k_to: int = typer.Option(..., "--k-to", help="last contraction size (inclusive)"),
    step: int = typer.Option(8, help="k step"),
    dtype: str = typer.Option("bfloat16", help="operand dtype"),
    repeats: int = typer.Option(5, help="timed repeats per point (host only)"),
    plot: Optional[str] = typer.Option(None, help="PNG path (default reports/tiling-sweep-<time>.png)"),
    no_plot: bool = typer.Option(False, "--no-plot", help="no figure"),
    platform: str = platform_option(),
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
):
    """Compile the dot across a range of k and plot predicted (and on the host measured) time and throughput."""
    from workbench.programs.tiling import sweep

    if repeats < 1:
        raise WorkbenchError(f"--repeats must be >= 1, got {repeats}")
    request_devices(None, platform)
    path = None if no_plot else (plot or f"reports/tiling-sweep-{time.strftime('%Y%m%d-%H%M%S')}.png")
    r = sweep(target, m, n, k_from, k_to, step, dtype=dtype, repeats=repeats, plot=path)
    rec = r.to_record()
    Store().append(make_record("tiling-sweep", {"target": r.target, "m": m, "n": n, "k_from": k_from,
                                                "k_to": k_to, "step": step, "dtype": r.dtype}, extra=rec))
    if json_out:
        emit_json(rec)
        return
    print_table([{"k": p["k"], "lhs layout": p["layouts"][0], "padded": "x".join(str(p["padded"][d]) for d in "mnk"),
                  "mxu": "x".join(str(p["mxu_padded"][d]) for d in "mnk"), "predicted_s": p["predicted_s"],
                  "compiler_s": p["compiler_estimated_s"], "measured_s": p["measured_s"]} for p in rec["points"]])
    if r.figure:
        print("figure:", r.figure)
    for note in rec["notes"]:
        print("note:", note)


def search_cmd(
    target: str = typer.Option(..., help="one-chip TPU slice (tpu-v5e:1x1) to compile for, or a GPU chip"),
    m: int = typer.Option(..., "--m"),
    n: int = typer.Option(..., "--n"),
    k: int = typer.Option(..., "--k"),
    kernel: str = typer.Option("matmul", help="matmul | matmul-bias-gelu"),
    dtype: str = typer.Option("bfloat16", help="operand dtype"),
    compile_top: int = typer.Option(3, "--compile-top", help="compile the best N for the target"),
    step_overhead_us: float = typer.Option(0.0, "--step-overhead-us",
                                           help="fixed cost per grid step in the model (not modelled: 0)"),
    show: int = typer.Option(15, help="rows to print (JSON has all)"),
    platform: str = platform_option(),
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
):
    """Enumerate Pallas block shapes that fit on chip, predict each from its tile roofline, compile the best."""
    from workbench.programs.tiling import search

    request_devices(None, platform)
    r = search(kernel, m, n, k, target, dtype=dtype, top=compile_top, step_overhead_s=step_overhead_us * 1e-6)
    rec = r.to_record()
    Store().append(make_record("tiling-search", {"kernel": kernel, "target": r.target, "m": m, "n": n, "k": k,
                                                 "dtype": r.dtype}, extra=rec))
    if json_out:
        emit_json(rec)
        return
    print_table([{"block": "x".join(map(str, c["block"])), "fits": c["fits"], "onchip MiB": c["onchip_bytes"] / 2**20,
                  "steps": c["steps"], "predicted_s": c["predicted_s"], "compiled": c["compiled"],
                  "measured_s": c["measured_s"], "reason": c["reason"][:70]} for c in rec["candidates"][:show]])
    rejected = [c for c in rec["candidates"] if not c["fits"]]
    if rejected:
        print(f"{len(rejected)} blocks rejected, e.g. {'x'.join(map(str, rejected[0]['block']))}: "
              f"{rejected[0]['reason']}")
    print(f"XLA dot at the tile model's padding: predicted {rec['xla_dot_predicted_s']:.3g}s")
    for note in rec["notes"]:
        print("note:", note)


def register(app: typer.Typer) -> None:
    tiling = typer.Typer(help="Systolic-friendly tiling: padding, the shape sawtooth, Pallas block search",
                         no_args_is_help=True, add_completion=False)
    app.add_typer(tiling, name="tiling")
    tiling.command("shape")(shape_cmd)
    tiling.command("sweep")(sweep_cmd)
    tiling.command("search")(search_cmd)
