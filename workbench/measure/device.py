"""An accelerator's own ceilings (a GPU or TPU that JAX runs on), measured through the one harness.

`workbench calibrate` on an accelerator host runs `calibrate_device` instead of the host calibration: in well under a
minute it times
  * an n³ matmul per dtype at a size that fills the chip (8192³: bfloat16, float8_e4m3fn with a bfloat16 result, and
    float32 at JAX's default precision, which XLA:GPU runs on the tensor cores as TF32), and the bfloat16 rate
    against size (1024³ … 4096³ as chains of matmuls inside one program, so that the per-call dispatch is not in
    it), which prices the smaller dots of a real program (matmul_rate);
  * a device-to-device stream (x·a + b over 2 GiB, donated: bytes read + bytes written);
  * the fixed cost of one more kernel in a program (two chains of tiny dependent kernels; the slope between them).
The figures are cached per device kind, driver (platform version), device count and jax version in
$WORKBENCH_CACHE_DIR (default ~/.cache/workbench). `calibrated_spec` lays them over the catalogue chip: the
catalogue stays the published ceiling, the calibrated spec is what this device reaches, and records carry a
prediction against each. The host calibration (workbench.measure.calibrate) never runs for accelerator programs.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time

from partitioning.mesh import make_mesh
from workbench import compat
from workbench.errors import WorkbenchError
from workbench.hardware.devices import device_info
from workbench.hardware.spec import HardwareSpec, Source, catalogue, resolve_name
from workbench.measure.calibrate import _say, cache_dir, get_spec, matmul_probe, measure_kernel_launch
from workbench.measure.harness import measure, measure_steps, random_inputs

DEVICE_CALIBRATION_VERSION = 2  # 2: the rate against size timed inside one program
MATMUL_DTYPES = (("bfloat16", "bfloat16"), ("float8_e4m3fn", "bfloat16"), ("float32", "float32"))  # (operands, result)
CURVE_SIZES = (1024, 2048, 4096)  # plus the ceiling's own size


def chip_for(device_kind: str, *, warn: bool = True) -> HardwareSpec | None:
    """The catalogue entry for a device kind as JAX reports it ("NVIDIA H200", "TPU v5 lite", ...; the aliases in
    workbench/hardware/catalogue.py), or None with a one-line warning naming --hardware."""
    try:
        return catalogue()[resolve_name(device_kind)]
    except (WorkbenchError, KeyError):
        if warn:
            print(f"workbench: warning: device kind {device_kind!r} is not in the catalogue: no MFU or prediction; "
                  "pass --hardware CHIP (see `workbench hw list`) to price it as a catalogue chip", file=sys.stderr)
        return None


def device_key() -> dict:
    """What a device calibration is valid for."""
    import jax

    info = device_info()
    return {"platform": info["platform"], "device_kind": info["device_kind"], "device_count": info["device_count"],
            "platform_version": info.get("platform_version"), "jax": jax.__version__,
            "version": DEVICE_CALIBRATION_VERSION}


def _cache_path(key: dict) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{key['device_kind']}-{key['platform_version'] or ''}-jax{key['jax']}")
    return os.path.join(cache_dir(), f"device-{slug.strip('-').lower()}-v{key['version']}.json")


def _matmul(n: int, dev, dtype: str, result: str, quick: bool) -> dict:
    c, x, y = matmul_probe(n, dev, dtype, result)
    m = measure(c, x, y, warmup=3, repeats=5 if quick else 10, min_total_s=0.0 if quick else 0.3)
    return {"n": n, "result_dtype": result, "flops_per_s": 2.0 * n**3 / m.median_s,
            "best_flops_per_s": 2.0 * n**3 / m.min_s, "spread": m.spread}


def _matmul_in_program(n: int, dev, quick: bool, chain: int = 16) -> float:
    """FLOP/s of an n³ bfloat16 matmul inside a program: a chain of `chain` dependent matmuls in one executable
    (x <- x @ w, rescaled so the values stay finite), timed whole and divided, so that the per-call dispatch of a
    program (tens of µs on a GPU, more than a 1024³ matmul takes) is not charged to the matmul, as it is not to the
    dots inside a training step."""
    import jax
    import jax.numpy as jnp

    a = jax.ShapeDtypeStruct((n, n), jnp.bfloat16)
    x, w = (jax.device_put(v, dev) for v in random_inputs((a, a), seed=2))
    scale = jnp.bfloat16(1.0 / n ** 0.5)

    def run(x, w):
        return jax.lax.fori_loop(0, chain, lambda i, x: (x @ w) * scale, x)

    c = jax.jit(run).lower(x, w).compile()
    m = measure(c, x, w, warmup=2, repeats=5 if quick else 10, min_total_s=0.0 if quick else 0.2)
    return 2.0 * n**3 * chain / m.median_s


def _stream(dev, nel: int, quick: bool) -> dict:
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda v: v * 1.0001 + 0.5, donate_argnums=0)
    box = {"x": jax.device_put(jnp.ones((nel,), jnp.float32), dev)}

    def step(i):
        box["x"] = f(box["x"])
        return box["x"]

    m = measure_steps(step, warmup=3, repeats=5 if quick else 20, guard=f)
    box.clear()
    return {"bytes": nel * 4, "bytes_per_s": 2.0 * nel * 4 / m.median_s, "spread": m.spread,
            "counted": "bytes read + bytes written (x*a + b, donated)"}


def _all_reduce(devices, quick: bool) -> dict:
    """An all-reduce over every device (psum in shard_map), at a size that fills the links (256 MiB per device) and
    at one float (its latency): the bus bandwidth per device in NCCL's convention, 2(n-1)/n x bytes / time, is what
    a ring all-reduce moves through each device's links; the latency per ring step is the small one's time over its
    2(n-1) steps."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(devices)
    mesh = make_mesh({"data": n}, devices=list(devices))
    out = {"devices": n}
    for label, per_device in (("large", (1 << 12) if quick else (1 << 26)), ("small", 1)):
        f = jax.jit(compat.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data"),
                                     out_specs=P("data")))
        x = jax.device_put(jnp.ones((n * per_device,), jnp.float32), NamedSharding(mesh, P("data")))
        m = measure(f.lower(x).compile(), x, warmup=2, repeats=5 if quick else 10)
        out[label] = {"bytes_per_device": per_device * 4, "seconds": m.median_s}
    steps = 2 * (n - 1)
    out["bus_bytes_per_s"] = steps / n * out["large"]["bytes_per_device"] / out["large"]["seconds"]
    out["latency_per_step_s"] = out["small"]["seconds"] / steps
    out["how"] = ("psum over all devices: bus bandwidth 2(n-1)/n x bytes per device / time (256 MiB per device); "
                  "latency: one float's all-reduce / its 2(n-1) ring steps")
    return out


def calibrate_device(*, quick: bool = False, quiet: bool = False) -> dict:
    """Measure the first device JAX runs on (see the module docstring); quick: small sizes (seconds; tests)."""
    import jax

    dev = jax.devices()[0]
    t0 = time.perf_counter()
    n = 256 if quick else 8192
    out = {"key": device_key(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "quick": quick,
           "matmul": {}, "findings": []}
    for dt, res in MATMUL_DTYPES:
        _say(f"calibrate: {dt} matmul {n}³ ({res} result) on {dev.device_kind}", quiet)
        try:
            out["matmul"][dt] = _matmul(n, dev, dt, res, quick)
        except Exception as e:  # noqa: BLE001 - a dtype the device or this jax cannot run: said, not guessed
            out["findings"].append(f"{dt} matmul did not run: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    curve = []
    for s in ((64, 128) if quick else CURVE_SIZES):
        _say(f"calibrate: bfloat16 matmul {s}³ inside a program (the rate against size)", quiet)
        curve.append((s, _matmul_in_program(s, dev, quick)))
    if "bfloat16" in out["matmul"]:
        curve.append((n, out["matmul"]["bfloat16"]["flops_per_s"]))
    out["matmul_curve_bfloat16"] = curve
    out["matmul_curve_how"] = ("chains of 16 dependent bfloat16 matmuls in one program, divided (no per-call "
                               "dispatch); the largest size is the ceiling's own timing")
    nel = (1 << 16) if quick else (1 << 29)  # 2 GiB of float32
    _say(f"calibrate: device stream over {nel * 4 / 2**30:.2g} GiB", quiet)
    out["stream"] = _stream(dev, nel, quick)
    _say("calibrate: per-kernel launch cost", quiet)
    out["kernel_launch"] = measure_kernel_launch(dev, reps=5 if quick else 9)
    if len(jax.devices()) > 1 and dev.platform != "cpu":  # simulated CPU devices have the host calibration's model
        _say(f"calibrate: all-reduce over {len(jax.devices())} devices", quiet)
        out["all_reduce"] = _all_reduce(jax.devices(), quick)
    chip = chip_for(dev.device_kind, warn=False)
    if chip is not None:
        out["catalogue_chip"] = chip.name
        out["vs_catalogue"] = {dt: v["flops_per_s"] / chip.peak(dt) for dt, v in out["matmul"].items()}
        out["vs_catalogue"]["stream"] = out["stream"]["bytes_per_s"] / chip.hbm_bw
        f32 = out["matmul"].get("float32")
        if f32 and chip.peak("float32") and f32["flops_per_s"] > 1.2 * chip.peak("float32"):
            out["findings"].append(
                f"float32 matmul ran at {f32['flops_per_s'] / 1e12:.0f} TFLOP/s, above the non-tensor float32 peak "
                f"({chip.peak('float32') / 1e12:.0f}): XLA ran it on the tensor cores (TF32 at JAX's default "
                "precision); the calibrated spec prices float32 dots at the measured rate")
    out["wall_s"] = time.perf_counter() - t0
    return out


def load_or_calibrate_device(*, force: bool = False, quick: bool = False, quiet: bool = False,
                             run_if_missing: bool = True) -> dict | None:
    """The cached calibration of this accelerator (matching device kind, driver, count and jax), measured when
    absent (run_if_missing) or forced; None when absent and not to be measured."""
    key = device_key()
    if key["platform"] == "cpu":
        raise WorkbenchError("calibrate_device is for accelerators; the host calibration is `workbench calibrate "
                             "--platform cpu`")
    path = _cache_path(key)
    if not force and os.path.exists(path):
        try:
            with open(path) as f:
                data = json.load(f)
            if data.get("key") == key and (quick or not data.get("quick")):
                data["cached"] = True
                return data
        except (OSError, ValueError):
            pass
    if not run_if_missing:
        return None
    data = calibrate_device(quick=quick, quiet=quiet)
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
    data.update(cached=False, path=path)
    return data


def calibrated_spec(spec: HardwareSpec, cal: dict) -> HardwareSpec:
    """`spec` (the catalogue chip) with this device's measured ceilings laid over it: the matmul rate per dtype
    measured, the bfloat16 rate against size, the stream bandwidth, the per-kernel launch cost and, where several
    devices were measured, the all-reduce's bus bandwidth and latency as the interconnect's."""
    peaks = dict(spec.peak_flops)
    for dt, v in cal.get("matmul", {}).items():
        peaks[dt] = v["flops_per_s"]
    src = Source(f"measured on this device ({cal['key']['device_kind']}, {cal['key'].get('platform_version')}) "
                 "by workbench calibrate", cal.get("time", "")[:10])
    curve = tuple((float(n), float(r)) for n, r in cal.get("matmul_curve_bfloat16") or ())
    ic = spec.interconnect
    ar = cal.get("all_reduce")
    if ar and ic.links:  # the measured bus bandwidth spread over the chip's links, the ring step's latency
        ic = dataclasses.replace(ic, link_bw=ar["bus_bytes_per_s"] / ic.links, latency_s=ar["latency_per_step_s"])
    return dataclasses.replace(
        spec, name=f"{spec.name}-calibrated", peak_flops=peaks, hbm_bw=cal["stream"]["bytes_per_s"], interconnect=ic,
        sources={**spec.sources, "peak_flops": src, "hbm_bw": src}).with_measured(
        kernel_launch_s=(cal.get("kernel_launch") or {}).get("per_kernel_s"),
        matmul_curves=(("bfloat16", curve),) if curve else None)


def local_spec(hardware: str | None = None) -> HardwareSpec | None:
    """The spec programs are priced with where they run: on a CPU the calibrated host (its own calibration); on an
    accelerator the catalogue chip its device kind names (or `hardware`, a catalogue name). None for an unknown
    accelerator (warned)."""
    import jax

    dev = jax.devices()[0]
    if hardware is not None:
        return get_spec(hardware)
    if dev.platform == "cpu":
        return get_spec("host")
    return chip_for(dev.device_kind)


def with_device_calibration(spec: HardwareSpec) -> HardwareSpec | None:
    """`spec` with the cached calibration of the accelerator programs run on laid over it (calibrated_spec); None on
    a CPU or where this device has not been calibrated. Never measures."""
    import jax

    if jax.devices()[0].platform == "cpu":
        return None
    cal = load_or_calibrate_device(run_if_missing=False)
    return calibrated_spec(spec, cal) if cal else None
