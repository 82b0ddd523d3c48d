"""CostReport: what the compiler says one device does for one execution of a program (per device, frozen, adds).

Sources, each kept apart so they can be compared:
- XLA `cost_analysis()` of the compiled program: flops, transcendentals, bytes accessed (per device). Where it gives
  none (XLA:GPU answers -1, or nothing, for flops and bytes), the field holds the HLO reader's count and
  `cost_analysis_unavailable` names it: never a silent 0.
- XLA `memory_analysis()`: argument, output, temp and alias bytes → per-device peak = args + outputs + temps − aliases.
- The optimized HLO text (workbench.cost.hlo): every kernel (fusion or unfused op) with bytes in/out and estimated flops,
  and every collective with payload, dtype, group size and mesh axes. Kernels inside loops count trip-count times.
  Custom calls the reader cannot price are listed in `unpriced_custom_calls` (their work is missing from the sums);
  those it prices by its own count (a kernel that declares no cost, e.g. splash attention) in `analytic_custom_calls`.
- The analytic count of the unoptimized program (workbench.cost.analytic; jax.experimental.roofline), for the whole
  (global) program: divide by n_devices to compare with a fully partitioned per-device count.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

from workbench import compat
from workbench.cost.hlo import CollectiveOp, KernelCost, custom_calls, parse_collectives, parse_kernels, parse_module

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

    flops: float  # per device, XLA cost_analysis (the HLO reader's count where it is unavailable, see below)
    transcendentals: float  # per device, XLA cost_analysis (likewise)
    bytes_accessed: float  # per device, XLA cost_analysis (likewise)
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
    # cost_analysis keys ('flops', 'bytes accessed', 'transcendentals') XLA gave no valid value for (missing, or
    # negative: XLA:GPU answers -1): the matching fields hold the HLO reader's sums instead
    cost_analysis_unavailable: tuple[str, ...] = ()
    # custom call targets the HLO reader cannot price, with executions per run: their work is in no flop count
    unpriced_custom_calls: tuple[tuple[str, int], ...] = ()
    # custom call targets the HLO reader priced by its own count (hlo.CustomCallUse.analytic: kernels that declare no
    # cost, e.g. Pallas splash attention), with executions per run: the compiler's cost_analysis lacks their work
    analytic_custom_calls: tuple[tuple[str, int], ...] = ()

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
    def host_bytes_out(self) -> float:
        """Per device, bytes moved to the host's memory per execution (host offloading; loop bodies × trip count)."""
        return sum(k.host_out * k.count for k in self.kernels)

    @property
    def host_bytes_in(self) -> float:
        """Per device, bytes moved back from the host's memory per execution."""
        return sum(k.host_in * k.count for k in self.kernels)

    @property
    def has_loops(self) -> bool:
        return any(k.count > 1 for k in self.kernels)

    @property
    def uses_hlo_counts(self) -> bool:
        """Whether the HLO kernel sums (trip-count scaled) replace the compiler's program-level counts: XLA's
        cost_analysis counts a loop body once, so a program with loops whose kernels add up to more than 1.5x the
        compiler's flops is counted from its kernels; and a program whose compiler gave no flops (XLA:GPU) is
        counted from its kernels; and so is a program with custom calls only the reader prices (analytic_custom_calls:
        cost_analysis does not hold their work). The one place this rule lives."""
        return ("flops" in self.cost_analysis_unavailable) or bool(self.analytic_custom_calls) \
            or (self.has_loops and self.hlo_flops > 1.5 * self.flops)

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
            notes=tuple(dict.fromkeys(self.notes + o.notes)),
            cost_analysis_unavailable=tuple(dict.fromkeys(self.cost_analysis_unavailable + o.cost_analysis_unavailable)),
            unpriced_custom_calls=_merge_counts(self.unpriced_custom_calls, o.unpriced_custom_calls),
            analytic_custom_calls=_merge_counts(self.analytic_custom_calls, o.analytic_custom_calls))

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
            "cost_analysis": {"flops": self.flops, "transcendentals": self.transcendentals,
                              "bytes accessed": self.bytes_accessed} | {k: "unavailable"
                                                                       for k in self.cost_analysis_unavailable},
            "cost_analysis_unavailable": list(self.cost_analysis_unavailable),
            "unpriced_custom_calls": dict(self.unpriced_custom_calls),
            "analytic_custom_calls": dict(self.analytic_custom_calls),
            "hlo_flops": self.hlo_flops, "hlo_bytes": self.hlo_bytes, "hlo_transcendentals": self.hlo_transcendentals,
            "host_bytes_out": self.host_bytes_out, "host_bytes_in": self.host_bytes_in,
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


def _merge_counts(*pairs: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
    """(name, count) pairs summed by name, sorted by name."""
    out: dict[str, int] = {}
    for name, n in (p for ps in pairs for p in ps):
        out[name] = out.get(name, 0) + n
    return tuple(sorted(out.items()))


def _guard(d: dict, key: str, notes: list[str], missing_ok: bool = False) -> float | None:
    """cost_analysis's `key` when finite and >= 0; else None (unavailable: the caller uses the HLO reader's count)
    with a note. missing_ok: an absent key means 0 (XLA:CPU leaves 'transcendentals' out when there are none)."""
    v = d.get(key)
    if v is None:
        if missing_ok:
            return 0.0
        notes.append(f"cost_analysis has no '{key}': unavailable, the HLO reader's count is used")
        return None
    v = float(v)
    if not math.isfinite(v) or v < 0:
        notes.append(f"cost_analysis '{key}' = {v:g} is invalid (XLA:GPU answers -1): unavailable, the HLO reader's "
                     "count is used")
        return None
    return v


def costs_from_compiled(compiled, *, n_devices: int | None = None, mesh=None, analytic: AnalyticCount | None = None,
                        compute_dtype: str = "float32", hlo_text: str | None = None) -> CostReport:
    """Read a jax `Compiled` (from jit(f).lower(...).compile()) into a per-device CostReport."""
    d, notes = compat.cost_analysis(compiled)  # one dict whatever the version returns; notes say what it took
    mem, mem_notes = compat.memory_analysis(compiled)
    notes.extend(n for n in mem_notes if "returned nothing" not in n)
    text = hlo_text if hlo_text is not None else compiled.as_text()
    if n_devices is None:
        n_devices = mesh.size if mesh is not None else 1
    mod = parse_module(text)
    kernels = tuple(parse_kernels(text, mod))
    colls = tuple(parse_collectives(text, mesh=mesh, n_devices=n_devices, mod=mod))
    calls = custom_calls(text, mod)
    unpriced = _merge_counts(tuple((u.target, u.count) for u in calls if not u.priced))
    if unpriced:
        notes.append("custom calls the HLO reader cannot price (their work is in no flop count): "
                     + ", ".join(f"{t} ×{n}" for t, n in unpriced))
    notes.extend(dict.fromkeys(u.note for u in calls if u.note))
    analytic_calls = _merge_counts(tuple((u.target, u.count) for u in calls if u.analytic))
    # the compiler's counts; where unavailable, the reader's sums over the kernels (trip-count scaled)
    hlo_sums = {"flops": sum(k.flops * k.count for k in kernels),
                "bytes accessed": sum(k.bytes * k.count for k in kernels),
                "transcendentals": sum(k.transcendentals * k.count for k in kernels)}
    got = {key: _guard(d, key, notes) for key in ("flops", "bytes accessed")}
    got["transcendentals"] = _guard(d, "transcendentals", notes, missing_ok=got["flops"] is not None)
    negative = sorted(k for k, v in d.items() if isinstance(v, (int, float)) and v < 0)
    if negative and any(v is not None for v in got.values()):
        # XLA:GPU answers -1 for each instruction it cannot cost (the cuBLAS and cuDNN calls) and sums those into
        # its totals: on an H200, a cuDNN attention gradient gave flops -2 and bytes accessed +4194326 (its two
        # calls' bytes missing). A total beside any negative entry may be positive and still miss their work.
        notes.append(f"cost_analysis has negative entries ({', '.join(negative[:4])}"
                     f"{', ...' if len(negative) > 4 else ''}): its totals miss the instructions XLA could not cost; "
                     "flops, bytes and transcendentals unavailable, the HLO reader's counts are used")
        got = dict.fromkeys(got)
    unavailable = tuple(k for k, v in got.items() if v is None)
    flops, bytes_acc, trans = (hlo_sums[k] if got[k] is None else got[k]
                               for k in ("flops", "bytes accessed", "transcendentals"))
    if "flops" in unavailable:
        notes.append("no compiler cost_analysis flops: flops and bytes summed from the optimized HLO's kernels "
                     "(workbench.cost.hlo)")
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
                     notes=tuple(notes), cost_analysis_unavailable=unavailable, unpriced_custom_calls=unpriced,
                     analytic_custom_calls=analytic_calls)
    if analytic_calls and not unavailable:
        rep = dataclasses.replace(rep, notes=rep.notes + (
            "custom calls priced by the HLO reader's own count (" + ", ".join(f"{t} ×{n}" for t, n in analytic_calls)
            + "): XLA cost_analysis does not hold their work; predictions use the HLO kernel sums",))
    elif rep.uses_hlo_counts and not unavailable:
        rep = dataclasses.replace(rep, notes=rep.notes + (
            "program has loops: XLA cost_analysis counts a loop body once; predictions use the HLO kernel sums "
            "(trip-count scaled)",))
    return rep
