"""Host calibration: what XLA achieves on this machine, beside what its cores could do on paper.

Measured (through the one harness, workbench.measure.harness; median and IQR over repeats):
- matmul FLOP/s through XLA (square n³, random inputs) for float32, bfloat16, float16 and the fp8 formats, each
  narrow dtype with a float32 result (preferred_element_type) and a narrow one: the faster form is the ceiling, the
  slower one a line in `findings`;
- streaming memory bandwidth: y = a·x + b over buffers far larger than the last-level cache, counting bytes read +
  written;
- special-function throughput (exp, tanh, log) through XLA: a chain of 2 dependent applications on an
  in-cache array, results/s — on CPUs these bound many elementwise fusions before memory does.
Derived (physical peak per dtype) from CPU features, documented in docs/hardware.md:
    cores × SIMD lanes (avx512f: 16 f32, avx2: 8) × FMA pipes × 2 FLOP/FMA × clock
    bfloat16: ×2 with avx512_bf16 (VDPBF16PS: two bf16 products per f32 lane); AMX (amx_bf16): 1024 FLOP/cycle/core
Overrides: WORKBENCH_HOST_CLOCK_GHZ, WORKBENCH_HOST_FMA_PIPES, WORKBENCH_HOST_PEAK_<DTYPE> (FLOP/s).
Cached per host fingerprint (CPU model, flags, cores, memory, jax version) in $WORKBENCH_CACHE_DIR
(default ~/.cache/workbench); `workbench calibrate --force` re-measures.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import sys
from typing import Any

from workbench.errors import WorkbenchError
from workbench.hardware.hostmem import describe
from workbench.hardware.spec import HardwareSpec, Interconnect, Source, resolve_name
from workbench.hardware.spec import get_spec as catalogue_spec
from workbench.measure.harness import measure, measure_steps, random_inputs, summarize

CALIBRATION_VERSION = 8


def cache_dir() -> str:
    return os.environ.get("WORKBENCH_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "workbench"))


def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if ":" in line:
                    k, v = line.split(":", 1)
                    info.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    return info


def _meminfo_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _llc_bytes() -> int:
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for idx in os.listdir(base):
            try:
                with open(os.path.join(base, idx, "size")) as f:
                    s = f.read().strip()
                mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(s[-1], 1)
                best = max(best, int(s.rstrip("KMG")) * mult)
            except (OSError, ValueError):
                continue
    except OSError:
        pass
    return best


def cpu_features() -> dict[str, Any]:
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"model": info.get("model name", "unknown"), "vendor": info.get("vendor_id", ""),
            "family": int(info.get("cpu family", "0") or 0), "mhz": float(info.get("cpu MHz", "0") or 0),
            "cores": cores, "flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse4"))),
            "llc_bytes": _llc_bytes(), "mem_bytes": _meminfo_bytes()}


def fma_pipes(feat: dict) -> tuple[int, str]:
    """FMA pipes of the vector width used, per core, with the reason (not readable from cpuid)."""
    env = os.environ.get("WORKBENCH_HOST_FMA_PIPES")
    if env:
        return int(env), "WORKBENCH_HOST_FMA_PIPES override"
    v, fam = feat["vendor"], feat["family"]
    if v == "AuthenticAMD":
        if fam >= 26:
            return 2, "AMD Zen 5 (family 1Ah): two 512-bit FMA pipes (AMD Zen 5 software optimization guide)"
        if fam == 25:
            return 1, "AMD Zen 4 (family 19h): AVX-512 executes as 2×256-bit, i.e. one 512-bit FMA per cycle"
        return 2, "AMD Zen 2/3: two 256-bit FMA pipes"
    if v == "GenuineIntel":
        return 2, "Intel server cores with AVX-512: two FMA ports (ports 0 and 5)"
    return 1, "unknown vendor: one FMA pipe assumed"


def physical_peaks(feat: dict, measured_f32: float | None = None) -> dict[str, Any]:
    """Peak FLOP/s from CPU features with the derivation written out.

    The OS often reports only the nominal clock (no cpufreq in a VM). When a measured float32 matmul exceeds the
    peak at that clock, the cores must be running faster (boost): the clock is then raised to the one the
    measurement implies (rounded up to 0.05 GHz), and the derivation says so."""
    flags = set(feat["flags"])
    env_clock = os.environ.get("WORKBENCH_HOST_CLOCK_GHZ")
    ghz = float(env_clock or 0) or feat["mhz"] / 1000.0
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags or "avx" in flags else 4
    pipes, why = fma_pipes(feat)
    clock_source = ("WORKBENCH_HOST_CLOCK_GHZ" if env_clock
                    else "/proc/cpuinfo 'cpu MHz' (the clock the OS reports; boost clocks may be higher)")
    per_cycle = feat["cores"] * lanes * pipes * 2
    if measured_f32 and not env_clock and measured_f32 > per_cycle * ghz * 1e9:
        implied = math.ceil(measured_f32 / (per_cycle * 1e9) / 0.05) * 0.05
        clock_source = (f"implied by the measured float32 matmul ({measured_f32 / 1e9:.0f} GFLOP/s exceeds the peak at "
                        f"the reported {ghz:.2f} GHz, so the cores boost): {implied:.2f} GHz")
        ghz = implied
    f32 = feat["cores"] * lanes * pipes * 2 * ghz * 1e9
    bf16_per_cycle = lanes * pipes * 2 * (2 if "avx512_bf16" in flags else 1)
    bf16_src = "avx512_bf16 VDPBF16PS (2 bf16 products per f32 lane)" if "avx512_bf16" in flags else "as float32"
    if "amx_bf16" in flags:
        bf16_per_cycle = 1024
        bf16_src = "AMX-BF16 tile multiply: 1024 FLOP/cycle/core (Intel optimization manual)"
    bf16 = feat["cores"] * bf16_per_cycle * ghz * 1e9
    peaks = {"float32": f32, "bfloat16": bf16}
    for dt in list(peaks):
        o = os.environ.get(f"WORKBENCH_HOST_PEAK_{dt.upper()}")
        if o:
            peaks[dt] = float(o)
    return {"peak_flops": peaks, "derivation": {
        "cores": feat["cores"], "clock_ghz": ghz, "f32_lanes": lanes, "fma_pipes": pipes, "fma_pipes_why": why,
        "float32": f"{feat['cores']} cores × {lanes} lanes × {pipes} FMA pipes × 2 × {ghz:.3f} GHz",
        "bfloat16": f"{feat['cores']} cores × {bf16_per_cycle} FLOP/cycle ({bf16_src}) × {ghz:.3f} GHz",
        "clock_source": clock_source}}


def fingerprint(feat: dict) -> str:
    import jax


    key = json.dumps({"model": feat["model"], "flags": feat["flags"], "cores": feat["cores"],
                      "mem": feat["mem_bytes"], "jax": jax.__version__, "v": CALIBRATION_VERSION,
                      "allocator": describe()}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _cache_path(fp: str) -> str:
    return os.path.join(cache_dir(), f"host-{fp}.json")


def _say(msg: str, quiet: bool):
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


# operand dtype -> the result dtypes its dot is measured with. XLA:CPU has two forms of a narrow-float dot: the result
# in the operand dtype, or float32 accumulation and result (preferred_element_type=float32); on a Zen 5 host with
# avx512_bf16 the bf16 forms ran at 321 and 865-903 GFLOP/s (docs/hardware.md). fp8 dots are measured with float32 and
# bfloat16 results (models/quant.py's form and the narrow one); an fp8 result is not a form any policy uses.
MATMUL_FORMS: dict[str, tuple[str, ...]] = {
    "float32": ("float32",),
    "bfloat16": ("float32", "bfloat16"),
    "float16": ("float32", "float16"),
    "float8_e4m3fn": ("float32", "bfloat16"),
    "float8_e5m2": ("float32", "bfloat16"),
}


def bf16_isa(flags) -> str:
    """What this CPU multiplies bfloat16 with: 'amx_bf16' (tile multiply), 'avx512_bf16' (VDPBF16PS dot products into
    float32 lanes) or 'none' (no bf16 arithmetic: operands are widened to float32 before float32 FMAs)."""
    f = set(flags)
    return "amx_bf16" if "amx_bf16" in f else "avx512_bf16" if "avx512_bf16" in f else "none"


def matmul_ceilings(n: int, reps: int, dev, feat: dict, *, quiet: bool = False) -> tuple[dict, list[str]]:
    """Square n³ matmuls through XLA for every dtype and result form of MATMUL_FORMS (random inputs, the one harness).

    Returns ({dtype: the fastest form's figures (flops_per_s: median, flops_per_s_best, iqr, spread), 'result_dtype'
    (that form), 'forms' {result dtype: figures, or {'error': ...} where XLA cannot compile it}}, findings: one line
    per dtype naming the slow form and how much slower it ran, and where a narrow dtype's ceiling falls below
    float32's)."""
    import jax
    import jax.numpy as jnp

    isa = bf16_isa(feat.get("flags", ()))
    mm: dict[str, Any] = {}
    findings: list[str] = []
    fl = 2.0 * n**3
    for dt, results in MATMUL_FORMS.items():
        a = jax.ShapeDtypeStruct((n, n), jnp.dtype(dt))
        x, y = random_inputs((a, a), seed=1)
        x, y = jax.device_put(x, dev), jax.device_put(y, dev)
        forms: dict[str, dict] = {}
        compiled = {}
        for rt in results:
            f = jax.jit(lambda p, q, rt=jnp.dtype(rt): jax.lax.dot(p, q, preferred_element_type=rt))
            try:
                compiled[rt] = f.lower(x, y).compile()
            except Exception as e:  # noqa: BLE001 - an unsupported form is a finding, not a failed calibration
                forms[rt] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        # the forms alternate in rounds, so a drift in the machine's load reaches every form alike
        rounds = 3 if len(compiled) > 1 else 1
        times: dict[str, list[float]] = {rt: [] for rt in compiled}
        for r in range(rounds):
            for rt, c in compiled.items():
                _say(f"calibrate: {dt} matmul {n}³ through XLA, {rt} result"
                     + (f" (round {r + 1}/{rounds})" if rounds > 1 else ""), quiet)
                times[rt] += measure(c, x, y, warmup=2 if r == 0 else 1, repeats=math.ceil(reps / rounds)).times_s
        for rt, ts in times.items():
            m = summarize(ts, warmup=2, calls=1, compile_s=None)
            forms[rt] = {"n": n, "result_dtype": rt, "flops_per_s": fl / m.median_s,
                         "flops_per_s_iqr": fl * m.iqr_s / m.median_s**2, "flops_per_s_best": fl / m.min_s,
                         "spread": m.spread, "wide_spread": m.wide_spread, "rounds": rounds}
        ok = {rt: v for rt, v in forms.items() if "flops_per_s" in v}
        for rt, v in forms.items():
            if "error" in v:
                findings.append(f"XLA:CPU cannot run a {dt} matmul with a {rt} result here ({v['error']})")
        if not ok:
            continue
        best_rt = max(ok, key=lambda r: ok[r]["flops_per_s"])
        mm[dt] = dict(ok[best_rt], forms=forms)
        for rt, v in ok.items():
            if rt != best_rt:
                b = ok[best_rt]["flops_per_s"]
                findings.append(
                    f"XLA:CPU {dt} matmul {n}³ ran {b / v['flops_per_s']:.2f}× faster with a {best_rt} result "
                    f"({b / 1e9:.0f} GFLOP/s) than with a {rt} result ({v['flops_per_s'] / 1e9:.0f}); the {best_rt}-"
                    f"result form is the {dt} ceiling (CPU bf16 arithmetic: {isa})")
    f32 = mm.get("float32", {}).get("flops_per_s")
    for dt, v in mm.items():
        if dt != "float32" and f32:
            r = v["flops_per_s"] / f32
            findings.append(f"XLA:CPU {dt} ceiling is {r:.2f}× float32's ({v['flops_per_s'] / 1e9:.0f} vs "
                            f"{f32 / 1e9:.0f} GFLOP/s, {v['result_dtype']} result; CPU bf16 arithmetic: {isa})")
    return mm, findings


def run_calibration(*, quick: bool = False, quiet: bool = False) -> dict:
    """Measure the host's ceilings (about 10–30 s; quick=True uses small sizes, for tests)."""
    import jax
    import jax.numpy as jnp

    feat = cpu_features()
    reps = 5 if quick else 9
    out: dict[str, Any] = {"cpu": feat, "physical": physical_peaks(feat), "quick": quick,
                           "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                           "jax": jax.__version__, "backend": jax.default_backend(),
                           "devices": len(jax.devices())}
    dev = jax.devices()[0]
    # matmuls: every operand dtype in each result form XLA:CPU compiles; the fastest form is the dtype's ceiling
    n = 512 if quick else 2048
    mm, findings = matmul_ceilings(n, reps, dev, feat, quiet=quiet)
    out["matmul"] = mm
    out.setdefault("findings", []).extend(findings)
    # achievable float32 matmul rate against problem size: small and skinny matmuls run far from the peak
    curve = []
    for cn in ((128, 256, 512) if quick else (128, 256, 512, 1024, 4096)):
        _say(f"calibrate: float32 matmul {cn}³ (rate against size)", quiet)
        a = jax.ShapeDtypeStruct((cn, cn), jnp.float32)
        x, y = random_inputs((a, a), seed=5)
        c = jax.jit(lambda p, q: p @ q).lower(x, y).compile()
        m = measure(c, x, y, warmup=2, repeats=reps)
        curve.append({"n": cn, "flops_per_s": 2.0 * cn**3 / m.median_s, "spread": m.spread})
    curve.append({"n": mm["float32"]["n"], "flops_per_s": mm["float32"]["flops_per_s"],
                  "spread": mm["float32"]["spread"]})
    out["matmul_curve"] = sorted(curve, key=lambda r: r["n"])
    out["physical"] = physical_peaks(feat, measured_f32=mm["float32"]["flops_per_s_best"])
    # streaming bandwidth, buffers far larger than the last-level cache
    llc = feat["llc_bytes"] or 32 * 2**20
    nbytes = (64 * 2**20) if quick else int(min(max(512 * 2**20, 16 * llc), max(feat["mem_bytes"] // 8, 64 * 2**20)))
    nel = nbytes // 4
    _say(f"calibrate: streaming bandwidth over {nbytes / 2**20:.0f} MiB buffers (LLC {llc / 2**20:.0f} MiB)", quiet)
    # the output reuses the input buffer (donation): fresh large allocations would add page-fault time, which is
    # measured apart below as the first-touch rate
    sf = jax.jit(lambda x: x * 1.0001 + 0.5, donate_argnums=0)
    state = {"x": jax.device_put(jax.random.normal(jax.random.key(2), (nel,), jnp.float32), dev)}

    def step(i):
        state["x"] = sf(state["x"])
        return state["x"]

    m = measure_steps(step, warmup=2, repeats=reps, guard=sf)
    traffic = 2.0 * nel * 4
    out["stream"] = {"buffer_bytes": nel * 4, "bytes_per_s": traffic / m.median_s,
                     "bytes_per_s_iqr": traffic * m.iqr_s / m.median_s**2, "bytes_per_s_best": traffic / m.min_s,
                     "counted": "bytes read + bytes written", "spread": m.spread}
    # the same kernel over a buffer that stays in the last-level cache
    nel_c = max(llc // 4 // 4, 1 << 14)
    state_c = {"x": jax.device_put(jax.random.normal(jax.random.key(4), (nel_c,), jnp.float32), dev)}

    def step_c(i):
        state_c["x"] = sf(state_c["x"])
        return state_c["x"]

    _say(f"calibrate: in-cache bandwidth over {nel_c * 4 / 2**20:.0f} MiB", quiet)
    mc = measure_steps(step_c, warmup=3, repeats=reps, guard=sf)
    out["cache_stream"] = {"buffer_bytes": nel_c * 4, "bytes_per_s": 2.0 * nel_c * 4 / mc.median_s,
                           "spread": mc.spread, "counted": "bytes read + bytes written"}
    state_c.clear()
    _say("calibrate: first-touch cost of fresh large outputs (same kernel, new output buffer each call)", quiet)
    xs = state.pop("x")
    fresh = jax.jit(lambda x: x * 1.0001 + 0.5).lower(xs).compile()
    mf = measure(fresh, xs, warmup=1, repeats=max(3, reps // 2))
    extra = max(mf.median_s - m.median_s, 1e-9)
    out["first_touch"] = {"bytes_per_s": nel * 4 / extra, "fresh_call_s": mf.median_s, "reused_call_s": m.median_s,
                          "why": "buffers above glibc's mmap threshold (32 MiB) are mapped fresh on every call, "
                                 "so each new output page is faulted in and zeroed by the kernel"}
    del xs
    # special functions: a dependent chain on an in-cache array
    depth = 2  # deeper chains spill: 8-deep ran at half the per-op rate of a softmax here
    nel_t = min(1 << 20, max(llc // 16, 1 << 16))
    chains = {"exp": lambda y: jnp.exp(-y), "tanh": jnp.tanh, "log": lambda y: jnp.log(1.0 + y)}
    xt = jax.device_put(jax.random.uniform(jax.random.key(3), (nel_t,), jnp.float32, 0.1, 1.0), dev)
    tr = {}
    for name, op in chains.items():
        _say(f"calibrate: {name} throughput ({depth}-deep chain over {nel_t} in-cache floats)", quiet)

        def chain(y, op=op):
            for _ in range(depth):
                y = op(y)
            return y

        c = jax.jit(chain).lower(xt).compile()
        m = measure(c, xt, warmup=2, repeats=reps)
        tr[name] = {"per_s": depth * nel_t / m.median_s, "spread": m.spread, "elements": nel_t, "depth": depth}
    out["transcendentals"] = tr
    # fixed cost of one call: a compiled program that does almost nothing (dispatch, argument handling, sync)
    _say("calibrate: per-call overhead (a one-element program)", quiet)
    one = jax.device_put(jnp.ones((1,), jnp.float32), dev)
    c = jax.jit(lambda v: v + 1.0).lower(one).compile()
    m = measure(c, one, warmup=3, repeats=reps)
    out["call_overhead_s"] = m.median_s
    return out


def load_or_calibrate(*, force: bool = False, quick: bool = False, quiet: bool = False,
                      run_if_missing: bool = True) -> dict:
    feat = cpu_features()
    fp = fingerprint(feat)
    path = _cache_path(fp)
    if not force and os.path.exists(path):
        try:
            with open(path) as f:
                data = json.load(f)
            if not quick and data.get("quick"):
                raise ValueError("quick calibration cached")
            data["cached"] = True
            return data
        except (OSError, ValueError):
            pass
    if not run_if_missing:
        raise WorkbenchError("this host is not calibrated yet; run `workbench calibrate`")
    data = run_calibration(quick=quick, quiet=quiet)
    data["fingerprint"] = fp
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
    data["cached"] = False
    data["path"] = path
    return data


def spec_from_calibration(cal: dict) -> HardwareSpec:
    date = cal.get("time", "")[:10]
    src_m = Source("measured by `workbench calibrate` (XLA on this host, median of repeats)", date)
    peaks = {dt: v["flops_per_s"] for dt, v in cal["matmul"].items()}
    if cal.get("matmul_curve"):  # float32: the best rate XLA reached over the sizes measured
        peaks["float32"] = max(peaks["float32"], *(r["flops_per_s"] for r in cal["matmul_curve"]))
    bw = cal["stream"]["bytes_per_s"]
    tr = cal["transcendentals"]
    rate = sorted(v["per_s"] for v in tr.values())[len(tr) // 2]  # the median function
    feat = cal["cpu"]
    return HardwareSpec(
        name="host", kind="cpu", vendor=feat.get("vendor", ""), peak_flops=peaks,
        hbm_bytes=float(feat["mem_bytes"]), hbm_bw=bw,
        interconnect=Interconnect("host-memory", bw, 1),
        first_touch_bw=cal.get("first_touch", {}).get("bytes_per_s"),
        onchip_bw=cal.get("cache_stream", {}).get("bytes_per_s"),
        call_overhead_s=cal.get("call_overhead_s"),
        matmul_curve=tuple((r["n"], r["flops_per_s"]) for r in cal.get("matmul_curve", ())) or None,
        onchip_bytes=float(feat["llc_bytes"]) or None, matrix_unit=None, transcendentals_per_s=rate,
        physical_peak_flops=cal["physical"]["peak_flops"],
        sources={"peak_flops": src_m, "hbm_bw": src_m, "transcendentals_per_s": src_m,
                 "physical_peak_flops": Source("derived from CPU features: " + "; ".join(
                     f"{k}: {v}" for k, v in cal["physical"]["derivation"].items() if k in ("float32", "bfloat16")),
                     date),
                 "hbm_bytes": Source("/proc/meminfo MemTotal", date)},
        notes=(f"{feat['model']}, {feat['cores']} cores",
               "narrow-float ceilings are the fastest result form measured: "
               + ", ".join(f"{dt} -> {v.get('result_dtype', dt)}" for dt, v in cal["matmul"].items()),
               "transcendentals_per_s is the median of exp/tanh/log: "
               + ", ".join(f"{k} {v['per_s']:.3g}/s" for k, v in tr.items())))


def host_spec(run_if_missing: bool = True) -> HardwareSpec:
    return spec_from_calibration(load_or_calibrate(run_if_missing=run_if_missing))


def get_spec(name: str, *, calibrate_if_missing: bool = True) -> HardwareSpec:
    """A catalogue chip by name or alias, or `host` (from the cached calibration; calibrates when absent unless
    calibrate_if_missing=False, which raises a one-line error instead)."""
    if resolve_name(name) == "host":
        return host_spec(run_if_missing=calibrate_if_missing)
    return catalogue_spec(name)
