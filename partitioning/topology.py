"""Prediction targets: TPU slices compiled for from this CPU host, and GPU nodes simulated on it.

A target names a chip and a slice shape:

    tpu-v5e:4x4     16 TPU v5e chips in a 4x4 2D torus    (also v5e:4x4, v5litepod:4x4)
    tpu-v4:2x2x1    4 TPU v4 chips (megacore: one JAX device per chip, as on a real v4 host)
    tpu-v5p:2x2x2   8 TPU v5p chips (megacore)
    tpu-v6e:2x4     8 TPU v6e (Trillium) chips
    tpu-v7x:2x2x1   4 TPU v7x (Ironwood) chips = 8 JAX devices (libtpu's `tpu7x`: one device per TensorCore)
    h100:8          one node of 8 NVIDIA H100 SXM (also h200:8, b200:8, a100:8; h100:16 = two nodes)

TPU targets get compile-only devices from the TPU compiler in libtpu through
`jax.experimental.topologies.get_topology_desc` — no TPU attached, no device memory touched; the CPU platform stays
JAX's default for everything else. GPU targets: the pinned jaxlib alone has no deviceless GPU compiler, so their
programs are compiled for a simulated CPU mesh of the same shape and predicted with the GPU's catalogue spec and
NVLink/InfiniBand collective models; with the JAX CUDA plugin installed (no GPU needed) XLA:GPU itself compiles them
for a compile-only GPU topology described by a GpuTargetConfig (see docs/targets.md).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re

from workbench import compat
from workbench.errors import WorkbenchError
from workbench.hardware import spec as hw
from workbench.hardware import tiles
from workbench.hardware.devices import default_platform, request_devices


@dataclasses.dataclass(frozen=True)
class TpuFamily:
    """One TPU generation: how libtpu names it and what slice shapes it comes in."""

    key: str                    # canonical short name: v5e
    libtpu_name: str            # prefix of libtpu's topology name: "v5e" in "v5e:4x4"
    dims: int                   # 2 = 2D torus (v5e, v6e), 3 = 3D torus (v4, v5p)
    chip_config: str            # "megacore" fuses the chip's two TensorCores into one JAX device
    max_chips: int              # largest slice Google Cloud sells (one pod)
    chip: str                   # the hardware catalogue's name (workbench.hardware.catalogue)
    slice_shapes: tuple[str, ...] = ()  # 2D families: the shapes on offer; empty = any accepted by libtpu
    source: str = ""
    devices_per_chip: int = 1   # JAX devices libtpu makes per chip (v7x: 2, one per TensorCore; checked on load)


# Slice shapes and sizes: Google Cloud TPU documentation, read 2026-11 —
#   v5e: https://cloud.google.com/tpu/docs/v5e   v6e: https://cloud.google.com/tpu/docs/v6e
#   v4:  https://cloud.google.com/tpu/docs/v4    v5p: https://cloud.google.com/tpu/docs/v5p
TPU_FAMILIES: dict[str, TpuFamily] = {
    "v4": TpuFamily("v4", "v4", 3, "megacore", 4096, "tpu-v4",
                    source="https://cloud.google.com/tpu/docs/v4"),
    "v5e": TpuFamily("v5e", "v5e", 2, "default", 256, "tpu-v5e",
                     ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
                     source="https://cloud.google.com/tpu/docs/v5e"),
    "v5p": TpuFamily("v5p", "v5p", 3, "megacore", 8960, "tpu-v5p",
                     source="https://cloud.google.com/tpu/docs/v5p"),
    "v6e": TpuFamily("v6e", "v6e", 2, "default", 256, "tpu-v6e",
                     ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
                     source="https://cloud.google.com/tpu/docs/v6e"),
    # TPU7x: libtpu's topology names are `tpu7x:XxYxZ` (`v7x:` is rejected: "Invalid TPU external name"); it has no
    # megacore chip config for it ("megacore ... does not exist"), so each TensorCore is its own device: two per chip
    # coordinate in get_topology_desc (libtpu 0.0.52). Pod: 9216 chips.
    "v7x": TpuFamily("v7x", "tpu7x", 3, "default", 9216, "tpu-v7x",
                     source="https://docs.cloud.google.com/tpu/docs/tpu7x", devices_per_chip=2),
}


@dataclasses.dataclass(frozen=True)
class GpuFamily:
    key: str
    chip: str                      # the hardware catalogue's name
    fpus_per_core: int             # FP32 lanes per SM (XLA:GPU's gpu_device_info), not used elsewhere
    gpus_per_node: int = 8         # NVLink domain of an HGX/DGX node; beyond it InfiniBand
    source: str = ""


# The GPUs a deviceless XLA:GPU compile is described for. The facts it reads (SMs, shared memory per SM, L2, clock,
# compute capability) come from the chip's tile model (workbench.hardware.tiles), memory size and bandwidth from the
# hardware catalogue, the device name from the catalogue's aliases; they steer XLA:GPU's fusion and tiling
# heuristics (fit is judged against the catalogue's HBM). Only the FP32 lanes per SM are stated here: 64 on
# compute capability 8.0, 128 on 9.0 and later (CUDA C++ Programming Guide, arithmetic instructions table).
GPU_FAMILIES: dict[str, GpuFamily] = {
    "a100": GpuFamily("a100", "a100-80gb", 64),
    "h100": GpuFamily("h100", "h100-sxm", 128),
    "h200": GpuFamily("h200", "h200", 128),
    "b200": GpuFamily("b200", "b200", 128),
}


def gpu_device_info(family: str) -> dict:
    """The gpu_device_info fields of an XLA GpuTargetConfig for `family`, read from the hardware package."""
    g = GPU_FAMILIES[family]
    t, c = tiles.tile_model(g.chip), hw.catalogue_spec(g.chip)
    smem = int(t.onchip_bytes.value)
    return dict(core_count=int(t.cores.value), clock_rate_ghz=t.clock_hz.value / 1e9, l2_cache_size=int(t.l2_bytes.value),
                device_memory_size=int(c.hbm_bytes), memory_bandwidth=int(c.hbm_bw), cc=tuple(t.compute_capability.value),
                shared_memory_per_core=smem, shared_memory_per_block_optin=smem - 1024, fpus_per_core=g.fpus_per_core)


def device_kind(chip: str) -> str:
    """What the device reports as its kind (`jax.devices()[0].device_kind`): the catalogue alias that names it so."""
    s = hw.catalogue_spec(chip)
    return next((a for a in s.aliases if a.startswith(("NVIDIA", "AMD", "TPU"))), chip)


def gpu_target_config(family: str) -> str:
    """An XLA GpuTargetConfig (text proto) for deviceless XLA:GPU compilation of `family`."""
    i = gpu_device_info(family)
    major, minor = i.pop("cc")
    fields = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
                  threads_per_core_limit=2048, block_dim_limit_x=2147483647, block_dim_limit_y=65535,
                  block_dim_limit_z=65535, registers_per_core_limit=65536, registers_per_block_limit=65536, **i)
    body = "\n".join(f"  {k}: {v}" for k, v in fields.items())
    return (f"gpu_device_info {{\n{body}\n  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
            f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 8 }}\n'
            f"runtime_version {{ major: 12 minor: 8 }}\n"
            f'device_description_str: "{device_kind(GPU_FAMILIES[family].chip)}"\n')


@dataclasses.dataclass(frozen=True)
class Target:
    """A parsed, validated prediction target."""

    name: str                  # canonical: tpu-v5e:4x4, h100:8
    kind: str                  # "tpu" or "gpu"
    family: str                # v5e, v4, h100, ...
    shape: tuple[int, ...]     # TPU: chips per torus dimension; GPU: (nodes, gpus_per_node)
    chip: str                  # the hardware catalogue's name of the chip (workbench.hardware.catalogue_spec)

    @property
    def n_chips(self) -> int:
        return math.prod(self.shape)

    @property
    def devices_per_chip(self) -> int:
        """JAX devices per chip: 2 on TPU v7x (one per TensorCore), 1 elsewhere (megacore or single-core chips)."""
        return TPU_FAMILIES[self.family].devices_per_chip if self.kind == "tpu" else 1

    @property
    def n_devices(self) -> int:
        """JAX devices the target's programs are partitioned over (meshes use every one): chips × devices_per_chip."""
        return self.n_chips * self.devices_per_chip

    @property
    def topology_name(self) -> str:
        """libtpu's name for the slice, e.g. v5e:4x4."""
        return f"{TPU_FAMILIES[self.family].libtpu_name}:{'x'.join(map(str, self.shape))}"

    @property
    def n_nodes(self) -> int:
        return self.shape[0] if self.kind == "gpu" else 1

    def describe(self) -> str:
        if self.kind == "tpu":
            fam = TPU_FAMILIES[self.family]
            per = (f" ({self.n_devices} devices: {fam.devices_per_chip} TensorCores per chip, one device each)"
                   if fam.devices_per_chip > 1 else "")
            return (f"{self.n_chips} TPU {self.family} chips{per}, {'x'.join(map(str, self.shape))} "
                    f"{fam.dims}D torus, compiled by libtpu for compile-only devices")
        return (f"{self.n_chips} {self.family.upper()} GPUs ({self.shape[0]} node(s) x {self.shape[1]}, "
                "NVLink inside a node)")


def known_targets() -> list[str]:
    """Examples of every family, for help texts and errors."""
    return ([f"tpu-{k}:{'2x2' if f.dims == 2 else '2x2x1'}" for k, f in TPU_FAMILIES.items()]
            + [f"{k}:8" for k in GPU_FAMILIES])


_TARGET_RE = re.compile(r"^(?:tpu[-_]?)?(?P<chip>[a-z0-9]+?)(?:[-_](?P<count>\d+))?(?::(?P<shape>[0-9x]+))?$")


def family_key(chip: str) -> str:
    """The TPU or GPU family of a chip name or any of the hardware catalogue's aliases (`trillium` -> v6e,
    `v5litepod` -> v5e); the name itself where no family claims it (parse_target then names the known ones)."""
    if chip in TPU_FAMILIES or chip in GPU_FAMILIES:
        return chip
    for name in (chip, f"tpu-{chip}"):
        try:
            canonical = hw.resolve_name(name)
        except WorkbenchError:
            continue
        for key, fam in (*TPU_FAMILIES.items(), *GPU_FAMILIES.items()):
            if fam.chip == canonical:
                return key
    return chip


def parse_target(text: str) -> Target:
    """Parse `tpu-v5e:4x4`, `v4:2x2x1`, `h100:8`, `h200:16` (two nodes) into a validated Target."""
    if not isinstance(text, str) or not text.strip():
        raise WorkbenchError(f"empty --target; give one like {', '.join(known_targets())}")
    raw = text.strip().lower()
    m = _TARGET_RE.match(raw)
    if not m:
        raise WorkbenchError(f"cannot read target {text!r}; write CHIP:SHAPE like {', '.join(known_targets())}")
    chip, count, shape_s = m.group("chip"), m.group("count"), m.group("shape")
    chip = family_key(chip)
    if chip in TPU_FAMILIES:
        fam = TPU_FAMILIES[chip]
        if shape_s is None:
            if count is not None:
                raise WorkbenchError(
                    f"target {text!r} gives a size but not a topology; write the slice shape, e.g. "
                    f"tpu-{chip}:{'4x4' if fam.dims == 2 else '2x2x2'}")
            raise WorkbenchError(f"target {text!r} needs a topology; "
                                 f"e.g. tpu-{chip}:{'2x2' if fam.dims == 2 else '2x2x1'}")
        shape = _parse_shape(shape_s, text)
        if len(shape) != fam.dims:
            example = "4x4" if fam.dims == 2 else "2x2x2"
            raise WorkbenchError(f"TPU {chip} slices are {fam.dims}D tori: topology {shape_s!r} has {len(shape)} "
                                 f"dimensions; write e.g. tpu-{chip}:{example}")
        n = math.prod(shape)
        if n > fam.max_chips:
            raise WorkbenchError(f"tpu-{chip}:{shape_s} has {n} chips; the largest {chip} slice has {fam.max_chips}")
        if fam.slice_shapes and "x".join(map(str, shape)) not in fam.slice_shapes:
            raise WorkbenchError(f"TPU {chip} does not come in a {shape_s} slice; choose one of "
                                 f"{', '.join(fam.slice_shapes)}")
        if fam.dims == 3:
            for d in shape:
                if d > 4 and d % 4:
                    raise WorkbenchError(f"tpu-{chip}:{shape_s}: 3D slice dimensions above 4 must be multiples of 4")
                if d in (3,):
                    raise WorkbenchError(f"tpu-{chip}:{shape_s}: slice dimensions are 1, 2, 4 or multiples of 4")
        return Target(f"tpu-{chip}:{'x'.join(map(str, shape))}", "tpu", chip, shape, fam.chip)
    if chip in GPU_FAMILIES:
        fam = GPU_FAMILIES[chip]
        if shape_s is None and count is None:
            raise WorkbenchError(f"target {text!r} needs a GPU count; "
                                 f"e.g. {chip}:8 (one node) or {chip}:16 (two nodes)")
        s = _parse_shape(shape_s or count, text)
        if len(s) == 1:
            n = s[0]
            if n <= fam.gpus_per_node:
                shape = (1, n)
            elif n % fam.gpus_per_node:
                raise WorkbenchError(f"{chip}:{n}: more than one node needs a multiple of {fam.gpus_per_node} GPUs "
                                     f"(nodes of {fam.gpus_per_node}); e.g. {chip}:{fam.gpus_per_node * 2}")
            else:
                shape = (n // fam.gpus_per_node, fam.gpus_per_node)
        elif len(s) == 2:
            if s[1] > fam.gpus_per_node:
                raise WorkbenchError(f"{chip}:{shape_s}: a node holds at most {fam.gpus_per_node} GPUs")
            shape = s
        else:
            raise WorkbenchError(f"GPU target {text!r}: write {chip}:N (GPUs) or {chip}:NODESxGPUS")
        return Target(f"{chip}:{shape[0] * shape[1]}" if shape[0] == 1 or shape[1] == fam.gpus_per_node
                      else f"{chip}:{shape[0]}x{shape[1]}", "gpu", chip, shape, fam.chip)
    raise WorkbenchError(f"unknown chip {m.group('chip')!r} in target {text!r}; known: "
                         f"{', '.join(sorted(TPU_FAMILIES) + sorted(GPU_FAMILIES))} "
                         f"(e.g. {', '.join(known_targets())})")


def _parse_shape(s: str, text: str) -> tuple[int, ...]:
    parts = s.split("x")
    if not all(p.isdigit() for p in parts):
        raise WorkbenchError(f"cannot read topology {s!r} in target {text!r}; write sizes joined by x, e.g. 4x4")
    shape = tuple(int(p) for p in parts)
    if any(d < 1 for d in shape):
        raise WorkbenchError(f"topology {s!r} in target {text!r} has a zero dimension; every size must be >= 1")
    return shape


# ---------------------------------------------------------------------------------------------------------------
# devices


def libtpu_available() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def require_libtpu() -> None:
    if not libtpu_available():
        raise WorkbenchError("libtpu is not installed, so TPU targets cannot be compiled here; install it with "
                             "`.venv/bin/pip install -e '.[tpu]'` (or `make test`, which installs the pinned lock)")


def _quiet_libtpu_env(target: Target) -> None:
    """libtpu looks for a TPU VM's metadata at load; on a CPU host tell it there is none (only if the user did not)."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # libtpu takes /tmp/libtpu_lockfile so that one process owns the TPU chips; compile-only topologies own no chips,
    # so several workbench processes (a planner, a test run) may load it side by side
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    accel = {"v5e": "v5litepod", "v6e": "v6e", "v4": "v4", "v5p": "v5p", "v7x": "tpu7x"}[target.family]
    cores = target.n_chips * (2 if target.family in ("v4", "v5p", "v7x") else 1)
    size = cores if target.family in ("v4", "v5p", "v7x") else target.n_chips  # v4/v5p/tpu7x names count cores
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{accel}-{size}")


def _host_bounds(target: Target) -> tuple[int, int, int]:
    """Chips per host in each dimension: single-host slices are one host; larger ones are 2x2x1 per host."""
    shape3 = tuple(target.shape) + (1,) * (3 - len(target.shape))
    if target.n_chips <= 4 or (TPU_FAMILIES[target.family].dims == 2 and target.n_chips <= 8):
        return shape3  # type: ignore[return-value]
    return (2, 2, 1)


def tpu_devices(target: "Target | str") -> tuple:
    """Compile-only TPU devices for the slice (no TPU needed). Cached per target; the CPU stays JAX's default."""
    return _tpu_devices(target if isinstance(target, Target) else parse_target(target))


@functools.lru_cache(maxsize=None)
def _tpu_devices(target: "Target") -> tuple:
    if target.kind != "tpu":
        raise WorkbenchError(f"{target.name} is not a TPU target")
    require_libtpu()

    default_platform()  # CPU for everything else; libtpu is loaded only as a compiler plugin
    _quiet_libtpu_env(target)
    fam = TPU_FAMILIES[target.family]
    try:
        topo = compat.get_topology_desc(
            topology_name=target.topology_name, platform="tpu", chip_config_name=fam.chip_config,
            chips_per_host_bounds=_host_bounds(target), num_slices=1)
    except RuntimeError as e:  # JaxRuntimeError subclasses RuntimeError
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "not installed" in msg:
            require_libtpu()
        raise WorkbenchError(f"libtpu rejected topology {target.topology_name}: {msg}") from None
    devices = tuple(topo.devices)
    per_chip = devices_per_chip_of(devices)
    if len(devices) != target.n_devices or per_chip != fam.devices_per_chip:
        raise WorkbenchError(f"libtpu made {len(devices)} devices ({per_chip} per chip) for {target.topology_name}, "
                             f"expected {target.n_devices} ({fam.devices_per_chip} per chip); this libtpu maps "
                             "devices differently from the one this workbench was checked with")
    return devices


def devices_per_chip_of(devices) -> int:
    """How many of `devices` share one chip, read from their chip coordinates (TPU devices carry `coords`, the
    chip's position, and `core_on_chip`). 1 when the devices carry no coordinates."""
    coords = [tuple(getattr(d, "coords", ()) or ()) for d in devices]
    if not coords or not all(coords):
        return 1
    counts = {}
    for c in coords:
        counts[c] = counts.get(c, 0) + 1
    return max(counts.values())


GPU_COMPILERS = ("auto", "xla-gpu", "cpu-sim")


def gpu_compiler_available() -> bool:
    """True when a JAX CUDA plugin is importable: XLA:GPU can then compile for a GPU topology with no GPU attached."""
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13)) \
        if importlib.util.find_spec("jax_plugins") is not None else False


def gpu_compiler_for(target: Target, choice: str = "auto") -> str:
    """'xla-gpu' (deviceless XLA:GPU compile) or 'cpu-sim' (the program compiled for simulated CPU devices)."""
    if choice not in GPU_COMPILERS:
        raise WorkbenchError(f"unknown --gpu-compiler {choice!r}; choose one of {', '.join(GPU_COMPILERS)}")
    if target.kind != "gpu":
        return "libtpu"
    if choice == "auto":
        return "xla-gpu" if gpu_compiler_available() else "cpu-sim"
    if choice == "xla-gpu" and not gpu_compiler_available():
        raise WorkbenchError("--gpu-compiler xla-gpu needs the JAX CUDA plugin matching this jaxlib; install it with "
                             "`.venv/bin/pip install --no-deps jax-cuda12-plugin==VERSION jax-cuda12-pjrt==VERSION` "
                             "(VERSION = jaxlib's) or use --gpu-compiler cpu-sim (see docs/targets.md)")
    return choice


def xla_gpu_devices(target: "Target | str") -> tuple:
    """Compile-only devices of XLA:GPU for a GPU node (no GPU needed; JAX CUDA plugin required)."""
    return _xla_gpu_devices(target if isinstance(target, Target) else parse_target(target))


@functools.lru_cache(maxsize=None)
def _xla_gpu_devices(target: "Target") -> tuple:
    default_platform()
    try:
        topo = compat.get_topology_desc(platform="cuda", target_config=gpu_target_config(target.family),
                                            topology=f"1x{target.shape[0]}x{target.shape[1]}")
    except Exception as e:  # noqa: BLE001 - the plugin's words, one line
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise WorkbenchError(f"XLA:GPU could not make a deviceless {target.name} topology: {msg}; "
                             "use --gpu-compiler cpu-sim") from None
    devices = tuple(topo.devices)
    if len(devices) != target.n_chips:
        raise WorkbenchError(f"XLA:GPU made {len(devices)} devices for {target.name}, expected {target.n_chips}")
    return devices


def target_devices(target: Target, gpu_compiler: str = "auto") -> list:
    """The devices a program for `target` is compiled for.

    TPU: libtpu's compile-only devices. GPU with the JAX CUDA plugin installed: XLA:GPU compile-only devices.
    GPU otherwise: simulated CPU devices of the same count (the caller must have called
    workbench.hardware.devices.request_devices(target.n_chips) before JAX started; a mismatch is a one-line error).
    """
    if target.kind == "tpu":
        return list(tpu_devices(target))
    if gpu_compiler_for(target, gpu_compiler) == "xla-gpu":
        return list(xla_gpu_devices(target))
    import jax


    have = request_devices(target.n_chips)
    devs = jax.devices()
    if have != target.n_chips or len(devs) != target.n_chips:
        raise WorkbenchError(f"{target.name} needs {target.n_chips} simulated CPU devices, JAX has {len(devs)}; "
                             f"run it in a fresh process (the CLI does) or with --devices {target.n_chips}")
    return list(devs)


def device_grid(devices: list, shape: tuple[int, ...]):
    """Devices arranged for a mesh of `shape`, physically aware on TPU (jax mesh_utils), plain order otherwise."""
    import numpy as np

    n = math.prod(shape)
    if n != len(devices):
        raise WorkbenchError(f"mesh of shape {'x'.join(map(str, shape))} needs {n} devices; the target has "
                             f"{len(devices)}: make the mesh axis sizes multiply to {len(devices)}")
    if devices and devices[0].platform == "tpu":
        from jax.experimental import mesh_utils

        try:
            return mesh_utils.create_device_mesh(tuple(shape), devices=list(devices), allow_split_physical_axes=True)
        except Exception:  # noqa: BLE001 - shapes the physical mapping cannot serve: fall back to id order
            pass
    return np.array(devices, dtype=object).reshape(shape)


def check_mesh_size(axes: dict[str, int], n_devices: int, target_name: str) -> None:
    """The mesh must use every chip of the target exactly once."""
    if math.prod(axes.values()) != n_devices:
        spec = ",".join(f"{k}={v}" for k, v in axes.items())
        raise WorkbenchError(f"mesh {spec} has {math.prod(axes.values())} devices but {target_name} has {n_devices} "
                             f"chips; make the axis sizes multiply to {n_devices}")


def mesh_factorizations(n: int, axes: tuple[str, ...] = ("data", "model")) -> list[dict[str, int]]:
    """Every way to split n devices over the named axes (sizes multiply to n), data-heaviest first."""
    if len(axes) == 1:
        return [{axes[0]: n}]
    out = []
    for d in sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True):
        for rest in mesh_factorizations(n // d, axes[1:]):
            out.append({axes[0]: d, **rest})
    return out


def setup_target_devices(target: "Target | str", gpu_compiler: str = "auto") -> "Target":
    """Parse the target (unless given parsed) and make its devices available BEFORE JAX starts (GPU nodes compiled
    on simulated CPUs: that many CPU devices)."""
    target = target if isinstance(target, Target) else parse_target(target)
    if gpu_compiler_for(target, gpu_compiler) == "cpu-sim":
        request_devices(target.n_chips)
    else:
        default_platform()
    return target
