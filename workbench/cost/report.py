"""CostReport: what the compiler says one device does for one execution of a program (per device, frozen, adds).

Sources, each kept apart so they can be compared:
- XLA `cost_analysis()` of the compiled program: flops, transcendentals, bytes accessed (per device).
- XLA `memory_analysis()`: argument, output, temp and alias bytes → per-device peak = args + outputs + temps − aliases.
- The optimized HLO text (workbench.cost.hlo): every kernel (fusion or unfused op) with bytes in/out and estimated flops,
  and every collective with payload, dtype, group size and mesh axes. Kernels inside loops count trip-count times.
- The analytic count of the unoptimized program (workbench.cost.analytic; jax.experimental.roofline), for the whole
  (global) program: divide by n_devices to compare with a fully partitioned per-device count.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

from workbench.cost.hlo import CollectiveOp, KernelCost, parse_collectives, parse_kernels, parse_module

# glibc serves allocations above this from fresh mmap'd pages (mallopt(3): DEFAULT_MMAP_THRESHOLD_MAX is
# 4·1024·1024·sizeof(long) = 32 MiB on 64-bit), so such buffers are page-faulted in on every call
MMAP_THRESHOLD_BYTES = 32 * 2**20


@dataclasses.dataclass(frozen=True, slots=True)
class AnalyticCount:
    """Count of the unoptimized (jaxpr) program, global over all devices."""

    flops: float
    bytes: float  # HBM bytes of the unfused program as jax.experimental.roofline counts them
    method: str  # 'jax.experimental.roofline' | 'workbench.cost.analytic.jaxpr_dots' (fallback)
    note: str = ""

    def __add__(self, o: "AnalyticCount") -> "AnalyticCount":
        return AnalyticCount(self.flops + o.flops, self.bytes + o.bytes, self.method, self.note)


@dataclasses.dataclass(frozen=True, slots=True)
class CostReport:
    """Per-device costs of one execution of a compiled program. All byte and flop fields are PER DEVICE."""

    flops: float  # per device, XLA cost_analysis
    transcendentals: float  # per device, XLA cost_analysis
    bytes_accessed: float  # per device, XLA cost_analysis
    argument_bytes: float = 0.0  # per device, memory_analysis
    output_bytes: float = 0.0
    temp_bytes: float = 0.0
    alias_bytes: float = 0.0
    generated_code_bytes: float = 0.0
    kernels: tuple[KernelCost, ...] = ()  # per device: fusions and unfused ops of the optimized HLO
    collectives: tuple[CollectiveOp, ...] = ()  # per device
    analytic: AnalyticCount | None = None  # global count of the unoptimized program
    large_output_bytes: float = 0.0  # per device: output arrays above glibc's mmap threshold, not aliased
    n_devices: int = 1
    compute_dtype: str = "float32"
    platform: str = "cpu"
    notes: tuple[str, ...] = ()

    # -- derived -------------------------------------------------------------------------------------------------
    @property
    def peak_memory_bytes(self) -> float:
        """Per-device memory the program needs: arguments + outputs + temps − aliased (donated) bytes."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    @property
    def hlo_flops(self) -> float:
        """Per device, summed over the optimized HLO's kernels (loop bodies × trip count)."""
        return sum(k.flops * k.count for k in self.kernels)

    @property
    def hlo_bytes(self) -> float:
        """Per device, bytes in + out of every kernel (loop bodies × trip count)."""
        return sum(k.bytes * k.count for k in self.kernels)

    @property
    def hlo_transcendentals(self) -> float:
        return sum(k.transcendentals * k.count for k in self.kernels)

    @property
    def has_loops(self) -> bool:
        return any(k.count > 1 for k in self.kernels)

    @property
    def uses_hlo_counts(self) -> bool:
        """Whether the HLO kernel sums (trip-count scaled) replace the compiler's program-level counts: XLA's
        cost_analysis counts a loop body once, so a program with loops whose kernels add up to more than 1.5x the
        compiler's flops is counted from its kernels. The one place this rule lives."""
        return self.has_loops and self.hlo_flops > 1.5 * self.flops

    @property
    def counted_flops(self) -> float:
        """Per-device flops of one execution: the HLO kernel sums when `uses_hlo_counts`, else cost_analysis."""
        return self.hlo_flops if self.uses_hlo_counts else self.flops

    @property
    def counted_bytes(self) -> float:
        return self.hlo_bytes if self.uses_hlo_counts else self.bytes_accessed

    @property
    def counted_transcendentals(self) -> float:
        return max(self.transcendentals, self.hlo_transcendentals) if self.uses_hlo_counts else self.transcendentals

    @property
    def intensity(self) -> float:
        """FLOP per byte accessed (per device)."""
        b = self.bytes_accessed
        return self.flops / b if b > 0 else math.inf

    def collective_bytes(self) -> float:
        """Per device: sum of collective payloads × executions."""
        return sum(c.payload_bytes * c.count for c in self.collectives)

    def collectives_by_kind(self) -> dict[str, dict[str, float]]:
        """{kind: {count, bytes}} per device."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "bytes": 0.0})
        for c in self.collectives:
            out[c.kind]["count"] += c.count
            out[c.kind]["bytes"] += c.payload_bytes * c.count
        return dict(out)

    def collectives_by_kind_and_axis(self) -> dict[str, dict[str, float]]:
        """{'all-gather@data': {count, bytes}, ...} per device; '?' when the groups match no mesh axis."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "bytes": 0.0})
        for c in self.collectives:
            key = f"{c.kind}@{'+'.join(c.mesh_axes) if c.mesh_axes else '?'}"
            out[key]["count"] += c.count
            out[key]["bytes"] += c.payload_bytes * c.count
        return dict(out)

    def top_kernels(self, n: int = 10, key: str = "bytes") -> list[KernelCost]:
        return sorted(self.kernels, key=lambda k: -getattr(k, key) * k.count)[:n]

    # -- algebra -------------------------------------------------------------------------------------------------
    def __add__(self, o: "CostReport") -> "CostReport":
        if not isinstance(o, CostReport):
            return NotImplemented
        if o.n_devices != self.n_devices:
            raise ValueError(f"cannot add costs over {self.n_devices} and {o.n_devices} devices")
        an = (self.analytic + o.analytic) if (self.analytic and o.analytic) else (self.analytic or o.analytic)
        return CostReport(
            flops=self.flops + o.flops, transcendentals=self.transcendentals + o.transcendentals,
            bytes_accessed=self.bytes_accessed + o.bytes_accessed,
            # programs run one after another: memory is the larger of the two, not the sum
            argument_bytes=max(self.argument_bytes, o.argument_bytes), output_bytes=max(self.output_bytes, o.output_bytes),
            temp_bytes=max(self.temp_bytes, o.temp_bytes), alias_bytes=max(self.alias_bytes, o.alias_bytes),
            generated_code_bytes=self.generated_code_bytes + o.generated_code_bytes,
            large_output_bytes=self.large_output_bytes + o.large_output_bytes,
            kernels=self.kernels + o.kernels, collectives=self.collectives + o.collectives, analytic=an,
            n_devices=self.n_devices, compute_dtype=self.compute_dtype, platform=self.platform,
            notes=tuple(dict.fromkeys(self.notes + o.notes)))

    def __radd__(self, o):
        if o == 0:  # sum([...])
            return self
        return NotImplemented

    def to_dict(self, kernels: int | None = 25) -> dict[str, Any]:
        """JSON-ready summary (kernels: the top-n by bytes; None = all)."""
        ks = self.kernels if kernels is None else self.top_kernels(kernels)
        return {
            "scope": "per_device",
            "n_devices": self.n_devices,
            "platform": self.platform,
            "compute_dtype": self.compute_dtype,
            "flops": self.flops, "transcendentals": self.transcendentals, "bytes_accessed": self.bytes_accessed,
            "hlo_flops": self.hlo_flops, "hlo_bytes": self.hlo_bytes, "hlo_transcendentals": self.hlo_transcendentals,
            "intensity": self.intensity if math.isfinite(self.intensity) else None,
            "memory": {"argument_bytes": self.argument_bytes, "output_bytes": self.output_bytes,
                       "temp_bytes": self.temp_bytes, "alias_bytes": self.alias_bytes,
                       "peak_bytes": self.peak_memory_bytes, "generated_code_bytes": self.generated_code_bytes,
                       "large_output_bytes": self.large_output_bytes},
            "analytic": dataclasses.asdict(self.analytic) if self.analytic else None,
            "n_kernels": len(self.kernels),
            "kernels": [dict(dataclasses.asdict(k), intensity=k.intensity) for k in ks],
            "collectives": [{k: v for k, v in dataclasses.asdict(c).items() if k != "groups"}
                            for c in self.collectives],
            "collectives_by_kind": self.collectives_by_kind(),
            "collectives_by_kind_and_axis": self.collectives_by_kind_and_axis(),
            "collective_bytes": self.collective_bytes(),
            "notes": list(self.notes),
        }


def _cost_dict(raw, notes: list[str]) -> dict[str, float]:
    """cost_analysis() returns a dict, a list of dicts (one per program) or None depending on the version."""
    if raw is None:
        notes.append("cost_analysis returned nothing")
        return {}
    if isinstance(raw, (list, tuple)):
        if len(raw) != 1:
            notes.append(f"cost_analysis returned {len(raw)} entries; summed")
        merged: dict[str, float] = defaultdict(float)
        for d in raw:
            for k, v in (d or {}).items():
                merged[k] += v
        return dict(merged)
    return dict(raw)


def _guard(d: dict, key: str, notes: list[str]) -> float:
    v = d.get(key)
    if v is None:
        notes.append(f"cost_analysis has no '{key}'; recorded as 0")
        return 0.0
    v = float(v)
    if not math.isfinite(v) or v < 0:
        notes.append(f"cost_analysis '{key}' = {v} is invalid; recorded as 0")
        return 0.0
    return v


def costs_from_compiled(compiled, *, n_devices: int | None = None, mesh=None, analytic: AnalyticCount | None = None,
                        compute_dtype: str = "float32", hlo_text: str | None = None) -> CostReport:
    """Read a jax `Compiled` (from jit(f).lower(...).compile()) into a per-device CostReport."""
    notes: list[str] = []
    try:
        raw = compiled.cost_analysis()
    except Exception as e:  # some backends do not implement it
        raw = None
        notes.append(f"cost_analysis unavailable: {type(e).__name__}")
    d = _cost_dict(raw, notes)
    flops = _guard(d, "flops", notes)
    trans = d.get("transcendentals", 0.0)
    trans = float(trans) if trans and trans > 0 else 0.0
    bytes_acc = _guard(d, "bytes accessed", notes)
    mem = {}
    try:
        m = compiled.memory_analysis()
        if m is not None:
            mem = {k: float(getattr(m, f"{k}_size_in_bytes", 0) or 0)
                   for k in ("argument", "output", "temp", "alias", "generated_code")}
    except Exception as e:
        notes.append(f"memory_analysis unavailable: {type(e).__name__}")
    text = hlo_text if hlo_text is not None else compiled.as_text()
    if n_devices is None:
        n_devices = mesh.size if mesh is not None else 1
    mod = parse_module(text)
    kernels = tuple(parse_kernels(text, mod))
    colls = tuple(parse_collectives(text, mesh=mesh, n_devices=n_devices, mod=mod))
    # outputs the runtime allocates afresh on every call (host: page-faulted when above the mmap threshold)
    root = next((i for i in reversed(mod.computations.get(mod.entry, [])) if i.is_root), None)
    large = sum(sh.bytes for sh in (root.shapes if root else []) if sh.bytes >= MMAP_THRESHOLD_BYTES)
    large = max(0.0, large - mem.get("alias", 0.0))
    platform = "cpu"
    try:
        platform = next(iter(compiled.input_shardings[0])).mesh.devices.flat[0].platform  # type: ignore[union-attr]
    except Exception:
        try:
            platform = mesh.devices.flat[0].platform if mesh is not None else "cpu"
        except Exception:
            pass
    rep = CostReport(flops=flops, transcendentals=trans, bytes_accessed=bytes_acc,
                     argument_bytes=mem.get("argument", 0.0), output_bytes=mem.get("output", 0.0),
                     temp_bytes=mem.get("temp", 0.0), alias_bytes=mem.get("alias", 0.0),
                     generated_code_bytes=mem.get("generated_code", 0.0), kernels=kernels, collectives=colls,
                     large_output_bytes=float(large),
                     analytic=analytic, n_devices=n_devices, compute_dtype=compute_dtype, platform=platform,
                     notes=tuple(notes))
    if rep.uses_hlo_counts:
        rep = dataclasses.replace(rep, notes=rep.notes + (
            "program has loops: XLA cost_analysis counts a loop body once; predictions use the HLO kernel sums "
            "(trip-count scaled)",))
    return rep
