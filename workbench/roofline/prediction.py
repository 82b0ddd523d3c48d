"""Roofline prediction: HardwareSpec × CostReport → Prediction (per device; whole mesh on one host when simulated).

Terms (seconds):
    compute_s       = flops / peak(dtype) + transcendentals / special-function rate (when the chip's rate is known)
    memory_s        = bytes / memory bandwidth (+ on the host: fresh large outputs / first-touch rate, see calibrate)
    comm_s          = Σ collective_time(kind, payload, group, interconnect) (partitioning/collectives.py)
    kernel_s        = Σ over kernels of max(kernel compute, kernel memory) (+ on the host the measured per-call
                      overhead): kernels run one after another, each bounded by its own roof (a program of many
                      small memory-bound fusions is not saved by one big compute-bound matmul). On the host a
                      kernel's matmuls run at the measured rate for their size (calibrate's rate-against-size
                      curve), not at the peak. Used when the HLO kernel flops account for the compiler's total
                      (within 10%, counted in cost_analysis's convention when there are no loops); otherwise
                      max(compute_s, memory_s) and a note says why.
    predicted_serial_s  = kernel_s + comm_s            (no compute/communication overlap)
    predicted_s         = max(kernel_s, comm_s)        (perfect overlap; the headline) — except on a simulated
                          mesh, where collectives are copies on the same cores as the kernels: kernel_s + comm_s
    bound           = the largest of compute_s, memory_s, comm_s
    intensity       = flops / bytes;  ridge = peak / bandwidth

Simulated CPU meshes: the devices share this host's cores and memory, so the whole mesh's work (per-device costs ×
device count) is predicted against the host ceilings, and collectives are host-memory traffic. The record says so
(`scope`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from partitioning.collectives import collective_time
from workbench.cost.report import CostReport
from workbench.hardware.spec import HardwareSpec, Interconnect, MemoryLevel, dtype_name


@dataclasses.dataclass(frozen=True, slots=True)
class Prediction:
    target: str
    scope: str  # 'per_device' | 'whole_mesh_on_host'
    dtype: str  # the compute dtype priced
    peak_dtype: str  # the catalogue entry that priced it (differs when the chip lacks units for `dtype`)
    peak_flops: float
    memory_bw: float
    flops: float
    bytes: float
    transcendentals: float
    compute_s: float
    transcendental_s: float
    memory_s: float
    comm_s: float
    kernel_s: float
    predicted_s: float
    predicted_serial_s: float
    intensity: float
    ridge: float
    bound: str
    n_devices: int
    comm_by_kind_s: dict[str, float] = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()
    # the memory bandwidth band the spec was calibrated with (host: lowest and highest stream sample) and the
    # predicted_s at each end of it (low bandwidth -> the slower prediction); None where the spec has no band
    memory_bw_band: tuple[float, float] | None = None
    predicted_s_band: tuple[float, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def explain(self) -> str:
        """One line: what bounds the program and by how much."""
        terms = {"compute": self.compute_s, "memory": self.memory_s, "communication": self.comm_s}
        ordered = sorted(terms.items(), key=lambda kv: -kv[1])
        (b, tb), (s, ts) = ordered[0], ordered[1]
        ratio = f"{tb / ts:.1f}× the {s} term" if ts > 0 else "the only non-zero term"
        return (f"{b}-bound on {self.target}: {b} {tb:.3g}s is {ratio}; intensity {self.intensity:.3g} FLOP/B vs "
                f"ridge {self.ridge:.3g}")


def kernel_roof(k, spec: HardwareSpec, peak_dtype: str, bw: float, sharers: int = 1) -> tuple[float, float]:
    """(compute seconds, memory seconds) of one execution of kernel `k` (a workbench.cost.hlo.KernelCost) at its own roof:
    flops at the peak of `peak_dtype` (on the host a kernel's dots at the measured rate for their size) plus its
    transcendentals at the special-function rate (on the host, a library fusion's at the rate measured inside one
    where calibrated), and its bytes at `bw` (a Prediction's memory_bw) as moved_seconds moves them.

    On the host two more throughputs bound a kernel's compute where they are calibrated (workbench calibrate): the
    elements its reductions consume at the rate XLA's reduction kernels reach (from the cache when the kernel runs
    mostly from it or the memory's read rate is measured by the sum itself, else from memory), and its float32 <->
    narrow-float conversions at the measured conversion rate; the compute term is the slowest of the three. Its
    strided transposes at the measured transpose rate bound its memory term (transpose_seconds).

    A host kernel's bytes are priced at the levels of the memory hierarchy its working set fits (host_memory_seconds):
    the whole arrays it touches (KernelCost.footprint) times the `sharers` that run the same kernel on the host's
    caches (the devices of a simulated mesh); in a program its inputs were written moments before."""
    rate = spec.transcendentals_per_s
    if spec.kind == "cpu" and k.library and spec.transcendentals_per_s_library:
        rate = spec.transcendentals_per_s_library
    peak = spec.peak_flops[peak_dtype]
    t_trans = k.transcendentals / rate if rate else 0.0
    if spec.matmul_curve and k.dot_flops:
        arith = k.dot_flops / spec.matmul_rate(k.dot_size, peak_dtype) + (k.flops - k.dot_flops) / peak + t_trans
    else:
        arith = k.flops / peak + t_trans
    in_cache = bool(spec.onchip_bw and bw == spec.onchip_bw)
    if spec.kind == "cpu":
        t_mem, memory_share = host_memory_seconds(k, spec, bw, sharers)
        in_cache = in_cache or memory_share < 0.5
    else:
        t_mem = moved_seconds(k, spec, bw, in_cache)
    # where the memory's read rate is the calibrated sum over the stream's buffer (or the host write-allocates, whose
    # reads are priced from the stream), a reduction from memory reads at the rate its bytes are already priced at:
    # its compute bound is the in-cache reduction rate, where the memory does not bound it
    reads_priced = spec.write_allocate or bool(spec.memory_read_ratio)
    red_rate = spec.reduce_per_s_cached if (in_cache or reads_priced) else spec.reduce_per_s
    t_red = k.reduce_elements / red_rate if (red_rate and k.reduce_elements) else 0.0
    t_conv = k.convert_elements / spec.convert_per_s if (spec.convert_per_s and k.convert_elements) else 0.0
    compute = max(arith, t_red, t_conv)
    if spec.kind == "cpu" and k.dependent_passes and k.dot_flops:
        # a dot after a reduction it consumes (an attention's softmax fused with its dot): one pass after another,
        # their work adds; a softmax or a layernorm alone overlaps its special functions with its reductions (on a
        # Xeon and a Zen 5 host the sum overpriced a 16 MiB library softmax by 75 % and 30 %, the larger by 30 %
        # and -7 %)
        compute = arith + t_red + t_conv
    return compute, max(t_mem, transpose_seconds(k, spec, in_cache))


def memory_levels(spec: HardwareSpec, bw: float) -> list[MemoryLevel]:
    """The host's memory hierarchy as a kernel's bytes are priced, smallest first: its measured caches
    (HardwareSpec.cache_levels; a calibration without any: the last-level cache at the in-cache stream), then the
    memory (unbounded) at `bw` with the measured read ratio (without one: 1.5 on a write-allocating host, whose
    fresh lines are read before they are written, else 1)."""
    levels = [lv for lv in (spec.cache_levels or ()) if lv.bw > 0 and lv.capacity > 0]
    if not levels and spec.onchip_bw and spec.onchip_bytes:
        levels.append(MemoryLevel("LLC", float(spec.onchip_bytes), float(spec.onchip_bw), 1.0))
    levels.sort(key=lambda lv: lv.capacity)
    ratio = spec.memory_read_ratio or (1.5 if spec.write_allocate else 1.0)
    return levels + [MemoryLevel("memory", math.inf, bw, ratio)]


def residency(working_set: float, levels: list[MemoryLevel]) -> list[tuple[MemoryLevel, float]]:
    """(level, share of the kernel's traffic it serves): all of it from the smallest level that holds the whole
    working set W; beyond a level of capacity C, the share it still serves is the hit rate h of a cyclic sweep over W
    under random replacement (each miss evicts a random line, so a line survives the m·W misses between its reuses
    with probability exp(−m·W / C): 1 − m = exp(−m·W / C)), the rest from the next level. No parameter: h is 1 at
    W = C, 0.42 at 1.5·C, 0.2 at 2·C, 0.02 at 4·C; a kernel slightly larger than a cache is priced mostly from
    it, a sweep over several times its size from the level beyond."""
    w = max(working_set, 0.0)
    for i, lv in enumerate(levels):
        if w <= lv.capacity:
            if i == 0 or w <= 0:
                return [(lv, 1.0)]
            h = sweep_hit_rate(w / levels[i - 1].capacity)
            return [(levels[i - 1], h), (lv, 1.0 - h)]
    return [(levels[-1], 1.0)]


def sweep_hit_rate(ratio: float) -> float:
    """The hit rate h = 1 − m of a cache under random replacement swept cyclically by a working set `ratio` times
    its capacity: the root m in (0, 1] of 1 − m = exp(−m·ratio) (1 when ratio <= 1), by bisection."""
    if ratio <= 1.0:
        return 1.0
    lo, hi = 0.0, 1.0  # f(m) = 1 − m − exp(−m·ratio): f(0) = 0 (the trivial root), f > 0 just above 0, f(1) < 0
    lo = 1e-9
    for _ in range(60):
        mid = (lo + hi) / 2
        if 1.0 - mid - math.exp(-mid * ratio) > 0:
            lo = mid
        else:
            hi = mid
    return 1.0 - (lo + hi) / 2


def host_memory_seconds(k, spec: HardwareSpec, bw: float, sharers: int = 1) -> tuple[float, float]:
    """(seconds, share of the traffic served from memory) of a host kernel's bytes: its working set (the whole
    arrays it touches, KernelCost.footprint, else its bytes, times the `sharers` running it on the same caches)
    placed in the hierarchy by `residency`, each level's share priced at that level's stream with its input/output
    split (MemoryLevel.seconds). When the program runs from the cache (`bw` is the in-cache bandwidth) no kernel is
    priced beyond the last-level cache."""
    program_in_cache = bool(spec.onchip_bw and bw == spec.onchip_bw)
    levels = memory_levels(spec, spec.hbm_bw if program_in_cache else bw)
    w = (k.footprint or k.bytes) * max(sharers, 1)
    if program_in_cache and len(levels) > 1:
        w = min(w, levels[-2].capacity)
    shares = residency(w, levels)
    t = sum(h * lv.seconds(k.bytes_in, k.bytes_out) for lv, h in shares)
    return t, sum(h for lv, h in shares if lv.name == "memory")


def moved_seconds(k, spec: HardwareSpec, bw: float, in_cache: bool = False) -> float:
    """A kernel's bytes in + out at `bw`, except on a host from memory, where they move with the memory's
    input/output split (memory_levels' last level): on a write-allocating host without a measured read rate every
    line a kernel writes is first read in for ownership, so a kernel moves bytes_in + 2·bytes_out, and the calibrated
    out-of-place stream, which counts 2 bytes for every 3 it moves, is 1.5 / 2 of the rate those bytes move at:
    t = (bytes_in + 2·bytes_out) / (1.5·bw). The stream itself prices the same either way; a reduction (reads only)
    costs 2/3 of its bytes at `bw`, a broadcast (writes only) 4/3."""
    if spec.kind == "cpu" and not in_cache and (spec.write_allocate or spec.memory_read_ratio):
        return memory_levels(spec, bw)[-1].seconds(k.bytes_in, k.bytes_out)
    return k.bytes / bw


def transpose_seconds(k, spec: HardwareSpec, in_cache: bool = False) -> float:
    """Host: the time of a kernel's strided transposes (KernelCost.transpose_elements) at the calibrated rate: the
    in-cache one when the program runs from the cache or the kernel's input fits in half the last-level cache (in a
    program it was written moments before: `small`'s 8 MiB strided inputs ran at in-cache rates), else the
    from-memory one; 0 without a calibrated rate.
    A strided read costs a cache line per element, so this bounds the kernel's memory term from below."""
    if not k.transpose_elements:
        return 0.0
    cached = in_cache or bool(spec.onchip_bytes and k.bytes_in <= spec.onchip_bytes / 2)
    rate = (spec.transpose_per_s_cached if cached else None) or spec.transpose_per_s
    return k.transpose_elements / rate if rate else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class KernelTime:
    """One kernel's predicted time at its own roof (per execution, one device)."""

    seconds: float
    compute_s: float
    memory_s: float
    roof: str  # 'compute' | 'memory'


def kernel_time(k, spec: HardwareSpec, *, dtype, memory_bw: float | None = None, sharers: int = 1) -> KernelTime:
    """max(kernel compute, kernel memory) of one KernelCost (workbench.cost.hlo) on `spec`, per execution.

    compute: the kernel's dot flops at the measured rate for its dot's size (the host's matmul curve) where the spec
    has one, else at the peak; its other flops at the peak; its transcendentals at the special-function rate.
    memory: its bytes over `memory_bw` (default: the spec's memory bandwidth) as kernel_roof moves them (on a host:
    write-allocate, the cache when its arrays times `sharers` fit, strided transposes)."""
    kc, km = kernel_roof(k, spec, spec.peak_dtype(dtype), memory_bw or spec.hbm_bw, sharers)
    launch = spec.kernel_launch_s or 0.0  # the executor's fixed cost per kernel (host: measured)
    return KernelTime(roof_seconds(k, spec, kc, km) + launch, kc, km, "compute" if kc >= km else "memory")


def roof_seconds(k, spec: HardwareSpec, compute_s: float, memory_s: float) -> float:
    """One kernel's time from its compute and memory terms (kernel_roof): the larger, as the two overlap — except
    on a CPU for a kernel that walks its rows in dependent passes (a reduction it consumes again,
    KernelCost.dependent_passes: a fused softmax, a layernorm, an attention's softmax fused with the dot after it).
    A core then streams a row in for the reduction, and computes the passes that consume it (the special functions,
    the second reduction, the dot) over the row from cache, one after the other, so the terms add: kernel_roof sums
    such a kernel's arithmetic, reductions and conversions, and this adds its memory (docs/accuracy.md). Accelerators
    pipeline the rows of such a kernel through on-chip memory: there they overlap."""
    if spec.kind == "cpu" and k.dependent_passes:
        return compute_s + memory_s
    return max(compute_s, memory_s)


def host_interconnect(spec: HardwareSpec, bw: float) -> Interconnect:
    """Simulated devices exchange through this host's memory: its bandwidth, and per collective the measured
    rendezvous cost (every device's thread must arrive; per device, so the mesh's sum is the wall time), at the
    collective's group size where the calibration measured it per group size."""
    return Interconnect("host-memory", bw, 1, latency_s=spec.collective_latency_s or 0.0,
                        latency_by_group=spec.collective_latency_by_group)


def memory_bw(cost: CostReport, spec: HardwareSpec, simulated_mesh: bool) -> tuple[float, str | None]:
    """(bytes/s, note): the in-cache bandwidth when the program's whole working set (all devices' on a simulated
    mesh) fits in the last-level cache, else the memory bandwidth."""
    footprint = cost.peak_memory_bytes * (cost.n_devices if (simulated_mesh or spec.kind == "cpu") else 1)
    if spec.onchip_bw and spec.onchip_bytes and 0 < footprint <= spec.onchip_bytes:
        return spec.onchip_bw, (f"working set {footprint / 2**20:.1f} MiB fits the {spec.onchip_bytes / 2**20:.0f} "
                                "MiB last-level cache: memory priced at the measured in-cache bandwidth")
    return spec.hbm_bw, None


def predict(cost: CostReport, spec: HardwareSpec, *, dtype=None, simulated_mesh: bool | None = None,
            torus_axes: int = 1) -> Prediction:
    """Predict one execution of the program that `cost` describes on `spec`.

    simulated_mesh: the costs come from devices simulated on this host (default: spec is the host and the program
    ran on more than one CPU device) → whole-mesh work against the host ceilings.
    """
    notes: list[str] = list(cost.notes)
    if simulated_mesh is None:
        simulated_mesh = spec.kind == "cpu" and cost.n_devices > 1
    d = dtype_name(dtype or cost.compute_dtype)
    pdt = spec.peak_dtype(d)
    if pdt != d:
        notes.append(f"{spec.name} has no {d} units in the catalogue: priced at its {pdt} peak")
    peak = spec.peak_flops[pdt]
    bw, bw_note = memory_bw(cost, spec, simulated_mesh)
    if bw_note:
        notes.append(bw_note)
    mult = cost.n_devices if simulated_mesh else 1
    scope = "whole_mesh_on_host" if simulated_mesh else "per_device"
    if simulated_mesh:
        notes.append(f"{cost.n_devices} simulated devices share this host: the whole mesh's work "
                     f"({cost.n_devices} × per-device costs) is predicted against the host ceilings")

    use_hlo = cost.uses_hlo_counts
    flops = cost.counted_flops * mult
    nbytes = cost.counted_bytes * mult
    trans = cost.counted_transcendentals * mult
    rate = spec.transcendentals_per_s
    if rate:
        t_trans = trans / rate
    else:
        t_trans = 0.0
        if trans:
            notes.append(f"{spec.name}: special-function rate unpublished; transcendental term omitted")
    if not use_hlo and cost.kernels and cost.hlo_bytes > 0 and cost.bytes_accessed > 5 * cost.hlo_bytes:
        notes.append(f"the compiler's bytes accessed ({cost.bytes_accessed:.3g}) are {cost.bytes_accessed / cost.hlo_bytes:.0f}× "
                     f"the HLO kernels' bytes in + out ({cost.hlo_bytes:.3g}): one op may be mispriced by cost_analysis; "
                     "the memory term uses the compiler's figure")
    t_compute = flops / peak + t_trans
    t_mem = nbytes / bw
    t_touch = 0.0
    if spec.first_touch_bw and cost.large_output_bytes:
        t_touch = cost.large_output_bytes * mult / spec.first_touch_bw
        t_mem += t_touch
        notes.append(f"host: {cost.large_output_bytes * mult / 2**20:.0f} MiB of fresh large outputs are page-faulted "
                     f"in every call (+{t_touch:.3g}s at the calibrated first-touch rate)")

    # communication: the interconnect of the spec, or host memory for simulated devices
    ic = spec.interconnect
    if simulated_mesh:
        ic = host_interconnect(spec, spec.hbm_bw)
    comm_by_kind: dict[str, float] = {}
    for c in cost.collectives:
        t = collective_time(c.kind, c.payload_bytes, c.group_size, ic, torus_axes=torus_axes,
                            operands=c.operands) * c.count * mult
        comm_by_kind[c.kind] = comm_by_kind.get(c.kind, 0.0) + t
    t_comm = sum(comm_by_kind.values())

    # kernel-level roofline (each kernel bounded by its own roof)
    if use_hlo:
        kflops, ref = sum(k.flops * k.count for k in cost.kernels), cost.hlo_flops
    else:  # against cost_analysis, in its convention: transcendentals apart, a convert one flop (the reader counts
        #   the float32 <-> narrow-float ones; other converts are rare in these programs)
        kflops = sum((k.flops - k.transcendentals + k.convert_elements) * k.count for k in cost.kernels)
        ref = cost.flops
    if cost.kernels and (ref == 0 or abs(kflops - ref) <= 0.1 * ref):
        t_kernels = sum(kernel_time(k, spec, dtype=pdt, memory_bw=bw, sharers=mult).seconds * k.count
                        for k in cost.kernels)
        t_kernels = t_kernels * mult + t_touch
    else:
        t_kernels = max(t_compute, t_mem)
        if cost.kernels:
            notes.append(f"HLO kernel flops ({kflops:.3g}) do not account for the compiler's ({ref:.3g}); "
                         "program-level roofline used")
    if simulated_mesh and t_comm:
        notes.append("simulated devices: collectives are copies on the same cores as the kernels, so nothing hides "
                     "them: predicted_s = kernel_s + comm_s")
    if spec.call_overhead_s:
        t_kernels += spec.call_overhead_s
        notes.append(f"includes the measured per-call overhead {spec.call_overhead_s * 1e6:.0f} µs")
    intensity = flops / nbytes if nbytes else math.inf
    terms = {"compute": t_compute, "memory": t_mem, "communication": t_comm}
    bound = max(terms, key=terms.get)
    band = pred_band = None
    if spec.hbm_bw_range and bw == spec.hbm_bw:
        lo, hi = spec.hbm_bw_range
        band = (lo, hi)
        ends = [predict(cost, dataclasses.replace(spec, hbm_bw=b, hbm_bw_range=None), dtype=dtype,
                        simulated_mesh=simulated_mesh, torus_axes=torus_axes).predicted_s for b in (hi, lo)]
        pred_band = (min(ends), max(ends))
    return Prediction(
        target=spec.name, scope=scope, dtype=d, peak_dtype=pdt, peak_flops=peak, memory_bw=bw, flops=flops,
        bytes=nbytes, transcendentals=trans, compute_s=t_compute, transcendental_s=t_trans, memory_s=t_mem,
        comm_s=t_comm, kernel_s=t_kernels,
        predicted_s=(t_kernels + t_comm) if simulated_mesh else max(t_kernels, t_comm),
        predicted_serial_s=t_kernels + t_comm, intensity=intensity, ridge=peak / bw, bound=bound,
        n_devices=cost.n_devices, comm_by_kind_s=comm_by_kind, notes=tuple(dict.fromkeys(notes)),
        memory_bw_band=band, predicted_s_band=pred_band)
