"""Host calibration: what XLA achieves on this machine, beside what its cores could do on paper.

Measured (through the one harness, workbench.measure.harness; median and IQR over repeats):
- matmul FLOP/s through XLA (square n³, random inputs) for float32, bfloat16, float16 and the fp8 formats, each
  narrow dtype with a float32 result (preferred_element_type) and a narrow one: the faster form is the ceiling, the
  slower one a line in `findings`; and the rate against size (`matmul_curve` for float32, `matmul_curves` for
  bfloat16), 128³–4096³ alternating in three rounds, each size timed for at least CURVE_MIN_S per round;
- streaming memory bandwidth: y = a·x + b over buffers far larger than the last-level cache, counting bytes read +
  written, out of place (into a second buffer, as a fused kernel writes a new array; the in-place form, about twice
  as fast on this project's VMs, is kept apart as `stream_inplace`);
- special-function throughput (exp, tanh, log) through XLA: a chain of 2 dependent applications on an
  in-cache array, results/s — on CPUs these bound many elementwise fusions before memory does.
- reduction throughput: the elements/s a sum consumes, over the stream's buffer and over an in-cache one (a
  reduction kernel is bounded by its dependent adds before the memory: `reduce`);
- float32 <-> bf16 conversion throughput inside fused elementwise kernels (`convert`): on a CPU without bf16
  arithmetic every bf16 op is computed in float32 between two conversions.
Derived (physical peak per dtype) from CPU features, documented in docs/hardware.md:
    cores × SIMD lanes (avx512f: 16 f32, avx2: 8) × FMA pipes × 2 FLOP/FMA × clock
    bfloat16: ×2 with avx512_bf16 (VDPBF16PS: two bf16 products per f32 lane); AMX (amx_bf16): 1024 FLOP/cycle/core
The clock is the CPU's own report, never a measurement: sysfs cpufreq's maximum, else the maximum boost clock of a
known part (KNOWN_PARTS, each with its source), else /proc/cpuinfo's `cpu MHz` (often only the nominal clock in a
VM); `physical.derivation.clock_source` names which. A measurement above the physical peak is reported in `findings`
(one-line statements), never folded into the peak. The streaming bandwidth is sampled several times across the
calibration (`stream.samples`, `stream.range_bytes_per_s`); predictions carry the band they were priced with. So is
the float32 matmul (`matmul_level.samples`: a 2048³ matmul at the start, in the matmul phase and at the end): the
matmul figures keep their shape from the one phase that measured them all and take their level from the median
sample (`matmul_level.factor`; each figure's phase value is kept as `flops_per_s_measured`). The vector units' figures
(special functions, conversions, in-cache reductions) take their level the same way from an exp probe sampled at the
start, in their phase and at the end (`vector_level`; phase values kept as `per_s_measured`).
Overrides: WORKBENCH_HOST_CLOCK_GHZ, WORKBENCH_HOST_FMA_PIPES, WORKBENCH_HOST_PEAK_<DTYPE> (FLOP/s).
Cached per host fingerprint (CPU model, flags, cores, memory, jax version) in $WORKBENCH_CACHE_DIR
(default ~/.cache/workbench); `workbench calibrate --force` re-measures.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import math
import os
import subprocess
import sys
from typing import Any

from workbench.cost.hlo import parse_kernels
from workbench.errors import WorkbenchError
from workbench.hardware.hostmem import describe
from workbench.hardware.measured import Measured, MemoryLevel
from workbench.hardware.spec import HardwareSpec, Interconnect, Source, catalogue_spec, resolve_name
from workbench.measure.harness import measure, measure_steps, random_inputs, summarize

CALIBRATION_VERSION = 29


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


def _size_bytes(text: str) -> int:
    """'48K' / '1024K' / '32M' (sysfs) or '96 KiB' / '4 MiB' (lscpu) in bytes; 0 when unreadable."""
    t = text.strip().split("(")[0].strip().replace("iB", "").replace("B", "").replace(" ", "")
    mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(t[-1:].upper(), 1)
    try:
        return int(float(t.rstrip("KMGkmg")) * mult)
    except ValueError:
        return 0


def _cpu_list(text: str) -> frozenset[int]:
    out: set[int] = set()
    for part in text.strip().split(","):
        if "-" in part:
            a, b = part.split("-")
            out.update(range(int(a), int(b) + 1))
        elif part.strip():
            out.add(int(part))
    return frozenset(out)


def cache_topology() -> list[dict[str, Any]]:
    """The data and unified caches of the cores this process runs on, per level, from the OS: sysfs
    (/sys/devices/system/cpu/cpu*/cache/index*/{level,type,size,shared_cpu_list}), else lscpu. Each: level, type,
    size_bytes (one instance), instances (distinct instances among this process's cores), shared_cpu_list (of cpu0's
    instance) and capacity_bytes = size × instances: what the process's cores hold at that level together (a per-core
    L2 counts once per core, a shared L3 once)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    levels: dict[tuple[int, str], dict[str, Any]] = {}
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/cache"
        try:
            names = sorted(n for n in os.listdir(base) if n.startswith("index"))
        except OSError:
            continue
        for idx in names:
            try:
                rd = lambda f: open(os.path.join(base, idx, f)).read().strip()  # noqa: E731, SIM115
                level, typ, size, shared = int(rd("level")), rd("type"), _size_bytes(rd("size")), rd("shared_cpu_list")
            except (OSError, ValueError):
                continue
            if typ not in ("Data", "Unified") or not size:
                continue
            e = levels.setdefault((level, typ), {"level": level, "type": typ, "size_bytes": size, "sets": set(),
                                                 "shared_cpu_list": shared, "source": "sysfs"})
            e["sets"].add(_cpu_list(shared))
    if not levels:
        return _lscpu_caches()
    out = []
    for (level, typ), e in sorted(levels.items()):
        n = len(e.pop("sets"))
        out.append(dict(e, instances=n, capacity_bytes=e["size_bytes"] * n))
    return out


def _lscpu_caches() -> list[dict[str, Any]]:
    """lscpu's 'L1d cache: 96 KiB (2 instances)' lines (the total over the instances) where sysfs has none."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    out = []
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key = key.strip()
        if key in ("L1d cache", "L2 cache", "L3 cache", "L4 cache"):
            total = _size_bytes(val)
            inst = int(val.split("(")[1].split()[0]) if "(" in val else 1
            out.append({"level": int(key[1]), "type": "Data" if key == "L1d cache" else "Unified",
                        "size_bytes": total // max(inst, 1), "instances": inst, "capacity_bytes": total,
                        "shared_cpu_list": None, "source": "lscpu"})
    return out


def cpu_features() -> dict[str, Any]:
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"model": info.get("model name", "unknown"), "vendor": info.get("vendor_id", ""),
            "family": int(info.get("cpu family", "0") or 0), "model_number": int(info.get("model", "0") or 0),
            "mhz": float(info.get("cpu MHz", "0") or 0), "max_mhz": _sysfs_max_mhz(),
            "cores": cores, "flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse4"))),
            "llc_bytes": _llc_bytes(), "mem_bytes": _meminfo_bytes(), "caches": cache_topology()}


def fma_pipes(feat: dict) -> tuple[int, str]:
    """FMA pipes of the vector width used, per core, with the reason (not readable from cpuid)."""
    env = os.environ.get("WORKBENCH_HOST_FMA_PIPES")
    if env:
        return int(env), "WORKBENCH_HOST_FMA_PIPES override"
    v, fam = feat["vendor"], feat["family"]
    if v == "AuthenticAMD":
        if fam >= 26:
            return 2, "AMD Zen 5 (family 1Ah): two 512-bit FMA pipes (AMD Zen 5 software optimization guide)"
        if fam == 25 and "avx512f" in feat["flags"]:
            return 1, "AMD Zen 4 (family 19h with AVX-512): AVX-512 executes as 2×256-bit, i.e. one 512-bit FMA per cycle"
        if fam == 25:
            return 2, "AMD Zen 3 (family 19h, no AVX-512): two 256-bit FMA pipes (AMD Zen 3 software optimization guide)"
        return 2, "AMD Zen 2/3: two 256-bit FMA pipes"
    if v == "GenuineIntel":
        return 2, "Intel server cores with AVX-512: two FMA ports (ports 0 and 5)"
    return 1, "unknown vendor: one FMA pipe assumed"


# Maximum boost clocks of parts whose VMs report only the base clock (no cpufreq): (vendor, cpu family, model,
# the base clock the OS reports in MHz) -> (part, max boost GHz, source). The boost clock bounds what any core can do.
KNOWN_PARTS = {
    ("AuthenticAMD", 0x17, 0x31, 2250): ("AMD EPYC 7B12 (Rome, Zen 2)", 3.3,
                                         "Google Compute Engine CPU platforms table (AMD EPYC Rome: base 2.25 GHz, "
                                         "single-core max turbo 3.3 GHz), cloud.google.com/compute/docs/cpu-platforms"),
    ("AuthenticAMD", 0x19, 0x01, 2450): ("AMD EPYC 7763 / 7B13 (Milan, Zen 3)", 3.5,
                                         "AMD EPYC 7763 product page (base 2.45 GHz, max boost up to 3.5 GHz); Google "
                                         "Compute Engine CPU platforms table (AMD EPYC Milan 7B13: base 2.45 GHz, "
                                         "max turbo 3.5 GHz)"),
}


def _sysfs_max_mhz() -> float:
    """cpufreq's cpuinfo_max_freq (kHz) of cpu0 in MHz; 0 where the kernel exposes no cpufreq (most VMs)."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as f:
            return int(f.read().strip()) / 1000.0
    except (OSError, ValueError):
        return 0.0


def host_clock(feat: dict) -> tuple[float, str, bool]:
    """(GHz, its source, whether it is a maximum) from the CPU's own report, never from a measurement: the override
    WORKBENCH_HOST_CLOCK_GHZ, sysfs cpufreq's maximum, the maximum boost of a known part, else /proc/cpuinfo's
    `cpu MHz` (in a VM usually the base clock: the cores may boost above it)."""
    env_clock = os.environ.get("WORKBENCH_HOST_CLOCK_GHZ")
    if env_clock:
        return float(env_clock), "WORKBENCH_HOST_CLOCK_GHZ override", True
    if feat.get("max_mhz"):
        return feat["max_mhz"] / 1000.0, "sysfs /sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq", True
    for (vendor, fam, model, base), (part, ghz, src) in KNOWN_PARTS.items():
        if (feat.get("vendor") == vendor and feat.get("family") == fam and feat.get("model_number") == model
                and abs(feat.get("mhz", 0) - base) <= 60):
            return ghz, (f"maximum boost of the {part} (family {fam:#x}, model {model:#x}, reported base "
                         f"{feat['mhz']:.0f} MHz): {src}"), True
    return (feat.get("mhz", 0) / 1000.0, "/proc/cpuinfo 'cpu MHz' (the clock the OS reports, often the base clock in "
            "a VM; boost clocks may be higher and this part is not in the table of known parts)", False)


def physical_peaks(feat: dict) -> dict[str, Any]:
    """Peak FLOP/s from CPU features with the derivation written out; the clock from host_clock (never derived from
    a measurement: a measurement above this peak is a finding, see peak_findings)."""
    flags = set(feat["flags"])
    ghz, clock_source, is_max = host_clock(feat)
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags or "avx" in flags else 4
    pipes, why = fma_pipes(feat)
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
        "cores": feat["cores"], "clock_ghz": ghz, "clock_is_maximum": is_max, "f32_lanes": lanes, "fma_pipes": pipes,
        "fma_pipes_why": why,
        "float32": f"{feat['cores']} cores × {lanes} lanes × {pipes} FMA pipes × 2 × {ghz:.3f} GHz",
        "bfloat16": f"{feat['cores']} cores × {bf16_per_cycle} FLOP/cycle ({bf16_src}) × {ghz:.3f} GHz",
        "clock_source": clock_source}}


def peak_findings(cal: dict) -> list[str]:
    """One-line statements about measurements the physical peak does not cover (and why that can happen)."""
    out = []
    phys = cal["physical"]["peak_flops"]
    der = cal["physical"]["derivation"]
    # each figure as measured and as levelled to the median sample (apply_matmul_level), whichever is higher
    rates = [(f"{dt} {v['n']}³ matmul", dt, max(v.get("flops_per_s_best", 0.0), v["flops_per_s"]))
             for dt, v in cal.get("matmul", {}).items()]
    rates += [(f"float32 {r['n']}³ matmul (rate curve)", "float32", max(r.get("flops_per_s_measured", 0.0),
                                                                        r["flops_per_s"]))
              for r in cal.get("matmul_curve", [])]
    rates += [(f"{dt} {r['n']}³ matmul (rate curve)", dt, max(r.get("flops_per_s_measured", 0.0), r["flops_per_s"]))
              for dt, rows in (cal.get("matmul_curves") or {}).items() for r in rows]
    for what, dt, rate in rates:
        peak = phys.get(dt)
        if peak and rate > peak * 1.001:
            out.append(f"measured {what} {rate / 1e9:.0f} GFLOP/s exceeds the physical {dt} peak {peak / 1e9:.0f} "
                       f"GFLOP/s ({der[dt] if dt in der else der['float32']}; clock: {der['clock_source'].split(' (')[0]}): the "
                       "clock, FMA-pipe count or core count of the derivation is wrong for this host")
    if not der.get("clock_is_maximum"):
        out.append(f"the physical peak uses the OS-reported clock {der['clock_ghz']:.2f} GHz, not a known maximum: "
                   "boosting cores can exceed it")
    return out


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
    isa = bf16_isa(feat.get("flags", ()))
    mm: dict[str, Any] = {}
    findings: list[str] = []
    fl = 2.0 * n**3
    all_forms: dict[str, dict[str, dict]] = {}
    runs = []  # (dtype, result dtype, compiled, x, y)
    for dt, results in MATMUL_FORMS.items():
        all_forms[dt] = {}
        for rt in results:
            try:
                runs.append((dt, rt, *matmul_probe(n, dev, dt, rt)))
            except Exception as e:  # noqa: BLE001 - an unsupported form is a finding, not a failed calibration
                all_forms[dt][rt] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    # every (dtype, form) alternates in rounds, so a slow spell of the machine reaches every dtype and form alike
    # (measured one dtype after another, a spell once put the bf16 ceiling at 206 GFLOP/s while the fp8 forms,
    # the same bf16 dots after a conversion, ran at 323-335)
    rounds = 3 if len(runs) > 1 else 1
    times: dict[tuple[str, str], list[float]] = {(dt, rt): [] for dt, rt, *_ in runs}
    for r in range(rounds):
        for dt, rt, c, x, y in runs:
            _say(f"calibrate: {dt} matmul {n}³ through XLA, {rt} result"
                 + (f" (round {r + 1}/{rounds})" if rounds > 1 else ""), quiet)
            times[(dt, rt)] += measure(c, x, y, warmup=2 if r == 0 else 1, repeats=math.ceil(reps / rounds)).times_s
    for (dt, rt), ts in times.items():
        m = summarize(ts, warmup=2, calls=1, compile_s=None)
        all_forms[dt][rt] = {"n": n, "result_dtype": rt, "flops_per_s": fl / m.median_s,
                             "flops_per_s_iqr": fl * m.iqr_s / m.median_s**2, "flops_per_s_best": fl / m.min_s,
                             "spread": m.spread, "wide_spread": m.wide_spread, "rounds": rounds}
    for dt, forms in all_forms.items():
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


CURVE_MIN_S = 0.3  # seconds each matmul-curve size is timed for, per round (full calibrations)


def _calibration_header(feat: dict, quick: bool) -> dict[str, Any]:
    """The calibration's opening fields: the CPU, its physical peaks, when and under which JAX it ran."""
    import jax

    return {"cpu": feat, "physical": physical_peaks(feat), "quick": quick,
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": len(jax.devices()), "findings": []}


def _matmul_curves(n: int, mm: dict, dev, reps: int, quick: bool, quiet: bool) -> tuple[dict, list[dict]]:
    """(bfloat16's rate-against-size curve by dtype, float32's curve sorted by n).

    Achievable matmul rate against problem size: small and skinny matmuls run far from the peak. float32 and
    bfloat16 (in its ceiling's result form) each have a curve: their shapes differ (bf16 gains less over float32 on
    small matmuls than on large ones). The sizes alternate in rounds, so a drift in the machine's load reaches every
    size alike (not one point of a curve)."""
    sizes = (128, 256, 512) if quick else (128, 256, 512, 1024, 2048, 4096)
    keys = [("float32", cn) for cn in sizes]
    bf16_form = (mm.get("bfloat16") or {}).get("result_dtype")
    if bf16_form:
        keys += [("bfloat16", cn) for cn in sizes if cn <= n]
    progs = {(dt, cn): matmul_probe(cn, dev, dt, bf16_form if dt == "bfloat16" else None) for dt, cn in keys}
    times: dict[tuple[str, int], list[float]] = {k: [] for k in keys}
    rounds = 3
    # each size is timed for at least CURVE_MIN_S per round: the small sizes' points decide the dots of a model's step
    # (a `small` step's dots sit between 512³ and 1024³), and nine 20 ms batches of a 512³ matmul put that point
    # anywhere from 106 to 177 GFLOP/s across five calibrations of one Zen 4 VM whose 2048³ samples agreed within 7 %
    min_s = 0.0 if quick else CURVE_MIN_S
    for r in range(rounds):
        for dt, cn in keys:
            _say(f"calibrate: {dt} matmul {cn}³ (rate against size, round {r + 1}/{rounds})", quiet)
            c, x, y = progs[(dt, cn)]
            times[(dt, cn)] += measure(c, x, y, warmup=2 if r == 0 else 1, repeats=math.ceil(reps / rounds),
                                       min_total_s=min_s).times_s
    curves: dict[str, list[dict]] = {}
    for dt, cn in keys:
        m = summarize(times[(dt, cn)], warmup=2, calls=1, compile_s=None)
        row = {"n": cn, "flops_per_s": 2.0 * cn**3 / m.median_s, "spread": m.spread}
        if dt != "float32":
            row["result_dtype"] = bf16_form
        curves.setdefault(dt, []).append(row)
    curve = curves["float32"]
    return {dt: v for dt, v in curves.items() if dt != "float32"}, sorted(curve, key=lambda r: r["n"])


SKINNY_ROWS = (1, 2, 4, 8, 16, 32, 64)
SKINNY_SIDE = 2048


def _skinny_dots(dev, reps: int, quick: bool, quiet: bool) -> list[dict]:
    """Float32 rate of matrix products with few rows: (m × SKINNY_SIDE) · (SKINNY_SIDE × SKINNY_SIDE) for m in
    SKINNY_ROWS, as [{'rows', 'flops_per_s', 'spread'}].

    A decode step's products have as many rows as sequences in the batch, and XLA:CPU does not run them on the square
    curve (matmul_curve) its size would put them on: on a 2-core Zen 3 VM an 8-row product over a 4096² weight took
    6.5 ms against 1.75 ms for one row and 15.4 ms for 64 (the library's few-row path uses one core). Priced on
    this curve by their smallest side (pricing.arithmetic_seconds), from 64 rows on on the square curve. Sampled in
    rounds like the square curve, so that a drift reaches every point alike."""
    import jax
    import jax.numpy as jnp

    k = 512 if quick else SKINNY_SIDE
    rows = SKINNY_ROWS[:3] if quick else SKINNY_ROWS
    progs = {}
    for m in rows:
        a, b = jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((k, k), jnp.float32)
        x, y = (jax.device_put(v, dev) for v in random_inputs((a, b), seed=2))
        progs[m] = (jax.jit(jnp.dot).lower(x, y).compile(), x, y)
    times: dict[int, list[float]] = {m: [] for m in rows}
    rounds = 3
    for r in range(rounds):
        for m in rows:
            _say(f"calibrate: float32 {m}-row matmul over a {k}² weight (few-row products, round {r + 1}/{rounds})",
                 quiet)
            c, x, y = progs[m]
            times[m] += measure(c, x, y, warmup=2 if r == 0 else 1, repeats=math.ceil(reps / rounds),
                                min_total_s=0.0 if quick else CURVE_MIN_S).times_s
    out = []
    for m in rows:
        s = summarize(times[m], warmup=2, calls=1, compile_s=None)
        out.append({"rows": m, "side": k, "flops_per_s": 2.0 * m * k * k / s.median_s, "spread": s.spread})
    return out


def _streams(out: dict, nel: int, dev, reps: int, few: int, quiet: bool, xbig) -> tuple[float, dict, Any]:
    """out['stream'] (the out-of-place kernel, the middle sample) and out['stream_inplace'], with the write-allocate
    finding; returns (the middle sample's bytes/s, its statistics, the stream's buffer)."""
    import jax

    # streaming bandwidth, buffers far larger than the last-level cache: the out-of-place kernel (second sample)
    bw_mid, st, xbig = _stream_sample(nel, dev, reps, quiet, "middle", xbig)
    out["stream"] = {"buffer_bytes": nel * 4, "bytes_per_s": bw_mid, "bytes_per_s_iqr": st["bytes_per_s_iqr"],
                     "per_trip_s": st["per_trip_s"], "trips": st["trips"], "spread": st["spread"],
                     "counted": "bytes read + bytes written",
                     "kernel": "out of place: y = a·x + b into a second buffer it never reads (a fused kernel "
                               "writing a new array), per trip of a loop over the same two buffers"}
    # in place (the output donated to the input's buffer): the best case, kept beside it as a reference
    sf = jax.jit(lambda x: x * 1.0001 + 0.5, donate_argnums=0)
    state = {"x": xbig + 0.0}

    def step_inplace(i):
        state["x"] = sf(state["x"])
        return state["x"]

    _say(f"calibrate: in-place streaming over {nel * 4 / 2**20:.0f} MiB (output donated to the input)", quiet)
    mi = measure_steps(step_inplace, warmup=2, repeats=few, guard=sf)
    state.clear()
    out["stream_inplace"] = {"buffer_bytes": nel * 4, "bytes_per_s": 2.0 * nel * 4 / mi.median_s,
                             "spread": mi.spread, "counted": "bytes read + bytes written",
                             "kernel": "y = a·x + b written over x (donated)"}
    ratio = out["stream_inplace"]["bytes_per_s"] / bw_mid
    if write_allocates(out):  # out['stream'] holds the middle sample here, the one `ratio` is taken against
        out["findings"].append(
            f"in-place streaming (output over its input) ran {ratio:.2f}x the out-of-place rate "
            f"({out['stream_inplace']['bytes_per_s'] / 1e9:.1f} vs {bw_mid / 1e9:.1f} GB/s): the caches "
            "write-allocate (a new array's lines are read before they are written), so a kernel from memory moves "
            "bytes_in + 2·bytes_out at 1.5× the out-of-place rate")
    elif ratio > 1.15:
        out["findings"].append(
            f"in-place streaming (output over its input) ran {ratio:.2f}x the out-of-place rate "
            f"({out['stream_inplace']['bytes_per_s'] / 1e9:.1f} vs {bw_mid / 1e9:.1f} GB/s), below the "
            f"{WRITE_ALLOCATE_RATIO}x that would show write-allocating caches: kernels are priced at the out-of-place "
            "rate, reads and writes alike")
    return bw_mid, st, xbig


def _cache_reduce_convert_transpose(out: dict, xbig, bw_mid: float, dev, llc: int, reps: int, quick: bool,
                                    quiet: bool) -> None:
    """out['cache_stream'], out['reduce'] (with its write-allocate finding), out['convert'], out['transpose']."""
    import jax
    import jax.numpy as jnp

    # the out-of-place kernel over a buffer that stays in the last-level cache
    nel_c = max(llc // 4 // 4, 1 << 14)
    xc = jax.device_put(jax.random.normal(jax.random.key(4), (nel_c,), jnp.float32), dev)
    _say(f"calibrate: in-cache bandwidth over {nel_c * 4 / 2**20:.0f} MiB (out of place)", quiet)
    rc = stream_out_of_place(xc, reps, trips=(1, 33))
    out["cache_stream"] = {"buffer_bytes": nel_c * 4, "bytes_per_s": rc["bytes_per_s"], "spread": rc["spread"],
                           "counted": "bytes read + bytes written", "kernel": out["stream"]["kernel"]}
    out["reduce"] = measure_reduce(xbig, xc, reps, quiet)
    out["row_product"] = measure_row_product(xbig, reps, quiet)
    if write_allocates(out):
        read = out["reduce"]["from_memory"]["per_s"] * 4
        out["findings"].append(
            f"the sum over the stream's buffer read {read / 1e9:.1f} GB/s, {read / (1.5 * bw_mid):.2f}x the read rate "
            f"write-allocate implies (1.5 x {bw_mid / 1e9:.1f} GB/s): reductions from memory are priced by their bytes, "
            "their adds at the in-cache reduction rate")
    out["convert"] = measure_convert(dev, reps, quiet)
    out["transpose"] = measure_transpose(dev, llc, reps, quiet, quick)


STABLE_SPREAD = 0.10  # a memory sample is stable when its last three repeats lie within this of their median
MAX_SAMPLES = 6


def until_stable(sample, *, spread: float = STABLE_SPREAD, at_least: int = 3, at_most: int = MAX_SAMPLES) -> dict:
    """Repeat `sample()` (a rate) until its last three values lie within `spread` of their median, or `at_most`
    times: {'median' (of the last three), 'samples' (all), 'spread' ((max − min) / median of the last three),
    'stable'}. A machine that never settles is reported, not averaged in."""
    vals: list[float] = []
    while True:
        vals.append(sample())
        last = sorted(vals[-3:])
        med = last[len(last) // 2]
        sp = (last[-1] - last[0]) / med if med > 0 else math.inf
        if (len(vals) >= at_least and sp <= spread) or len(vals) >= at_most:
            return {"median": med, "samples": vals, "spread": sp, "stable": sp <= spread}


def _read_rate(x, reps: int) -> float:
    """Bytes/s of a sum over x (reads only)."""
    import jax

    c = jax.jit(lambda v: v.sum()).lower(x).compile()
    return x.size * x.dtype.itemsize / measure(c, x, warmup=1, repeats=reps).median_s


MMAP_THRESHOLD = 32 * 2**20  # glibc's largest mmap threshold: a larger fresh output is page-faulted in every call


def _launch_seconds(dev) -> float:
    """Median seconds of one call of the stream's kernel over 1024 floats: the launch a single call's time carries."""
    import jax
    import jax.numpy as jnp

    tiny = jax.device_put(jnp.ones((1024,), jnp.float32), dev)
    return measure(_stream_kernel().lower(tiny).compile(), tiny, warmup=3, repeats=15).median_s


def _stream_kernel():
    """The stream's out-of-place kernel, y = a·x + b, as one jitted call."""
    import jax

    return jax.jit(lambda v: v * 1.0001 + 0.5)


def _level_rate(nel: int, dev, launch: float) -> tuple[dict, list[float], float]:
    """_level_sample and the median of its last three read ratios: (stream statistics, read ratios, read ratio)."""
    st, reads = _level_sample(nel, dev, launch)
    ratios = sorted(reads[-3:])
    return st, reads, ratios[len(ratios) // 2]


def _level_sample(nel: int, dev, launch: float):
    """(the stream over two buffers of nel floats, until stable; the read ratios beside its samples). Each sample
    is the faster of two forms of the same out-of-place kernel: the per-trip time of a loop of it
    (stream_out_of_place: launches cancel) and one call of it less a launch (what a kernel between others in a
    program sees; only while its output stays below the mmap threshold, beyond which every call faults it in
    fresh). `launch`: _launch_seconds. On a 2-vCPU Xeon VM the loop ran at half a single call's rate over 16 MiB
    buffers (26 against 47 GB/s) while a program's 16 MiB kernels ran at the single call's."""
    import jax
    import jax.numpy as jnp

    x = jax.device_put(jax.random.normal(jax.random.key(6), (nel,), jnp.float32), dev)
    reads: list[float] = []
    single = _stream_kernel().lower(x).compile() if nel * 4 <= MMAP_THRESHOLD else None

    def sample(x=x):
        r = stream_out_of_place(x, 3, trips=(1, 17))["bytes_per_s"]
        if single is not None:
            t = measure(single, x, warmup=2, repeats=9).median_s - launch
            if t > 0:
                r = max(r, 2.0 * x.size * 4 / t)
        reads.append(_read_rate(x, 3) / r)
        return r

    return until_stable(sample), reads


def level_beats_memory(stream_bw: float, read_ratio: float | None, memory_bw: float | None,
                       memory_read_bw: float | None = None) -> bool:
    """Whether a cache level's measured rates show it serves a kernel faster than memory: its out-of-place stream
    or its reads (the stream times its read ratio) at least 20 % above memory's. Either is enough: on a
    write-allocating VM the stream over a level can run near memory's while its reads run half as fast again."""
    if memory_bw is None:
        return True
    if stream_bw >= 1.2 * memory_bw:
        return True
    return bool(memory_read_bw and read_ratio and stream_bw * read_ratio >= 1.2 * memory_read_bw)


def effective_llc_bytes(levels: list[dict], fallback: int) -> int:
    """The last-level cache this process holds: the largest measured level's effective capacity (a level with a
    rate), else `fallback` (the OS's figure)."""
    sizes = [int(lv.get("effective_bytes") or lv["capacity_bytes"]) for lv in levels
             if lv.get("bytes_per_s") and lv.get("capacity_bytes")]
    return max(sizes) if sizes else fallback


def measure_cache_levels(caches: list[dict], dev, quick: bool, quiet: bool, memory_bw: float | None = None,
                         memory_read_bw: float | None = None) -> tuple[list[dict], list[str]]:
    """Per data/unified cache level of the OS's topology (cache_topology): the out-of-place stream over a working
    set of half the level's capacity for this process (input and output together), repeated until stable
    (until_stable), and a sum over the same input beside each sample (its read ratio: read bytes/s over the
    stream's). When neither that stream nor its reads beat memory (`memory_bw`, `memory_read_bw`; by 20 %,
    level_beats_memory) — a virtual machine's OS may report the host's whole shared cache, of which this process
    holds far less — the working set is quartered until they do; that working set is the level's `effective_bytes`,
    the capacity the pricing gives it, and its rate is sampled again over half of it; a level that never beats
    memory down to the level below it gets no rate. A level under 256 KiB is listed without a rate: a kernel over it is its
    launch, not its bytes. Returns (levels, findings)."""
    out, findings = [], []
    below = 256 * 1024
    launch = None
    for c in caches:
        lv = dict(c)
        cap = int(c.get("capacity_bytes") or 0)
        if c.get("type") not in ("Data", "Unified") or cap < 256 * 1024 or (quick and cap > 64 * 2**20):
            lv["bytes_per_s"] = None
            lv["note"] = "not timed: under 256 KiB (a kernel there is its launch)" if cap < 256 * 1024 else \
                "not timed in a quick calibration"
            out.append(lv)
            continue
        ws = cap // 2  # input and output together
        tried = []
        launch = _launch_seconds(dev) if launch is None else launch
        while True:
            nel = max(ws // 8, 1 << 12)  # two buffers of a quarter of the capacity: half of it in all
            _say(f"calibrate: L{c['level']} stream over {2 * nel * 4 / 2**20:.2f} MiB (of its {cap / 2**20:.1f} MiB "
                 "for this process's cores; repeated until stable)", quiet)
            st, reads, ratio = _level_rate(nel, dev, launch)
            fast = level_beats_memory(st["median"], ratio, memory_bw, memory_read_bw)
            tried.append({"working_set_bytes": 2 * nel * 4, "bytes_per_s": st["median"], "read_ratio": ratio})
            if fast or ws // 4 < 2 * below:
                break
            ws //= 4
        effective = (cap if len(tried) == 1 else 2 * nel * 4) if fast else None
        found = 2 * nel * 4
        if fast and len(tried) > 1:
            # the level holds the working set that beat memory: its rate, as every level's, is the stream over
            # half the capacity the pricing gives it
            nel //= 2
            _say(f"calibrate: L{c['level']} stream over {2 * nel * 4 / 2**20:.2f} MiB (half the {found / 2**20:.0f} "
                 "MiB it holds)", quiet)
            st, reads, ratio = _level_rate(nel, dev, launch)
            tried.append({"working_set_bytes": 2 * nel * 4, "bytes_per_s": st["median"], "read_ratio": ratio})
        lv.update(bytes_per_s=st["median"] if fast else None, samples=st["samples"], spread=st["spread"],
                  stable=st["stable"], read_ratio=ratio, read_ratios=reads,
                  working_set_bytes=2 * nel * 4, tried=tried, effective_bytes=effective,
                  counted="bytes read + bytes written (out-of-place stream); read_ratio: a sum's bytes/s over it")
        if len(tried) > 1:
            findings.append(f"L{c['level']}: the OS reports {cap / 2**20:.0f} MiB, but a stream over "
                            f"{tried[0]['working_set_bytes'] / 2**20:.0f} MiB ran at {tried[0]['bytes_per_s'] / 1e9:.1f}"
                            f" GB/s, its reads no faster than memory's; "
                            + (f"{found / 2**20:.1f} MiB beat memory: priced as a {found / 2**20:.0f} MiB level "
                               f"streaming {st['median'] / 1e9:.1f} GB/s (over half of it)" if fast
                               else "priced as memory"))
        if not st["stable"]:
            lo, hi = min(st["samples"][-3:]), max(st["samples"][-3:])
            findings.append(f"L{c['level']} stream did not settle in {len(st['samples'])} samples "
                            f"({lo / 1e9:.1f}–{hi / 1e9:.1f} GB/s over the last three): the machine is noisy")
        out.append(lv)
        below = cap
    findings += _fill_last_level(out, dev, launch, quiet, memory_bw)
    return out, findings


def fill_capacity(level_bw: float, full_bw: float, memory_bw: float, capacity: float) -> tuple[float, float]:
    """(share of a stream's traffic the level served, the capacity that share gives) from the out-of-place stream
    over a working set of the level's whole capacity (`full_bw`), against the same stream over half of it
    (`level_bw`, all from the level) and over memory (`memory_bw`): the times mix as h / level + (1 − h) / memory,
    and `residency` prices a sweep over W beyond a capacity C with the hit rate of random replacement, so the C that
    gives h at W = capacity is capacity / r with 1 − m = exp(−m·r), m = 1 − h: r = −ln(h) / (1 − h). A level that
    served the whole working set (h ≥ 0.97) keeps its capacity; one that served none of it, a tenth."""
    if not (level_bw > memory_bw > 0 and full_bw > 0):
        return 1.0, capacity
    h = (1.0 / memory_bw - 1.0 / full_bw) / (1.0 / memory_bw - 1.0 / level_bw)
    h = min(max(h, 0.0), 1.0)
    if h >= 0.97:
        return h, capacity
    if h <= 0.0:
        return h, capacity / 10
    return h, max(capacity * (1.0 - h) / -math.log(h), capacity / 10)


def _fill_last_level(levels: list[dict], dev, launch: float | None, quiet: bool, memory_bw: float | None) -> list[str]:
    """The last-level cache with a rate, streamed once more over its whole effective capacity (input and output
    together): a kernel whose arrays fill the cache (a 16 MiB array into a 16 MiB result on a 32 MiB cache) runs
    between the level's rate and memory's, as the cache is shared with what else runs (other tenants of a VM's host,
    the process's own code and data) and replaces lines imperfectly. fill_capacity turns that stream's rate into the
    capacity the pricing gives the level (`effective_bytes`); the sample is kept as `full`."""
    timed = [lv for lv in levels if lv.get("bytes_per_s")]
    if not (timed and memory_bw):
        return []
    lv = timed[-1]
    cap = float(lv.get("effective_bytes") or lv["capacity_bytes"])
    nel = int(cap // 8)
    if nel * 4 > MMAP_THRESHOLD:
        return []  # beyond glibc's threshold a fresh output faults in every call: not the cache's rate
    launch = _launch_seconds(dev) if launch is None else launch
    _say(f"calibrate: L{lv['level']} stream over {2 * nel * 4 / 2**20:.2f} MiB (all of its {cap / 2**20:.1f} MiB; "
         "repeated until stable)", quiet)
    st, _, _ = _level_rate(nel, dev, launch)
    h, eff = fill_capacity(lv["bytes_per_s"], st["median"], memory_bw, cap)
    lv["full"] = {"working_set_bytes": 2 * nel * 4, "bytes_per_s": st["median"], "samples": st["samples"],
                  "spread": st["spread"], "stable": st["stable"], "hit_share": h, "capacity_bytes": cap}
    lv["effective_bytes"] = int(eff)
    if eff >= cap:
        return []
    return [f"L{lv['level']}: a stream over all of its {cap / 2**20:.0f} MiB ran at {st['median'] / 1e9:.1f} GB/s "
            f"(half of it: {lv['bytes_per_s'] / 1e9:.1f}, memory: {memory_bw / 1e9:.1f}): {h:.0%} of it from the "
            f"cache, priced as a {eff / 2**20:.1f} MiB level (the capacity whose replacement gives that share)"]


def _transcendental_throughput(vprobe, reps: int, quiet: bool) -> dict:
    """Special functions' throughput over independent elements: four independent applications per element of the
    in-cache probe array (no result feeds another), results/s per function. Unlike the 2-deep chains
    (`transcendentals`), no application waits for another's result."""
    import jax
    import jax.numpy as jnp

    xt = vprobe[1]
    fns = {"exp": lambda v: jnp.exp(-v), "tanh": jnp.tanh, "log": lambda v: jnp.log(1.0 + v)}
    out = {}
    for name, op in fns.items():
        _say(f"calibrate: {name} throughput (4 independent applications per element over {xt.size} in-cache "
             "floats)", quiet)

        def f(v, op=op):
            return op(v) + op(v * 0.5 + 0.25) + op(v * 0.25 + 0.5) + op(1.0 - v * 0.5)

        c = jax.jit(f).lower(xt).compile()
        m = measure(c, xt, warmup=2, repeats=reps)
        out[name] = {"per_s": 4 * xt.size / m.median_s, "spread": m.spread, "elements": int(xt.size),
                     "independent": 4}
    return out


def _fma_chain(depth: int):
    """v -> `depth` multiply-adds of v (2·depth flops per element)."""
    def f(v):
        for i in range(depth):
            v = v * (1.0 + 0.25 * i) + 0.5
        return v
    return f


def _transcendental_library(dev, nel: int, reps: int, quiet: bool) -> tuple[dict, dict]:
    """(exponentials/s inside a library fusion, the library fusion's own passes): XLA:CPU's YNN kernels fuse a
    reduction with the ops that compute its operand (a softmax's exp and sum, a layernorm's variance), but write that
    operand into a buffer in a pass of its own before reducing it, and run each elementwise op of the chain as a
    vector loop over it. Row sums over the same in-cache [rows, 1024] float32 array of x, of x·a + b, of four such
    multiply-adds and of exp(x), alternating in five rounds (medians):
        ops/s     = 6 · n / (t(4 multiply-adds) − t(1))          (the six extra flops per element)
        pass      = t(1 multiply-add) − t(sum) − 2 · n / ops/s    (the produced operand's pass; elements/s = n / pass)
        exp/s     = n / (t(exp) − t(sum) − pass)                  (the exponentials beyond that pass)
    A calibration without these (before version 27) keeps exp/s = n / (t(exp) − t(sum)), which holds the pass.
    Where a difference is lost in the noise (under 5 % of the time it is part of) the op rate, the pass and the rate
    beyond it are None, and exp/s is n / t(exp)."""
    import jax
    import jax.numpy as jnp

    rows = max(nel // 1024, 1)
    x = jax.device_put(jax.random.uniform(jax.random.key(7), (rows, 1024), jnp.float32, -1.0, 0.0), dev)
    _say(f"calibrate: exp and multiply-adds inside a library reduction fusion ([{rows}, 1024] in cache)", quiet)
    fns = {"exp_sum": lambda v: jnp.exp(v).sum(-1), "sum": lambda v: v.sum(-1),
           "fma1_sum": lambda v: _fma_chain(1)(v).sum(-1), "fma4_sum": lambda v: _fma_chain(4)(v).sum(-1)}
    progs = {k: jax.jit(f).lower(x).compile() for k, f in fns.items()}
    times: dict[str, list[float]] = {k: [] for k in progs}
    for r in range(5):  # each call is a fraction of a millisecond: many repeats, as differences are taken
        for k, c in progs.items():
            times[k] += measure(c, x, warmup=2 if r == 0 else 1, repeats=2 * reps).times_s
    t = {k: summarize(v, warmup=1, calls=1, compile_s=None).median_s for k, v in times.items()}
    n = rows * 1024
    kinds = {k: [kc.library for kc in parse_kernels(c.as_text())] for k, c in progs.items()}

    def seen(diff: float, whole: float) -> bool:  # a difference above the noise: over 5 % of the time it is part of
        return diff > 0.05 * whole

    d_ops = t["fma4_sum"] - t["fma1_sum"]
    ops = 6 * n / d_ops if seen(d_ops, t["fma4_sum"]) else None
    pass_s = t["fma1_sum"] - t["sum"] - (2 * n / ops if ops else 0.0)
    pass_s = pass_s if (ops and seen(pass_s, t["fma1_sum"])) else None
    extra = t["exp_sum"] - t["sum"]
    exp = {"per_s": n / extra if seen(extra, t["exp_sum"]) else n / t["exp_sum"], "seconds": t,
           "elements": n, "kernels": kinds,
           "how": "row sums of exp(x) and of x over an in-cache [rows, 1024] float32 array, alternating in rounds: "
                  "elements / extra time (the produced operand's pass included)"}
    beyond = extra - (pass_s or 0.0)
    if pass_s and seen(beyond, t["exp_sum"]):
        exp["per_s_beyond_pass"] = n / beyond
    lib = {"ops": {"per_s": ops}, "pass": {"per_s": n / pass_s if pass_s else None}, "seconds": t, "elements": n,
           "kernels": kinds, "library": all(k and k[0] for k in kinds.values()),
           "how": "row sums of x, of x·a + b and of four multiply-adds over an in-cache [rows, 1024] float32 array, "
                  "alternating in rounds: ops/s = 6 n / (t4 − t1); pass = t1 − t(sum) − 2 n / ops/s"}
    return exp, lib


def _first_touch(xbig, st: dict, nel: int, reps: int, quiet: bool) -> dict:
    """What a fresh large output costs beyond a reused one (page faults), or a note that it costs nothing here."""
    import jax

    _say("calibrate: first-touch cost of fresh large outputs (the same kernel, a new output buffer each call)", quiet)
    fresh = jax.jit(lambda x: x * 1.0001 + 0.5).lower(xbig).compile()
    mf = measure(fresh, xbig, warmup=1, repeats=max(3, reps // 2))
    extra = mf.median_s - st["per_trip_s"]
    measurable = extra > 0.05 * st["per_trip_s"]
    out = {"bytes_per_s": nel * 4 / extra if measurable else None, "fresh_call_s": mf.median_s,
           "out_of_place_trip_s": st["per_trip_s"],
           "why": "buffers above glibc's mmap threshold (32 MiB) are mapped fresh on every call, so "
                  "each new output page is faulted in and zeroed: a fresh-output call against one "
                  "trip of the out-of-place loop, whose output pages are already mapped"}
    if not measurable:
        out["note"] = ("a fresh output cost no more than a reused one (within 5 %): page faults are "
                       "not priced on this host")
    return out


def _transcendentals(vprobe, nel_t: int, reps: int, quiet: bool) -> dict:
    """Special functions' throughput: a dependent chain on an in-cache array, per function."""
    import jax
    import jax.numpy as jnp

    depth = VECTOR_DEPTH  # deeper chains spill: 8-deep ran at half the per-op rate of a softmax here
    chains = {"exp": None, "tanh": jnp.tanh, "log": lambda y: jnp.log(1.0 + y)}  # exp: the vector probe itself
    xt = vprobe[1]
    tr = {}
    for name, op in chains.items():
        _say(f"calibrate: {name} throughput ({depth}-deep chain over {nel_t} in-cache floats)", quiet)

        def chain(y, op=op):
            for _ in range(depth):
                y = op(y)
            return y

        c = vprobe[0] if op is None else jax.jit(chain).lower(xt).compile()
        m = measure(c, xt, warmup=2, repeats=reps)
        tr[name] = {"per_s": depth * nel_t / m.median_s, "spread": m.spread, "elements": nel_t, "depth": depth}
    return tr


def _call_costs(out: dict, dev, reps: int, quick: bool, quiet: bool) -> None:
    """out['call_overhead_s'], out['kernel_launch'] and (full calibrations) out['rendezvous']."""
    import jax
    import jax.numpy as jnp

    # fixed cost of one call: a compiled program that does almost nothing (dispatch, argument handling, sync)
    _say("calibrate: per-call overhead (a one-element program)", quiet)
    one = jax.device_put(jnp.ones((1,), jnp.float32), dev)
    c = jax.jit(lambda v: v + 1.0).lower(one).compile()
    m = measure(c, one, warmup=3, repeats=reps)
    out["call_overhead_s"] = m.median_s
    _say("calibrate: per-kernel launch cost (chains of tiny dependent kernels)", quiet)
    out["kernel_launch"] = measure_kernel_launch(dev, reps)
    if not quick:
        _say("calibrate: rendezvous cost of one collective on 8 simulated devices, groups of 2, 4, 8 (a fresh "
             "process)", quiet)
        out["rendezvous"] = measure_rendezvous(8, 5)


def _stream_drift(out: dict, stream_samples: list[float], read_samples: list[float] | None = None) -> None:
    """out['stream'] takes the median of its samples (start, middle, end, and more at the end until the last three
    agree within 15 %, at most three more); `spread` is (max − min) / median of them all, `stable` whether the last
    three agreed; a spread over 15 % is a finding (and a warning in `workbench calibrate`)."""
    lo, hi = min(stream_samples), max(stream_samples)
    med = sorted(stream_samples)[len(stream_samples) // 2]
    last = sorted(stream_samples[-3:])
    out["stream"]["iqr_spread"] = out["stream"].get("spread")
    out["stream"].update(samples=stream_samples, range_bytes_per_s=[lo, hi], bytes_per_s=med,
                         spread=(hi - lo) / med if med > 0 else None,
                         stable=bool(last[0] > 0 and last[-1] <= 1.15 * last[0]),
                         sampled="at the start, the middle and the end of the calibration (more at the end until "
                                 "the last three agree within 15 %); bytes_per_s is the median")
    if read_samples:
        out["stream"]["samples_read"] = read_samples
    if hi > 1.15 * lo:
        out["findings"].append(f"streaming bandwidth drifted {hi / lo - 1:.0%} across the calibration "
                               f"({lo / 1e9:.1f}–{hi / 1e9:.1f} GB/s): memory-bound predictions carry that band")


def run_calibration(*, quick: bool = False, quiet: bool = False) -> dict:
    """Measure the host's ceilings (about a minute: 65 s on a 2-core Zen 4 VM; quick=True uses small sizes, for tests)."""
    import jax

    feat = cpu_features()
    reps = 5 if quick else 9
    out = _calibration_header(feat, quick)
    dev = jax.local_devices()[0]  # this process's own (in a process group, devices()[0] may be another's)
    llc = feat["llc_bytes"] or 32 * 2**20
    nbytes = (64 * 2**20) if quick else int(min(max(512 * 2**20, 16 * llc), max(feat["mem_bytes"] // 8, 64 * 2**20)))
    nel = nbytes // 4
    # streaming bandwidth is sampled at the start, the middle and the end: a noisy VM drifts during the calibration
    few = max(3, reps // 3)
    bw0, st0, xbig = _stream_sample(nel, dev, few, quiet, "start")
    stream_samples, read_samples = [bw0], [st0["read_bytes_per_s"]]
    n = 512 if quick else 2048
    probe = matmul_probe(n, dev)
    mm_samples = {"start": matmul_sample(probe, few, quiet, "start")}
    # the vector units' rate (special functions, conversions, in-cache reductions) is sampled the same way
    nel_t = min(1 << 20, max(llc // 16, 1 << 16))
    vprobe = vector_probe(nel_t, dev)
    vec_samples = {"start": vector_sample(vprobe, few, quiet, "start")}
    # matmuls: every operand dtype in each result form XLA:CPU compiles; the fastest form is the dtype's ceiling
    mm, findings = matmul_ceilings(n, reps, dev, feat, quiet=quiet)
    out["matmul"] = mm
    out.setdefault("findings", []).extend(findings)
    out["matmul_curves"], out["matmul_curve"] = _matmul_curves(n, mm, dev, reps, quick, quiet)
    out["skinny_dots"] = _skinny_dots(dev, reps, quick, quiet)
    bw_mid, st, xbig = _streams(out, nel, dev, reps, few, quiet, xbig)
    stream_samples.append(bw_mid)
    read_samples.append(st["read_bytes_per_s"])
    # the caches first: the in-cache probes after them are sized by what this process really holds of the
    # last level (a VM's OS may report the host's whole shared cache)
    out["cache_levels"], level_findings = measure_cache_levels(feat.get("caches") or [], dev, quick, quiet,
                                                               memory_bw=bw_mid,
                                                               memory_read_bw=st.get("read_bytes_per_s"))
    out["findings"] += level_findings
    llc = effective_llc_bytes(out["cache_levels"], llc)
    out["llc_effective_bytes"] = llc
    _cache_reduce_convert_transpose(out, xbig, bw_mid, dev, llc, reps, quick, quiet)
    out["first_touch"] = _first_touch(xbig, st, nel, reps, quiet)
    out["transcendentals"] = _transcendentals(vprobe, nel_t, reps, quiet)
    out["transcendentals_throughput"] = _transcendental_throughput(vprobe, reps, quiet)
    out["transcendentals_library"], out["library_fusion"] = _transcendental_library(dev, nel_t, reps, quiet)
    _call_costs(out, dev, reps, quick, quiet)
    _say("calibrate: the start of a stream from memory (sums over distinct 1-8 MiB arrays)", quiet)
    out["memory_start"] = measure_memory_start(dev, max(feat["llc_bytes"] or 0, llc), reps, quick)
    for i in range(4):  # the end sample, and up to three more until the last three agree within 15 %
        bw_end, st_end, _ = _stream_sample(nel, dev, few, quiet, "end" if i == 0 else f"end, again ({i})", xbig)
        stream_samples.append(bw_end)
        read_samples.append(st_end["read_bytes_per_s"])
        last = sorted(stream_samples[-3:])
        if last[-1] <= 1.15 * last[0]:
            break
    del xbig
    mm_samples["end"] = matmul_sample(probe, few, quiet, "end")
    del probe
    mm_samples["middle"] = out["matmul"]["float32"]["flops_per_s"]
    out["findings"] += apply_matmul_level(out, mm_samples)
    vec_samples["end"] = vector_sample(vprobe, few, quiet, "end")
    del vprobe
    vec_samples["middle"] = out["transcendentals"]["exp"]["per_s"]
    out["findings"] += apply_vector_level(out, vec_samples)
    _stream_drift(out, stream_samples, read_samples)
    out["findings"] += peak_findings(out)
    return out


def measure_reduce(big, cached, reps: int, quiet: bool) -> dict:
    """Elements/s a reduction kernel consumes: a sum over the stream's buffer (far beyond the last-level cache) and
    over the in-cache buffer. On this project's Zen 3 VMs the first runs at about half the stream's bandwidth: the
    reduction's dependent adds, not the memory, bound it (docs/accuracy.md)."""
    import jax

    out = {}
    for key, x in (("from_memory", big), ("in_cache", cached)):
        _say(f"calibrate: reduction throughput ({key.replace('_', ' ')}, {x.size * 4 / 2**20:.0f} MiB)", quiet)
        c = jax.jit(lambda v: v.sum()).lower(x).compile()
        m = measure(c, x, warmup=2, repeats=reps)
        out[key] = {"per_s": x.size / m.median_s, "elements": int(x.size), "spread": m.spread}
    out["how"] = "jnp.sum of a float32 vector: elements / median time"
    return out


ROW_PRODUCT_N = 4096  # the weight's columns in the one-row product probe (its rows: the stream's buffer / this)


def measure_row_product(big, reps: int, quiet: bool, rounds: int = 3) -> dict:
    """How fast a product with one row reads its weight from memory, against a sum over the same bytes: x·W with x
    (1, K) and W (K, 4096) float32 the stream's buffer (the form a decode step's projections take: the weight's rows
    contracted, XLA:CPU's matrix-vector kernel) and jnp.sum over it, alternating in `rounds` rounds; the read ratio
    is the median of each round's product rate over its sum rate (the machine's drift cancels within a round). The
    memory model prices a one-row product's weight reads at the memory's read rate times this ratio
    (Measured.row_product_read_ratio)."""
    import jax
    import jax.numpy as jnp

    k = big.size // ROW_PRODUCT_N
    w = (big if big.size == k * ROW_PRODUCT_N else big[: k * ROW_PRODUCT_N]).reshape(k, ROW_PRODUCT_N)  # no copy
    x = jnp.ones((1, k), jnp.float32)
    prod = jax.jit(lambda x, w: x @ w).lower(x, w).compile()
    total = jax.jit(lambda w: w.sum()).lower(w).compile()
    nbytes = k * ROW_PRODUCT_N * 4
    rates, sums = [], []
    for r in range(rounds):
        _say(f"calibrate: one-row product over a {nbytes / 2**20:.0f} MiB weight against a sum over it "
             f"(round {r + 1}/{rounds})", quiet)
        rates.append(nbytes / measure(prod, x, w, warmup=2, repeats=max(3, reps // rounds)).median_s)
        sums.append(nbytes / measure(total, w, warmup=1, repeats=max(3, reps // rounds)).median_s)
    ratios = sorted(p / q for p, q in zip(rates, sums))
    return {"read_ratio": ratios[len(ratios) // 2], "bytes_per_s": sorted(rates)[rounds // 2],
            "sum_bytes_per_s": sorted(sums)[rounds // 2], "ratios": ratios, "weight": [k, ROW_PRODUCT_N],
            "how": "x (1, K) @ W (K, 4096) float32 over the stream's buffer, alternating with jnp.sum over W: "
                   "the median round's weight bytes/s ratio"}


def transpose_sizes(llc: int, quick: bool = False) -> dict[str, int]:
    """n of the n×n float32 transposes the calibration times: in the cache (input and output within half the
    last-level cache) and from memory (each array at least twice the cache; quick: 2000). Each n is a little below a
    power of two: a row stride of a large power of two bytes falls into few of the L1 cache's sets, and a 1024² or
    4096² transpose ran 3–4× slower than a 1000² or 4000² one here, a worst case the programs' own transposes do
    not show (docs/accuracy.md)."""
    n_c = 1 << max(6, int(math.log2(math.sqrt(llc / 2 / 8))))
    n_m = 2048 if quick else 1 << max(12, math.ceil(math.log2(math.sqrt(2 * llc / 4))))
    return {"in_cache": n_c - 24, "from_memory": n_m - 96 if n_m > 2048 else n_m - 48}


def measure_transpose(dev, llc: int, reps: int, quiet: bool, quick: bool = False) -> dict:
    """Elements/s of a strided transpose (the output contiguous along the input's other dimension) inside a fused
    elementwise kernel, y = (a·x + b)ᵀ, over an n×n float32 array in the cache and one from memory. XLA:CPU walks
    such a kernel element by element, each read a different cache line's: on this project's Zen 4 VMs 1.3–1.6 G
    elements/s in the cache (n = 1000) and 0.2–0.5 from memory (n = 4000), against 2.6 G/s for the stream's own 1:1
    kernel, which the kernel's bytes alone would price it at (docs/accuracy.md)."""
    import jax
    import jax.numpy as jnp

    out = {}
    for key, n in transpose_sizes(llc, quick).items():
        _say(f"calibrate: strided transpose in a fused kernel ({key.replace('_', ' ')}, {n}×{n} float32)", quiet)
        x = jax.device_put(jax.random.normal(jax.random.key(5), (n, n), jnp.float32), dev)
        c = jax.jit(lambda v: (v * 1.0001 + 0.5).T).lower(x).compile()
        m = measure(c, x, warmup=2, repeats=reps)
        out[key] = {"per_s": n * n / m.median_s, "n": n, "spread": m.spread}
    out["how"] = "(a·x + b)ᵀ of an n×n float32 array, one fused kernel: elements / median time"
    return out


def measure_convert(dev, reps: int, quiet: bool) -> dict:
    """float32 <-> bf16 conversions/s inside fused elementwise kernels: two chains of bf16 multiply-adds (4 and 16
    deep) over an in-cache vector; the conversions XLA put in each (counted from its HLO, as the kernel model
    counts them) over the time the longer chain took beyond the shorter one."""
    import jax
    import jax.numpy as jnp

    n = 1 << 18
    x = jax.device_put(jnp.ones((n,), jnp.bfloat16), dev)

    def chain(depth):
        def f(y):
            for i in range(depth):
                y = y * (1.0 + 0.25 * i) + 0.5
            return y
        return f

    _say("calibrate: float32 <-> bf16 conversion throughput (bf16 chains, 4 and 16 deep)", quiet)
    progs, conv, times = {}, {}, {4: [], 16: []}
    for depth in (4, 16):
        progs[depth] = c = jax.jit(chain(depth)).lower(x).compile()
        conv[depth] = sum(k.convert_elements * k.count for k in parse_kernels(c.as_text()))
    # the rate is a difference of two timings, so a spell on one of them moves it by more than the spell: the two
    # chains alternate in rounds (as the matmul forms do), and each keeps the median of its rounds' calls
    rounds = 3
    for r in range(rounds):
        for depth, c in progs.items():
            times[depth] += measure(c, x, warmup=2 if r == 0 else 1, repeats=math.ceil(reps / rounds)).times_s
    t = {d: summarize(v, warmup=2, calls=1, compile_s=None).median_s for d, v in times.items()}
    dc, dt = conv[16] - conv[4], t[16] - t[4]
    return {"per_s": dc / dt if dc > 0 and dt > 0 else None, "converted_elements": conv, "seconds": t,
            "rounds": rounds,
            "how": "bf16 multiply-add chains 16 and 4 deep over 2^18 in-cache elements, alternating in rounds: extra "
                   "conversions / extra time"}


def _oop_loop(trips: int):
    """A program that runs one out-of-place streaming kernel `trips` times: each trip reads x and writes a second
    buffer of the same size that it never reads (the loop carry, so the same pages every trip), as a fused kernel
    writing a fresh array does."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def f(x):
        def body(i, c):
            return c[0], c[0] * 1.0001 + i.astype(jnp.float32)
        return lax.fori_loop(0, trips, body, (x, jnp.zeros_like(x)))[1]
    return jax.jit(f)


def stream_out_of_place(x, reps: int, trips: tuple[int, int] = (1, 9)) -> dict:
    """bytes/s (read + write counted) of a fused kernel that reads one buffer and writes another: the per-trip time
    of the out-of-place loop, (t(t2) - t(t1)) / (t2 - t1), so the call's own overhead and the one fresh output it
    returns cancel. On this project's Zen 3 VMs it streams at about half the in-place rate (docs/hardware.md)."""
    t1, t2 = trips
    c1, c2 = _oop_loop(t1).lower(x).compile(), _oop_loop(t2).lower(x).compile()
    for _ in range(2):  # a second try where noise made the longer loop look no slower
        m1 = measure(c1, x, warmup=1, repeats=reps)
        m2 = measure(c2, x, warmup=1, repeats=reps)
        dt = m2.median_s - m1.median_s
        if dt > 0:
            break
    traffic = 2.0 * x.size * x.dtype.itemsize * (t2 - t1)
    if dt <= 0:
        raise WorkbenchError("calibration: the out-of-place stream loop ran no slower with more trips; the host is too "
                             "noisy to calibrate now: rerun `workbench calibrate --force` on a quieter machine")
    return {"bytes_per_s": traffic / dt, "bytes_per_s_iqr": traffic * math.hypot(m1.iqr_s, m2.iqr_s) / dt**2,
            "per_trip_s": dt / (t2 - t1), "trips": list(trips), "spread": max(m1.spread, m2.spread)}


def _stream_sample(nel: int, dev, reps: int, quiet: bool, when: str, x=None):
    """(bytes/s, details, buffer) of the out-of-place streaming kernel over nel float32s (stream_out_of_place),
    read + write counted; details['read_bytes_per_s'] is a sum over the same buffer timed right after it (the
    memory's read rate at the same moment)."""
    import jax
    import jax.numpy as jnp

    _say(f"calibrate: streaming bandwidth over {nel * 4 / 2**20:.0f} MiB buffers ({when}; out of place)", quiet)
    if x is None:
        x = jax.device_put(jax.random.normal(jax.random.key(2), (nel,), jnp.float32), dev)
    r = stream_out_of_place(x, reps)
    r["read_bytes_per_s"] = _read_rate(x, reps)
    return r["bytes_per_s"], r, x


def matmul_probe(n: int, dev, dtype: str = "float32", result: str | None = None):
    """(compiled, x, y) of an n³ matmul in `dtype` with a `result` result (default: the operands' dtype); the float32
    one samples the machine's matmul rate (matmul_sample)."""
    import jax
    import jax.numpy as jnp

    a = jax.ShapeDtypeStruct((n, n), jnp.dtype(dtype))
    x, y = random_inputs((a, a), seed=1)
    x, y = jax.device_put(x, dev), jax.device_put(y, dev)
    rt = jnp.dtype(result or dtype)
    return jax.jit(lambda p, q: jax.lax.dot(p, q, preferred_element_type=rt)).lower(x, y).compile(), x, y


def matmul_sample(probe, reps: int, quiet: bool = True, when: str = "now") -> float:
    """Median FLOP/s of the probe's matmul (matmul_probe) over `reps` timed calls."""
    c, x, y = probe
    n = x.shape[0]
    _say(f"calibrate: float32 matmul {n}³ ({when}; the machine's matmul rate)", quiet)
    return 2.0 * n**3 / measure(c, x, y, warmup=1, repeats=reps).median_s


def _level(samples: dict[str, float]) -> tuple[list[float], float, float]:
    """(the samples sorted, their median, median / the 'middle' sample): the level a phase's figures take."""
    vals = sorted(samples.values())
    med, mid = vals[len(vals) // 2], samples["middle"]
    return vals, med, (med / mid if mid > 0 else 1.0)


def apply_matmul_level(cal: dict, samples: dict[str, float]) -> list[str]:
    """Set the level of the calibration's matmul figures to the median of the float32 samples taken across it.

    `samples` maps when ('start', 'middle' = the matmul phase's own float32 ceiling, 'end') to FLOP/s of the same
    float32 matmul. The phase measured every dtype and every size of the rate curve within a minute, so their ratios
    to each other are its own; its level is one moment of a machine whose matmul rate moves by tens of percent
    within minutes (60–105 GFLOP/s for 2048³ within one minute on this project's VMs). Every figure is scaled by
    median / middle, keeping the phase value as `flops_per_s_measured`; `matmul_level` records the samples, their
    range and the factor. Returns the findings: one line when the samples span more than 15 %."""
    vals, med, factor = _level(samples)
    for v in (list(cal.get("matmul", {}).values()) + list(cal.get("matmul_curve", []))
              + [r for rows in (cal.get("matmul_curves") or {}).values() for r in rows]):
        v["flops_per_s_measured"] = v["flops_per_s"]
        v["flops_per_s"] = v["flops_per_s"] * factor
    cal["matmul_level"] = {"samples": dict(samples), "range_flops_per_s": [vals[0], vals[-1]], "factor": factor,
                           "n": cal.get("matmul", {}).get("float32", {}).get("n"),
                           "sampled": "float32 matmul at the start, in the matmul phase (middle) and at the end; "
                                      "every matmul figure is scaled by median / middle"}
    lo, hi = vals[0], vals[-1]
    if lo > 0 and hi > 1.15 * lo:
        return [f"float32 matmul rate drifted {hi / lo - 1:.0%} across the calibration ({lo / 1e9:.0f}–"
                f"{hi / 1e9:.0f} GFLOP/s); the matmul figures are levelled to the median sample ({med / 1e9:.0f}, "
                f"×{factor:.2f} the matmul phase)"]
    return []


VECTOR_DEPTH = 2


def vector_probe(nel: int, dev):
    """(compiled, x) of the vector units' probe: the calibration's exp chain (VECTOR_DEPTH dependent exp(-y) over
    nel in-cache floats): the calibration times this very program for `transcendentals.exp` (vector_sample)."""
    import jax
    import jax.numpy as jnp

    x = jax.device_put(jax.random.uniform(jax.random.key(3), (nel,), jnp.float32, 0.1, 1.0), dev)

    def chain(y):
        for _ in range(VECTOR_DEPTH):
            y = jnp.exp(-y)
        return y

    return jax.jit(chain).lower(x).compile(), x


def vector_sample(probe, reps: int, quiet: bool = True, when: str = "now") -> float:
    """Median exponentials/s of the vector probe (vector_probe) over `reps` timed calls."""
    c, x = probe
    _say(f"calibrate: exp chain over {x.size} in-cache floats ({when}; the vector units' rate)", quiet)
    return VECTOR_DEPTH * x.size / measure(c, x, warmup=1, repeats=reps).median_s


# the figures a vector-unit level scales: compute-bound kernels over in-cache data (the reduction from memory and
# the streams are memory rates, sampled on their own)
def _vector_figures(cal: dict) -> list[dict]:
    out = list((cal.get("transcendentals") or {}).values())
    out += list((cal.get("transcendentals_throughput") or {}).values())
    if (cal.get("transcendentals_library") or {}).get("per_s"):
        out.append(cal["transcendentals_library"])
    out += [v for v in ((cal.get("library_fusion") or {}).get(k) or {} for k in ("ops", "pass")) if v.get("per_s")]
    if (cal.get("convert") or {}).get("per_s"):
        out.append(cal["convert"])
    if ((cal.get("reduce") or {}).get("in_cache") or {}).get("per_s"):
        out.append(cal["reduce"]["in_cache"])
    return out


def apply_vector_level(cal: dict, samples: dict[str, float]) -> list[str]:
    """Set the level of the calibration's vector-unit figures (special functions, float32 <-> narrow-float
    conversions, in-cache reductions) to the median of the exp-probe samples taken across it, as apply_matmul_level
    does for the matmuls: `samples` maps 'start', 'middle' (the special-function phase's own exp rate) and 'end' to
    exponentials/s of the same probe. The phase measured these figures within seconds of each other, so their
    ratios are its own; its level is one moment of a VM whose vector rate moves by up to 2× within minutes (the
    same [8192, 2048] softmax: 11.9 ms, then 18.7 ms eight minutes later, docs/hardware.md). Every figure is scaled
    by median / middle, the phase value kept as `per_s_measured`; `vector_level` records the samples, their range,
    the factor and `level` (the median: the rate a later probe is compared with). Returns the findings: one line
    when the samples span more than 15 %."""
    vals, med, factor = _level(samples)
    for v in _vector_figures(cal):
        v["per_s_measured"] = v["per_s"]
        v["per_s"] = v["per_s"] * factor
        if v.get("per_s_beyond_pass"):
            v["per_s_beyond_pass"] *= factor
    cal["vector_level"] = {"samples": dict(samples), "range_per_s": [vals[0], vals[-1]], "factor": factor,
                           "level": med, "depth": VECTOR_DEPTH,
                           "sampled": "the exp chain at the start, in the special-function phase (middle) and at the "
                                      "end; special functions, conversions and in-cache reductions are scaled by "
                                      "median / middle"}
    lo, hi = vals[0], vals[-1]
    if lo > 0 and hi > 1.15 * lo:
        return [f"vector units' rate (the exp probe) drifted {hi / lo - 1:.0%} across the calibration "
                f"({lo / 1e9:.2f}–{hi / 1e9:.2f} G/s); special-function, conversion and in-cache reduction rates are "
                f"levelled to the median sample (×{factor:.2f} their phase)"]
    return []


def quick_mode() -> bool:
    """WORKBENCH_CALIBRATION=quick (the test suite sets it): a missing calibration is measured at the quick sizes
    (seconds, not minutes) and a cached quick one is accepted. Tests check the mechanics, not this host's ceilings."""
    return os.environ.get("WORKBENCH_CALIBRATION", "") == "quick"


def _cached(path: str, quick: bool) -> dict | None:
    """The calibration stored at `path` (a quick one only where a quick one will do), None where there is none."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not quick and data.get("quick"):
        return None
    data["cached"] = True
    return data


@contextlib.contextmanager
def calibration_lock(quiet: bool = False, name: str = "calibrate.lock"):
    """One calibration at a time per cache directory: two processes calibrating the same host at once would time each
    other's load. An exclusive flock on `name` in the cache directory (a process group's launcher holds one of its
    own while the calibration it starts takes this one); where there is no fcntl or the filesystem has no locks, no
    lock. A process that finds it taken says so and waits. Yields the lock file's path."""
    os.makedirs(cache_dir(), exist_ok=True)
    path = os.path.join(cache_dir(), name)
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield path
        return
    with open(path, "a") as f:
        locked = True
        try:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                _say(f"workbench: waiting for another process to calibrate this host (lock {path}; two at once would "
                     "time each other)", quiet)
                fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            locked = False
        try:
            yield path
        finally:
            if locked:
                fcntl.flock(f, fcntl.LOCK_UN)


def load_or_calibrate(*, force: bool = False, quick: bool = False, quiet: bool = False,
                      run_if_missing: bool = True) -> dict:
    quick = quick or quick_mode()
    feat = cpu_features()
    fp = fingerprint(feat)
    path = _cache_path(fp)
    data = None if force else _cached(path, quick)
    if data is not None:
        return data
    if not run_if_missing:
        raise WorkbenchError("this host is not calibrated yet; run `workbench calibrate`")
    with calibration_lock(quiet):
        data = None if force else _cached(path, quick)  # another process calibrated it while this one waited
        if data is not None:
            return data
        data = run_calibration(quick=quick, quiet=quiet)
        data["fingerprint"] = fp
        tmp = path + f".tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)
    data["cached"] = False
    data["path"] = path
    return data


WRITE_ALLOCATE_RATIO = 1.3


def write_allocates(cal: dict) -> bool:
    """Whether the host's caches read a line in before writing it: the in-place stream (the output over its input,
    whose lines the read just brought in) ran at least WRITE_ALLOCATE_RATIO × the out-of-place one (a fresh output
    is read, then written: 3 bytes moved per 2 counted; 1.5× if nothing else differs; 1.7–3.6× on this project's Zen
    4 VMs). Non-temporal stores would make the two rates equal."""
    inplace = (cal.get("stream_inplace") or {}).get("bytes_per_s")
    oop = (cal.get("stream") or {}).get("bytes_per_s")
    return bool(inplace and oop and inplace >= WRITE_ALLOCATE_RATIO * oop)


def memory_read_ratio(cal: dict) -> float | None:
    """The memory's read-only rate over its out-of-place stream: the median over the stream samples of each one's
    sum over the same buffer (`stream.samples_read`, timed beside it), else (calibrations before version 23) the
    from-memory reduction's bytes over the stream's median. None where reads run slower than the stream counts
    (below 1: the sum is bounded by its adds, not the memory, so it does not measure the reads)."""
    st = cal.get("stream") or {}
    pairs = [(r, b) for r, b in zip(st.get("samples_read") or (), st.get("samples") or ()) if r and b]
    if pairs:
        ratios = sorted(r / b for r, b in pairs)
        ratio = ratios[len(ratios) // 2]
    else:
        per = ((cal.get("reduce") or {}).get("from_memory") or {}).get("per_s")
        ratio = per * 4 / st["bytes_per_s"] if (per and st.get("bytes_per_s")) else None
    return ratio if ratio and ratio >= 1.0 else None


def row_product_read_ratio(cal: dict) -> float | None:
    """A one-row product's weight-read rate over a sum's over the same bytes in memory (`row_product`, version 28
    on); None without it, or where the memory's read rate is not itself the sum's (memory_read_ratio None): the
    ratio is relative to that rate."""
    r = (cal.get("row_product") or {}).get("read_ratio")
    return float(r) if (r and r > 0 and memory_read_ratio(cal)) else None


def host_cache_levels(cal: dict) -> tuple[MemoryLevel, ...] | None:
    """The measured cache levels of a calibration (`cache_levels`, version 23 on): each data or unified level with a
    measured stream, its capacity for this process and its read ratio (a level without a measured read rate: 1).
    None for older calibrations: the pricing then takes the last-level cache at `cache_stream`."""
    out = []
    mem_bw = (cal.get("stream") or {}).get("bytes_per_s")
    mem_read = mem_bw * (memory_read_ratio(cal) or 1.0) if mem_bw else None
    for lv in cal.get("cache_levels") or ():
        if not lv.get("capacity_bytes"):
            continue
        if lv.get("bytes_per_s"):  # effective_bytes: what the process really holds
            out.append(MemoryLevel(f"L{lv['level']}", float(lv.get("effective_bytes") or lv["capacity_bytes"]),
                                   float(lv["bytes_per_s"]), float(lv.get("read_ratio") or 1.0)))
        elif lv.get("tried") and lv.get("read_ratio"):
            # version 24 judged a level by its stream alone: its last working set counts where its reads beat
            # memory's (level_beats_memory), as a level of that size
            last = lv["tried"][-1]
            if level_beats_memory(last["bytes_per_s"], lv["read_ratio"], mem_bw, mem_read):
                out.append(MemoryLevel(f"L{lv['level']}", float(min(lv["capacity_bytes"], last["working_set_bytes"])),
                                       float(last["bytes_per_s"]), float(lv["read_ratio"])))
    return tuple(sorted(out, key=lambda v: v.capacity)) or None


def convert_rate(cal: dict) -> float | None:
    """float32 <-> narrow-float conversions/s: the calibration's slope between its two bf16 chains (extra conversions
    over extra time), but never slower than either chain converted over its whole time (converts / the chain's
    time, at the same level): a kernel's whole time bounds the time of its conversions, so a slope below that is the
    deeper chain's other costs (its spills), not conversions."""
    cv = cal.get("convert") or {}
    rate = cv.get("per_s")
    conv, secs = cv.get("converted_elements") or {}, cv.get("seconds") or {}
    level = rate / cv["per_s_measured"] if (rate and cv.get("per_s_measured")) else 1.0
    whole = [conv[d] / secs[d] * level for d in conv if secs.get(d)]
    return max([r for r in (rate, *whole) if r], default=None)


def first_touch_bw(cal: dict) -> float | None:
    """Bytes/s at which fresh large outputs are page-faulted in, or None where the calibration could not tell it
    from the stream's own noise: the fresh-output call is compared with a trip of the out-of-place loop at the
    slowest stream sample of the calibration (the trip it was timed beside may have run in a fast spell), and only
    what it took beyond that, by more than 5 %, is priced."""
    ft = cal.get("first_touch") or {}
    bw = ft.get("bytes_per_s")
    st = cal.get("stream") or {}
    fresh, lo, nbytes = ft.get("fresh_call_s"), (st.get("range_bytes_per_s") or [None])[0], st.get("buffer_bytes")
    if not bw or not (fresh and lo and nbytes):
        return bw
    slow_trip = 2.0 * nbytes / lo
    extra = fresh - slow_trip
    return nbytes / extra if extra > 0.05 * slow_trip else None


def spec_from_calibration(cal: dict) -> HardwareSpec:
    date = cal.get("time", "")[:10]
    src_m = Source("measured by `workbench calibrate` (XLA on this host, median of repeats)", date)
    peaks = {dt: v["flops_per_s"] for dt, v in cal["matmul"].items()}
    if cal.get("matmul_curve"):  # float32: the best rate XLA reached over the sizes measured
        peaks["float32"] = max(peaks["float32"], *(r["flops_per_s"] for r in cal["matmul_curve"]))
    for dt, rows in (cal.get("matmul_curves") or {}).items():  # a narrow dtype's own curve, the same way
        if rows and dt in peaks:
            peaks[dt] = max(peaks[dt], *(r["flops_per_s"] for r in rows))
    bw = cal["stream"]["bytes_per_s"]
    conv = convert_rate(cal)
    # special functions: their throughput over independent elements (version 23 on), else the 2-deep chains
    tr = cal.get("transcendentals_throughput") or cal["transcendentals"]
    rate = sorted(v["per_s"] for v in tr.values())[len(tr) // 2]  # the median function
    # inside a library (YNN) fusion: measured there (version 23 on; from version 27 beyond the pass that writes the
    # reduced operand, which is priced on its own), else that library's in-cache reduction rate
    libf = cal.get("library_fusion") or {}
    tl = cal.get("transcendentals_library") or {}
    lib_pass = (libf.get("pass") or {}).get("per_s")
    lib_ops = (libf.get("ops") or {}).get("per_s")
    if not (lib_pass and lib_ops and tl.get("per_s_beyond_pass")) or libf.get("library") is False:
        # not all measured (the exponentials' rate then holds the pass: not priced twice), or the probes ran
        # outside a library fusion: a library fusion is priced as XLA's own kernels are
        lib_pass = lib_ops = None
    lib = (tl.get("per_s_beyond_pass") if lib_pass else None) or tl.get("per_s") or \
        ((cal.get("reduce") or {}).get("in_cache") or {}).get("per_s")
    feat = cal["cpu"]
    levels = host_cache_levels(cal)
    # the last-level cache as the pricing holds it: the largest measured level (what this process really holds,
    # at its own stream), else the OS's size at the in-cache stream
    onchip_bw = cal.get("cache_stream", {}).get("bytes_per_s")
    onchip_bytes = float(feat["llc_bytes"]) or None
    if levels:
        onchip_bw, onchip_bytes = levels[-1].bw, levels[-1].capacity
    return HardwareSpec(
        name="host", kind="cpu", vendor=feat.get("vendor", ""), peak_flops=peaks,
        hbm_bytes=float(feat["mem_bytes"]), hbm_bw=bw,
        interconnect=Interconnect("host-memory", bw, 1),
        measured=Measured(
            first_touch_bw=first_touch_bw(cal),
            onchip_bw=onchip_bw,
            call_overhead_s=cal.get("call_overhead_s"),
            matmul_curve=tuple((r["n"], r["flops_per_s"]) for r in cal.get("matmul_curve", ())) or None,
            matmul_curves=tuple((dt, tuple((r["n"], r["flops_per_s"]) for r in rows))
                                for dt, rows in sorted((cal.get("matmul_curves") or {}).items()) if rows) or None,
            skinny_curve=tuple((r["rows"], r["flops_per_s"]) for r in cal.get("skinny_dots") or ()) or None,
            hbm_bw_range=tuple(cal["stream"]["range_bytes_per_s"]) if cal["stream"].get("range_bytes_per_s") else None,
            kernel_launch_s=(cal.get("kernel_launch") or {}).get("per_kernel_s"),
            memory_start_s=(cal.get("memory_start") or {}).get("per_kernel_s"),
            collective_latency_s=(cal.get("rendezvous") or {}).get("per_collective_per_device_s"),
            collective_latency_by_group=tuple(sorted((int(g), v["per_collective_per_device_s"]) for g, v in
                                                     ((cal.get("rendezvous") or {}).get("by_group") or {}).items()))
            or None,
            reduce_per_s=((cal.get("reduce") or {}).get("from_memory") or {}).get("per_s"),
            reduce_per_s_cached=((cal.get("reduce") or {}).get("in_cache") or {}).get("per_s"),
            convert_per_s=conv,
            write_allocate=write_allocates(cal),
            transpose_per_s=((cal.get("transpose") or {}).get("from_memory") or {}).get("per_s"),
            transpose_per_s_cached=((cal.get("transpose") or {}).get("in_cache") or {}).get("per_s"),
            cache_levels=levels, memory_read_ratio=memory_read_ratio(cal),
            row_product_read_ratio=row_product_read_ratio(cal),
            transcendentals_per_s_library=lib,
            library_pass_per_s=lib_pass, library_ops_per_s=lib_ops,
            physical_peak_flops=cal["physical"]["peak_flops"],
            physical_clock_ghz=cal["physical"]["derivation"].get("clock_ghz")),
        onchip_bytes=onchip_bytes, matrix_unit=None, transcendentals_per_s=rate,
        sources={"peak_flops": src_m, "hbm_bw": src_m, "transcendentals_per_s": src_m,
                 "physical_peak_flops": Source("derived from CPU features: " + "; ".join(
                     f"{k}: {v}" for k, v in cal["physical"]["derivation"].items()
                     if k in ("float32", "bfloat16", "clock_source")),
                     date),
                 "hbm_bytes": Source("/proc/meminfo MemTotal", date)},
        notes=(f"{feat['model']}, {feat['cores']} cores",
               "narrow-float ceilings are the fastest result form measured: "
               + ", ".join(f"{dt} -> {v.get('result_dtype', dt)}" for dt, v in cal["matmul"].items()),
               "transcendentals_per_s is the median of exp/tanh/log"
               + (" over independent elements: " if cal.get("transcendentals_throughput") else " (2-deep chains): ")
               + ", ".join(f"{k} {v['per_s']:.3g}/s" for k, v in tr.items())))


def host_spec(run_if_missing: bool = True) -> HardwareSpec:
    return spec_from_calibration(load_or_calibrate(run_if_missing=run_if_missing))


def get_spec(name: str, *, calibrate_if_missing: bool = True) -> HardwareSpec:
    """A catalogue chip by name or alias, or `host` (from the cached calibration; calibrates when absent unless
    calibrate_if_missing=False, which raises a one-line error instead)."""
    if resolve_name(name) == "host":
        return host_spec(run_if_missing=calibrate_if_missing)
    return catalogue_spec(name)


def measure_kernel_launch(dev, reps: int = 9) -> dict:
    """Fixed cost of one more kernel inside a program: two chains of dependent 8×8 matmuls (XLA fuses no dot into
    another, so each is its own kernel; their arithmetic is ~1 kFLOP), timed whole; the slope between the chain
    lengths is the per-kernel cost of the thunk executor (dispatch, argument lookup, completion), apart from the
    per-call overhead of a program."""
    import jax
    import jax.numpy as jnp

    def chain(k):
        def f(x, w):
            for _ in range(k):
                x = jnp.tanh(x @ w)  # tanh fuses into the dot's consumer, not into the next dot
            return x
        return f

    x = jax.device_put(jnp.full((8, 8), 0.5, jnp.float32), dev)
    w = jax.device_put(jnp.eye(8, dtype=jnp.float32) * 0.9, dev)
    out = {}
    for k in (8, 72):
        c = jax.jit(chain(k)).lower(x, w).compile()
        out[k] = measure(c, x, w, warmup=3, repeats=reps).median_s
    kernels = _count_kernels(jax.jit(chain(72)).lower(x, w).compile().as_text()) - _count_kernels(
        jax.jit(chain(8)).lower(x, w).compile().as_text())
    per = max(out[72] - out[8], 0.0) / max(kernels, 1)
    return {"per_kernel_s": per, "chain_s": {str(k): v for k, v in out.items()}, "kernels_apart": kernels,
            "how": "two chains of dependent 8x8 matmul+tanh kernels (8 and 72 links): (t72 - t8) / kernels apart"}


def measure_memory_start(dev, llc_bytes: int, reps: int = 9, quick: bool = False) -> dict:
    """The fixed cost of starting a stream from memory: chains of dependent sums, each over an array of its own (1, 2,
    4 and 8 MiB; quick: 1 and 4), the arrays together four times the last-level cache (at least 128 MiB), so every
    sum reads from memory. Seconds per sum against its bytes is a line; its intercept is what a kernel pays before
    its stream runs at the memory's rate (the prefetchers' ramp, the first misses of a page), its slope that rate.
    On a 2-vCPU Zen 4 VM a 1 MiB sum ran at 13 GB/s and an 8 MiB one at 21: 20-30 µs each before the stream."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    total = max(4 * llc_bytes, 128 * 2**20)

    def chain(s, arrays):
        for a in arrays:
            s = (a * s).sum() * 0.5 + 1.0  # each sum needs the one before: one stream at a time
        return s

    s0 = jax.device_put(jnp.float32(1.0), dev)
    runs = []
    for mib in ((1, 4) if quick else (1, 2, 4, 8)):
        size = mib * 2**20
        n = max(int(total // size), 4)
        arrays = [jax.device_put(jnp.full((size // 4,), 1.0 / (i + 1), jnp.float32), dev) for i in range(n)]
        runs.append((float(size), n, jax.jit(chain).lower(s0, arrays).compile(), arrays))
    fits, per_size = [], {size: [] for size, *_ in runs}
    for _ in range(2 * reps):  # the sizes in turn, round after round: each round's line is fitted on its own, so a
        # slow spell of the machine moves a round's line, not its intercept; the median round's intercept stands
        pts = [(size, measure(c, s0, arrays, warmup=1, repeats=3).median_s / n) for size, n, c, arrays in runs]
        for size, t in pts:
            per_size[size].append(t)
        slope, start = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)
        fits.append((float(start), float(slope)))
    del runs
    starts = sorted(f[0] for f in fits)
    slopes = sorted(f[1] for f in fits)
    start, slope = starts[len(starts) // 2], slopes[len(slopes) // 2]
    return {"per_kernel_s": max(start, 0.0), "bytes_per_s": 1.0 / slope if slope > 0 else None,
            "per_kernel_s_range": [starts[0], starts[-1]],
            "seconds_per_sum": {str(int(x)): sorted(v)[len(v) // 2] for x, v in per_size.items()},
            "total_bytes": total, "rounds": len(fits),
            "how": "dependent sums over distinct arrays from memory, the sizes in turn: the median round's intercept "
                   "of seconds per sum against bytes"}


def _count_kernels(hlo_text: str) -> int:
    return sum(k.count for k in parse_kernels(hlo_text))


RENDEZVOUS_SCRIPT = r"""
import json, os, sys, time
import jax
jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
n = int(sys.argv[1]); lengths = [int(v) for v in sys.argv[2].split(",")]; reps = int(sys.argv[3])
groups = [int(v) for v in sys.argv[4].split(",")]
def compiled(g, k):
    # n // g groups of g devices each meet at once: a psum over the mesh's second axis
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(n // g, g), ("r", "g"))
    x = jax.device_put(jnp.ones((n,), jnp.float32), NamedSharding(mesh, P(("r", "g"))))
    def chain(y):
        for _ in range(k):
            y = jax.lax.psum(y, "g") * 0.5
        return y
    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P(("r", "g")), out_specs=P(("r", "g"))))
    return f.lower(x).compile(), x
cs = {(g, k): compiled(g, k) for g in groups for k in lengths}
for c, x in cs.values():
    for _ in range(3): jax.block_until_ready(c(x))
ts = {key: [] for key in cs}
for _ in range(reps):  # every chain called in turn: a slow spell of the machine falls on all of them
    for key, (c, x) in cs.items():
        t0 = time.perf_counter(); jax.block_until_ready(c(x)); ts[key].append(time.perf_counter() - t0)
print(json.dumps({"times_s": {f"{g},{k}": v for (g, k), v in ts.items()},
                  "collectives": {f"{g},{k}": c.as_text().count(" all-reduce(") for (g, k), (c, _) in cs.items()}}))
"""

RENDEZVOUS_GROUPS = (2, 4, 8)


def measure_rendezvous(n_devices: int = 8, reps: int = 9, groups: tuple[int, ...] = RENDEZVOUS_GROUPS) -> dict | None:
    """Fixed cost of one collective on `n_devices` simulated CPU devices, for each group size in `groups` (in a
    fresh process: the device count is fixed when JAX starts): chains of 4 and 20 dependent all-reduces of one float
    per device, the n/g groups of g devices meeting at once, every chain called in turn 3·reps times in one process;
    the median over the pairs of (t20 − t4) / collectives apart is the wall time of one rendezvous of the whole mesh
    at that group size (every device's thread must arrive at its group's meeting; on a few cores that means
    scheduling them all, and a larger group waits for more threads). Calling the chains in turn keeps a slow spell of
    the VM from landing on one of them only (one process per chain measured 144–384 µs in three tries within a
    minute here). The top-level figures are the largest group's (the whole mesh), `by_group` holds each. None when
    the subprocess fails."""
    groups = tuple(g for g in groups if n_devices % g == 0) or (n_devices,)
    try:
        p = subprocess.run([sys.executable, "-c", RENDEZVOUS_SCRIPT, str(n_devices), "4,20", str(3 * reps),
                            ",".join(map(str, groups))],
                           capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        res = json.loads(p.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None
    by_group = {}
    for g in groups:
        t4, t20 = res["times_s"][f"{g},4"], res["times_s"][f"{g},20"]
        apart = res["collectives"][f"{g},20"] - res["collectives"][f"{g},4"]
        slopes = sorted((b - a) / max(apart, 1) for a, b in zip(t4, t20))
        wall = max(slopes[len(slopes) // 2], 0.0)
        by_group[str(g)] = {"per_collective_s": wall, "per_collective_per_device_s": wall / n_devices,
                            "chain_s": {"4": sorted(t4)[len(t4) // 2], "20": sorted(t20)[len(t20) // 2]},
                            "collectives_apart": apart, "pairs": len(slopes),
                            "slope_range_s": [slopes[0], slopes[-1]]}
    top = by_group[str(max(groups))]
    return {"n_devices": n_devices, **top, "by_group": by_group,
            "how": f"chains of 4 and 20 dependent psums of one float on {n_devices} simulated devices in groups of "
                   f"{', '.join(map(str, groups))}, called in turn in one fresh process: the median over the pairs "
                   "of the wall time per collective (all groups meeting at once)"}
