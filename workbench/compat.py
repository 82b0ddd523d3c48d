"""The one place for what differs between the JAX versions the workbench runs on.

Ground floor: imports jax, numpy and the standard library, nothing from the project. Code elsewhere calls these
names instead of testing versions. Two locks are supported (Makefile): jax 0.12 on Python >= 3.12 (the default,
`requirements.lock`) and jax 0.10 on Python 3.11 (`requirements-py311.lock`; jax stopped supporting 3.11 after
0.10). Checked on jax/jaxlib 0.10.2 + libtpu 0.0.42.1 and on jax/jaxlib 0.12.0.1 + libtpu 0.0.52:

- shard_map: `jax.shard_map` in both; `jax.experimental.shard_map` warns (deprecated since 0.8). -> `shard_map`
- mesh axis types: `jax.make_mesh` defaults to Explicit axes in both; its first parameter was renamed
  (`axis_shapes` -> `axis_sizes`). -> `jax_mesh(shape, names, devices=, axis_types=)`: positional, Auto axes
  (partitioning.mesh.make_mesh builds the project's meshes from specs over it)
- sharding-in-types: `jax.set_mesh`, `jax.sharding.use_abstract_mesh`, `get_abstract_mesh` in both; no
  `jax.sharding.use_mesh`. -> `set_mesh`, `use_abstract_mesh`, `get_abstract_mesh`
- ragged-all-to-all on XLA:CPU: UNIMPLEMENTED in both (0.12's message is longer). -> `ragged_all_to_all_supported`
  compiles a probe once per process instead of trusting a version table
- `Compiled.cost_analysis()`: a dict on both here; a list of dicts on older jaxlibs and some plugins, None for
  XLA:GPU compile-only programs. -> `cost_analysis(compiled)`: one dict and notes
- `Compiled.memory_analysis()`: 0.12 adds `peak_unpadded_heap_bytes`, `total_allocation_bytes`,
  `indefinite_allocations`. -> `memory_analysis(compiled)`: the fields both have, so records compare
- TPU `optimal_seconds`: often negative with libtpu 0.0.42, positive on the programs tried with 0.0.52; callers
  guard it (workbench.programs.predict.xla_estimate)
- `jax.experimental.roofline`: present in both. -> `experimental_roofline()` (None where a jax lacks it)
- residuals saved for the backward: `jax._src.ad_checkpoint.saved_residuals` in both (the list behind the public
  `jax.ad_checkpoint.print_saved_residuals`). -> `saved_residual_bytes(fn, *args, skip_args=)`
- varying manual axes of a value inside shard_map: `jax.typeof(x).manual_axis_type.varying` in both (older jax
  spelled it `.vma`, still read as a fallback). -> `varying_axes(x)` (empty outside shard_map)
- TPU7x topologies: `tpu7x:XxYxZ` compiles with libtpu 0.0.42.1 and 0.0.52 (partitioning/topology.py)
- Pallas: both have `pl.pallas_call`, `pl.BlockSpec(block_shape, index_map)`, `pl.CostEstimate`,
  `pltpu.PrefetchScalarGridSpec`, `pltpu.VMEM` and `pltpu.CompilerParams`; older releases named the last one
  `pltpu.TPUCompilerParams` and the Triton one `plgpu.TritonCompilerParams`. -> `compat.pallas_call`,
  `compat.BlockSpec`, ... (`PALLAS_NAMES`, imported on first use so that importing the project does not load
  Pallas), `tpu_compiler_params`, `triton_compiler_params`

The versions a record ran with are read from the installed distributions by workbench.results.store.versions()
(no JAX import there) and carried in every record's provenance.
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

# ------------------------------------------------------------------------------------------------ sharding API

shard_map = jax.shard_map  # both versions; never jax.experimental.shard_map (deprecated, warns)
set_mesh = jax.set_mesh
use_abstract_mesh = jax.sharding.use_abstract_mesh
get_abstract_mesh = jax.sharding.get_abstract_mesh
AUTO = AxisType.Auto
EXPLICIT = AxisType.Explicit


def auto_axes(n: int) -> tuple:
    """Axis types for an n-axis mesh whose shardings propagate (GSPMD/Shardy): AxisType.Auto on every axis. Both
    versions' jax.make_mesh default to Explicit axes, which the models' sharding rules are not written for."""
    return (AxisType.Auto,) * n


def jax_mesh(shape, names, *, devices=None, axis_types=None):
    """jax.make_mesh with the shape passed positionally (its name changed between 0.10 and 0.12) and Auto axes
    unless told otherwise."""
    types = tuple(axis_types) if axis_types is not None else auto_axes(len(names))
    if devices is None:
        return jax.make_mesh(tuple(shape), tuple(names), types)
    return jax.make_mesh(tuple(shape), tuple(names), types, devices=devices)


# --------------------------------------------------------------------------------------- compiled-program queries


def cost_analysis(compiled) -> tuple[dict, list[str]]:
    """`compiled.cost_analysis()` as one dict of floats, and notes on what had to be done to get it.

    Returns ({}, [why]) when the backend has none (XLA:GPU compile-only programs, some plugins) or raises; a list
    of per-program dicts (older jaxlibs) is summed key by key. Values are passed through, not judged: negative or
    missing figures are the caller's to guard (workbench.cost.report)."""
    try:
        raw = compiled.cost_analysis()
    except Exception as e:  # noqa: BLE001 - some backends do not implement it
        return {}, [f"cost_analysis unavailable: {type(e).__name__}"]
    if raw is None:
        return {}, ["cost_analysis returned nothing"]
    if isinstance(raw, (list, tuple)):
        notes = [] if len(raw) == 1 else [f"cost_analysis returned {len(raw)} entries; summed"]
        merged: dict[str, float] = {}
        for d in raw:
            for k, v in (d or {}).items():
                merged[k] = merged.get(k, 0.0) + v
        return merged, notes
    return dict(raw), []


MEMORY_FIELDS = ("argument", "output", "temp", "alias", "generated_code")


def memory_analysis(compiled) -> tuple[dict[str, float], list[str]]:
    """`compiled.memory_analysis()` as {argument, output, temp, alias, generated_code: bytes} (the fields every
    version has; 0.12's extra heap statistics are left out so records compare across versions), and notes."""
    try:
        m = compiled.memory_analysis()
    except Exception as e:  # noqa: BLE001
        return {}, [f"memory_analysis unavailable: {type(e).__name__}"]
    if m is None:
        return {}, ["memory_analysis returned nothing"]
    return {k: float(getattr(m, f"{k}_size_in_bytes", 0) or 0) for k in MEMORY_FIELDS}, []


def hlo_module_class():
    """jaxlib's HloModule binding (from_serialized_hlo_module_proto, to_string), or None where this jaxlib has none:
    `jaxlib._hlo` (0.12), `xla_client._xla` (earlier)."""
    try:
        from jaxlib import _hlo

        return _hlo.HloModule
    except ImportError:
        pass
    try:
        from jax._src.lib import xla_client

        return getattr(xla_client._xla, "HloModule", None)
    except ImportError:
        return None


def experimental_roofline():
    """jax.experimental.roofline (the analytic counter), or None where this jax lacks it."""
    try:
        from jax.experimental import roofline
    except ImportError:
        return None
    return roofline


def get_topology_desc(**kwargs):
    """jax.experimental.topologies.get_topology_desc (compile-only devices of a TPU slice or GPU node)."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(**kwargs)


# --------------------------------------------------------------------------------------------- backend support


@functools.lru_cache(maxsize=None)
def ragged_all_to_all_supported(platform: str) -> bool:
    """Whether the backend compiles jax.lax.ragged_all_to_all. TPU and GPU do; XLA:CPU did not in jax 0.10.2 nor
    0.12.0.1 ("HLO opcode ragged-all-to-all is not supported by XLA:CPU"). On CPU this compiles a 1-device probe
    once per process instead of trusting a version table, so a jaxlib that adds it is used as soon as it does."""
    if platform in ("tpu", "gpu", "cuda", "rocm"):
        return True
    if platform != "cpu":
        return False
    dev = jax.devices("cpu")[:1]
    mesh = jax.sharding.Mesh(np.array(dev), ("x",), axis_types=auto_axes(1))

    def body(op, out, io, ss, oo, rs):
        return jax.lax.ragged_all_to_all(op, out, io, ss, oo, rs, axis_name="x")

    spec = PartitionSpec("x")
    f = jax.jit(shard_map(body, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))
    i32 = jax.ShapeDtypeStruct((1,), jnp.int32)
    x = jax.ShapeDtypeStruct((2, 1), jnp.float32)
    try:
        f.lower(x, x, i32, i32, i32, i32).compile()
    except Exception:  # noqa: BLE001 - UNIMPLEMENTED (or any refusal): not supported here
        return False
    return True


# a debug option that only sizes the buffer-assignment report (no effect on the program) and that JAX's persistent
# cache key keeps (jax._src.cache_key clears the dump options, not this one), at a value no other compile sets
_UNCACHED_OPTIONS = {"xla_debug_buffer_assignment_show_max": 987654321}


@contextlib.contextmanager
def no_persistent_cache():
    """Yields the compiler options that make a compile skip JAX's persistent compilation cache, and keeps what it
    compiles out of it. A compile whose XLA dump is read afterwards needs this: the cache key leaves out xla_dump_to,
    so a cached executable of the same program comes back without running the compiler and nothing is dumped.
    (jax_enable_compilation_cache cannot do it: JAX reads it once per process.) The options key the compile apart
    from every other; jax_persistent_cache_min_compile_time_secs, read at each write, keeps it from being written,
    so no compile ever finds an entry under that key."""
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        yield dict(_UNCACHED_OPTIONS)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def saved_residual_bytes(fn, *args, skip_args: tuple[str, ...] = ()) -> float:
    """Bytes of the residuals jax.vjp(fn, *args) saves for the backward pass, as JAX traces them (before XLA fuses
    or drops any): the list jax.ad_checkpoint.print_saved_residuals prints (jax._src.ad_checkpoint.saved_residuals,
    the same on jax 0.10 and 0.12). Residuals that are fn's arguments named in `skip_args` (its parameter names,
    e.g. the weights: saving them allocates nothing) are left out."""
    from jax._src import ad_checkpoint

    total = 0.0
    for aval, src in ad_checkpoint.saved_residuals(fn, *args):
        if any(src == f"from the argument {n}" or src.startswith((f"from the argument {n}[", f"from the argument {n}."))
               for n in skip_args):
            continue
        total += float(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
    return total


def varying_axes(x) -> frozenset:
    """The manual mesh axes `x` varies over inside jax.shard_map (its varying-manual-axes type); empty outside."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(t, "vma", ()) or ())


# ------------------------------------------------------------------------------------------------ Pallas

# name -> (module, attribute): the Pallas names the project's kernels use, resolved on first access (module
# __getattr__) so that importing the workbench does not import Pallas and its TPU backend
PALLAS_NAMES = {
    "pallas_call": ("pl", "pallas_call"), "BlockSpec": ("pl", "BlockSpec"), "CostEstimate": ("pl", "CostEstimate"),
    "program_id": ("pl", "program_id"), "num_programs": ("pl", "num_programs"), "when": ("pl", "when"),
    "cdiv": ("pl", "cdiv"), "ds": ("pl", "ds"), "VMEM": ("pltpu", "VMEM"),
    "PrefetchScalarGridSpec": ("pltpu", "PrefetchScalarGridSpec"),
}


@functools.cache
def _pallas_modules() -> dict:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    return {"pl": pl, "pltpu": pltpu}


def __getattr__(name: str):
    if name in PALLAS_NAMES:
        mod, attr = PALLAS_NAMES[name]
        return getattr(_pallas_modules()[mod], attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def tpu_compiler_params(dimension_semantics, vmem_limit_bytes: int | None = None):
    """Mosaic TPU compiler parameters (grid dimension semantics, the kernel's scoped-VMEM limit)."""
    pltpu = _pallas_modules()["pltpu"]
    cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    kw = {"dimension_semantics": tuple(dimension_semantics)}
    if vmem_limit_bytes:
        kw["vmem_limit_bytes"] = int(vmem_limit_bytes)
    return cls(**kw)


def triton_compiler_params(num_warps: int = 4, num_stages: int = 3):
    """Triton (Pallas GPU) compiler parameters, or None where this jax has no Triton backend module."""
    try:
        from jax.experimental.pallas import triton as pltriton
    except ImportError:  # pragma: no cover - jax without the Triton backend
        return None
    cls = getattr(pltriton, "CompilerParams", None) or getattr(pltriton, "TritonCompilerParams", None)
    return cls(num_warps=num_warps, num_stages=num_stages) if cls else None
