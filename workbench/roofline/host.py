"""The host roofline: how a calibrated CPU refines the roofline's terms with what it measured (Measured).

A CPU is not an accelerator with one memory and one compute unit per chip. Its kernel's bytes come from the cache
level its working set fits, its writes may first read the line they write (write-allocate), fresh large outputs are
page-faulted on first touch, a call costs a fixed overhead, and its reductions, conversions and strided transposes
run at their own measured throughputs. workbench.roofline.prediction composes these refinements where the spec is a
CPU (`spec.kind == "cpu"`); every figure they use is a field of `spec.measured` that `workbench calibrate` measured.

    kernel compute = max(arithmetic, reductions / reduction rate, conversions / conversion rate)
                     (the three add for a dot after a reduction it consumes: dependent passes; a product with few
                     rows adds the packing of a weight the program's footprint keeps out of the cache; a library
                     fusion whose loops the calibration timed: reductions + the pass over each computed operand it
                     reduces + its flops at the library's op rate + its special functions, one loop after another)
    kernel memory  = Σ over the levels its working set reaches: share × level.seconds(bytes in, bytes out),
                     bounded below by its strided transposes at the transpose rate
    kernel time    = max(compute, memory), or compute + memory for a kernel that walks its rows in dependent passes
    program        + fresh large outputs / first-touch rate + the per-call overhead
"""
from __future__ import annotations

import dataclasses
import math

from workbench.cost.report import CostReport
from workbench.hardware.measured import MemoryLevel
from workbench.hardware.spec import HardwareSpec, Interconnect
from workbench.roofline.pricing import arithmetic_seconds


def kernel_roof(k, spec: HardwareSpec, peak_dtype: str, bw: float, sharers: int = 1,
                program_bytes: float = 0.0) -> tuple[float, float]:
    """(compute seconds, memory seconds) of one execution of host kernel `k` (a workbench.cost.hlo.KernelCost).

    compute: its flops (dots at the measured rate for their size), its transcendentals at the special-function rate
    (a library fusion's at the rate measured inside one, where calibrated); the elements its reductions consume at
    the rate XLA's reduction kernels reach (from the cache when the kernel runs mostly from it or the memory's read
    rate is measured by the sum itself, else from memory), and its float32 <-> narrow-float conversions at the
    measured conversion rate: the slowest of the three, or their sum for a dot after a reduction it consumes.
    memory: its bytes at the levels of the hierarchy its working set fits (host_memory_seconds): the whole arrays it
    touches (KernelCost.footprint) times the `sharers` that run the same kernel on the host's caches (the devices of
    a simulated mesh); its strided transposes at the measured transpose rate bound it from below."""
    m = spec.measured
    rate = m.transcendentals_per_s_library if (k.library and m.transcendentals_per_s_library) else None
    arith = arithmetic_seconds(k, spec, peak_dtype, rate)
    t_mem, memory_share = host_memory_seconds(k, spec, bw, sharers, program_bytes)
    in_cache = bool(m.onchip_bw and bw == m.onchip_bw) or memory_share < 0.5
    # where the memory's read rate is the calibrated sum over the stream's buffer (or the host write-allocates, whose
    # reads are priced from the stream), a reduction from memory reads at the rate its bytes are already priced at:
    # its compute bound is the in-cache reduction rate, where the memory does not bound it
    reads_priced = m.write_allocate or bool(m.memory_read_ratio)
    red_rate = m.reduce_per_s_cached if (in_cache or reads_priced) else m.reduce_per_s
    t_red = k.reduce_elements / red_rate if (red_rate and k.reduce_elements) else 0.0
    t_conv = k.convert_elements / m.convert_per_s if (m.convert_per_s and k.convert_elements) else 0.0
    compute = max(arith + weight_packing_seconds(k, spec, bw, program_bytes * max(sharers, 1)), t_red, t_conv)
    lib = library_compute_seconds(k, spec, t_red)
    if lib is not None:
        compute = max(lib, t_conv)
    elif k.dependent_passes and k.dot_flops:
        # a dot after a reduction it consumes (an attention's softmax fused with its dot): one pass after another,
        # their work adds; a softmax or a layernorm alone overlaps its special functions with its reductions
        compute = arith + t_red + t_conv
    return compute, max(t_mem, transpose_seconds(k, spec, in_cache))


def library_compute_seconds(k, spec: HardwareSpec, reduce_s: float) -> float | None:
    """The arithmetic of a library fusion without dots (XLA:CPU's YNN kernels: a softmax, a layernorm, a sum over a
    computed operand), where the calibration measured the library's own loops (Measured.library_pass_per_s,
    library_ops_per_s): the library runs its ops one vector loop after another over each tile, so their times add —
    its reductions (`reduce_s`), the pass that writes each reduction's computed operand into a buffer
    (KernelCost.produced_reduce_elements), its other elementwise flops at the library's op rate, and its special
    functions at the rate measured inside one. None for any other kernel, or without those figures."""
    m = spec.measured
    if not (k.library == "__ynn_fusion" and not k.dot_flops and m.library_pass_per_s and m.library_ops_per_s):
        return None
    produced = getattr(k, "produced_reduce_elements", 0.0)
    other = max(k.flops - k.reduce_elements - k.transcendentals, 0.0)
    trans_rate = m.transcendentals_per_s_library or spec.transcendentals_per_s
    return (reduce_s + produced / m.library_pass_per_s + other / m.library_ops_per_s
            + (k.transcendentals / trans_rate if trans_rate else 0.0))


def weight_packing_seconds(k, spec: HardwareSpec, bw: float, program_bytes: float) -> float:
    """The pass in which a product with few rows (2 to the skinny curve's end, Measured.skinny_rate) packs a weight
    that comes from memory: XLA:CPU's matrix library copies the weight's panels into a buffer before it multiplies
    them, and with few rows there is too little arithmetic per weight byte to hide that copy, so it adds to the
    arithmetic (a single row runs a matrix-vector kernel that streams the weight as it multiplies: nothing to add).
    The weight is read by the kernel straight from the program's parameters (KernelCost.param_bytes); between one
    call and the next the program touches its whole footprint, so the share of the weight the last-level cache still
    holds is placed by `call_sweep` over that footprint (nothing, beyond the cache's capacity): the rest is read from
    memory and written into the cache. 0 where the program fits the last-level cache, or without a skinny curve."""
    rows = getattr(k, "dot_rows", 0.0)
    if not (k.dot_flops and rows >= 2 and getattr(k, "param_bytes", 0.0) and program_bytes):
        return 0.0
    if spec.measured.skinny_rate(rows, "float32") is None:
        return 0.0
    levels = memory_levels(spec, bw)
    if len(levels) < 2:
        return 0.0
    cache, memory = levels[-2], levels[-1]
    missed = sum(h for lv, h in call_sweep(program_bytes, levels) if lv is memory)
    return missed * (memory.seconds(k.param_bytes, 0.0) + cache.seconds(0.0, k.param_bytes))


def roof_seconds(k, compute_s: float, memory_s: float) -> float:
    """One host kernel's time from its compute and memory terms: the larger, as the two overlap — except for a
    kernel that walks its rows in dependent passes (a reduction it consumes again, KernelCost.dependent_passes: a
    fused softmax, a layernorm, an attention's softmax fused with the dot after it). A core then streams a row in
    for the reduction and computes the passes that consume it over the row from cache, one after the other, so the
    terms add. Accelerators pipeline the rows of such a kernel through on-chip memory: there they overlap."""
    return compute_s + memory_s if k.dependent_passes else max(compute_s, memory_s)


def memory_levels(spec: HardwareSpec, bw: float) -> list[MemoryLevel]:
    """The host's memory hierarchy as a kernel's bytes are priced, smallest first: its measured caches
    (Measured.cache_levels; a calibration without any: the last-level cache at the in-cache stream), then the
    memory (unbounded) at `bw` with the measured read ratio (without one: 1.5 on a write-allocating host, whose
    fresh lines are read before they are written, else 1)."""
    m = spec.measured
    levels = [lv for lv in (m.cache_levels or ()) if lv.bw > 0 and lv.capacity > 0]
    if not levels and m.onchip_bw and spec.onchip_bytes:
        levels.append(MemoryLevel("LLC", float(spec.onchip_bytes), float(m.onchip_bw), 1.0))
    levels.sort(key=lambda lv: lv.capacity)
    ratio = m.memory_read_ratio or (1.5 if m.write_allocate else 1.0)
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


def call_sweep(footprint: float, levels: list[MemoryLevel]) -> list[tuple[MemoryLevel, float]]:
    """Where an array the program last touched a call ago is read from: all of it from the smallest level that holds
    the program's whole footprint. Between two calls every other array of the program passes through the caches, in
    the same order each call, kernel after kernel over arrays of their own; measured on the Zen 4 VM, such a sweep
    keeps nothing once it exceeds a cache (host_memory_seconds), unlike one kernel re-run over its own data
    (`residency`)."""
    return [(next(lv for lv in levels if footprint <= lv.capacity), 1.0)]


def sweep_hit_rate(ratio: float) -> float:
    """The hit rate h = 1 − m of a cache under random replacement swept cyclically by a working set `ratio` times
    its capacity: the root m in (0, 1] of 1 − m = exp(−m·ratio) (1 when ratio <= 1), by bisection."""
    if ratio <= 1.0:
        return 1.0
    lo, hi = 1e-9, 1.0  # f(m) = 1 − m − exp(−m·ratio): f(0) = 0 (the trivial root), f > 0 just above 0, f(1) < 0
    for _ in range(60):
        mid = (lo + hi) / 2
        if 1.0 - mid - math.exp(-mid * ratio) > 0:
            lo = mid
        else:
            hi = mid
    return 1.0 - (lo + hi) / 2


def host_memory_seconds(k, spec: HardwareSpec, bw: float, sharers: int = 1,
                        program_bytes: float = 0.0) -> tuple[float, float]:
    """(seconds, share of the traffic served from memory) of a host kernel's bytes: its working set (the whole
    arrays it touches, KernelCost.footprint, else its bytes, times the `sharers` running it on the same caches)
    placed in the hierarchy by `residency`, each level's share priced at that level's stream with its input/output
    split (MemoryLevel.seconds). The bytes it reads straight from the program's parameters (KernelCost.param_bytes:
    weights, a cache, optimizer state) were last touched a whole call ago, so they are placed by the program's
    footprint (`program_bytes`) where that is the larger working set, all from the smallest level that holds it: the
    call sweeps every other array through the caches before it reads them again, and a sweep of many kernels, each
    over arrays of its own, keeps none of them beyond the cache's capacity (on the Zen 4 VM, 4 MiB one-row products
    over 32 to 160 MiB of weights all ran at the memory's 21-24 GB/s, where `residency`'s random replacement would
    serve half of a 40 MiB sweep from the 32 MiB L3). A one-row product reads its share in memory at the measured
    row-product rate (Measured.row_product_read_ratio). A kernel's stream from memory first pays the measured start
    (Measured.memory_start_s, 20-30 µs on a 2-vCPU Zen 4, where a 1 MiB sum from memory ran at 0.6 of the rate of an
    8 MiB one), in the share of its traffic served there. When the program runs from the cache (`bw` is the in-cache
    bandwidth) no kernel is priced beyond the last-level cache."""
    program_in_cache = bool(spec.measured.onchip_bw and bw == spec.measured.onchip_bw)
    levels = memory_levels(spec, spec.hbm_bw if program_in_cache else bw)
    w = (k.footprint or k.bytes) * max(sharers, 1)
    if program_in_cache and len(levels) > 1:
        w = min(w, levels[-2].capacity)
    params = min(getattr(k, "param_bytes", 0.0), k.bytes_in)
    whole = program_bytes * max(sharers, 1)
    if program_in_cache or whole <= w:
        params = 0.0
    shares = residency(w, levels)
    t = sum(h * lv.seconds(k.bytes_in - params, k.bytes_out) for lv, h in shares)
    from_memory = sum(h for lv, h in shares if lv.name == "memory") * (k.bytes - params)
    if params:
        far = call_sweep(whole, levels)
        # a one-row product reads its weight with XLA:CPU's matrix-vector kernel, at its own measured rate
        row = spec.measured.row_product_read_ratio if getattr(k, "dot_rows", 0.0) == 1 and k.dot_flops else None
        t += sum(h * lv.seconds(params, 0.0) / (row if (row and lv.name == "memory") else 1.0) for lv, h in far)
        from_memory += sum(h for lv, h in far if lv.name == "memory") * params
    share = from_memory / k.bytes if k.bytes else 0.0
    # a stream from memory starts slowly (Measured.memory_start_s): paid in the share of the kernel that reads there
    return t + share * (spec.measured.memory_start_s or 0.0), share


def moved_seconds(k, spec: HardwareSpec, bw: float, in_cache: bool = False) -> float:
    """A kernel's bytes in + out from memory at `bw` with the memory's input/output split (memory_levels' last
    level): on a write-allocating host without a measured read rate every line a kernel writes is first read in for
    ownership, so a kernel moves bytes_in + 2·bytes_out, and the calibrated out-of-place stream, which counts 2 bytes
    for every 3 it moves, is 1.5 / 2 of the rate those bytes move at: t = (bytes_in + 2·bytes_out) / (1.5·bw). The
    stream itself prices the same either way; a reduction (reads only) costs 2/3 of its bytes at `bw`, a broadcast
    (writes only) 4/3. From the cache, or without either measurement: bytes / bw."""
    m = spec.measured
    if not in_cache and (m.write_allocate or m.memory_read_ratio):
        return memory_levels(spec, bw)[-1].seconds(k.bytes_in, k.bytes_out)
    return k.bytes / bw


def transpose_seconds(k, spec: HardwareSpec, in_cache: bool = False) -> float:
    """The time of a kernel's strided transposes (KernelCost.transpose_elements) at the calibrated rate: the
    in-cache one when the program runs from the cache or the kernel's input fits in half the last-level cache (in a
    program it was written moments before), else the from-memory one; 0 without a calibrated rate.
    A strided read costs a cache line per element, so this bounds the kernel's memory term from below."""
    if not k.transpose_elements:
        return 0.0
    m = spec.measured
    cached = in_cache or bool(spec.onchip_bytes and k.bytes_in <= spec.onchip_bytes / 2)
    rate = (m.transpose_per_s_cached if cached else None) or m.transpose_per_s
    return k.transpose_elements / rate if rate else 0.0


def host_interconnect(spec: HardwareSpec, bw: float) -> Interconnect:
    """Simulated devices exchange through this host's memory: its bandwidth, and per collective the measured
    rendezvous cost (every device's thread must arrive; per device, so the mesh's sum is the wall time), at the
    collective's group size where the calibration measured it per group size."""
    return Interconnect("host-memory", bw, 1, latency_s=spec.measured.collective_latency_s or 0.0,
                        latency_by_group=spec.measured.collective_latency_by_group)


def in_cache_bandwidth(cost: CostReport, spec: HardwareSpec) -> tuple[float, str] | None:
    """(bytes/s, note) when the program's whole working set (all devices' on a simulated mesh) fits in the
    last-level cache: the measured in-cache stream; None otherwise."""
    footprint = cost.peak_memory_bytes * cost.n_devices
    if spec.measured.onchip_bw and spec.onchip_bytes and 0 < footprint <= spec.onchip_bytes:
        return spec.measured.onchip_bw, (f"working set {footprint / 2**20:.1f} MiB fits the "
                                         f"{spec.onchip_bytes / 2**20:.0f} MiB last-level cache: memory priced at "
                                         "the measured in-cache bandwidth")
    return None


def first_touch_seconds(cost: CostReport, spec: HardwareSpec, mult: int) -> tuple[float, str | None]:
    """(seconds, note): the program's fresh large outputs page-faulted in every call, at the first-touch rate."""
    if not (spec.measured.first_touch_bw and cost.large_output_bytes):
        return 0.0, None
    t = cost.large_output_bytes * mult / spec.measured.first_touch_bw
    return t, (f"host: {cost.large_output_bytes * mult / 2**20:.0f} MiB of fresh large outputs are page-faulted in "
               f"every call (+{t:.3g}s at the calibrated first-touch rate)")


def without_band(spec: HardwareSpec, bw: float) -> HardwareSpec:
    """The spec at one end of its calibrated bandwidth band (no band of its own)."""
    return dataclasses.replace(spec, hbm_bw=bw).with_measured(hbm_bw_range=None)
