"""The one measurement harness: warm-up, compile time apart from run time, block_until_ready, repeats with
median / IQR / min, random (never zero) inputs, a recompile during timing is an error, a wide spread is flagged.

Calls shorter than `min_batch_s` are timed in batches of several back-to-back calls (reported per call), so the
timer's and Python's overhead stay small against the program.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import numpy as np

from workbench.cost.hlo import COLLECTIVE_KINDS, HLO_TO_NUMPY, attr, parse_dots, parse_kernels, parse_module
from workbench.errors import RecompileError
from workbench.measure.kernels import trace_kernels

WIDE_SPREAD = 0.25  # IQR / median above this flags the measurement as noisy


@dataclasses.dataclass(frozen=True, slots=True)
class Measurement:
    times_s: tuple[float, ...]  # per call, one entry per repeat
    median_s: float
    iqr_s: float
    min_s: float
    mean_s: float
    warmup: int
    repeats: int
    calls_per_repeat: int
    compile_s: float | None
    wide_spread: bool
    spread: float  # IQR / median
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summarize(times: list[float], *, warmup: int, calls: int, compile_s: float | None,
              notes=()) -> Measurement:
    a = np.asarray(times, dtype=np.float64)
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    spread = float((q3 - q1) / med) if med > 0 else math.inf
    n = list(notes)
    wide = spread > WIDE_SPREAD
    if wide:
        n.append(f"wide spread: IQR is {spread:.0%} of the median (threshold {WIDE_SPREAD:.0%}); "
                 "was something else running?")
    return Measurement(tuple(float(t) for t in a), float(med), float(q3 - q1), float(a.min()), float(a.mean()),
                       warmup, len(a), calls, compile_s, wide, spread, tuple(n))


def _block(out):
    import jax

    return jax.block_until_ready(out)


def _cache_size(fn) -> int | None:
    f = getattr(fn, "_cache_size", None)
    return f() if callable(f) else None


def measure(fn: Callable, *args, warmup: int = 2, repeats: int = 10, compile_s: float | None = None,
            min_batch_s: float = 0.02, max_calls: int = 64, min_total_s: float = 0.0,
            max_repeats: int = 1000) -> Measurement:
    """Time fn(*args). `fn` is a jax Compiled (cannot recompile) or a jitted function (guarded: a recompile after
    warm-up raises RecompileError). Arguments are reused (no donation). Each timing is a batch of calls lasting at
    least `min_batch_s`; at least `repeats` timings are taken, and more (up to `max_repeats`) until they add up to
    `min_total_s`: a 512³ matmul timed as nine 20 ms batches is 0.2 s of the machine, a sample one hiccup of a VM
    can move by a third."""
    for _ in range(max(1, warmup)):
        _block(fn(*args))
    before = _cache_size(fn)
    t0 = time.perf_counter()
    _block(fn(*args))
    single = time.perf_counter() - t0
    calls = 1 if single >= min_batch_s else int(min(max_calls, math.ceil(min_batch_s / max(single, 1e-7))))
    times: list[float] = []
    while len(times) < repeats or (sum(times) * calls < min_total_s and len(times) < max(repeats, max_repeats)):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        _block(out)
        times.append((time.perf_counter() - t0) / calls)
    after = _cache_size(fn)
    if before is not None and after != before:
        raise RecompileError(f"the program recompiled while being timed ({before} → {after} cached executables): "
                             "shapes, dtypes or shardings of the inputs changed between calls")
    return summarize(times, warmup=warmup, calls=calls, compile_s=compile_s)


def measure_interleaved(programs: dict[str, tuple], *, warmup: int = 1, rounds: int = 10,
                        compile_s: dict[str, float] | None = None) -> tuple[dict[str, Measurement], dict[str, list]]:
    """Time several programs against each other: `programs` maps a name to (fn, *args). Each round calls every
    program once, in an order that rotates from round to round, so a load that drifts during the run weighs on all
    of them alike. Returns (a Measurement per name, the per-round times per name): ratios of the same round's times
    (e.g. median of a_i / b_i) cancel the drift that separate medians keep. Jitted functions are guarded against
    recompiling, as in `measure`."""
    names = list(programs)
    for n in names:
        fn, *args = programs[n]
        for _ in range(max(1, warmup)):
            _block(fn(*args))
    before = {n: _cache_size(programs[n][0]) for n in names}
    per_round = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            fn, *args = programs[n]
            t0 = time.perf_counter()
            _block(fn(*args))
            per_round[n].append(time.perf_counter() - t0)
    for n in names:
        if before[n] is not None and _cache_size(programs[n][0]) != before[n]:
            raise RecompileError(f"{n} recompiled while being timed (input shapes/dtypes/shardings changed)")
    out = {n: summarize(per_round[n], warmup=warmup, calls=1, compile_s=(compile_s or {}).get(n)) for n in names}
    return out, per_round


def measure_steps(step: Callable[[int], Any], *, warmup: int = 2, repeats: int = 10, guard=None,
                  compile_s: float | None = None, min_total_s: float = 0.0, max_repeats: int = 1000) -> Measurement:
    """Time a stateful step: step(i) runs iteration i (feeding its own state forward) and returns what to block on.
    `guard` is the jitted function whose cache must not grow while timing. At least `repeats` steps are timed, and
    more (up to `max_repeats`) until the timed steps add up to `min_total_s`: a step of a few milliseconds timed five
    times is a sample a scheduling hiccup of the host decides."""
    for i in range(max(1, warmup)):
        _block(step(i))
    before = _cache_size(guard) if guard is not None else None
    times: list[float] = []
    i = 0
    while i < repeats or (sum(times) < min_total_s and i < max(repeats, max_repeats)):
        t0 = time.perf_counter()
        _block(step(warmup + i))
        times.append(time.perf_counter() - t0)
        i += 1
    if guard is not None and _cache_size(guard) != before:
        raise RecompileError("the step recompiled while being timed (input shapes/dtypes/shardings changed)")
    return summarize(times, warmup=warmup, calls=1, compile_s=compile_s)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn(), wall seconds) of one call that is not a repeatable program (a checkpoint save, a restore, a wait):
    the one place such a single interval is read from the clock."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def random_inputs(abstract_args, seed: int = 0):
    """Concrete random arrays (normal for floats, small positive ints otherwise; never zeros) matching abstract
    ShapeDtypeStructs, placed with their shardings when they have them."""
    import jax
    import jax.numpy as jnp

    leaves, tree = jax.tree.flatten(abstract_args)
    key = jax.random.key(seed)
    out = []
    for i, a in enumerate(leaves):
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            out.append(a)
            continue
        k = jax.random.fold_in(key, i)
        dt = jnp.dtype(a.dtype)
        if jnp.issubdtype(dt, jnp.floating):
            x = jax.random.normal(k, a.shape, jnp.float32).astype(dt)
        elif jnp.issubdtype(dt, jnp.integer):
            x = jax.random.randint(k, a.shape, 1, 100).astype(dt)
        else:
            x = jnp.ones(a.shape, dt)
        sh = getattr(a, "sharding", None)
        if sh is not None:
            x = jax.device_put(x, sh)
        out.append(x)
    return jax.tree.unflatten(tree, out)


# ------------------------------------------------------------------------------------------ per-kernel profile
def _kernel_class(name: str, dot: bool) -> str:
    if dot:
        return "matmul"

    base = name.rsplit(".", 1)[0] if name.rsplit(".", 1)[-1].isdigit() else name
    if base.startswith(COLLECTIVE_KINDS):
        return "collective"  # on simulated devices: includes waiting for the other devices
    if "dynamic-update-slice" in base:
        return "dynamic-update-slice"
    if "dynamic-slice" in base:
        return "dynamic-slice"
    if base.startswith(("copy", "transpose")):
        return "copy/transpose"
    if base in ("wrapped_broadcast", "broadcast"):
        return "broadcast"
    if base in ("while", "conditional", "call"):
        return "control"
    return "elementwise/reduce"


def _dot_text(dot) -> str:
    """'f32[2048,512] lhs_c={1} rhs_c={0}': the dot's output and contracting dimensions (batch dims when present)."""
    import re

    dims = re.findall(r"(lhs|rhs)_(contracting|batch)_dims=(\{[^}]*\})", dot.attrs)
    return " ".join([dot.type_str.split("{")[0]] + [f"{s}_{'c' if k == 'contracting' else 'b'}={v}" for s, k, v in dims])


def profile_kernels(step: Callable[[int], Any], hlo_text: str, *, steps: int = 2, ceiling_flops: float | None = None,
                    top: int = 25) -> dict:
    """Time every kernel of a compiled program from a jax.profiler trace of `steps` calls of step(i).

    Joins each traced kernel (a fusion or unfused op of the optimized HLO, `hlo_text`) with its CostReport-style
    costs (workbench.cost.hlo.parse_kernels: flops and bytes per call) and returns per-step totals: 'kernels' (the `top`
    longest: name, class, ms, min_ms (its fastest single call), calls, GFLOP, achieved GFLOP/s and GB/s, the dot's
    shape, the op_name it came from),
    'classes' (ms, calls, GFLOP by matmul / copy/transpose / dynamic-(update-)slice / broadcast / collective /
    elementwise/reduce; on simulated devices each device's kernels add up, and a collective includes the wait)
    and 'matmul_rate' (the dots' flops over their time). The thunk runtime may run independent kernels at once, so
    the kernel times sum to about the step, not exactly. Each kernel lasts until its completion mark
    (traced by workbench.measure.kernels.trace_kernels); a dot whose achieved rate is still above 1.5x `ceiling_flops`
    (a trace without the marks showed an asynchronous Eigen dot's dispatch only) is flagged `async`.
    """
    import collections
    import re

    mod = parse_module(hlo_text)
    costs = {k.name: k for k in parse_kernels(hlo_text, mod)}
    instrs = {i.name: i for body in mod.computations.values() for i in body}
    events = trace_kernels(step, steps=steps, warmup=1).events  # each kernel until its completion mark
    dur: dict[str, float] = collections.Counter()
    calls: dict[str, float] = collections.Counter()
    fastest: dict[str, float] = {}
    for e in events:
        if e.name in instrs:
            dur[e.name] += e.dur_s / steps
            calls[e.name] += 1 / steps
            fastest[e.name] = min(fastest.get(e.name, math.inf), e.dur_s)
    rows = []
    for name, sec in dur.items():
        ins = instrs[name]
        callee = (attr(ins.attrs, "calls") or "").lstrip("%")
        body = mod.computations.get(callee, [ins])
        dot = next((i for i in body if i.opcode in ("dot", "convolution")), None)
        meta = re.search(r'op_name="([^"]+)"', (dot or ins).attrs) or next(
            (m for m in (re.search(r'op_name="([^"]+)"', i.attrs) for i in body) if m), None)
        k = costs.get(name)
        flops = (k.flops if k else 0.0) * calls[name]
        nbytes = (k.bytes if k else 0.0) * calls[name]
        rate = flops / sec if sec > 0 else 0.0
        rows.append({"name": name, "class": _kernel_class(name, dot is not None), "ms": sec * 1e3,
                     "min_ms": fastest[name] * 1e3, "calls": round(calls[name], 2), "gflop": flops / 1e9,
                     "gflop_per_s": rate / 1e9,
                     "gb_per_s": nbytes / sec / 1e9 if sec > 0 else 0.0,
                     "dot": _dot_text(dot) if dot is not None else None,
                     "op": "/".join(meta.group(1).split("/")[-2:]) if meta else "",
                     "async": bool(dot is not None and ceiling_flops and rate > 1.5 * ceiling_flops)})
    rows.sort(key=lambda r: -r["ms"])
    classes: dict[str, dict] = {}
    for r in rows:
        c = classes.setdefault(r["class"], {"ms": 0.0, "kernels": 0, "gflop": 0.0})
        c["ms"] += r["ms"]
        c["kernels"] += 1
        c["gflop"] += r["gflop"]
    timed_dots = [r for r in rows if r["class"] == "matmul" and not r["async"]]
    dot_ms = sum(r["ms"] for r in timed_dots)
    return {"steps": steps, "kernel_ms": sum(r["ms"] for r in rows), "kernels": rows[:top],
            "classes": dict(sorted(classes.items(), key=lambda kv: -kv[1]["ms"])),
            "matmul_rate": sum(r["gflop"] for r in timed_dots) * 1e9 / (dot_ms / 1e3) if dot_ms else None,
            "async_dots": sum(1 for r in rows if r["async"]),
            "note": "per-step kernel times from a jax.profiler trace, each kernel from its launch to its completion "
                    "mark; concurrent kernels overlap"}


def dot_floor(hlo_text: str, *, steps: int = 5, warmup: int = 5, ceiling_flops: float | None = None,
              progress=None) -> dict:
    """The time a compiled program's dots take on their own: a floor under its step time, whatever the rest costs.

    Every dot of the optimized HLO (workbench.cost.hlo.parse_dots: operand shapes, dimension numbers, executions per run)
    is reduced to its matrix-multiply sizes, batch B × (M×K)·(K×N), and compiled alone in the layout XLA needs no
    copy for ([B,]M,K)·([B,]K,N); after `warmup` calls, `steps` calls are traced with jax.profiler (profile_kernels)
    and each matmul kernel counts at its fastest call: no dispatch, no layout copies, no other kernel sharing the
    cores. Dots of the same sizes are timed once. Returns {'dot_s': seconds per program run, 'gflop', 'rate' (FLOP/s),
    'dots': one row per distinct size, longest total first, 'note'}. For a per-device program on simulated devices
    the host runs n_devices of these.
    """
    import collections

    import jax
    import jax.numpy as jnp


    groups: dict[tuple, list] = collections.OrderedDict()
    for d in parse_dots(hlo_text):
        free_l = [n for i, n in enumerate(d.lhs.dims) if i not in d.lhs_contracting + d.lhs_batch]
        free_r = [n for i, n in enumerate(d.rhs.dims) if i not in d.rhs_contracting + d.rhs_batch]
        bmkn = tuple(int(np.prod(x)) for x in ([d.lhs.dims[i] for i in d.lhs_batch], free_l,
                                                [d.lhs.dims[i] for i in d.lhs_contracting], free_r))
        key = (bmkn, d.lhs.dtype, d.rhs.dtype, d.out.dtype)
        g = groups.setdefault(key, [d, 0])
        g[1] += d.count
    rows = []
    dev = jax.devices()[0]
    for i, (((b, m, k, n), lt, rt, ot), (d, count)) in enumerate(groups.items()):
        what = (f"{b}×" if b > 1 else "") + f"({m}×{k})·({k}×{n}) {lt}"
        if progress:
            progress(i, len(groups), what)
        lead = (b,) if b > 1 else ()
        lhs = jax.ShapeDtypeStruct(lead + (m, k), jnp.dtype(HLO_TO_NUMPY.get(lt, "float32")))
        rhs = jax.ShapeDtypeStruct(lead + (k, n), jnp.dtype(HLO_TO_NUMPY.get(rt, "float32")))
        dims = (((len(lead) + 1,), (len(lead),)), ((0,), (0,)) if lead else ((), ()))
        out_dt = jnp.dtype(HLO_TO_NUMPY.get(ot, "float32"))
        fn = jax.jit(lambda a, c, dims=dims, out_dt=out_dt: jax.lax.dot_general(a, c, dims,
                                                                               preferred_element_type=out_dt))
        x, y = (jax.device_put(v, dev) for v in random_inputs((lhs, rhs), seed=i))
        compiled = fn.lower(x, y).compile()
        for _ in range(max(warmup - 1, 0)):
            _block(compiled(x, y))
        prof = profile_kernels(lambda _, c=compiled: c(x, y), compiled.as_text(), steps=steps,
                               ceiling_flops=ceiling_flops, top=50)
        mm = [r for r in prof["kernels"] if r["class"] == "matmul"]
        if mm and not any(r["async"] for r in mm):
            sec, how = sum(r["min_ms"] * r["calls"] for r in mm) / 1e3, "trace"
        else:  # an asynchronous Eigen dot shows only its dispatch in the trace: the program's wall clock instead
            sec, how = measure(compiled, x, y, warmup=1, repeats=max(steps, 5)).min_s, "wall"
        rows.append({"dot": what, "count": count, "ms_each": sec * 1e3, "ms_total": sec * 1e3 * count,
                     "gflop_per_s": d.flops / sec / 1e9 if sec > 0 else 0.0, "gflop_total": d.flops * count / 1e9,
                     "timed_by": how, "example": str(d)})
    rows.sort(key=lambda r: -r["ms_total"])
    dot_s = sum(r["ms_total"] for r in rows) / 1e3
    gflop = sum(r["gflop_total"] for r in rows)
    return {"dot_s": dot_s, "gflop": gflop, "rate": gflop * 1e9 / dot_s if dot_s else None, "dots": rows,
            "note": "each dot of the program as its matrix sizes, compiled alone in a copy-free layout and traced "
                    "(matmul kernels only: no dispatch, no layout copies, no other kernel sharing the cores), "
                    "times its executions per run"}
