"""One call through the whole spine: compile → CostReport → Prediction → Measurement (local only) → Record."""
from __future__ import annotations

import math
from typing import Callable

import jax

from workbench.cost.compile import compile_program
from workbench.errors import WorkbenchError
from workbench.hardware.hostmem import check_fits
from workbench.hardware.spec import HardwareSpec
from workbench.measure.calibrate import get_spec
from workbench.measure.device import local_spec, with_device_calibration
from workbench.measure.harness import measure, random_inputs
from workbench.results.store import Store, make_record
from workbench.roofline.prediction import predict

FIX = "use smaller sizes, or --target CHIP to predict without running"


def run_program(fn: Callable, args: tuple, *, kind: str, spec: dict, target=None,
                run: bool = True, repeats: int = 10, warmup: int = 2, seed: int = 0, store=None,
                extra: dict | None = None, compute_dtype: str | None = None, also_predict=()) -> dict:
    """Compile fn for abstract `args`; predict on `target` (a name or HardwareSpec; default: where it runs, the
    calibrated host or the accelerator's catalogue chip: workbench.measure.device.local_spec);
    when run=True and the devices are local (the host, or a GPU/TPU host running this), measure on random inputs;
    predictions for `also_predict` specs go into extra; append the record to the store and return it."""
    arg_bytes = sum(math.prod(a.shape) * a.dtype.itemsize for a in args)

    local = target is None or target == "host" or isinstance(target, HardwareSpec)
    if local and run and not isinstance(target, HardwareSpec):
        check_fits(arg_bytes, spec.get("op", "program"), FIX)
    comp = compile_program(fn, *args, compute_dtype=compute_dtype)
    cost = comp.cost
    if local and run and not isinstance(target, HardwareSpec):
        check_fits(cost.peak_memory_bytes, spec.get("op", "program"), FIX)
    hw = target if isinstance(target, HardwareSpec) else (get_spec(target) if target else local_spec())
    if hw is None:  # an accelerator the catalogue does not know (warned): pass --target CHIP to price it
        raise WorkbenchError(f"no spec to price this program on {jax.devices()[0].device_kind!r}; pass --target CHIP")
    pred = predict(cost, hw)
    cal_spec = with_device_calibration(hw) if target is None else None  # an accelerator's own ceilings too
    if cal_spec is not None and all(o.name != cal_spec.name for o in also_predict):
        also_predict = (*also_predict, cal_spec)
    extra = dict(extra or {})
    for other in also_predict:
        extra.setdefault("predictions", {})[other.name] = predict(cost, other).to_dict()
    meas = None
    if local and run:
        concrete = random_inputs(args, seed=seed)
        meas = measure(comp.compiled, *concrete, warmup=warmup, repeats=repeats, compile_s=comp.compile_s)
    rec = make_record(kind, dict(spec, target=hw.name), cost, pred, meas,
                      extra=dict(extra or {}, compile_s=comp.compile_s, lower_s=comp.lower_s), seed=seed)
    (store or Store()).append(rec)
    return rec


def summary(rec: dict) -> dict:
    """The flat view CLI commands print: flops, bytes, intensity, bound, predicted_s, measured_s, target, error."""
    c, p, m = rec["costs"], rec["prediction"], rec.get("measurement")
    meas = m["median_s"] if m else None
    pred = p["predicted_s"]
    return {
        "target": p["target"], "flops": c["flops"], "bytes": c["bytes_accessed"], "transcendentals": c["transcendentals"],
        "analytic_flops": (c.get("analytic") or {}).get("flops"), "hlo_flops": c["hlo_flops"],
        "intensity": p["intensity"], "ridge": p["ridge"], "bound": p["bound"],
        "compute_s": p["compute_s"], "memory_s": p["memory_s"], "comm_s": p["comm_s"],
        "predicted_s": pred, "predicted_serial_s": p["predicted_serial_s"], "measured_s": meas,
        "measured_iqr_s": m["iqr_s"] if m else None, "measured_min_s": m["min_s"] if m else None,
        "wide_spread": m["wide_spread"] if m else None,
        "error": abs(pred - meas) / meas if meas else None,
        "achieved_flops_per_s": c["flops"] / meas if meas else None,
        "peak_memory_bytes": c["memory"]["peak_bytes"], "record_id": rec["id"], "notes": p["notes"],
        "predicted_s_calibrated": next((v["predicted_s"] for k, v in (rec["extra"].get("predictions") or {}).items()
                                        if k.endswith("-calibrated")), None),
    }
