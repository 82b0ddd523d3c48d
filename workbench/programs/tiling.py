"""Systolic-friendly tiling: padding waste of matmul shapes, the shape sawtooth from compiled programs, and a tile
search for the Pallas blocked matmul.

Three programs (each returns a frozen result with `to_record()`; `workbench tiling shape|sweep|search`):

shape_report   a matmul (or every matmul of a preset's step) padded to the chip's matrix-unit granule
               (workbench.hardware.tiles.pad_granule): padded shapes, utilization = useful / padded flops, wasted flops and
               bytes, the roofline time at the padded size (workbench.roofline.prediction.predict on a CostReport of the padded
               matmul); for a model, the waste each config dimension causes and its nearest friendly values.
sweep          compiles x(m, k) @ y(k, n) for k over a range for the target (a TPU slice through libtpu's compile-only
               devices; the host, measured), reads each operand's layout from the compiled HLO
               (`bf16[4096,1032]{0,1:T(8,128)(2,1)}`), pads the logical shape by the tiles it names, rounds the
               contraction and output columns up to the MXU side, and predicts the time of that padded program
               through the roofline. Beside it: the TPU compiler's own cycle estimate of the dot fusion
               (backend_config estimated_cycles), and on the host the measured time.
search         enumerates block shapes of models/kernels/matmul.py, keeps those whose double-buffered blocks and
               accumulator fit the core's on-chip memory (VMEM / shared memory; a block that does not fit is
               rejected with the reason), predicts each from the tile's own roofline (per grid step: MXU time at the
               padded block, HBM time of the blocks it loads, VMEM time of the accumulator; steps overlap their loads
               with the previous step's compute; plus the pipeline fill and the last write-back), compiles the best few
               for the target and, where the target's hardware is this host, measures them.
"""
from __future__ import annotations

import dataclasses
import math
import re
import sys
import time
from typing import Any

from models.kernels.matmul import Block, matmul
from models.presets import get_config
from partitioning import topology as topo
from workbench.cost.compile import compile_program
from workbench.cost.hlo import DTYPE_BYTES, KernelCost
from workbench.cost.report import CostReport
from workbench.errors import WorkbenchError
from workbench.hardware import tiles
from workbench.hardware.spec import HardwareSpec, resolve_name
from workbench.measure.calibrate import get_spec
from workbench.measure.harness import measure, random_inputs
from workbench.roofline.prediction import predict

# ------------------------------------------------------------------------------------------------- targets


@dataclasses.dataclass(frozen=True)
class TilingTarget:
    """A chip (catalogue name), how many of them (a slice or node), and the text the user gave."""

    text: str
    chip: str
    n_devices: int
    topology: Any  # partitioning.topology.Target or None (a bare chip name or the host)

    @property
    def is_host(self) -> bool:
        return self.chip == "host"


def parse_tiling_target(text: str) -> TilingTarget:
    """`tpu-v6e` (one chip), `tpu-v5e:2x2` (a slice), `h100:8` (a node), `host`."""
    if not text or not str(text).strip():
        raise WorkbenchError("empty --target; give a chip (tpu-v6e, h100), a slice (tpu-v5e:1x1) or host")
    raw = str(text).strip().lower()
    if raw in ("host", "cpu", "local"):
        return TilingTarget(raw, "host", 1, None)
    if ":" in raw:
        t = topo.parse_target(raw)
        return TilingTarget(raw, t.chip, t.n_chips, t)
    try:
        chip = resolve_name(raw)
    except WorkbenchError:
        chip = tiles.chip_key(raw)  # a chip with a tile model but no catalogue entry here (yet)
    return TilingTarget(raw, chip, 1, None)


def _spec(chip: str) -> HardwareSpec:
    try:
        return get_spec(chip)
    except WorkbenchError as e:
        raise WorkbenchError(f"{chip} has a tile model but no hardware catalogue entry to predict with ({e}); "
                             "use a chip from `workbench hw list`") from None


def _tile_model(chip: str) -> tiles.TileModel:
    if chip == "host":
        raise WorkbenchError("the host CPU has no matrix-unit tile model; give --target a TPU or GPU chip "
                             "(`workbench tiling sweep --target host` measures the host instead)")
    return tiles.tile_model(chip)


def _matmul_cost(flops: float, bytes_in: float, bytes_out: float, dtype: str, platform: str,
                 size: float) -> CostReport:
    """A CostReport of one dot kernel (the roofline's input) with the given flops and bytes."""
    k = KernelCost("dot", "dot", "", float(bytes_in), float(bytes_out), float(flops), 0.0, 1, float(flops),
                   float(size))
    return CostReport(flops=float(flops), transcendentals=0.0, bytes_accessed=float(bytes_in + bytes_out),
                      output_bytes=float(bytes_out), kernels=(k,), compute_dtype=dtype, platform=platform)


def predict_matmul_s(spec: HardwareSpec, flops: float, bytes_in: float, bytes_out: float, dtype: str,
                     size: float = 0.0):
    """The roofline Prediction of one matmul kernel with these flops and bytes on `spec`."""
    return predict(_matmul_cost(flops, bytes_in, bytes_out, dtype, spec.kind, size), spec, dtype=dtype)


# ------------------------------------------------------------------------------------------------- shape


@dataclasses.dataclass(frozen=True)
class MatmulShape:
    """One matmul of a step: (batch ×) m × k @ k × n, run `count` times; `dims` names the config field behind
    each of m, n, k (or a product of fields, or a step size such as tokens)."""

    name: str
    m: int
    n: int
    k: int
    batch: int = 1
    count: int = 1
    dims: tuple[str, str, str] = ("m", "n", "k")


@dataclasses.dataclass(frozen=True)
class ShapeRow:
    shape: MatmulShape
    padded: tiles.PaddedMatmul
    predicted_s: float            # one execution at the padded shape (roofline)
    predicted_unpadded_s: float   # the same matmul if the unit had no granule (the ideal)

    def to_record(self) -> dict:
        s = self.shape
        return {"name": s.name, "m": s.m, "n": s.n, "k": s.k, "batch": s.batch, "count": s.count,
                "dims": list(s.dims),
                "padded": {"m": self.padded.m_pad, "n": self.padded.n_pad, "k": self.padded.k_pad},
                "utilization": self.padded.utilization, "wasted_flops": self.padded.wasted_flops * s.count,
                "wasted_bytes": self.padded.wasted_bytes * s.count, "predicted_s": self.predicted_s * s.count,
                "predicted_unpadded_s": self.predicted_unpadded_s * s.count}


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """A config dimension, the waste it causes, and the nearest values that waste nothing on this target."""

    field: str
    value: int
    multiple: int
    friendly_down: int | None
    friendly_up: int
    wasted_flops: float   # per step: what padding this dimension alone costs
    share: float          # of all wasted flops of the step
    reason: str

    def to_record(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ShapeReport:
    target: str
    chip: str
    dtype: str
    granule: tuple[int, int, int]
    n_devices: int
    rows: tuple[ShapeRow, ...]
    suggestions: tuple[Suggestion, ...]
    source: str                       # what the matmuls are: 'matmul' or 'preset P (mode, batch, seq)'
    notes: tuple[str, ...] = ()

    @property
    def flops(self) -> float:
        return sum(r.padded.flops * r.shape.count for r in self.rows)

    @property
    def padded_flops(self) -> float:
        return sum(r.padded.padded_flops * r.shape.count for r in self.rows)

    @property
    def utilization(self) -> float:
        return self.flops / self.padded_flops if self.padded_flops else 1.0

    @property
    def predicted_s(self) -> float:
        return sum(r.predicted_s * r.shape.count for r in self.rows)

    def to_record(self) -> dict:
        rows = [r.to_record() for r in self.rows]
        single = len(self.rows) == 1 and self.rows[0].shape.count == 1
        return {
            "target": self.target, "chip": self.chip, "dtype": self.dtype, "granule": list(self.granule),
            "n_devices": self.n_devices, "source": self.source,
            "padded": rows[0]["padded"] if single else [{"name": r["name"], **r["padded"]} for r in rows],
            "utilization": self.utilization,
            "wasted_flops": self.padded_flops - self.flops,
            "wasted_bytes": sum(r["wasted_bytes"] for r in rows),
            "predicted_s": self.predicted_s,
            "predicted_unpadded_s": sum(r["predicted_unpadded_s"] for r in rows),
            "suggestions": [s.to_record() for s in self.suggestions],
            "matmuls": rows, "notes": list(self.notes),
        }


def _row(shape: MatmulShape, model: tiles.TileModel, spec: HardwareSpec, dtype: str) -> ShapeRow:
    p = tiles.pad_matmul(shape.m, shape.n, shape.k, model, dtype, batch=shape.batch)
    b_in = tiles.dtype_bits(dtype) / 8
    size = (shape.m * shape.n * shape.k) ** (1 / 3)
    out_p = p.batch * p.m_pad * p.n_pad * b_in
    pred = predict_matmul_s(spec, p.padded_flops, p.padded_bytes - out_p, out_p, dtype, size)
    out_u = p.batch * p.m * p.n * b_in
    ideal = predict_matmul_s(spec, p.flops, p.bytes - out_u, out_u, dtype, size)
    return ShapeRow(shape, p, pred.predicted_s, ideal.predicted_s)


def shape_report(target: str, *, m: int | None = None, n: int | None = None, k: int | None = None,
                 batch: int = 1, dtype: str = "bfloat16", preset: str | None = None, overrides: str | None = None,
                 step_batch: int = 8, seq: int | None = None, mode: str = "train") -> ShapeReport:
    """Padding of one matmul (m, n, k) or of every matmul of a preset's step on `target` (module docstring)."""
    t = parse_tiling_target(target)
    model = _tile_model(t.chip)
    spec = _spec(t.chip)
    dtype = tiles.canonical_dtype(dtype)
    notes = [f"granule {tiles.pad_granule(model, dtype)} (m, n, k) from the {model.chip} tile model: "
             + ("m to the dtype's sublane tile, n and k to the systolic array's side" if model.kind == "tpu"
                else "the tensor-core MMA instruction shape (libraries tile in larger blocks on top)")]
    if preset is None:
        if None in (m, n, k):
            raise WorkbenchError("give --m, --n and --k (a matmul) or --preset P (every matmul of its step)")
        shapes = [MatmulShape("matmul", int(m), int(n), int(k), int(batch), 1, ("m", "n", "k"))]
        source = "matmul"
        cfg = None
    else:
        cfg = get_config(preset, overrides)
        shapes = model_matmuls(cfg, batch=step_batch, seq=seq or cfg.seq_len, mode=mode)
        source = f"preset {preset} ({mode}, batch {step_batch}, seq {seq or cfg.seq_len})"
        notes.append("matmuls as models/ issues them (global shapes, one device); the backward pass adds the two "
                     "gradient matmuls of each forward one, with the dimensions in other roles")
    rows = tuple(_row(s, model, spec, dtype) for s in shapes)
    sugg = suggestions(rows, model, spec, dtype, t.n_devices, cfg)
    return ShapeReport(t.text, t.chip, dtype, tiles.pad_granule(model, dtype), t.n_devices, rows, sugg, source,
                       tuple(notes))


def model_matmuls(cfg, *, batch: int, seq: int, mode: str = "train") -> list[MatmulShape]:
    """The matmuls of one step of models.transformer.Transformer with this config (train: forward + the two
    gradient matmuls of each; forward: forward only). Tokens T = batch · seq."""
    if mode not in ("train", "forward"):
        raise WorkbenchError(f"--mode must be train or forward, got {mode!r}")
    T, S, L = batch * seq, seq, cfg.n_layers
    d, h, n, kv, f, v = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.vocab_size
    fwd: list[MatmulShape] = [
        MatmulShape("attn.q", T, n * h, d, 1, L, ("tokens", "n_heads*head_dim", "d_model")),
        MatmulShape("attn.kv", T, kv * h, d, 1, 2 * L, ("tokens", "n_kv_heads*head_dim", "d_model")),
        MatmulShape("attn.scores", S, S, h, batch * n, L, ("seq_len", "seq_len", "head_dim")),
        MatmulShape("attn.values", S, h, S, batch * n, L, ("seq_len", "head_dim", "seq_len")),
        MatmulShape("attn.out", T, d, n * h, 1, L, ("tokens", "d_model", "n_heads*head_dim")),
    ]
    if cfg.is_moe:
        rows = max(1, math.ceil(T * cfg.top_k * (cfg.capacity_factor or 1.0) / cfg.n_experts))
        fwd.append(MatmulShape("moe.router", T, cfg.n_experts, d, 1, L, ("tokens", "n_experts", "d_model")))
        up = 2 if cfg.mlp == "swiglu" else 1
        fwd.append(MatmulShape("mlp.up", rows, f, d, cfg.n_experts, up * L, ("expert_rows", "d_ff", "d_model")))
        fwd.append(MatmulShape("mlp.down", rows, d, f, cfg.n_experts, L, ("expert_rows", "d_model", "d_ff")))
    else:
        up = 2 if cfg.mlp == "swiglu" else 1
        fwd.append(MatmulShape("mlp.up", T, f, d, 1, up * L, ("tokens", "d_ff", "d_model")))
        fwd.append(MatmulShape("mlp.down", T, d, f, 1, L, ("tokens", "d_model", "d_ff")))
    fwd.append(MatmulShape("head", T, v, d, 1, 1, ("tokens", "vocab_size", "d_model")))
    if mode == "forward":
        return fwd
    out = list(fwd)
    for s in fwd:  # dX = dY · Wᵀ: (m, k) from (m, n) x (n, k);  dW = Xᵀ · dY: (k, n) from (k, m) x (m, n)
        dm, dn, dk = s.dims
        out.append(MatmulShape(s.name + ".dx", s.m, s.k, s.n, s.batch, s.count, (dm, dk, dn)))
        out.append(MatmulShape(s.name + ".dw", s.k, s.n, s.m, s.batch, s.count, (dk, dn, dm)))
    return out


def _field_multiple(field: str, side: int, n_devices: int) -> tuple[int, str]:
    if field == "vocab_size":
        return side * n_devices, (f"vocab padded to a multiple of {side} (array side) x {n_devices} device(s): the "
                                  "output head shards the vocabulary")
    if field == "head_dim":
        return side, (f"head_dim is the contraction of the attention scores and the column dimension of the "
                      f"values matmul: a multiple of {side} fills the matrix unit")
    return side, f"a multiple of {side} fills the matrix unit in every role this dimension plays"


def suggestions(rows, model: tiles.TileModel, spec, dtype: str, n_devices: int, cfg=None) -> tuple[Suggestion, ...]:
    """Waste per named dimension: Σ over matmuls of the padded flops minus those with only that dimension unpadded;
    for config fields, the nearest multiples of the friendly granule (module docstring)."""
    total_waste = sum(r.padded.wasted_flops * r.shape.count for r in rows)
    waste: dict[str, float] = {}
    gran: dict[str, int] = {}
    for r in rows:
        p, s = r.padded, r.shape
        padded = {"m": p.m_pad, "n": p.n_pad, "k": p.k_pad}
        logical = {"m": p.m, "n": p.n, "k": p.k}
        for role, field, g in zip("mnk", s.dims, p.granule):
            gran[field] = max(gran.get(field, 1), g)
            alt = dict(padded, **{role: logical[role]})
            saved = 2.0 * p.batch * (p.m_pad * p.n_pad * p.k_pad - alt["m"] * alt["n"] * alt["k"]) * s.count
            if saved > 0:
                waste[field] = waste.get(field, 0.0) + saved
    out = []
    for field, w in sorted(waste.items(), key=lambda kv: -kv[1]):
        base = field.split("*")[-1]
        value = getattr(cfg, base, None) if cfg is not None else None
        if cfg is None:
            value = {"m": rows[0].shape.m, "n": rows[0].shape.n, "k": rows[0].shape.k}.get(field)
        if value is None:  # tokens, expert rows: sizes of the step, not config fields
            value = next(getattr(r.shape, role) for r in rows for role, f in zip("mnk", r.shape.dims) if f == field)
        mult, why = _field_multiple(base, gran[field], n_devices)
        if "*" in field:
            prod_other = 1
            for part in field.split("*")[:-1]:
                prod_other *= getattr(cfg, part)
            g = gran[field]
            mult = max(1, g // math.gcd(g, prod_other))
            why = f"{field} must be a multiple of {g}: {base} a multiple of {mult}"
        down, up = tiles.friendly(int(value), mult)
        out.append(Suggestion(field, int(value), mult, down, up, w, w / total_waste if total_waste else 0.0, why))
    return tuple(out)


# ------------------------------------------------------------------------------------------------- layouts

_LAYOUT_RE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]\{([0-9,]*)(?::([^}]*))?\}")
_TILE_RE = re.compile(r"T\(([0-9,]+)\)")


@dataclasses.dataclass(frozen=True)
class Layout:
    """An array type with its layout as the compiled HLO prints it: dtype[dims]{minor_to_major:T(tile)...}."""

    text: str
    dtype: str
    dims: tuple[int, ...]
    minor_to_major: tuple[int, ...]
    tiles: tuple[tuple[int, ...], ...]

    @property
    def padded_dims(self) -> tuple[int, ...]:
        """The logical dims padded by the first (outer) tile: it covers the most-minor len(tile) dimensions."""
        if not self.tiles or not self.dims:
            return self.dims
        tile = self.tiles[0]
        order = list(reversed(self.minor_to_major)) if self.minor_to_major else list(range(len(self.dims)))
        out = list(self.dims)
        for size, dim in zip(reversed(tile), reversed(order)):
            out[dim] = tiles.round_up(out[dim], size)
        return tuple(out)

    @property
    def bytes_padded(self) -> float:
        return math.prod(self.padded_dims) * DTYPE_BYTES.get(self.dtype, 4)


def parse_layouts(text: str) -> list[Layout]:
    out = []
    for dt, dims, m2m, rest in _LAYOUT_RE.findall(text):
        tl = tuple(tuple(int(x) for x in t.split(",")) for t in _TILE_RE.findall(rest or ""))
        out.append(Layout(f"{dt}[{dims}]{{{m2m}{':' + rest if rest else ''}}}", dt,
                          tuple(int(d) for d in dims.split(",") if d), tuple(int(d) for d in m2m.split(",") if d),
                          tl))
    return out


def entry_layouts(hlo_text: str) -> tuple[list[Layout], list[Layout]]:
    """(parameter layouts, result layouts) from the module's entry_computation_layout."""
    m = re.search(r"entry_computation_layout=\{\((.*?)\)->(.*?)\}(?:,|\s*$)", hlo_text, re.M)
    if not m:
        raise WorkbenchError("the compiled HLO has no entry_computation_layout to read layouts from")
    return parse_layouts(m.group(1)), parse_layouts(m.group(2) + "}")


_CYCLES_RE = re.compile(r'"estimated_cycles":"(\d+)"')


def compiler_cycles(hlo_text: str) -> int | None:
    """Σ of the TPU compiler's estimated_cycles over the program's fusions (backend_config), or None."""
    vals = [int(v) for v in _CYCLES_RE.findall(hlo_text)]
    return sum(vals) if vals else None


def tpu_clock_hz(model: tiles.TileModel, spec: HardwareSpec) -> float:
    """Derived: bf16 peak / (2 · MXUs · side² · TensorCores per device) — the clock the catalogue peak implies."""
    side = model.matrix_unit.value[0]
    cores = model.cores.value if spec.name in ("tpu-v4", "tpu-v5p") else 1
    return spec.peak("bfloat16") / (2.0 * model.matrix_units.value * side * side * cores)


# ------------------------------------------------------------------------------------------------- sweep


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    k: int
    m: int
    n: int
    layouts: tuple[str, ...]          # lhs, rhs, result as compiled
    padded: dict                      # m, n, k after the layouts' tiles
    mxu_padded: dict                  # m, n, k as the matrix unit runs them (n and k to the array side on TPU)
    predicted_s: float                # roofline of the padded program
    predicted_unpadded_s: float       # roofline of the logical shape (no padding anywhere)
    compiler_cycles: int | None       # TPU: the compiler's estimated_cycles of the program's fusions
    compiler_estimated_s: float | None  # those cycles at the clock the catalogue peak implies
    xla_flops: float                  # the compiler's cost_analysis flops (per device)
    measured_s: float | None
    compile_s: float

    @property
    def throughput_flops(self) -> float:
        """Useful flops (2·m·n·k) per predicted second."""
        return 2.0 * self.m * self.n * self.k / self.predicted_s if self.predicted_s else 0.0

    def to_record(self) -> dict:
        d = dataclasses.asdict(self)
        d["layouts"] = list(self.layouts)
        d["throughput_flops"] = self.throughput_flops
        d["measured_throughput_flops"] = 2.0 * self.m * self.n * self.k / self.measured_s if self.measured_s else None
        return d


@dataclasses.dataclass(frozen=True)
class SweepResult:
    target: str
    chip: str
    dtype: str
    m: int
    n: int
    points: tuple[SweepPoint, ...]
    boundaries: tuple[int, ...]      # k values where a new tile starts (multiples of the contraction granule)
    granule_k: int
    figure: str | None
    notes: tuple[str, ...] = ()

    def to_record(self) -> dict:
        return {"target": self.target, "chip": self.chip, "dtype": self.dtype, "m": self.m, "n": self.n,
                "granule_k": self.granule_k, "boundaries": list(self.boundaries),
                "points": [p.to_record() for p in self.points], "figure": self.figure, "notes": list(self.notes)}


def _sweep_devices(t: TilingTarget):
    """The device to compile for and whether its programs can be measured here."""
    import jax

    if t.is_host:
        return jax.devices("cpu")[0], True
    if t.topology is not None and t.topology.kind == "tpu":
        if t.n_devices != 1:
            raise WorkbenchError(f"the sweep compiles one chip's dot; give a one-chip slice such as "
                                 f"tpu-{t.topology.family}:1x1{'x1' if len(t.topology.shape) == 3 else ''}")
        return topo.tpu_devices(t.topology.name)[0], False
    local = [d for d in jax.devices() if d.platform in ("gpu", "cuda", "rocm", "tpu")]
    if local:
        return local[0], True
    raise WorkbenchError(f"--target {t.text}: the sweep compiles for a TPU slice from this host (e.g. tpu-v5e:1x1) "
                         "or runs on the host / a local GPU; no compiler for that target here")


def sweep(target: str, m: int, n: int, k_from: int, k_to: int, step: int = 8, *, dtype: str = "bfloat16",
          repeats: int = 5, plot: str | None = None, progress: bool = True) -> SweepResult:
    """Compile the dot for every k in [k_from, k_to] (step) for the target and predict each from its compiled
    layouts (module docstring). The host is measured too."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    for name, v in (("--m", m), ("--n", n), ("--k-from", k_from), ("--k-to", k_to), ("--step", step)):
        if int(v) < 1:
            raise WorkbenchError(f"{name} must be >= 1, got {v}")
    if k_to < k_from:
        raise WorkbenchError(f"--k-to ({k_to}) must be >= --k-from ({k_from})")
    ks = list(range(int(k_from), int(k_to) + 1, int(step)))
    if len(ks) > 200:
        raise WorkbenchError(f"{len(ks)} sweep points; use a larger --step (at most 200 compiles)")
    t = parse_tiling_target(target)
    dev, local = _sweep_devices(t)
    spec = get_spec("host") if t.is_host else _spec(t.chip)
    model = None if t.is_host else _tile_model(t.chip)
    dname = tiles.canonical_dtype(dtype)
    jdt = jnp.dtype(dname)
    sh = SingleDeviceSharding(dev)
    fn = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jdt))
    granule = tiles.pad_granule(model, dname) if model else (1, 1, 1)
    clock = tpu_clock_hz(model, spec) if model and model.kind == "tpu" else None
    points = []
    t0 = time.perf_counter()
    for i, k in enumerate(ks):
        a = jax.ShapeDtypeStruct((m, k), jdt, sharding=sh)
        b = jax.ShapeDtypeStruct((k, n), jdt, sharding=sh)
        comp = compile_program(fn, a, b, analytic=False, compute_dtype=dname)
        params, results = entry_layouts(comp.hlo_text)
        if len(params) < 2 or not results:
            raise WorkbenchError(f"k={k}: could not read the operand layouts from the compiled program")
        (pm, pk1), (pk2, pn1), (pm2, pn2) = params[0].padded_dims, params[1].padded_dims, results[0].padded_dims
        pad = {"m": max(pm, pm2), "n": max(pn1, pn2), "k": max(pk1, pk2)}
        if model is not None and model.kind == "tpu":
            side = model.matrix_unit.value[0]
            mxu = {"m": pad["m"], "n": tiles.round_up(pad["n"], side), "k": tiles.round_up(pad["k"], side)}
        else:
            gm, gn, gk = granule
            mxu = {"m": tiles.round_up(pad["m"], gm), "n": tiles.round_up(pad["n"], gn),
                   "k": tiles.round_up(pad["k"], gk)}
        flops = 2.0 * mxu["m"] * mxu["n"] * mxu["k"]
        b_in = params[0].bytes_padded + params[1].bytes_padded
        b_out = results[0].bytes_padded
        size = (m * n * k) ** (1 / 3)
        pred = predict_matmul_s(spec, flops, b_in, b_out, dname, size).predicted_s
        isz = jdt.itemsize
        ideal = predict_matmul_s(spec, 2.0 * m * n * k, (m * k + k * n) * isz, m * n * isz, dname, size).predicted_s
        cyc = compiler_cycles(comp.hlo_text)
        meas = None
        if local:
            x, y = random_inputs((a, b), seed=k)
            meas = measure(comp.compiled, x, y, warmup=2, repeats=repeats, compile_s=comp.compile_s).median_s
        points.append(SweepPoint(k, m, n, (params[0].text, params[1].text, results[0].text), pad, mxu, pred, ideal,
                                 cyc, cyc / clock if (cyc and clock) else None, comp.cost.flops, meas,
                                 comp.compile_s))
        if progress:
            el = time.perf_counter() - t0
            print(f"tiling sweep: {i + 1}/{len(ks)} k={k} {params[0].text} · {params[1].text}  predicted "
                  f"{pred * 1e6:.1f} us  (compile {comp.compile_s:.1f}s, {el:.0f}s elapsed)", file=sys.stderr,
                  flush=True)
    gk = granule[2] if model is not None and model.kind == "tpu" else max(granule[2], 1)
    bounds = tuple(x for x in range(tiles.round_up(ks[0], gk), ks[-1] + 1, gk)) if gk > 1 else ()
    notes = ["predicted_s: the roofline of the dot at the padded shape read from the compiled layouts (bytes at "
             "the tiled sizes; flops with n and k rounded up to the matrix unit's side)"]
    if clock:
        notes.append(f"compiler_estimated_s: the TPU compiler's estimated_cycles at {clock / 1e9:.3f} GHz, the clock "
                     "the catalogue's bf16 peak implies (peak / (2 · MXUs · side²)); derived, not published")
    res = SweepResult(t.text, t.chip, dname, m, n, tuple(points), bounds, gk, None, tuple(notes))
    if plot:
        res = dataclasses.replace(res, figure=plot_sweep(res, plot))
    return res


def plot_sweep(res: SweepResult, path: str) -> str:
    """Time and throughput against k, tile boundaries marked; PNG at `path`."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [p.k for p in res.points]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    ax.plot(ks, [p.predicted_s * 1e6 for p in res.points], "o-", ms=3, label="predicted (padded, compiled layouts)")
    ax.plot(ks, [p.predicted_unpadded_s * 1e6 for p in res.points], "--", label="roofline without padding")
    if any(p.compiler_estimated_s for p in res.points):
        ax.plot(ks, [(p.compiler_estimated_s or float("nan")) * 1e6 for p in res.points], "s:", ms=3,
                label="TPU compiler's estimated cycles")
    if any(p.measured_s for p in res.points):
        ax.plot(ks, [(p.measured_s or float("nan")) * 1e6 for p in res.points], "x-", label="measured")
    ax.set_ylabel("time per call (µs)")
    ax2.plot(ks, [p.throughput_flops / 1e12 for p in res.points], "o-", ms=3, label="predicted")
    if any(p.measured_s for p in res.points):
        ax2.plot(ks, [2.0 * p.m * p.n * p.k / p.measured_s / 1e12 if p.measured_s else float("nan")
                      for p in res.points], "x-", label="measured")
    ax2.set_ylabel("useful TFLOP/s")
    ax2.set_xlabel(f"k  (x[{res.m}, k] @ y[k, {res.n}], {res.dtype})")
    for a_ in (ax, ax2):
        for b in res.boundaries:
            a_.axvline(b, color="grey", lw=0.6, alpha=0.6)
        a_.legend(fontsize=7)
        a_.grid(alpha=0.3)
    ax.set_title(f"shape sawtooth on {res.target}: tile boundaries every {res.granule_k} (grey)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------- search

BLOCK_MENU = (128, 256, 512, 1024, 2048, 4096)
# Mosaic's internal scratch comes on top of the blocks: a 1024^3 bf16 block (16.0 MiB by onchip_footprint) asked for
# 18.36 MiB when compiled for v5e. Blocks above this fraction of the default scoped limit get vmem_limit_bytes.
SCOPED_MARGIN = 0.85
GPU_BLOCK_MENU = (64, 128, 256, 512)
GPU_K_MENU = (32, 64, 128, 256)
KERNELS = ("matmul", "matmul-bias-gelu")


@dataclasses.dataclass(frozen=True)
class Candidate:
    block: tuple[int, int, int]
    onchip_bytes: float        # double-buffered input blocks + output block + float32 accumulator
    fits: bool
    reason: str
    predicted_s: float | None
    steps: int
    compute_s: float           # Σ over steps of the padded block's MXU time
    hbm_s: float               # Σ of the blocks' HBM loads and the output write-back
    onchip_s: float            # Σ of the accumulator's VMEM traffic (TPU)
    intensity: float           # flops per HBM byte of one step
    compiled: bool | None = None
    compile_s: float | None = None
    compile_error: str | None = None
    measured_s: float | None = None

    def to_record(self) -> dict:
        d = dataclasses.asdict(self)
        d["block"] = list(self.block)
        return d


@dataclasses.dataclass(frozen=True)
class SearchResult:
    kernel: str
    target: str
    chip: str
    m: int
    n: int
    k: int
    dtype: str
    onchip_capacity: float
    scoped_default: float | None
    candidates: tuple[Candidate, ...]
    xla_dot_predicted_s: float     # the plain dot through the roofline at the tile model's padding
    notes: tuple[str, ...] = ()

    @property
    def best(self) -> Candidate | None:
        ok = [c for c in self.candidates if c.fits and c.compiled is not False]
        return ok[0] if ok else None

    def to_record(self) -> dict:
        b = self.best
        return {"kernel": self.kernel, "target": self.target, "chip": self.chip, "m": self.m, "n": self.n,
                "k": self.k, "dtype": self.dtype, "onchip_capacity": self.onchip_capacity,
                "scoped_default": self.scoped_default, "best": b.to_record() if b else None,
                "xla_dot_predicted_s": self.xla_dot_predicted_s,
                "candidates": [c.to_record() for c in self.candidates], "notes": list(self.notes)}


def block_menu(m: int, n: int, k: int, model: tiles.TileModel, dtype: str) -> list[tuple[int, int, int]]:
    """Block shapes to try: powers of two from 128 up to 4096 per dimension, none much larger than its dimension
    (a dimension smaller than 128 gets one block of its size rounded up to the native tile)."""
    if model.kind == "gpu":  # thread-block tiles: the accumulator in registers, K sliced thinly
        mn_menu, k_menu, sub, lane = GPU_BLOCK_MENU, GPU_K_MENU, 16, 16
    else:
        mn_menu, k_menu, sub, lane = BLOCK_MENU, BLOCK_MENU, tiles.native_tile(model, dtype)[0], 128

    def sizes(dim: int, menu, align: int) -> list[int]:
        c = [b for b in menu if b < dim * 2]
        return c or [tiles.round_up(dim, align)]

    return [(bm, bn, bk) for bm in sizes(m, mn_menu, sub) for bn in sizes(n, mn_menu, lane)
            for bk in sizes(k, k_menu, lane)]


def onchip_footprint(block, in_bytes: float, out_bytes: float, bias: bool = False, kind: str = "tpu") -> float:
    """Bytes one grid step keeps in the core's on-chip memory.
    TPU (VMEM): two buffers of each input block and of the output block (Pallas double-buffers every BlockSpec'd
    operand) and the float32 accumulator. GPU (shared memory): two stages of the input slices; the accumulator
    lives in registers (checked against the register file apart)."""
    bm, bn, bk = block
    if kind == "gpu":
        return 2 * (bm * bk + bk * bn) * in_bytes
    return 2 * (bm * bk + bk * bn) * in_bytes + 2 * bm * bn * out_bytes + bm * bn * 4 + (2 * bn * in_bytes if bias else 0)


def predict_block(m, n, k, block, model: tiles.TileModel, spec: HardwareSpec, dtype: str, out_dtype: str,
                  step_overhead_s: float = 0.0, onchip_bw: float | None = None) -> dict:
    """The tile's roofline (module docstring). Returns predicted_s and its terms."""
    bm, bn, bk = block
    gm, gn, gk = -(-m // bm), -(-n // bn), -(-k // bk)
    steps = gm * gn * gk
    b_in = tiles.dtype_bits(dtype) / 8
    b_out = tiles.dtype_bits(out_dtype) / 8
    g_m, g_n, g_k = tiles.pad_granule(model, dtype)
    peak = spec.peak(dtype)
    t_mxu = 2.0 * tiles.round_up(bm, g_m) * tiles.round_up(bn, g_n) * tiles.round_up(bk, g_k) / peak
    load = (bm * bk + bk * bn) * b_in
    t_load = load / spec.hbm_bw
    t_write = bm * bn * b_out / spec.hbm_bw
    t_acc = (2 * bm * bn * 4 + load) / onchip_bw if onchip_bw else 0.0
    # per step: the MXU works while the next blocks load (double buffering); the output block is written once per
    # (i, j), overlapping the next row of K steps except the very last
    per_step = max(t_mxu, t_load, t_acc) + step_overhead_s
    writes = gm * gn * t_write
    total = steps * per_step + max(0.0, writes - steps * max(0.0, t_mxu - t_load)) + t_load + t_write
    return {"predicted_s": total, "steps": steps, "compute_s": steps * t_mxu, "hbm_s": steps * t_load + writes,
            "onchip_s": steps * t_acc, "intensity": 2.0 * bm * bn * bk / load}


def _onchip_bw(model: tiles.TileModel, spec: HardwareSpec) -> tuple[float | None, str]:
    if model.kind == "tpu":
        return (22.0 * spec.hbm_bw, "VMEM bandwidth taken as 22x the HBM bandwidth, the ratio the scaling book "
                "gives for TPU v5e (jax-ml.github.io/scaling-book/tpus); applied to every TPU generation as an "
                "assumption")
    return None, ("GPU: shared-memory bandwidth is not modelled (registers hold the accumulator); every thread "
                  "block's loads are charged to HBM (no L2 reuse between blocks) and waves over the SMs are not "
                  "modelled, so small blocks read as memory-bound")


def search(kernel: str, m: int, n: int, k: int, target: str, *, dtype: str = "bfloat16", top: int = 3,
           step_overhead_s: float = 0.0, measure_local: bool = True, progress: bool = True) -> SearchResult:
    """Enumerate, predict, compile the best `top` for the target (module docstring)."""
    if kernel not in KERNELS:
        raise WorkbenchError(f"unknown --kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    for name, v in (("--m", m), ("--n", n), ("--k", k)):
        if int(v) < 1:
            raise WorkbenchError(f"{name} must be >= 1, got {v}")
    if top < 0:
        raise WorkbenchError(f"--compile-top must be >= 0, got {top}")
    t = parse_tiling_target(target)
    model = _tile_model(t.chip)
    spec = _spec(t.chip)
    dname = tiles.canonical_dtype(dtype)
    b_in = tiles.dtype_bits(dname) / 8
    bias = kernel != "matmul"
    cap = float(model.onchip_bytes.value)
    scoped = float(model.default_scoped_vmem.value) if model.default_scoped_vmem else None
    bw, bw_note = _onchip_bw(model, spec)
    cands = []
    for blk in block_menu(m, n, k, model, dname):
        fp = onchip_footprint(blk, b_in, b_in, bias, model.kind)
        pr = predict_block(m, n, k, blk, model, spec, dname, dname, step_overhead_s, bw)
        regs = float(model.vector_register.value) if model.kind == "gpu" else math.inf
        if model.kind == "gpu" and blk[0] * blk[1] * 4 > regs:
            reason = (f"the {blk[0]}x{blk[1]} float32 accumulator ({blk[0] * blk[1] * 4 / 1024:.0f} KiB) exceeds the "
                      f"{regs / 1024:.0f} KiB register file of one SM")
            cands.append(Candidate(blk, fp, False, reason, None, pr["steps"], pr["compute_s"], pr["hbm_s"],
                                   pr["onchip_s"], pr["intensity"]))
            continue
        if fp > cap:
            what = (f"2 x ({blk[0]}x{blk[2]} + {blk[2]}x{blk[1]}) inputs, 2 x {blk[0]}x{blk[1]} output, "
                    f"{blk[0]}x{blk[1]} float32 accumulator" if model.kind == "tpu"
                    else f"2 stages of {blk[0]}x{blk[2]} + {blk[2]}x{blk[1]} input slices")
            reason = (f"needs {fp / 2**20:.2f} MiB on chip ({what}); {model.chip} has {cap / 2**20:.2f} MiB of "
                      f"{'VMEM' if model.kind == 'tpu' else 'shared memory'} per core")
            cands.append(Candidate(blk, fp, False, reason, None, pr["steps"], pr["compute_s"], pr["hbm_s"],
                                   pr["onchip_s"], pr["intensity"]))
            continue
        reason = "fits"
        if scoped and fp > SCOPED_MARGIN * scoped:
            reason = (f"fits VMEM; within {1 - SCOPED_MARGIN:.0%} of or above Mosaic's default scoped limit "
                      f"({scoped / 2**20:.0f} MiB): compiled with vmem_limit_bytes")
        cands.append(Candidate(blk, fp, True, reason, pr["predicted_s"], pr["steps"], pr["compute_s"], pr["hbm_s"],
                               pr["onchip_s"], pr["intensity"]))
    cands.sort(key=lambda c: (not c.fits, c.predicted_s if c.predicted_s is not None else math.inf, c.steps))
    notes = [bw_note, "predicted_s: per grid step max(MXU time at the padded block, HBM time of its input blocks, "
             "VMEM time of the accumulator) + step overhead "
             f"({step_overhead_s * 1e6:.2f} us, --step-overhead-us), plus the first load and the last write-back"]
    dot = tiles.pad_matmul(m, n, k, model, dname)
    out_b = dot.m_pad * dot.n_pad * b_in
    xla = predict_matmul_s(spec, dot.padded_flops, dot.padded_bytes - out_b, out_b, dname,
                           (m * n * k) ** (1 / 3)).predicted_s
    cands = _compile_top(cands, kernel, m, n, k, t, model, dname, top, measure_local, progress, notes)
    return SearchResult(kernel, t.text, t.chip, m, n, k, dname, cap, scoped, tuple(cands), xla, tuple(notes))


def _compile_top(cands, kernel, m, n, k, t: TilingTarget, model, dtype, top, measure_local, progress, notes):
    """Compile the `top` best fitting candidates for the target's compiler (TPU: libtpu from this host; GPU:
    Triton where a GPU is attached); measure where the hardware is local."""
    import jax
    import jax.numpy as jnp

    if top == 0:
        return cands
    dev, backend, local = None, None, False
    if model.kind == "tpu":
        if t.topology is None or t.n_devices != 1:
            notes.append(f"not compiled: give a one-chip TPU slice (e.g. {model.chip}:1x1) to compile candidates")
            return cands
        dev = topo.tpu_devices(t.topology.name)[0]
        backend = "tpu"
        local = any(d.platform == "tpu" for d in jax.devices())
        if local:
            dev = next(d for d in jax.devices() if d.platform == "tpu")
    else:
        gpus = [d for d in jax.devices() if d.platform in ("gpu", "cuda")]
        if not gpus:
            notes.append("not compiled: the Pallas GPU (Triton) compiler needs a GPU attached to this host "
                         "(skipped)")
            return cands
        dev, backend, local = gpus[0], "gpu", True
    from jax.sharding import SingleDeviceSharding

    sh = SingleDeviceSharding(dev)
    jdt = jnp.dtype(dtype)
    a = jax.ShapeDtypeStruct((m, k), jdt, sharding=sh)
    b = jax.ShapeDtypeStruct((k, n), jdt, sharding=sh)
    bias = jax.ShapeDtypeStruct((n,), jdt, sharding=sh)
    act = "gelu" if kernel == "matmul-bias-gelu" else "none"
    out = list(cands)
    done = 0
    for i, c in enumerate(out):
        if done >= top:
            break
        if not c.fits:
            continue
        limit = None
        if model.default_scoped_vmem and c.onchip_bytes > SCOPED_MARGIN * model.default_scoped_vmem.value:
            limit = int(min(model.onchip_bytes.value, c.onchip_bytes * 1.25 + 4 * 2**20))
        blk = Block(*c.block)
        if act == "none":
            fn = jax.jit(lambda x, y, _b=blk, _l=limit: matmul(x, y, block=_b, backend=backend, vmem_limit_bytes=_l))
            args = (a, b)
        else:
            fn = jax.jit(lambda x, y, z, _b=blk, _l=limit: matmul(x, y, z, block=_b, activation=act, backend=backend,
                                                                  vmem_limit_bytes=_l))
            args = (a, b, bias)
        t0 = time.perf_counter()
        try:
            compiled = fn.lower(*args).compile()
            ok, err = True, None
        except Exception as e:  # noqa: BLE001 - the compiler's words are the answer
            compiled, ok = None, False
            err = " ".join(str(e).split())[:400]
        cs = time.perf_counter() - t0
        meas = None
        if ok and local and measure_local:
            meas = measure(compiled, *random_inputs(args, seed=1), warmup=2, repeats=5, compile_s=cs).median_s
        out[i] = dataclasses.replace(c, compiled=ok, compile_s=cs, compile_error=err, measured_s=meas,
                                     reason=c.reason if ok else f"compile failed: {err}")
        done += 1
        if progress:
            print(f"tiling search: compiled {done}/{top} block {blk} for {t.text}: "
                  f"{'ok' if ok else 'FAILED'} in {cs:.1f}s", file=sys.stderr, flush=True)
    return out
