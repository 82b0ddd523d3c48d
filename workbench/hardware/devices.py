"""Which devices JAX runs on. Everything that needs a device count calls `request_devices` before JAX starts.

The simulated CPU device count must be fixed before JAX initialises its backends; a later, different request
fails loudly instead of silently running on the devices that already exist.
"""
from __future__ import annotations

import os

from workbench.errors import WorkbenchError

_requested: int | None = None


def _backends_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


PLATFORMS = ("auto", "cpu", "gpu", "tpu")
_JAX_NAMES = {"gpu": "cuda,cpu", "tpu": "tpu,cpu", "cpu": "cpu"}
_PCI_VENDORS = {"0x10de": "gpu", "0x1ae0": "tpu"}  # NVIDIA; Google (TPU chips on a TPU VM)
_chosen: dict = {}


def default_platform() -> None:
    """CPU unless the user chose (JAX_PLATFORMS): for work that only compiles (predict, plan, hw), where TPUs and
    GPUs are compile targets, not devices. With libtpu installed JAX would probe for TPUs at start-up."""
    import jax

    if not os.environ.get("JAX_PLATFORMS") and not _backends_started():
        jax.config.update("jax_platforms", "cpu")


def detect_accelerator() -> tuple[str | None, str]:
    """('gpu' | 'tpu' | None, why) for this host, without starting JAX: an accelerator counts when its device is
    on the PCI bus (or its device node exists) and the JAX plugin that drives it is installed."""
    import glob
    import importlib.util

    seen = set()
    for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(path) as f:
                kind = _PCI_VENDORS.get(f.read().strip())
        except OSError:
            continue
        if kind == "gpu":  # an NVIDIA display or 3D controller, not a bridge or audio function
            try:
                with open(os.path.join(os.path.dirname(path), "class")) as f:
                    kind = kind if f.read().strip().startswith("0x03") else None
            except OSError:
                kind = None
        if kind:
            seen.add(kind)
    if glob.glob("/dev/nvidia[0-9]*") or os.path.isdir("/proc/driver/nvidia/gpus"):
        seen.add("gpu")
    if glob.glob("/dev/accel[0-9]*"):
        seen.add("tpu")

    def plugin(*names):
        return any(importlib.util.find_spec(n.split(".")[0]) is not None and importlib.util.find_spec(n) is not None
                   for n in names)

    if "gpu" in seen:
        if plugin("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
            return "gpu", "an NVIDIA GPU and the JAX CUDA plugin"
        return None, "an NVIDIA GPU, but no JAX CUDA plugin (pip install 'jax[cuda13]', or `make demo CUDA=1`)"
    if "tpu" in seen:
        if plugin("libtpu"):
            return "tpu", "a TPU device and libtpu"
        return None, "a TPU device, but no libtpu"
    return None, "no GPU or TPU on this host"


def select_platform(choice: str | None = "auto", *, simulated_devices: int | None = None, quiet: bool = False) -> str:
    """Put JAX on the platform programs run on, before it starts, and return it ('cpu' | 'gpu' | 'tpu').

    choice 'auto': the accelerator this host has (detect_accelerator), else the CPU; 'cpu' simulates on the host.
    simulated_devices (--devices N) implies the CPU. JAX_PLATFORMS, when set, wins. Once JAX has started the
    platform is what it started with. An accelerator chosen (or found but unusable) is said once on stderr
    (quiet=False); a CPU host stays quiet, and every record stores the platform."""
    import sys

    import jax

    choice = choice or "auto"
    if choice not in PLATFORMS:
        raise WorkbenchError(f"unknown --platform {choice!r}; choose one of {', '.join(PLATFORMS)}")
    if simulated_devices is not None and choice in ("gpu", "tpu"):
        raise WorkbenchError(f"--devices simulates CPU devices; it cannot be combined with --platform {choice} "
                             "(an accelerator host's device count is what it has)")
    if _backends_started():
        return _platform_of(jax.devices()[0].platform)
    env = os.environ.get("JAX_PLATFORMS", "").strip()
    if env:
        platform, why = _platform_of(env.split(",")[0]), "JAX_PLATFORMS=" + env
    elif simulated_devices is not None:
        platform, why = "cpu", f"--devices {simulated_devices}: simulated CPU devices"
    elif choice != "auto":
        platform, why = choice, f"--platform {choice}"
    else:
        platform, why = detect_accelerator()
        platform = platform or "cpu"
    if not env:
        jax.config.update("jax_platforms", _JAX_NAMES[platform])
    # said where it matters: programs go to an accelerator, or one is here but cannot be used (no plugin); a plain CPU
    # host stays quiet (the record says cpu either way)
    if platform != _chosen.get("platform") and not quiet and (platform != "cpu" or "but no" in why):
        print(f"workbench: platform {platform} ({why}; --platform cpu simulates on the host)", file=sys.stderr)
    _chosen.update(platform=platform, why=why)
    return platform


def _platform_of(jax_platform: str) -> str:
    """JAX's platform names ('cuda', 'rocm', 'gpu', 'tpu', 'cpu') as the workbench's three."""
    p = jax_platform.strip().lower()
    return "gpu" if p in ("cuda", "rocm", "gpu") else ("tpu" if p == "tpu" else "cpu")


def device_info() -> dict:
    """What the programs run on, for every record: platform, device kind, device count and, where JAX reports it,
    the driver (CUDA/ROCm) or runtime version."""
    import jax

    devs = jax.devices()
    out = {"platform": _platform_of(devs[0].platform), "device_kind": devs[0].device_kind, "device_count": len(devs),
           "chosen_because": _chosen.get("why")}
    try:
        from jax.extend import backend

        version = str(backend.get_backend().platform_version)
        if version and version != out["platform"]:  # XLA:CPU answers 'cpu'
            out["platform_version"] = version  # e.g. 'PJRT C API\ncuda 13000' with the CUDA plugin
    except Exception:  # noqa: BLE001 - an optional detail; versions differ in what they expose
        pass
    return out


def request_devices(n: int | None, platform: str | None = "auto") -> int:
    """Make `n` CPU devices available (simulated on this host); None: the devices of the platform chosen by
    select_platform(platform) (an accelerator host's own, or the CPU).

    Returns the number of devices JAX will use (all processes' when several form one group: `n` counts this
    process's own). Raises WorkbenchError when JAX already started with another count.
    """
    global _requested
    import jax

    if n is None:
        select_platform(platform)
        return len(jax.devices())
    select_platform(platform, simulated_devices=n)
    if n < 1:
        raise WorkbenchError(f"--devices must be >= 1, got {n}")
    if _backends_started():
        have = jax.local_device_count()
        if have != n:
            raise WorkbenchError(
                f"JAX already started with {have} devices; {n} were requested too late "
                "(pass --devices before anything runs, or set it once per process)")
        return len(jax.devices())
    if jax.config.jax_platforms not in (None, "", "cpu"):
        # real accelerators: the count is what the host has
        return len(jax.devices())
    jax.config.update("jax_num_cpu_devices", n)
    _requested = n
    have = jax.local_device_count()
    if have != n:
        raise WorkbenchError(f"asked for {n} simulated CPU devices, JAX has {have}")
    return len(jax.devices())


def is_simulated() -> bool:
    """True when the devices are CPU devices sharing this host (a simulated mesh when there are several)."""
    import jax

    return jax.devices()[0].platform == "cpu"


def enable_compilation_cache(path: str | None = None) -> None:
    """Persistent XLA compilation cache (speeds repeated compiles, e.g. the planner)."""
    import jax

    path = path or os.environ.get("WORKBENCH_CACHE", os.path.join(os.getcwd(), ".cache", "jax"))
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
