"""The host allocator XLA:CPU runs on: transparent huge pages for its buffers.

XLA:CPU allocates every step's temporaries and fresh outputs through glibc malloc. Above glibc's mmap threshold
(32 MiB at most) each allocation is a fresh mapping, and on a kernel whose transparent huge pages are in `madvise`
mode it is faulted in 4 KiB at a time on first touch: measured here at ~3.5 GB/s against ~60 GB/s streaming
(docs/hardware.md). glibc >= 2.35 can madvise its allocations for huge pages (the tunable glibc.malloc.hugetlb=1),
which turns 512 faults into one. On this 2-core host that took the `small` training step from 1.03 s to 0.88 s
(unrolled layers) and 0.985 s to 0.777 s (scanned layers); memory-bound kernels gained 2.6-3.8x (docs/hardware.md).

The tunable is read by glibc when a process starts, so the entry points (`workbench`, the benchmark scripts) call
`reexec_with_hugepages()` first: it re-executes the same command line once with the tunable added to GLIBC_TUNABLES.
It does nothing when the kernel's THP mode is `always` (every large mapping gets huge pages already) or `never`,
when glibc is older than 2.35, off Linux, or with WORKBENCH_HUGEPAGES=0. `describe()` goes into every record's
provenance and the calibration fingerprint, so a ceiling is only ever compared with steps run under the same
allocator.
"""
from __future__ import annotations

import os
import sys

from workbench.errors import WorkbenchError

TUNABLE = "glibc.malloc.hugetlb=1"
_MARK = "WORKBENCH_REEXEC"


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode ('always' | 'madvise' | 'never'), None where unknown."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def glibc_version() -> tuple[int, int] | None:
    try:
        name, ver = os.confstr("CS_GNU_LIBC_VERSION").split()
        major, minor = ver.split(".")[:2]
        return int(major), int(minor)
    except (ValueError, OSError, AttributeError):
        return None


def hugepages_active() -> bool:
    """True when this process's malloc madvises huge pages (the tunable is set), or the kernel gives them always."""
    return TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":") or thp_mode() == "always"


def wanted() -> bool:
    """Would re-executing with the tunable change anything here?"""
    if os.environ.get("WORKBENCH_HUGEPAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    ver = glibc_version()
    return thp_mode() == "madvise" and ver is not None and ver >= (2, 35) and not hugepages_active()


def reexec_with_hugepages() -> None:
    """Re-execute this process's command line once with glibc.malloc.hugetlb=1; returns only when that is not
    wanted (see the module docstring) or was already tried. Call it before anything else runs."""
    if not wanted() or os.environ.get(_MARK) or not getattr(sys, "orig_argv", None):
        return
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(x for x in (env.get("GLIBC_TUNABLES"), TUNABLE) if x)
    env[_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, list(sys.orig_argv), env)
    except OSError:
        return  # carry on without huge pages


def describe() -> dict:
    """For provenance and the calibration fingerprint."""
    return {"thp": thp_mode(), "malloc_hugetlb": TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":"),
            "hugepages": hugepages_active()}


def available_bytes() -> int | None:
    """Memory the host can still give this process (/proc/meminfo MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(needed_bytes: float, what: str, fix: str, margin: float = 0.8) -> None:
    """A one-line WorkbenchError, before anything is allocated, when `what` needs more than `margin` of the memory
    the host has free (the rest is left for the process itself and the allocator's slack)."""
    free = available_bytes()
    if free is not None and needed_bytes > margin * free:
        raise WorkbenchError(f"{what} needs {needed_bytes / 2**30:.3g} GiB but this host has {free / 2**30:.3g} GiB "
                             f"available; {fix}")
