"""Hardware specs: the catalogue chips (every figure with its source and date) and `host`, this machine, calibrated.

Figures are per chip. `peak_flops` maps a dtype name to dense FLOP/s. For `host` there are two ceilings per dtype:
`peak_flops` holds what XLA achieves here (measured by `workbench calibrate`), and `physical_peak_flops` what the
cores could do (derived from CPU features, see workbench/calibrate.py and docs/hardware.md).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from workbench.errors import WorkbenchError
from workbench.hardware.catalogue import CHIPS
from workbench.hardware.measured import Measured

FP8_NAMES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3", "float8_e4m3fnuz", "float8_e5m2fnuz")
DTYPE_ALIASES = {"f32": "float32", "fp32": "float32", "bf16": "bfloat16", "f16": "float16", "fp16": "float16",
                 "fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2", "s8": "int8",
                 "f64": "float64"}


def dtype_name(dtype) -> str:
    """Canonical dtype name ('bfloat16', 'float32', 'float8_e4m3fn', ...)."""
    if dtype is None:
        return "float32"
    if isinstance(dtype, str):
        return DTYPE_ALIASES.get(dtype, dtype)
    import numpy as np

    return np.dtype(dtype).name


def _fallback_chain(d: str) -> list[str]:
    """The formats whose rate prices a `d` matmul where a chip has no units for `d`: itself first, then the next
    wider ones (fp8 -> bfloat16, float16 -> bfloat16, bfloat16 -> float32, ...)."""
    return {"float8_e4m3fn": ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "bfloat16", "float32"],
            "float8_e5m2": ["float8_e5m2", "float8_e5m2fnuz", "float8_e4m3fn", "bfloat16", "float32"],
            "float4_e2m1fn": ["float4_e2m1fn", "float8_e4m3fn", "float8_e4m3fnuz", "bfloat16", "float32"],
            "float6_e2m3fn": ["float6_e2m3fn", "float8_e4m3fn", "float8_e4m3fnuz", "bfloat16", "float32"],
            "float6_e3m2fn": ["float6_e3m2fn", "float8_e5m2", "float8_e5m2fnuz", "bfloat16", "float32"],
            "int8": ["int8", "bfloat16", "float32"],
            "float16": ["float16", "bfloat16", "float32"],
            "bfloat16": ["bfloat16", "float32"],
            "float64": ["float64", "float32"]}.get(d, [d, "float32"])


@dataclasses.dataclass(frozen=True)
class Source:
    source: str
    date: str
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Interconnect:
    """Chip-to-chip links. link_bw: bytes/s one way per link. kind: ici-torus-2d|ici-torus-3d|nvlink|
    infinity-fabric|host-memory (simulated devices exchange through this host's memory)."""

    kind: str
    link_bw: float
    links: int
    latency_s: float = 0.0
    scale_out_bw: float | None = None  # per chip, one way (InfiniBand/DCN)
    # host-memory only: ((group size, latency_s), ...) where the rendezvous was measured per group size
    latency_by_group: tuple[tuple[int, float], ...] | None = None

    def latency_for(self, group_size: int) -> float:
        """α for a collective over `group_size` devices: the figure measured at the nearest group size (in log
        size) where latency_by_group holds any, else latency_s."""
        if not self.latency_by_group:
            return self.latency_s
        import math

        g = max(int(group_size), 1)
        return min(self.latency_by_group, key=lambda p: (abs(math.log(p[0]) - math.log(g)), -p[0]))[1]

    @property
    def per_chip_bw(self) -> float:
        """One-way bytes/s a chip can push over all its links."""
        return self.link_bw * self.links


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    name: str
    kind: str  # tpu | gpu | cpu
    vendor: str
    peak_flops: dict[str, float]  # dtype -> dense FLOP/s per chip (for host: achievable through XLA, measured)
    hbm_bytes: float
    hbm_bw: float  # bytes/s per chip (for host: measured streaming bandwidth, read + write)
    interconnect: Interconnect
    onchip_bytes: float | None = None
    host_link_bw: float | None = None
    matrix_unit: tuple[int, ...] | None = None
    transcendentals_per_s: float | None = None  # special-function results/s per chip; None = unpublished
    sources: dict[str, Source] = dataclasses.field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    tpu_generation: str | None = None
    notes: tuple[str, ...] = ()
    cores_per_chip: int | None = None  # TensorCores per chip where the catalogue records it (TPU v7x: 2)
    devices_per_chip: int = 1  # JAX devices this spec's figures are divided over (see per_device)
    # what a calibration measured beyond the roofline's ceilings (the host: its caches, rate curves, per-call costs;
    # a calibrated accelerator: its matmul curve and kernel launch); empty for a catalogue chip
    measured: Measured = dataclasses.field(default_factory=lambda: Measured())

    def with_measured(self, **fields) -> HardwareSpec:
        """This spec with some measured refinements replaced (Measured's fields)."""
        return dataclasses.replace(self, measured=dataclasses.replace(self.measured, **fields))

    def matmul_rate(self, size: float, dtype) -> float:
        """Achievable FLOP/s of a matmul of the given size in `dtype`: the measured curve's rate where there is one
        (Measured.matmul_rate), else the dtype's peak."""
        return self.measured.matmul_rate(size, dtype_name(dtype), self.peak(dtype))

    def peak(self, dtype) -> float:
        """Dense peak FLOP/s for `dtype`. A dtype the chip has no units for runs at the next wider format's rate
        (fp8 → bfloat16, int8 → bfloat16, float16 → bfloat16, bfloat16 → float32); say so via peak_dtype()."""
        return self.peak_flops[self.peak_dtype(dtype)]

    def physical_peak(self, dtype) -> float | None:
        """Host specs: the physical peak FLOP/s for `dtype` (derived from the CPU's features), through the same
        fallback chain as peak(); None where the spec has none (catalogue chips: their peak is the physical one)."""
        physical = self.measured.physical_peak_flops or {}
        for c in _fallback_chain(dtype_name(dtype)):
            if physical.get(c):
                return float(physical[c])
        return None

    def peak_dtype(self, dtype) -> str:
        """Which catalogue entry prices `dtype` on this chip (itself when present, else the fallback chain)."""
        d = dtype_name(dtype)
        for c in _fallback_chain(d):
            if c in self.peak_flops:
                return c
        raise WorkbenchError(f"{self.name} has no peak for dtype {d}; known: {', '.join(self.peak_flops)}")

    def ridge(self, dtype) -> float:
        """Arithmetic intensity (FLOP/byte) where compute and memory time are equal."""
        return self.peak(dtype) / self.hbm_bw

    def per_device(self, devices_per_chip: int) -> HardwareSpec:
        """The share of one JAX device when libtpu exposes each chip as `devices_per_chip` devices (TPU v7x: one
        device per TensorCore, two per chip). Peaks, HBM capacity and bandwidth, on-chip memory, transcendental rate
        and the chip's links (ICI and DCN, which the cores share) are divided evenly; per-device costs are then
        compared with per-device ceilings, and device × devices_per_chip gives back the chip. 1 returns self."""
        k = int(devices_per_chip)
        if k == 1:
            return self
        if k < 1:
            raise WorkbenchError(f"devices_per_chip must be >= 1, got {k}")
        ic = self.interconnect
        div = (lambda v: None if v is None else v / k)
        return dataclasses.replace(
            self, name=f"{self.name}/device", peak_flops={d: v / k for d, v in self.peak_flops.items()},
            hbm_bytes=self.hbm_bytes / k, hbm_bw=self.hbm_bw / k, onchip_bytes=div(self.onchip_bytes),
            host_link_bw=div(self.host_link_bw), transcendentals_per_s=div(self.transcendentals_per_s),
            interconnect=dataclasses.replace(ic, link_bw=ic.link_bw / k, scale_out_bw=div(ic.scale_out_bw)),
            devices_per_chip=self.devices_per_chip * k,
            notes=self.notes + (f"per JAX device: every per-chip figure of {self.name} / {k} ({k} devices per chip; "
                                "the sources give the chip's figures)",))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(d.pop("measured"))  # one flat record: the measured fields beside the ceilings they refine
        d["sources"] = {k: dataclasses.asdict(v) for k, v in self.sources.items()}
        d["ridge_points"] = {k: v / self.hbm_bw for k, v in self.peak_flops.items()}
        return d


def _val(entry, key, sources, name):
    if entry is None:
        return None
    value, src, date, *rest = entry
    sources[name] = Source(src, date, rest[0] if rest else "")
    return value


def _from_catalogue(name: str, c: dict) -> HardwareSpec:
    src: dict[str, Source] = {}
    peaks = {dt: _val(e, dt, src, f"peak_flops.{dt}") for dt, e in c["peak_flops"].items() if e is not None}
    ic = c["interconnect"]
    inter = Interconnect(
        kind=ic["kind"], link_bw=_val(ic["link_bw"], "", src, "interconnect.link_bw"),
        links=int(_val(ic["links"], "", src, "interconnect.links")),
        latency_s=_val(ic.get("latency_s"), "", src, "interconnect.latency_s") or 0.0,
        scale_out_bw=_val(ic.get("scale_out_bw"), "", src, "interconnect.scale_out_bw"))
    mu = _val(c.get("matrix_unit"), "", src, "matrix_unit")
    return HardwareSpec(
        name=name, kind=c["kind"], vendor=c["vendor"], peak_flops=peaks,
        hbm_bytes=_val(c["hbm_bytes"], "", src, "hbm_bytes"), hbm_bw=_val(c["hbm_bw"], "", src, "hbm_bw"),
        interconnect=inter, onchip_bytes=_val(c.get("onchip_bytes"), "", src, "onchip_bytes"),
        host_link_bw=_val(c.get("host_link_bw"), "", src, "host_link_bw"),
        matrix_unit=tuple(mu) if mu else None,
        transcendentals_per_s=_val(c.get("transcendentals_per_s"), "", src, "transcendentals_per_s"),
        sources=src, aliases=tuple(c.get("aliases", ())), tpu_generation=c.get("tpu_generation"),
        notes=tuple(c.get("notes", ())), cores_per_chip=_val(c.get("cores_per_chip"), "", src, "cores_per_chip"))


def catalogue() -> dict[str, HardwareSpec]:
    """The catalogue chips (not `host`). Built once per process; the specs are frozen, the dict is a copy."""
    return dict(_catalogue())


@functools.lru_cache(maxsize=1)
def _catalogue() -> dict[str, HardwareSpec]:
    return {n: _from_catalogue(n, c) for n, c in CHIPS.items()}


def names() -> list[str]:
    return [*catalogue(), "host"]


def resolve_name(name: str) -> str:
    """Canonical chip name for a name or alias (case-insensitive)."""
    key = name.strip().lower()
    if key in ("host", "cpu", "local"):
        return "host"
    for n, spec in catalogue().items():
        if key == n or key in (a.lower() for a in spec.aliases):
            return n
    raise WorkbenchError(f"unknown chip {name!r}; choose one of {', '.join(names())} (see `workbench hw list`)")


def catalogue_spec(name: str) -> HardwareSpec:
    """A catalogue chip by name or alias. `host` is measured, not catalogued: workbench.measure.calibrate.get_spec
    answers for it (from the cached calibration, calibrating when absent) and for every catalogue chip."""
    n = resolve_name(name)
    if n == "host":
        raise WorkbenchError("the host's spec comes from its calibration: use workbench.measure.calibrate.get_spec('host')")
    return catalogue()[n]
