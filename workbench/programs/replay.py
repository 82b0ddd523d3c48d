"""Replay a stored host: predict its measured ops from its stored calibration, here, without its hardware.

A host folder (tests/data/hosts/<class>-<date>/) holds the files the workbench wrote on that host, unedited:
`calibration.json` (the cached calibration), `demo-results*.json` (`workbench demo`'s results.json: each op's label,
predicted_s, measured_s) and optionally `prediction-error.json` (`python -m benchmarks.prediction_error`'s report).
Every op is rebuilt from its label or config (workbench.programs.ops.program), compiled on this machine, priced by
`spec_from_calibration(stored calibration)` and compared with the stored measured_s: a change to the host model is
checked against every CPU class the project has met, not only the one it runs on. Compiling reads no timing of
this machine; the optimized HLO is XLA:CPU's for the same JAX version.
"""
from __future__ import annotations

import ast
import dataclasses
import glob
import json
import os
import statistics
import sys

from workbench.cost.compile import compile_program
from workbench.hardware.spec import HardwareSpec
from workbench.measure.calibrate import spec_from_calibration
from workbench.programs.ops import program
from workbench.roofline.prediction import predict

HOSTS_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "hosts")


@dataclasses.dataclass(frozen=True)
class ReplayRow:
    source: str  # 'demo' (with the file's name) | 'prediction-error'
    name: str
    builder: str
    sizes: dict
    dtype: str
    in_sample: bool
    predicted_s: float  # replayed here from the stored calibration
    predicted_s_stored: float | None  # what the host itself predicted
    measured_s: float

    @property
    def error(self) -> float:
        return abs(self.predicted_s - self.measured_s) / self.measured_s

    @property
    def signed_error(self) -> float:
        return self.predicted_s / self.measured_s - 1

    @property
    def error_stored(self) -> float | None:
        if self.predicted_s_stored is None:
            return None
        return abs(self.predicted_s_stored - self.measured_s) / self.measured_s


def host_folders(root: str = HOSTS_DIR) -> list[str]:
    """The stored host folders (each with a calibration.json), sorted by name."""
    return sorted(os.path.dirname(p) for p in glob.glob(os.path.join(root, "*", "calibration.json")))


def stored_spec(folder: str) -> HardwareSpec:
    with open(os.path.join(folder, "calibration.json")) as f:
        return spec_from_calibration(json.load(f))


def parse_label(label: str) -> tuple[str, dict]:
    """('softmax', {'rows': 4096, 'cols': 1024}) from a demo row's label "softmax {'rows': 4096, 'cols': 1024}"."""
    name, _, rest = label.partition(" ")
    return name, ast.literal_eval(rest)


_PRICED: dict[tuple, tuple] = {}


def predict_op(builder: str, sizes: dict, dtype: str, spec: HardwareSpec) -> float:
    """Seconds per call of one op on `spec`: compiled here from abstract inputs (nothing is run), priced by
    workbench.roofline.prediction.predict as the demo and the error benchmark price it. Compiles are cached per op
    and spec within the process."""
    key = (builder, tuple(sorted(sizes.items())), dtype, id(spec))
    hit = _PRICED.get(key)
    if hit is None or hit[0] is not spec:  # the entry holds its spec, so a spec's id is never reused while cached
        fn, args = program(builder, sizes, dtype)
        comp = compile_program(fn, *args, compute_dtype=dtype, analytic=False)
        hit = _PRICED[key] = (spec, predict(comp.cost, spec).predicted_s)
    return hit[1]


def replay(folder: str, *, skip=lambda builder, sizes, dtype: False) -> list[ReplayRow]:
    """Every stored op of a host folder, predicted here from its stored calibration. `skip(builder, sizes, dtype)`
    leaves an op out (a test keeps its compiles small)."""
    spec = stored_spec(folder)
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "demo-results*.json"))):
        with open(path) as f:
            demo = json.load(f)
        for r in demo:
            if r.get("measured_s") is None:
                continue
            builder, sizes = parse_label(r["label"])
            dtype = r.get("dtype") or "float32"
            if skip(builder, sizes, dtype):
                continue
            rows.append(ReplayRow(f"demo:{os.path.basename(path)}", r["label"], builder, sizes, dtype, False,
                                  predict_op(builder, sizes, dtype, spec), r.get("predicted_s"), r["measured_s"]))
    pe_path = os.path.join(folder, "prediction-error.json")
    if os.path.exists(pe_path):
        with open(pe_path) as f:
            pe = json.load(f)
        for o in pe.get("ops", []):
            c = o["config"]
            if o.get("measured_s") is None or skip(c["op"], c["sizes"], c["dtype"]):
                continue
            rows.append(ReplayRow("prediction-error", o["name"], c["op"], c["sizes"], c["dtype"],
                                  bool(o.get("in_sample")), predict_op(c["op"], c["sizes"], c["dtype"], spec),
                                  o.get("predicted_s"), o["measured_s"]))
    return rows


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _largest_error_against_fastest(demo: list[ReplayRow]) -> float | None:
    """The largest error of a demo op against its fastest stored timing: a disturbance only adds time, so an op
    every run of which is far from its prediction is a miss of the model, one slow timing among fast ones is the
    machine's (a 2-vCPU VM's stream samples spread 28-39 GB/s within one calibration)."""
    fastest: dict[tuple, ReplayRow] = {}
    for r in demo:
        key = (r.builder, json.dumps(r.sizes, sort_keys=True), r.dtype)
        if key not in fastest or r.measured_s < fastest[key].measured_s:
            fastest[key] = r
    return max((r.error for r in fastest.values()), default=None)


def summarize(rows: list[ReplayRow]) -> dict:
    """The figures docs/accuracy.md's host table gives: the demo ops' median and largest error over every demo file
    (and the largest against each op's fastest timing), the error benchmark's held-out ops' median, each replayed
    here and as the host stored them."""
    demo = [r for r in rows if r.source.startswith("demo")]
    held = [r for r in rows if r.source == "prediction-error" and not r.in_sample]
    return {"demo_median": _median(r.error for r in demo), "demo_max": max((r.error for r in demo), default=None),
            "demo_max_fastest": _largest_error_against_fastest(demo),
            "heldout_median": _median(r.error for r in held),
            "demo_median_stored": _median(r.error_stored for r in demo),
            "demo_max_stored": max((r.error_stored for r in demo if r.error_stored is not None), default=None),
            "heldout_median_stored": _median(r.error_stored for r in held),
            "demo_rows": len(demo), "heldout_rows": len(held)}


def main(argv=None) -> None:
    """python -m workbench.programs.replay [FOLDER ...]: every stored host's rows and medians."""
    folders = (argv if argv is not None else sys.argv[1:]) or host_folders()
    for folder in folders:
        rows = replay(folder)
        print(f"{os.path.basename(os.path.normpath(folder))}")
        for r in rows:
            stored = f"{r.predicted_s_stored:.4g}" if r.predicted_s_stored is not None else "-"
            print(f"  {r.source[:22]:22s} {r.name[:44]:44s} replayed {r.predicted_s:.4g}  stored {stored}  measured "
                  f"{r.measured_s:.4g}  {r.signed_error:+.0%}")
        s = summarize(rows)
        fmt = lambda x: f"{x:.1%}" if x is not None else "n/a"  # noqa: E731
        print(f"  demo median {fmt(s['demo_median'])} (stored {fmt(s['demo_median_stored'])}), largest "
              f"{fmt(s['demo_max'])} (stored {fmt(s['demo_max_stored'])}; against each op's fastest timing "
              f"{fmt(s['demo_max_fastest'])}); held-out ops median "
              f"{fmt(s['heldout_median'])} (stored {fmt(s['heldout_median_stored'])})")


if __name__ == "__main__":
    main()
