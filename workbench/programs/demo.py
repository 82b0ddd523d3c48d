"""The headline study on this CPU: the built-in ops at a few sizes, measured and predicted on the calibrated host.

Prints a table; writes a report folder (README.md with the table, roofline.png, results.json). Under 3 minutes on a
2-core machine (calibration included the first time).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import statistics

from workbench.measure.calibrate import load_or_calibrate
from workbench.measure.device import local_spec
from workbench.programs.experiment import run_program, summary
from workbench.programs.ops import build
from workbench.results.console import print_table
from workbench.results.console import progress as bar
from workbench.results.figures import markdown_table, roofline_chart

# (op, sizes): small to large, spanning memory- and compute-bound
SUITE = [
    ("matmul", {"m": 256, "n": 256, "k": 256}),
    ("matmul", {"m": 1024, "n": 1024, "k": 1024}),
    ("matmul", {"m": 2048, "n": 2048, "k": 2048}),
    ("elementwise", {"n": 1 << 22}),
    ("elementwise", {"n": 1 << 26}),
    ("softmax", {"rows": 4096, "cols": 1024}),
    ("layernorm", {"rows": 4096, "cols": 1024}),
    ("attention", {"batch": 2, "heads": 8, "seq": 512, "head_dim": 64}),
]
TINY_SUITE = [("matmul", {"m": 128, "n": 128, "k": 128}), ("elementwise", {"n": 1 << 16}),
              ("softmax", {"rows": 64, "cols": 128}), ("layernorm", {"rows": 64, "cols": 128}),
              ("attention", {"batch": 1, "heads": 2, "seq": 64, "head_dim": 32})]


def run_suite(suite, *, dtype: str = "float32", target=None, repeats: int = 10, store=None,
              kind: str = "roofline-op", progress: bool = True, also_predict=()) -> list[dict]:
    """Run ops through the spine; return summary rows (one record each in the store)."""
    rows = []
    items = bar(suite, total=len(suite), desc="ops") if progress else suite
    for name, sizes in items:
        o = build(name, dtype, **sizes)
        run = target is None or target == "host" or not isinstance(target, str)
        rec = run_program(o.fn, o.args, kind=kind, target=target, run=run, repeats=repeats, also_predict=also_predict,
                          spec={"op": name, "sizes": o.sizes, "dtype": o.dtype, "description": o.description},
                          extra={"formula_flops": o.formula_flops, "formula_bytes": o.formula_bytes},
                          compute_dtype=o.dtype, store=store)
        s = summary(rec)
        s.update(op=name, sizes="×".join(str(v) for v in o.sizes.values()), label=f"{name} {o.sizes}")
        rows.append(s)
    return rows


def run_demo(out_dir: str | None = None, tiny: bool = False) -> dict:
    spec = local_spec()
    rows = run_suite(TINY_SUITE if tiny else SUITE, repeats=5 if tiny else 10)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = out_dir or os.path.join("reports", f"demo-{stamp}")
    os.makedirs(out_dir, exist_ok=True)
    for r in rows:  # the measurement's own spread: a miss inside it is the host's noise, not the model's
        m, iqr = r.get("measured_s"), r.get("measured_iqr_s")
        r["spread"] = iqr / m if (m and iqr is not None) else None
        r["within_spread"] = None if (r["spread"] is None or r.get("error") is None) else \
            ("yes" if r["error"] <= r["spread"] else "no")
    cols = ["op", "sizes", "flops", "bytes", "intensity", "bound", "predicted_s", "measured_s", "error", "spread",
            "within_spread"]
    print_table(rows, cols, title=f"Built-in ops on {spec.name} (predicted vs measured)")
    errs = [r["error"] for r in rows if r["error"] is not None]
    med = statistics.median(errs) if errs else None
    chart = roofline_chart(rows, spec, os.path.join(out_dir, "roofline.png"),
                           title="Built-in ops on this host: measured (filled) and predicted (hollow)")
    noisy = [r["op"] for r in rows if r.get("wide_spread")]
    stream_note = _stream_noise()
    if stream_note:
        print(stream_note)
    md = [f"# Workbench demo — {stamp}", "",
          f"Host: {' '.join(spec.notes[:1])}. Ceilings (measured by `workbench calibrate`): "
          + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in spec.peak_flops.items())
          + f"; stream {spec.hbm_bw / 1e9:.1f} GB/s; physical peaks "
          + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in (spec.measured.physical_peak_flops or {}).items()) + ".", "",
          markdown_table(rows, cols), "",
          f"Median prediction error |predicted − measured| / measured: {med:.1%}" if med is not None else "", "",
          "`spread` is each measurement's interquartile range over its median; `within_spread` says whether the "
          "prediction's miss lies inside it.", "",
          f"Noisy measurements (IQR > 25% of median): {', '.join(noisy)}" if noisy else "All measurements quiet.",
          stream_note,
          "", "![roofline](roofline.png)", ""]
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write("\n".join(md))
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(rows, f, indent=2, default=str)
    print(f"median prediction error {med:.1%}" if med is not None else "", f"report: {out_dir}/README.md, {chart}")
    return {"rows": rows, "median_error": med, "report": out_dir}


def _stream_noise() -> str:
    """A warning with the range when the calibration's memory stream samples spread over 15 % ('' otherwise)."""
    try:
        st = load_or_calibrate(run_if_missing=False).get("stream") or {}
    except Exception:  # noqa: BLE001 - no calibration (an accelerator): nothing to say
        return ""
    band, spread = st.get("range_bytes_per_s"), st.get("spread")
    if not band or spread is None or (spread <= 0.15 and st.get("stable", True)):
        return ""
    return (f"warning: the calibration's memory stream is noisy ({band[0] / 1e9:.1f}–{band[1] / 1e9:.1f} GB/s): "
            "memory-bound ops' predictions carry that band")
