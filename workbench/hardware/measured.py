"""What a calibration measured beyond a chip's roofline: the refinements the host roofline composes.

A chip's roofline is its peak FLOP/s per dtype, its memory bandwidth and its links (workbench.hardware.spec,
HardwareSpec). A calibrated machine adds what it measured (`workbench calibrate`, workbench/measure/calibrate.py):
on the host its cache levels with their bandwidths, matmul rate curves, the cost of a call and of a kernel,
reduction, conversion and transpose throughputs, whether its caches allocate on a write miss; on a calibrated
accelerator its matmul curve and kernel launch. A catalogue chip has none of these (every field None). The host's
pricing of them lives in workbench/roofline/host.py.
"""
from __future__ import annotations

import dataclasses
import math


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


def log_interpolate(pts: list[tuple[float, float]], x: float) -> float:
    """The rate at `x` on a curve of (size, rate) points sorted by size: linear in log(size) between the two points
    around it, the end point's rate beyond either end."""
    if x <= pts[0][0]:
        return pts[0][1]
    for (n0, r0), (n1, r1) in zip(pts, pts[1:]):
        if x <= n1:
            return r0 + (math.log(x) - math.log(n0)) / (math.log(n1) - math.log(n0)) * (r1 - r0)
    return pts[-1][1]


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
class Measured:
    """The measured refinements of one machine (None: not measured)."""

    physical_peak_flops: dict[str, float] | None = None  # host: what the cores could do, from their features
    physical_clock_ghz: float | None = None  # host: the clock physical_peak_flops assumes (OS-reported or known max)
    first_touch_bw: float | None = None  # host: bytes/s of page-faulting fresh large output buffers
    onchip_bw: float | None = None  # host: measured bandwidth of a stream that stays in the last-level cache
    call_overhead_s: float | None = None  # host: measured time of a call that does almost nothing
    matmul_curve: tuple[tuple[float, float], ...] | None = None  # host: (n, float32 FLOP/s of an n³ matmul)
    # host: ((dtype, ((n, FLOP/s of an n³ matmul in that dtype), ...)), ...): a narrow dtype's own rate curve,
    # measured where the calibration ran one (bfloat16, since version 21); other dtypes take float32's curve's shape
    matmul_curves: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] | None = None
    # host: ((rows, float32 FLOP/s of a rows × 2048 by 2048² product), ...) for 1 to 64 rows: products with few rows
    # (a decode step's, one row per sequence) run on a path of their own, below the square curve (version 26 on)
    skinny_curve: tuple[tuple[float, float], ...] | None = None
    hbm_bw_range: tuple[float, float] | None = None  # host: (lowest, highest) stream sample of the calibration
    kernel_launch_s: float | None = None  # host: measured fixed cost of one more kernel in a program
    # host: the fixed seconds a kernel whose data comes from memory pays before its stream runs at the memory's rate
    # (the intercept of dependent sums over distinct 1-8 MiB arrays against their bytes; version 29 on)
    memory_start_s: float | None = None
    collective_latency_s: float | None = None  # host: one collective's rendezvous on a simulated mesh, per device
    # host: ((group size, per-device rendezvous s), ...): the same measured with the mesh in groups of 2, 4, 8
    collective_latency_by_group: tuple[tuple[int, float], ...] | None = None
    # host: elements/s XLA's reduction kernels consume, from memory and from the last-level cache
    reduce_per_s: float | None = None
    reduce_per_s_cached: float | None = None
    convert_per_s: float | None = None  # host: float32 <-> bf16 conversions/s inside fused elementwise kernels
    # host: the caches allocate a line on a write miss (the in-place stream ran well above the out-of-place one:
    # writing a new array also reads it), so kernels that run from memory move bytes_in + 2·bytes_out
    write_allocate: bool = False
    # host: elements/s of a strided transpose in a fused kernel, from memory and from the last-level cache
    transpose_per_s: float | None = None
    transpose_per_s_cached: float | None = None
    # host: the caches a kernel's working set can fit in, smallest first, each with its measured stream
    # (MemoryLevel); the memory beyond them streams at hbm_bw with memory_read_ratio (reads at ratio·hbm_bw)
    cache_levels: tuple[MemoryLevel, ...] | None = None
    memory_read_ratio: float | None = None
    # host: a one-row product's weight-read rate from memory over the memory's read rate (XLA:CPU's matrix-vector
    # kernel over a weight whose rows it contracts: a decode step's projections); None: that read rate
    row_product_read_ratio: float | None = None
    # host: special-function results/s inside a library fusion (XLA:CPU's YNN kernels: a softmax, a reduction
    # over exponentials), which evaluates them with its own vector code; None: transcendentals_per_s
    transcendentals_per_s_library: float | None = None
    # host: inside a library fusion, elements/s of the pass that writes a reduction's computed operand into a buffer
    # before reducing it, and elementwise flops/s of its vector loops (KernelCost.produced_reduce_elements;
    # workbench.roofline.host.library_compute_seconds); None: a library fusion is priced as XLA's own kernels are
    library_pass_per_s: float | None = None
    library_ops_per_s: float | None = None

    def skinny_rate(self, rows: float, name: str) -> float | None:
        """Achievable float32 FLOP/s of a product whose smallest side has `rows` rows, from skinny_curve
        (interpolated in log(rows), its monotone fit); None where there is no curve, the dtype is not float32, or
        the product has at least the curve's last row count (the square curve prices it)."""
        if not self.skinny_curve or name != "float32" or rows <= 0:
            return None
        pts = monotone_curve(self.skinny_curve)
        return None if rows >= pts[-1][0] else log_interpolate(pts, rows)

    def matmul_rate(self, size: float, name: str, peak: float) -> float:
        """Achievable FLOP/s of a matmul of the given size (cube root of m·n·k) in dtype `name` whose peak is
        `peak`: the dtype's own measured curve (matmul_curves) where there is one, else float32's (matmul_curve)
        scaled to the dtype's peak, interpolated in log(size) and capped at the peak; the peak where no curve was
        measured. A narrow dtype has a curve of its own because its shape differs from float32's (on CPUs with
        bf16 dot instructions its gain over float32 grows with the size). A curve is read as its monotone fit
        (monotone_curve): a larger matmul reuses each operand byte more and is never slower per FLOP than a smaller
        one, so a measured point that breaks the order is noise pooled with its neighbours."""
        own = dict(self.matmul_curves or ()).get(name)
        curve = own or self.matmul_curve
        if not curve or size <= 0:
            return peak
        pts = monotone_curve(curve)
        # float32's curve serves another dtype by its shape, scaled so that its top is the dtype's measured ceiling
        top = pts[-1][1] if (own is None and name != "float32") else peak
        return min(peak, log_interpolate(pts, size) * peak / top)
