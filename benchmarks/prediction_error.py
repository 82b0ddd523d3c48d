"""Prediction error of the host roofline for the built-in ops at several sizes.

    python -m benchmarks.prediction_error [--quick] [--json]

Measures the host's ceilings (a fresh calibration) and the programs in the same run, then a second calibration at
the end to show how much the machine drifted meanwhile; prints |predicted − measured| / measured per op and the
medians (targets: ≤ 25% over all ops, ≤ 10% for large matmuls). Records land in the results store (kind
'prediction-error').
"""
from __future__ import annotations

import argparse
import json
import statistics

from workbench.hardware.devices import request_devices
from workbench.measure.calibrate import load_or_calibrate
from workbench.programs.demo import run_suite
from workbench.results.console import print_table

SIZES = [
    ("matmul", {"m": 512, "n": 512, "k": 512}),
    ("matmul", {"m": 1024, "n": 1024, "k": 1024}),
    ("matmul", {"m": 2048, "n": 2048, "k": 2048}),
    ("matmul", {"m": 4096, "n": 4096, "k": 4096}),
    ("matmul", {"m": 4096, "n": 1024, "k": 4096}),
    ("elementwise", {"n": 1 << 20}),
    ("elementwise", {"n": 1 << 24}),
    ("elementwise", {"n": 1 << 26}),
    ("softmax", {"rows": 1024, "cols": 1024}),
    ("softmax", {"rows": 8192, "cols": 2048}),
    ("layernorm", {"rows": 1024, "cols": 1024}),
    ("layernorm", {"rows": 8192, "cols": 2048}),
    ("attention", {"batch": 2, "heads": 8, "seq": 256, "head_dim": 64}),
    ("attention", {"batch": 4, "heads": 8, "seq": 1024, "head_dim": 64}),
]
QUICK = [("matmul", {"m": 256, "n": 256, "k": 256}), ("elementwise", {"n": 1 << 18}),
         ("softmax", {"rows": 256, "cols": 256})]
LARGE_MATMUL_FLOPS = 2 * 2048**3


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    request_devices(None)
    before = load_or_calibrate(force=True, quick=args.quick)
    rows = run_suite(QUICK if args.quick else SIZES, kind="prediction-error")
    after = load_or_calibrate(force=True, quick=args.quick)
    drift = {
        "matmul_float32": after["matmul"]["float32"]["flops_per_s"] / before["matmul"]["float32"]["flops_per_s"] - 1,
        "stream": after["stream"]["bytes_per_s"] / before["stream"]["bytes_per_s"] - 1,
    }
    errs = [r["error"] for r in rows]
    large = [r["error"] for r in rows if r["op"] == "matmul" and r["flops"] >= LARGE_MATMUL_FLOPS]
    out = {
        "median_error": statistics.median(errs),
        "median_error_large_matmul": statistics.median(large) if large else None,
        "max_error": max(errs), "n_ops": len(rows), "noisy_ops": sum(1 for r in rows if r["wide_spread"]),
        "ceiling_drift_during_run": drift,
        "rows": [{k: r[k] for k in ("op", "sizes", "bound", "intensity", "predicted_s", "measured_s",
                                    "measured_iqr_s", "error", "wide_spread")} for r in rows],
    }
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        print_table(out["rows"], title="Prediction error on this host")
        print(f"median error {out['median_error']:.1%} over {len(rows)} ops; large matmuls "
              f"{out['median_error_large_matmul']:.1%}" if large else f"median error {out['median_error']:.1%}")
        print(f"ceiling drift between the calibrations bracketing the run: matmul {drift['matmul_float32']:+.1%}, "
              f"stream {drift['stream']:+.1%}; {out['noisy_ops']} ops with a wide spread")
    return out


if __name__ == "__main__":
    from workbench.hardware.hostmem import reexec_with_hugepages

    reexec_with_hugepages()  # before JAX starts: huge pages for XLA:CPU buffers (workbench/hostmem.py)
    main()
