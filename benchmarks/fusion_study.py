"""Fusion study: what XLA's fusion saves and costs, fused against unfused, predicted against measured.

Cases (each through the fusion explorer, workbench.programs.fusion.explore: the default compile and the one with
every fusing pass off, on this host, measured and traced per kernel):
  chain-D          elementwise chains of D multiply-adds over 16M floats (D = 1, 2, 4, 8, 16)
  norm-act-res     x + gelu(layernorm(x)·g + b) over [4096, 1024]
  softmax          softmax over [4096, 1024]
  attention        causal attention b=4 h=8 s=512 d=64 (workbench.programs.ops)
  small-mlp        the `small` preset's x + mlp(norm(x)), batch 8 × 256 tokens
  small-attention  the `small` preset's x + attn(norm(x))
  small-train      the `small` preset's full training step (batch 8)
The attention cases also run with YNNPACK limited to single dots (XLA flag
xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT): the softmax then runs in XLA's own loop
fusions beside bare library dots, which isolates what fusing the softmax into the dot's library fusion does.

Per case: kernels, bytes (Σ kernel bytes in + out), predicted and measured time of each variant, the speedup of
fusing (unfused / fused), the per-kernel prediction error per fusion kind, and the default kernels the unfused (or
single-dot) variant splits, fused kernel against its parts (`tradeoffs`: where fusion loses, the kernels say why).

    python -m benchmarks.fusion_study                 # all cases (a few minutes on a quiet machine)
    python -m benchmarks.fusion_study --quick         # small sizes, four cases: checks the plumbing
    python -m benchmarks.fusion_study --replot DIR    # table and figure again from DIR/summary.json

Records go to the results store (kind 'fusion', one per variant); summary.json, table.md and the figures go to --out
(default reports/fusion_study). Nothing here times anything itself: the explorer uses workbench.measure.harness.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp

from workbench.errors import WorkbenchError
from workbench.hardware.hostmem import reexec_with_hugepages
from workbench.programs import fusion as fx
from workbench.programs.ops import elementwise
from workbench.results.figures import fusion_chart, fusion_study_chart, markdown_table

YNN_DOTS_ONLY = "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"


def norm_act_residual(x_rc, g_c, b_c):
    """x + gelu(layernorm(x)·g + b): a reduction, elementwise work and a residual add over one array."""
    mu = x_rc.mean(-1, keepdims=True)
    var = ((x_rc - mu) ** 2).mean(-1, keepdims=True)
    return x_rc + jax.nn.gelu((x_rc - mu) * jax.lax.rsqrt(var + 1e-5) * g_c + b_c)


def cases(quick: bool) -> list[tuple[str, callable, list[str]]]:
    """(name, program builder, extra XLA flag variants)."""
    n = 1 << 20 if quick else 1 << 24
    rows, cols = (512, 256) if quick else (4096, 1024)
    out = []
    for d in ((1, 4) if quick else (1, 2, 4, 8, 16)):
        def chain(d=d):
            fn, args, *_ = elementwise(n, jnp.float32, depth=d)
            return fx.function_program(fn, *args, name=f"chain-{d}",
                                       description=f"chain of {d} multiply-adds over {n} floats")
        out.append((f"chain-{d}", chain, []))
    sds = jax.ShapeDtypeStruct
    out.append(("norm-act-res", lambda: fx.function_program(
        norm_act_residual, sds((rows, cols), jnp.float32), sds((cols,), jnp.float32), sds((cols,), jnp.float32),
        name="norm-act-res", description=f"x + gelu(layernorm(x)·g + b) over [{rows},{cols}]"), []))
    if quick:
        out.append(("attention", lambda: fx.op_program("attention", batch=1, heads=2, seq=128, head_dim=32),
                    [YNN_DOTS_ONLY]))
        return out
    out.append(("softmax", lambda: fx.op_program("softmax", rows=rows, cols=cols), []))
    out.append(("attention", lambda: fx.op_program("attention"), [YNN_DOTS_ONLY]))
    out.append(("small-mlp", lambda: fx.model_program("small", "mlp"), []))
    out.append(("small-attention", lambda: fx.model_program("small", "attention"), [YNN_DOTS_ONLY]))
    out.append(("small-train", lambda: fx.model_program("small", "train"), [YNN_DOTS_ONLY]))
    return out


def summarize(name: str, rec: dict) -> dict:
    v = rec["variants"]
    d, u = v["default"], v.get("no-fusion") or {}
    row = {"case": name, "kernels_fused": d["kernels"], "kernels_unfused": u.get("kernels"),
           "bytes_fused": d["bytes"], "bytes_unfused": u.get("bytes"),
           "predicted_fused_s": d["predicted_s"], "predicted_unfused_s": u.get("predicted_s"),
           "measured_fused_s": d["measured_s"], "measured_unfused_s": u.get("measured_s"),
           "speedup_measured": rec["speedup"]["measured"], "speedup_predicted": rec["speedup"]["predicted"],
           "fusion_passes": ",".join(rec["fusion_passes"])}
    flag = next((n for n in v if n.startswith("flags:")), None)
    if flag:
        f = v[flag]
        row.update(kernels_single_dots=f["kernels"], bytes_single_dots=f["bytes"],
                   predicted_single_dots_s=f["predicted_s"], measured_single_dots_s=f["measured_s"])
    return row


def write(out_dir: str, summary: dict) -> None:
    rows = summary["rows"]
    cols = ["case", "kernels_fused", "kernels_unfused", "bytes_fused", "bytes_unfused", "measured_fused_s",
            "measured_unfused_s", "predicted_fused_s", "predicted_unfused_s", "speedup_measured", "speedup_predicted"]
    md = [f"# Fusion study ({summary['time']}, {summary['compiler']})", "",
          "bytes: Σ kernel bytes in + out; times per run (median); speedup = unfused / fused.", "",
          markdown_table(rows, cols)]
    alt = [r for r in rows if r.get("kernels_single_dots") is not None]
    if alt:
        md += ["", "## YNNPACK limited to single dots (softmax in XLA's loop fusions)", "",
               markdown_table(alt, ["case", "kernels_fused", "kernels_single_dots", "bytes_fused", "bytes_single_dots",
                                    "measured_fused_s", "measured_single_dots_s", "predicted_fused_s",
                                    "predicted_single_dots_s"])]
    md += ["", "## Prediction error per fusion kind (default variant; (predicted − measured) / measured)", ""]
    md.append(markdown_table([{"case": c, "kind": k, **{kk: e.get(kk) for kk in ("kernels", "predicted_s",
                                                                              "measured_s", "error", "median_error")}}
                              for c, kinds in summary["errors_by_kind"].items() for k, e in kinds.items()],
                             ["case", "kind", "kernels", "predicted_s", "measured_s", "error", "median_error"]))
    md += ["", "## Fused kernels against their parts (the largest differences)", ""]
    trows = []
    for c, per in summary["tradeoffs"].items():
        for var, ts in per.items():
            for t in ts[:4]:
                trows.append({"case": c, "variant": var, "kernel": t["kernel"], "kind": t["kind"],
                              "parts": t["parts"], "bytes_fused": t["bytes_fused"], "bytes_parts": t["bytes_parts"],
                              "measured_fused_s": t["measured_fused_s"], "measured_parts_s": t["measured_parts_s"],
                              "fused_GFLOP/s": (t["fused_flops_per_s"] or 0) / 1e9 or None,
                              "parts_dot_GFLOP/s": (t["parts_dot_flops_per_s"] or 0) / 1e9 or None,
                              "fusion": t["fusion"]})
    md.append(markdown_table(trows, list(trows[0]) if trows else ["case"]))
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    fusion_study_chart(rows, os.path.join(out_dir, "fusion_study.png"),
                       title=f"fusion study: fused vs unfused ({summary['compiler']})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, four cases")
    ap.add_argument("--out", default=os.path.join("reports", "fusion_study"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", default=None, help="comma-separated case names")
    ap.add_argument("--replot", metavar="DIR", default=None)
    a = ap.parse_args(argv)
    if a.replot:
        with open(os.path.join(a.replot, "summary.json")) as f:
            write(a.replot, json.load(f))
        return 0
    if a.repeats < 1:
        raise SystemExit("fusion_study: error: --repeats must be >= 1")
    todo = cases(a.quick)
    if a.only:
        want = a.only.split(",")
        unknown = [w for w in want if w not in {n for n, *_ in todo}]
        if unknown:
            print(f"fusion_study: error: unknown case(s) {', '.join(unknown)}; choose from "
                  f"{', '.join(n for n, *_ in todo)}", file=sys.stderr)
            return 2
        todo = [c for c in todo if c[0] in want]
    os.makedirs(a.out, exist_ok=True)
    summary = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "quick": a.quick, "rows": [], "errors_by_kind": {}, "tradeoffs": {}, "compiler": None,
               "note": "measured on this host; a figure taken while other work ran is void (see docs/fusion.md)"}
    for name, build, flags in todo:
        print(f"fusion_study: {name}", file=sys.stderr, flush=True)
        try:
            res = fx.explore(build(), xla_flags=flags, repeats=a.repeats)
        except WorkbenchError as e:
            print(f"fusion_study: {name}: {e}", file=sys.stderr)
            continue
        rec = res.to_record()
        summary["compiler"] = rec["compiler"]
        summary["rows"].append(summarize(name, rec))
        summary["errors_by_kind"][name] = rec["prediction_error_by_kind"].get("default", {})
        summary["tradeoffs"][name] = rec["tradeoffs"]
        fusion_chart(rec, os.path.join(a.out, f"{name}.png"), title=rec["program"]["description"] or name)
        with open(os.path.join(a.out, "summary.json"), "w") as f:  # after every case: an interrupted run keeps
            json.dump(summary, f, indent=1, default=str)             # what it measured
    write(a.out, summary)
    print(os.path.join(a.out, "table.md"))
    return 0


if __name__ == "__main__":
    reexec_with_hugepages()
    sys.exit(main())
