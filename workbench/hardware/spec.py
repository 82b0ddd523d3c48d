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


def monotone_curve(points) -> list[tuple[float, float]]:
    """The non-decreasing curve closest in least squares to measured (size, rate) points: isotonic regression by
    pooling adjacent violators, each point weighted alike. A matmul is never slower per FLOP for being larger, so
    where a measured point breaks that order, the points involved share their mean: the noise of one point moves its
    neighbours by a share of it, where an upper envelope (a running maximum) would carry every high excursion to all
    larger sizes. Returns [(size, rate)] sorted by size."""
    blocks: list[list[float]] = []  # [sum of rates, count]
    pts = sorted(points)
    for _, r in pts:
        blocks.append([r, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    rates = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return [(n, r) for (n, _), r in zip(pts, rates)]


@dataclasses.dataclass(frozen=True)
class MemoryLevel:
    """Host only: one level of the memory hierarchy a kernel's working set can fit in.

    capacity: bytes this process's cores hold at the level (a per-core cache times the instances among the cores
    the process runs on; a shared cache once), from the OS (sysfs). bw: bytes/s (read + written counted) of the
    out-of-place stream over a working set that fits the level, measured. read_ratio: the read-only rate over bw
    (a sum over the same level's data), measured where the calibration has it: a kernel reads at read_ratio·bw and
    a written byte costs (2 − 1/read_ratio)/bw, so the stream's own 1:1 kernel prices at bw whatever the ratio;
    1.5 is a write-allocating cache (each written line read first), 1.0 reads and writes alike."""

    name: str
    capacity: float
    bw: float
    read_ratio: float = 1.0

    def seconds(self, bytes_in: float, bytes_out: float) -> float:
        r = max(self.read_ratio, 1.0)
        return bytes_in / (r * self.bw) + bytes_out * (2.0 - 1.0 / r) / self.bw


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
    physical_peak_flops: dict[str, float] | None = None  # host only: derived from CPU features
    first_touch_bw: float | None = None  # host only: bytes/s of page-faulting fresh large output buffers
    onchip_bw: float | None = None  # host only: measured bandwidth of a stream that stays in the last-level cache
    call_overhead_s: float | None = None  # host only: measured time of a call that does almost nothing
    matmul_curve: tuple[tuple[float, float], ...] | None = None  # host only: (n, float32 FLOP/s of an n³ matmul)
    # host only: ((dtype, ((n, FLOP/s of an n³ matmul in that dtype), ...)), ...): a narrow dtype's own rate curve,
    # measured where the calibration ran one (bfloat16, since version 21); other dtypes take float32's curve's shape
    matmul_curves: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] | None = None
    hbm_bw_range: tuple[float, float] | None = None  # host only: (lowest, highest) stream sample of the calibration
    kernel_launch_s: float | None = None  # host only: measured fixed cost of one more kernel in a program
    collective_latency_s: float | None = None  # host only: one collective's rendezvous on a simulated mesh, per device
    # host only: ((group size, per-device rendezvous s), ...): the same measured with the mesh in groups of 2, 4, 8
    collective_latency_by_group: tuple[tuple[int, float], ...] | None = None
    # host only: elements/s XLA's reduction kernels consume, from memory and from the last-level cache
    reduce_per_s: float | None = None
    reduce_per_s_cached: float | None = None
    convert_per_s: float | None = None  # host only: float32 <-> bf16 conversions/s inside fused elementwise kernels
    # host only: the caches allocate a line on a write miss (the in-place stream ran well above the out-of-place one:
    # writing a new array also reads it), so kernels that run from memory move bytes_in + 2·bytes_out
    write_allocate: bool = False
    # host only: elements/s of a strided transpose in a fused kernel, from memory and from the last-level cache
    transpose_per_s: float | None = None
    transpose_per_s_cached: float | None = None
    # host only: the caches a kernel's working set can fit in, smallest first, each with its measured stream
    # (MemoryLevel); the memory beyond them streams at hbm_bw with memory_read_ratio (reads at ratio·hbm_bw)
    cache_levels: tuple[MemoryLevel, ...] | None = None
    memory_read_ratio: float | None = None
    # host only: special-function results/s inside a library fusion (XLA:CPU's YNN kernels: a softmax, a reduction
    # over exponentials), which evaluates them with its own vector code; None: transcendentals_per_s
    transcendentals_per_s_library: float | None = None

    def matmul_rate(self, size: float, dtype) -> float:
        """Achievable FLOP/s of a matmul of the given size (cube root of m·n·k) in `dtype`: the dtype's own measured
        curve (matmul_curves) where there is one, else float32's (matmul_curve) scaled to the dtype's peak,
        interpolated in log(size) and capped at the dtype's peak; the peak where no curve was measured. A narrow
        dtype has a curve of its own because its shape differs: on a Zen 4 host with avx512_bf16, bf16 ran 1.3–1.5×
        float32 at 128³–256³ and 2.0–2.1× at 1024³–2048³, so float32's shape scaled to the bf16 ceiling priced the
        small bf16 dots of a `tiny` step up to 1.5× too fast. A curve is read as its monotone fit (monotone_curve):
        a larger matmul reuses each operand byte more and is never slower per FLOP than a smaller one, so a point
        below a smaller size's rate (1024³ at 71 GFLOP/s between 512³ at 79 and 2048³ at 110 on one host) is pooled
        with its neighbours rather than pricing the sizes around it alone; and a point above the larger sizes' (1024³
        at 196 between 2048³ and 4096³ at 178 on a Zen 4 host, where the same shapes alternating in rounds ran within
        3 % of each other) is noise that does not lift them."""
        peak = self.peak(dtype)
        name = dtype_name(dtype)
        own = dict(self.matmul_curves or ()).get(name)
        curve = own or self.matmul_curve
        if not curve or size <= 0:
            return peak
        import math

        pts = monotone_curve(curve)
        # float32's curve serves another dtype by its shape, scaled so that its top is the dtype's measured ceiling
        top = pts[-1][1] if (own is None and name != "float32") else peak
        if size <= pts[0][0]:
            r = pts[0][1]
        elif size >= pts[-1][0]:
            r = pts[-1][1]
        else:
            for (n0, r0), (n1, r1) in zip(pts, pts[1:]):
                if n0 <= size <= n1:
                    f = (math.log(size) - math.log(n0)) / (math.log(n1) - math.log(n0))
                    r = r0 + f * (r1 - r0)
                    break
        return min(peak, r * peak / top)

    sources: dict[str, Source] = dataclasses.field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    tpu_generation: str | None = None
    notes: tuple[str, ...] = ()
    cores_per_chip: int | None = None  # TensorCores per chip where the catalogue records it (TPU v7x: 2)
    devices_per_chip: int = 1  # JAX devices this spec's figures are divided over (see per_device)

    def peak(self, dtype) -> float:
        """Dense peak FLOP/s for `dtype`. A dtype the chip has no units for runs at the next wider format's rate
        (fp8 → bfloat16, int8 → bfloat16, float16 → bfloat16, bfloat16 → float32); say so via peak_dtype()."""
        return self.peak_flops[self.peak_dtype(dtype)]

    def physical_peak(self, dtype) -> float | None:
        """Host specs: the physical peak FLOP/s for `dtype` (derived from the CPU's features), through the same
        fallback chain as peak(); None where the spec has none (catalogue chips: their peak is the physical one)."""
        for c in _fallback_chain(dtype_name(dtype)):
            if (self.physical_peak_flops or {}).get(c):
                return float(self.physical_peak_flops[c])
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
