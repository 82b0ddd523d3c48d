"""Compile a JAX program for a set of devices from abstract inputs, and read its costs."""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import tempfile
import time
from typing import Any, Callable

from workbench import compat
from workbench.cost.analytic import analytic_count
from workbench.cost.hlo import hbm_bytes
from workbench.cost.report import CostReport, costs_from_compiled
from workbench.errors import DoesNotFit


@dataclasses.dataclass
class Compiled:
    fn: Any  # the jitted function (callable with concrete arrays; guarded against recompiles by measure)
    lowered: Any
    compiled: Any  # jax.stages.Compiled
    cost: CostReport
    lower_s: float
    compile_s: float
    hlo_text: str


def _dominant_dtype(args) -> str:
    import jax
    import numpy as np

    best, size = "float32", -1
    for a in jax.tree.leaves(args):
        if hasattr(a, "dtype") and hasattr(a, "shape") and np.issubdtype(np.dtype(a.dtype), np.floating):
            n = int(np.prod(a.shape))
            if n > size:
                best, size = np.dtype(a.dtype).name, n
    return best


def is_resource_exhausted(e: BaseException) -> bool:
    s = f"{type(e).__name__} {e}"
    return any(w in s for w in ("RESOURCE_EXHAUSTED", "ResourceExhausted", "Out of memory", "out of memory",
                                "exceeds the memory", "Ran out of memory"))


def compile_program(fn: Callable, *args, jit_kwargs: dict | None = None, mesh=None, n_devices: int | None = None,
                    analytic: bool = True, compute_dtype: str | None = None, compiler_options: dict | None = None,
                    **kwargs) -> Compiled:
    """jit(fn).lower(*args).compile() with abstract (ShapeDtypeStruct, possibly sharded) or concrete args.

    `fn` may already be jitted. `compiler_options` go to this compile only (XLA debug options such as
    xla_disable_hlo_passes: `lowered.compile(compiler_options=...)`, no process-wide XLA_FLAGS).
    A compile that runs out of device memory raises DoesNotFit with the compiler's words.
    """
    import jax

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn, **(jit_kwargs or {}))
    t0 = time.perf_counter()
    lowered = jitted.lower(*args, **kwargs)
    t1 = time.perf_counter()
    try:
        compiled = lowered.compile(compiler_options=compiler_options) if compiler_options else lowered.compile()
    except Exception as e:
        if is_resource_exhausted(e):
            raise DoesNotFit(str(e).strip().splitlines()[0][:400]) from e
        raise
    t2 = time.perf_counter()
    if n_devices is None:
        n_devices = mesh.size if mesh is not None else _devices_of(args)
    an = None
    if analytic:

        inner = getattr(fn, "__wrapped__", fn)
        an = analytic_count(inner, *args, **kwargs)
    text = compiled.as_text()
    cost = costs_from_compiled(compiled, n_devices=n_devices, mesh=mesh, analytic=an,
                               compute_dtype=compute_dtype or _dominant_dtype(args), hlo_text=text)
    return Compiled(jitted, lowered, compiled, cost, t1 - t0, t2 - t1, text)


def _devices_of(args) -> int:
    import jax

    n = 1
    for a in jax.tree.leaves(args):
        sh = getattr(a, "sharding", None)
        if sh is not None and hasattr(sh, "num_devices"):
            n = max(n, sh.num_devices)
    return n


class UncompiledHlo:
    """The optimized HLO of a program the compiler refused for want of memory, standing in for a jax `Compiled`
    where only its text is read (workbench.cost.report.costs_from_compiled): no cost_analysis, no memory_analysis."""

    def __init__(self, text: str):
        self._text = text

    def as_text(self) -> str:
        return self._text

    def cost_analysis(self):
        raise RuntimeError("the program did not compile (out of memory): no compiler cost_analysis")

    def memory_analysis(self):
        raise RuntimeError("the program did not compile (out of memory): no memory_analysis")


def compile_keeping_oom_hlo(lowered):
    """lowered.compile() with an XLA dump directory, so that a program the compiler refuses for want of device memory
    still leaves its optimized HLO: (compiled or None, the error or None, the optimized HLO text or None, its
    largest allocations: largest_allocations, [] where the compiler wrote no memory report).

    The compiler runs its optimization passes before it assigns buffers, and with a dump directory it writes the
    optimized module before it reports the overflow (`*.after_optimizations.hlo.pb`), and its buffer assignment
    (`*memory-usage-report.txt`). The module is read from the proto and printed by this jaxlib, so tuple elements are
    explicit get-tuple-element instructions as in `Compiled.as_text()` (libtpu's own text dump writes them as
    `%x#k`, which the HLO reader does not follow). One compile either way; the dump goes to a temporary directory
    removed afterwards."""
    d = tempfile.mkdtemp(prefix="workbench-oom-hlo-")
    try:
        try:
            return lowered.compile(compiler_options={"xla_dump_to": d, "xla_dump_hlo_as_proto": True,
                                                     "xla_dump_hlo_as_text": True}), None, None, []
        except Exception as e:  # noqa: BLE001
            if not is_resource_exhausted(e):
                raise
            return None, e, _dumped_optimized_hlo(d), largest_allocations(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
def largest_allocations(dump_dir: str, n: int = 3) -> list[dict]:
    """The `n` largest device-memory (color 0) allocations of the compiler's buffer assignment, read from the
    `*memory-usage-report.txt` it dumps: [{'bytes', 'shape' (the largest value placed there), 'values' (how many
    values share the allocation over the program), 'repeats' (how many of them have that shape)}], largest first.
    Their sizes add up to the temporaries the compiler asked for, so the first names what does not fit."""
    paths = sorted(glob.glob(os.path.join(dump_dir, "*memory-usage-report.txt")), key=os.path.getsize, reverse=True)
    if not paths:
        return []
    with open(paths[0], encoding="utf-8", errors="replace") as f:
        text = f.read()
    section = text.split("Memory Space:")[1] if "Memory Space:" in text else ""
    out = []
    for line in section.splitlines():
        parts = [p.strip() for p in line.split(";")]
        if len(parts) < 5 or not parts[2].isdigit():
            continue
        sized = re.fullmatch(r"([\d.]+)(B|KiB|MiB|GiB|TiB)", parts[1])
        size = float(sized.group(1)) * _UNITS[sized.group(2)] if sized else None
        shapes = []
        for item in _split_shapes(parts[4]):
            times, _, shape = item.rpartition("×")
            if "[" in shape:
                shapes.append((hbm_bytes(shape), shape, int(times) if times.isdigit() else 1))
        if size is None or not shapes:
            continue
        big = max(shapes)
        out.append({"bytes": size, "shape": big[1], "repeats": big[2], "values": int(parts[3])})
        if len(out) == n:
            break
    return out


def _split_shapes(s: str) -> list[str]:
    """'2×f32[4,64], bf16[8]' -> ['2×f32[4,64]', 'bf16[8]'] (commas inside brackets and tuples kept)."""
    items, depth, cur = [], 0, ""
    for ch in s:
        depth += 1 if ch in "[(" else -1 if ch in "])" else 0
        if ch == "," and depth == 0:
            items.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [i for i in items + [cur.strip()] if i and not i.startswith("(")]


def _dumped_optimized_hlo(d: str) -> str | None:
    """The largest optimized module in dump directory `d`, as text; None where the compiler wrote none."""
    for path in sorted(glob.glob(os.path.join(d, "*.after_optimizations.hlo.pb")), key=os.path.getsize,
                       reverse=True):
        with open(path, "rb") as f:
            text = hlo_text_of_proto(f.read())
        if text:
            return text
    return None


def _proto_field(buf: bytes, number: int) -> bytes | None:
    """The first length-delimited field `number` of a serialized protocol buffer message (wire format)."""
    def varint(i: int) -> tuple[int, int]:
        v = shift = 0
        while True:
            b = buf[i]
            i += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return v, i
    i = 0
    while i < len(buf):
        key, i = varint(i)
        num, wire = key >> 3, key & 7
        if wire == 2:
            n, i = varint(i)
            if num == number:
                return buf[i:i + n]
            i += n
        elif wire == 0:
            _, i = varint(i)
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            return None
    return None


def hlo_text_of_proto(data: bytes) -> str | None:
    """An XLA dump's `HloProto` (its field 1 is the HloModuleProto) printed as HLO text by this jaxlib; None when
    it does not parse."""
    module_cls = compat.hlo_module_class()
    if module_cls is None:
        return None
    for blob in (_proto_field(data, 1), data):
        if not blob:
            continue
        try:
            return module_cls.from_serialized_hlo_module_proto(blob).to_string()
        except Exception:  # noqa: BLE001 - not this message
            continue
    return None
