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


def default_platform() -> None:
    """CPU unless the user chose (JAX_PLATFORMS). With libtpu installed JAX would probe for TPUs at start-up."""
    import jax

    if not os.environ.get("JAX_PLATFORMS") and not _backends_started():
        jax.config.update("jax_platforms", "cpu")


def request_devices(n: int | None) -> int:
    """Make `n` CPU devices available (simulated on this host); None keeps the current/default count.

    Returns the number of devices JAX will use (all processes' when several form one group: `n` counts this
    process's own). Raises WorkbenchError when JAX already started with another count.
    """
    global _requested
    import jax

    default_platform()
    if n is None:
        return len(jax.devices())
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
