"""Roofline prediction: HardwareSpec × CostReport → Prediction (per device; whole mesh on one host when simulated).

Terms (seconds):
    compute_s       = flops / peak(dtype) + transcendentals / special-function rate (when the chip's rate is known)
    memory_s        = bytes / memory bandwidth
    comm_s          = Σ collective_time(kind, payload, group, interconnect) (partitioning/collectives.py)
    kernel_s        = Σ over kernels of (max(kernel compute, kernel memory) + measured launch cost): kernels run one
                      after another, each bounded by its own roof (a program of many small memory-bound fusions is
                      not saved by one big compute-bound matmul). Used when the HLO kernel flops account for the
                      compiler's total (within 10%, counted in cost_analysis's convention when there are no loops);
                      otherwise max(compute_s, memory_s) and a note says why.
    host_s          = max(bytes to the host, bytes from it) / host_link_bw (an accelerator that offloads to its
                      host's memory: the link carries both directions at once)
    predicted_serial_s  = kernel_s + comm_s + host_s   (no overlap)
    predicted_s         = max(kernel_s, comm_s, host_s) (perfect overlap; the headline: collectives and offload
                          copies are asynchronous) — except on a simulated mesh, where collectives are copies on the
                          same cores as the kernels: kernel_s + comm_s
    bound           = the largest of compute_s, memory_s, comm_s, host_s
    intensity       = flops / bytes;  ridge = peak / bandwidth

On a CPU host the measured refinements of workbench/roofline/host.py price each kernel (cache levels, reductions,
conversions, transposes, dependent passes) and add the program's first-touch faults and per-call overhead. Simulated
CPU meshes: the devices share this host's cores and memory, so the whole mesh's work (per-device costs × device
count) is predicted against the host ceilings, and collectives are host-memory traffic. The record says so
(`scope`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from partitioning.collectives import collective_time
from workbench.cost.report import CostReport
from workbench.hardware.spec import HardwareSpec, dtype_name
from workbench.roofline import host
from workbench.roofline.pricing import arithmetic_seconds


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
    host_s: float = 0.0  # host offloading's transfers over the host link
    # the memory bandwidth band the spec was calibrated with (host: lowest and highest stream sample) and the
    # predicted_s at each end of it (low bandwidth -> the slower prediction); None where the spec has no band
    memory_bw_band: tuple[float, float] | None = None
    predicted_s_band: tuple[float, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def terms(self) -> dict[str, float]:
        """The step's terms by name (`bound` is the largest)."""
        return step_terms(self.compute_s, self.memory_s, self.comm_s, self.host_s)

    def explain(self) -> str:
        """One line: what bounds the program and by how much."""
        ordered = sorted(self.terms.items(), key=lambda kv: -kv[1])
        (b, tb), (s, ts) = ordered[0], ordered[1]
        ratio = f"{tb / ts:.1f}× the {s} term" if ts > 0 else "the only non-zero term"
        return (f"{b}-bound on {self.target}: {b} {tb:.3g}s is {ratio}; intensity {self.intensity:.3g} FLOP/B vs "
                f"ridge {self.ridge:.3g}")


def step_terms(compute_s: float, memory_s: float, comm_s: float, host_s: float) -> dict[str, float]:
    """The terms a step's time is the largest of (overlapped): one list for `bound`, `explain` and the bottleneck."""
    return {"compute": compute_s, "memory": memory_s, "communication": comm_s, "host transfer": host_s}


def kernel_roof(k, spec: HardwareSpec, peak_dtype: str, bw: float, sharers: int = 1,
                program_bytes: float = 0.0) -> tuple[float, float]:
    """(compute seconds, memory seconds) of one execution of kernel `k` (a workbench.cost.hlo.KernelCost) at its own
    roof: its arithmetic at the peak of `peak_dtype` (pricing.arithmetic_seconds) and its bytes at `bw` (a
    Prediction's memory_bw); on a CPU host as its measured refinements price them (host.kernel_roof, `sharers`: the
    devices of a simulated mesh running the same kernel on the host's caches; `program_bytes`: the program's
    footprint per device, which decides whether the weights it keeps from call to call are still in the cache)."""
    if spec.kind == "cpu":
        return host.kernel_roof(k, spec, peak_dtype, bw, sharers, program_bytes)
    return arithmetic_seconds(k, spec, peak_dtype), k.bytes / bw


def roof_seconds(k, spec: HardwareSpec, compute_s: float, memory_s: float) -> float:
    """One kernel's time from its compute and memory terms: the larger, as the two overlap (a CPU host: host.roof_seconds,
    where a kernel walking its rows in dependent passes adds them)."""
    if spec.kind == "cpu":
        return host.roof_seconds(k, compute_s, memory_s)
    return max(compute_s, memory_s)


@dataclasses.dataclass(frozen=True, slots=True)
class KernelTime:
    """One kernel's predicted time at its own roof (per execution, one device)."""

    seconds: float
    compute_s: float
    memory_s: float
    roof: str  # 'compute' | 'memory'


def kernel_time(k, spec: HardwareSpec, *, dtype, memory_bw: float | None = None, sharers: int = 1,
                program_bytes: float = 0.0) -> KernelTime:
    """The roof of one KernelCost (workbench.cost.hlo) on `spec`, per execution: roof_seconds of kernel_roof's terms
    at `memory_bw` (default: the spec's memory bandwidth), plus the measured fixed cost of a kernel where the spec
    has one."""
    kc, km = kernel_roof(k, spec, spec.peak_dtype(dtype), memory_bw or spec.hbm_bw, sharers, program_bytes)
    launch = spec.measured.kernel_launch_s or 0.0
    return KernelTime(roof_seconds(k, spec, kc, km) + launch, kc, km, "compute" if kc >= km else "memory")


def memory_bw(cost: CostReport, spec: HardwareSpec, simulated_mesh: bool) -> tuple[float, str | None]:
    """(bytes/s, note): the memory bandwidth, or on a CPU host whose program fits its last-level cache the measured
    in-cache stream (host.in_cache_bandwidth)."""
    if spec.kind == "cpu":
        cached = host.in_cache_bandwidth(cost, spec)
        if cached:
            return cached
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
    if simulated_mesh:
        notes.append(f"{cost.n_devices} simulated devices share this host: the whole mesh's work "
                     f"({cost.n_devices} × per-device costs) is predicted against the host ceilings")
    flops, nbytes, trans = (cost.counted_flops * mult, cost.counted_bytes * mult,
                            cost.counted_transcendentals * mult)
    t_trans = _transcendental_seconds(trans, spec, notes)
    t_compute = flops / peak + t_trans
    t_mem = nbytes / bw
    _note_compiler_bytes(cost, notes)
    t_touch, touch_note = host.first_touch_seconds(cost, spec, mult) if spec.kind == "cpu" else (0.0, None)
    if touch_note:
        t_mem += t_touch
        notes.append(touch_note)
    comm_by_kind = _communication(cost, spec, simulated_mesh, mult, torus_axes)
    t_comm = sum(comm_by_kind.values())
    t_kernels = _kernel_seconds(cost, spec, pdt, bw, mult, max(t_compute, t_mem), notes, t_touch)
    if simulated_mesh and t_comm:
        notes.append("simulated devices: collectives are copies on the same cores as the kernels, so nothing hides "
                     "them: predicted_s = kernel_s + comm_s")
    if spec.measured.call_overhead_s:
        t_kernels += spec.measured.call_overhead_s
        notes.append(f"includes the measured per-call overhead {spec.measured.call_overhead_s * 1e6:.0f} µs")
    t_host = _host_transfer_seconds(cost, spec, notes)
    terms = step_terms(t_compute, t_mem, t_comm, t_host)
    band, pred_band = _bandwidth_band(cost, spec, bw, dtype, simulated_mesh, torus_axes)
    return Prediction(
        target=spec.name, scope="whole_mesh_on_host" if simulated_mesh else "per_device", dtype=d, peak_dtype=pdt,
        peak_flops=peak, memory_bw=bw, flops=flops, bytes=nbytes, transcendentals=trans, compute_s=t_compute,
        transcendental_s=t_trans, memory_s=t_mem, comm_s=t_comm, kernel_s=t_kernels,
        predicted_s=(t_kernels + t_comm) if simulated_mesh else max(t_kernels, t_comm, t_host),
        predicted_serial_s=t_kernels + t_comm + t_host, host_s=t_host, intensity=flops / nbytes if nbytes else math.inf,
        ridge=peak / bw, bound=max(terms, key=terms.get), n_devices=cost.n_devices, comm_by_kind_s=comm_by_kind,
        notes=tuple(dict.fromkeys(notes)), memory_bw_band=band, predicted_s_band=pred_band)


def _host_transfer_seconds(cost: CostReport, spec: HardwareSpec, notes: list[str]) -> float:
    """Seconds of the program's transfers to and from the host's memory (host offloading) over the host link."""
    out, back = cost.host_bytes_out, cost.host_bytes_in
    if not (out or back) or spec.kind == "cpu":
        return 0.0
    if not spec.host_link_bw:
        notes.append(f"{spec.name}: host link bandwidth unpublished; the {max(out, back) / 1e9:.3g} GB offloaded per "
                     "step are not priced")
        return 0.0
    t = max(out, back) / spec.host_link_bw
    notes.append(f"host offloading moves {out / 1e9:.3g} GB to the host and {back / 1e9:.3g} GB back per device: "
                 f"{t:.3g}s at the {spec.host_link_bw / 1e9:.3g} GB/s host link, overlapped with the kernels")
    return t


def _transcendental_seconds(trans: float, spec: HardwareSpec, notes: list[str]) -> float:
    if spec.transcendentals_per_s:
        return trans / spec.transcendentals_per_s
    if trans:
        notes.append(f"{spec.name}: special-function rate unpublished; transcendental term omitted")
    return 0.0


def _note_compiler_bytes(cost: CostReport, notes: list[str]) -> None:
    if not cost.uses_hlo_counts and cost.kernels and cost.hlo_bytes > 0 and cost.bytes_accessed > 5 * cost.hlo_bytes:
        notes.append(f"the compiler's bytes accessed ({cost.bytes_accessed:.3g}) are "
                     f"{cost.bytes_accessed / cost.hlo_bytes:.0f}× the HLO kernels' bytes in + out "
                     f"({cost.hlo_bytes:.3g}): one op may be mispriced by cost_analysis; the memory term uses the "
                     "compiler's figure")


def _communication(cost: CostReport, spec: HardwareSpec, simulated_mesh: bool, mult: int,
                   torus_axes: int) -> dict[str, float]:
    """Seconds per collective kind over the spec's interconnect (host memory for simulated devices)."""
    ic = host.host_interconnect(spec, spec.hbm_bw) if simulated_mesh else spec.interconnect
    comm_by_kind: dict[str, float] = {}
    for c in cost.collectives:
        t = collective_time(c.kind, c.payload_bytes, c.group_size, ic, torus_axes=c.torus_axes or torus_axes,
                            operands=c.operands, bidirectional=c.bidirectional) * c.count * mult
        comm_by_kind[c.kind] = comm_by_kind.get(c.kind, 0.0) + t
    return comm_by_kind


def _kernel_seconds(cost: CostReport, spec: HardwareSpec, pdt: str, bw: float, mult: int, program_roof: float,
                    notes: list[str], t_touch: float) -> float:
    """Σ kernel_time over the HLO kernels (× the simulated devices) when their flops account for the compiler's
    count (within 10 %), else the program-level roof and a note."""
    if cost.uses_hlo_counts:
        kflops, ref = sum(k.flops * k.count for k in cost.kernels), cost.hlo_flops
    else:  # against cost_analysis, in its convention: transcendentals apart, a convert one flop (the reader counts
        #   the float32 <-> narrow-float ones; other converts are rare in these programs)
        kflops = sum((k.flops - k.transcendentals + k.convert_elements) * k.count for k in cost.kernels)
        ref = cost.flops
    if cost.kernels and (ref == 0 or abs(kflops - ref) <= 0.1 * ref):
        t = sum(kernel_time(k, spec, dtype=pdt, memory_bw=bw, sharers=mult,
                            program_bytes=cost.peak_memory_bytes).seconds * k.count for k in cost.kernels)
        return t * mult + t_touch
    if cost.kernels:
        notes.append(f"HLO kernel flops ({kflops:.3g}) do not account for the compiler's ({ref:.3g}); "
                     "program-level roofline used")
    return program_roof


def _bandwidth_band(cost: CostReport, spec: HardwareSpec, bw: float, dtype, simulated_mesh: bool,
                    torus_axes: int) -> tuple[tuple[float, float] | None, tuple[float, float] | None]:
    """The calibrated memory bandwidth band (lowest, highest stream sample) and predicted_s at each end of it;
    (None, None) where the spec has no band or the program runs from the cache."""
    rng = spec.measured.hbm_bw_range
    if not rng or bw != spec.hbm_bw:
        return None, None
    ends = [predict(cost, host.without_band(spec, b), dtype=dtype, simulated_mesh=simulated_mesh,
                    torus_axes=torus_axes).predicted_s for b in (rng[1], rng[0])]
    return (rng[0], rng[1]), (min(ends), max(ends))
