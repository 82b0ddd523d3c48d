"""`workbench fusion (--op OP [sizes] | --preset P --program train|forward|layer) [--target T] [variants] [--json]`."""
from __future__ import annotations

import datetime
import os
from typing import List, Optional

import typer

from workbench.commands.options import platform_option
from workbench.errors import WorkbenchError, positive_int
from workbench.hardware.devices import request_devices
from workbench.results.console import emit_json, print_table, say
from workbench.results.figures import fusion_chart


def register(app: typer.Typer) -> None:
    @app.command("fusion")
    def fusion_cmd(
        op: Optional[str] = typer.Option(None, "--op", help="a built-in op: matmul | elementwise | softmax | "
                                                            "layernorm | attention"),
        m: Optional[str] = typer.Option(None, "--m", help="matmul rows"),
        n: Optional[str] = typer.Option(None, "--n", help="matmul columns; elementwise element count"),
        k: Optional[str] = typer.Option(None, "--k", help="matmul contracting size"),
        rows: Optional[str] = typer.Option(None, help="softmax/layernorm rows"),
        cols: Optional[str] = typer.Option(None, help="softmax/layernorm columns"),
        batch: Optional[str] = typer.Option(None, help="attention batch; model programs: global batch (default 8)"),
        heads: Optional[str] = typer.Option(None, help="attention heads"),
        seq: Optional[str] = typer.Option(None, help="attention sequence length; model programs: tokens per sequence"),
        head_dim: Optional[str] = typer.Option(None, help="attention head dimension"),
        dtype: str = typer.Option("float32", help="op dtype: float32 | bfloat16 | float16"),
        preset: Optional[str] = typer.Option(None, help="a model preset (small, tiny, ...)"),
        program: str = typer.Option("layer", help="with --preset: train | forward | layer (one block) | mlp | attention (its halves)"),
        precision: str = typer.Option("float32", help="with --preset: the precision policy"),
        set_: Optional[str] = typer.Option(None, "--set", help="with --preset: config overrides k=v,k=v"),
        target: Optional[str] = typer.Option(None, help="compile for a TPU slice (tpu-v5e:2x2, ...; AOT through "
                                                        "libtpu, predicted, not run); default: this host"),
        disable_passes: List[str] = typer.Option([], "--disable-passes", help="a variant with these XLA passes off "
                                                 "(comma-separated; repeatable)"),
        xla_flags: List[str] = typer.Option([], "--xla-flags", help="a variant compiled with these XLA flags, "
                                            "e.g. '--xla_cpu_enable_fast_math=true' (repeatable)"),
        barrier_after: Optional[str] = typer.Option(None, "--barrier-after", help="a variant with an optimization "
                                                    "barrier after every equation of these primitives (mul,exp,...)"),
        no_unfused: bool = typer.Option(False, "--no-unfused", help="skip the all-fusion-off variant"),
        no_host: bool = typer.Option(False, "--no-host", help="with --target: skip the XLA:CPU side-by-side compile"),
        list_passes: bool = typer.Option(False, "--list-passes", help="list the passes the compiler runs on the "
                                                                      "program and what the changing ones did"),
        repeats: int = typer.Option(5, help="timed repeats per variant (host)"),
        profile_steps: int = typer.Option(2, help="traced runs per variant for per-kernel times (host; 0: none)"),
        chart: bool = typer.Option(True, help="write the chart under reports/"),
        platform: str = platform_option(),
        json_out: bool = typer.Option(False, "--json", help="print JSON"),
    ):
        """What XLA fused in a program, what each kernel costs, and what fusing saved, under fusion variants."""
        from workbench.programs import fusion as fx  # deferred: --help stays fast

        if repeats < 1:
            raise WorkbenchError(f"--repeats must be >= 1, got {repeats}")
        if profile_steps < 0:
            raise WorkbenchError(f"--profile-steps must be >= 0, got {profile_steps}")
        if (op is None) == (preset is None):
            raise WorkbenchError("give a program: --op OP (matmul, elementwise, softmax, layernorm, attention) or "
                                 "--preset P --program train|forward|layer")
        pass_lists = [fx.parse_pass_list(p) for p in disable_passes]
        for f in xla_flags:
            fx.parse_xla_flags(f)
        barriers = tuple(b for b in (barrier_after or "").split(",") if b) if barrier_after is not None else ()
        if barrier_after is not None and not barriers:
            raise WorkbenchError("--barrier-after is empty; give jax primitive names, e.g. --barrier-after mul,exp")
        request_devices(None, platform)
        if op is not None:
            sizes = dict(m=m, n=n, k=k, rows=rows, cols=cols, batch=batch, heads=heads, seq=seq, head_dim=head_dim)
            prog = fx.op_program(op, dtype, target=target, **sizes)
        else:
            b = positive_int("--batch", batch) if batch is not None else 8
            s = positive_int("--seq", seq) if seq is not None else None
            prog = fx.model_program(preset, program, target=target, batch=b, seq=s, precision=precision,
                                    overrides=set_)
        say = _say
        if list_passes:
            names, effects = fx.list_passes(prog)
            if json_out:
                emit_json({"passes": names, "effects": [e.to_record() for e in effects]})
            else:
                print(f"{len(names)} passes: {', '.join(names)}")
                print_table([dict(e.to_record(), fuses=e.fuses, drops_barriers=e.drops_barriers) for e in effects],
                            title="passes that changed the program")
            return
        res = fx.explore(prog, disable_passes=pass_lists, xla_flags=list(xla_flags), barrier_after=barriers,
                         no_fusion=not no_unfused, repeats=repeats, profile_steps=profile_steps,
                         compare_host=not no_host, progress=say)
        out = res.to_record()
        if chart:
            stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
            d = os.path.join("reports", f"fusion-{stamp}")
            os.makedirs(d, exist_ok=True)
            out["chart"] = fusion_chart(out, os.path.join(d, "fusion.png"), title=prog.description or prog.name)
        if json_out:
            emit_json(out)
            return
        _console(out, print_table)


def _say(msg: str) -> None:
    say(f"fusion: {msg}")


def _console(out: dict, print_table) -> None:
    p = out["program"]
    print(f"{p['description'] or p['name']} — {out['compiler']} on {p['target']}")
    base = out["variants"]["default"]
    rows = []
    for name, v in out["variants"].items():
        rows.append({"variant": name, "kernels": v["kernels"], "bytes": v["bytes"], "flops": v["flops"],
                     "bytes/default": v["bytes"] / base["bytes"] if base["bytes"] else None,
                     "predicted_s": v["predicted_s"], "measured_s": v["measured_s"],
                     "measured/default": (v["measured_s"] / base["measured_s"]
                                          if v["measured_s"] and base["measured_s"] else None)})
    print_table(rows, title="variants (bytes: Σ kernel bytes in + out, per device)")
    for name, ks in out["kernels"].items():
        if name not in ("default", "no-fusion"):
            continue
        top = sorted(ks, key=lambda r: -(r["measured_s"] if r["measured_s"] is not None else r["predicted_s"]))[:12]
        print_table([{"kernel": r["name"], "kind": r["kind"], "ops": _ops(r["ops"]), "bytes": r["bytes"] * r["count"],
                      "flops": r["flops"] * r["count"], "x": r["count"], "predicted_s": r["predicted_s"],
                      "measured_s": r["measured_s"], "bound": r["bound"]} for r in top],
                    title=f"{name}: the longest of {len(ks)} kernels")
    for name, d in out["diff"].items():
        print(f"{name} vs default: {d['kernels']:+d} kernels, {d['bytes']:+.3g} bytes; "
              f"{d['n_split']} default kernels split, {d['n_merged']} merged")
        for s in d["split"][:3]:
            print(f"  {s['kernel']} ({s['kind']}) -> {len(s['into'])} kernels: {s['bytes_before']:.3g} -> "
                  f"{s['bytes_after']:.3g} bytes")
    for name, kinds in out["prediction_error_by_kind"].items():
        print_table([{"kind": k, **v} for k, v in kinds.items()], title=f"{name}: prediction error per fusion kind")
    if out.get("host_compare"):
        h = out["host_compare"]
        if "error" in h:
            print("host side by side:", h["error"])
        else:
            print(f"side by side: XLA:CPU {h['host_kernels']} kernels {h['host_by_kind']}; target "
                  f"{h['target_kernels']} kernels {h['target_by_kind']}; target predicted {h['target_predicted_s']:.3g}s")
            for t in h["target_fuses_host_does_not"][:5]:
                print(f"  target fuses into {t['kernel']} ({t['kind']}) what XLA:CPU runs as {len(t['host_kernels'])}")
            for t in h["host_fuses_target_does_not"][:5]:
                print(f"  XLA:CPU fuses into {t['kernel']} ({t['kind']}) what the target runs as "
                      f"{len(t['target_kernels'])}")
    print(f"saved bytes (no-fusion − default): {out['saved_bytes']}; speedup of fusing: {out['speedup']}")
    for note in out["notes"]:
        print("note:", note)
    if out.get("chart"):
        print("chart:", out["chart"])


def _ops(ops: dict) -> str:
    return " ".join(f"{k}×{v}" if v > 1 else k for k, v in list(ops.items())[:5]) + (" …" if len(ops) > 5 else "")
