"""Per-kernel truth: every kernel of a compiled program, its predicted time at its own roof beside its measured time
from a jax.profiler trace, joined by the HLO instruction name; errors per kernel class.

    table = kernel_table(compiled_or_hlo_text, step, spec, n_devices=8)   # step(i) runs the program once
    table.rows          # KernelRow per kernel: predicted_s, measured_s (its share of the wall clock), class, ...
    table.classes       # ClassError per class: predicted vs measured, signed error
    table.to_record()   # JSON-ready

Kernel classes (KERNEL_CLASSES): 'dot' (an unfused dot, or a fusion that is only a dot and layout ops), 'dot-fusion'
(a fusion with a dot and other arithmetic), 'elementwise/reduce', 'copy/transpose' (data movement without
arithmetic: copies, transposes, slices, in-place updates, broadcasts), 'collective', 'loop-control' (the kernels of
a while loop's condition).

Measured time. XLA:CPU's thunk executor records one trace event per kernel execution (args: hlo_op, device_ordinal,
run_id) around its launch, and an event 'end: <kernel>' at its completion: a kernel split over the intra-op thread
pool completes after its launch returns, so each kernel lasts from its launch to its completion mark
(events_from_trace). Kernels can run at once — several simulated devices share the host's cores, and the executor runs
independent kernels concurrently — so a kernel's own duration overstates what it cost the step. Each kernel is
charged its share of the wall clock instead: every instant of the trace is split evenly among the kernel events
running at that instant (`measured_s`; the raw duration sum is `measured_raw_s`). The shares of all kernels add up
to the time at least one kernel ran (`busy_s`); the rest of the traced step (`wall_s - busy_s`) is dispatch, loop
and host work. A `while`/`call`/`conditional` event spans the kernels it runs and is not charged itself. On a
simulated mesh a collective's event is mostly one device waiting for the others (which compute meanwhile on the
same cores): collectives are charged only the instants when no other kernel runs (`wall_shares`).

Predicted time: workbench.roofline.prediction.kernel_time (max of the kernel's compute at its dot's measured rate and its
bytes at the memory bandwidth; their sum for a kernel walking its rows in dependent passes on a CPU, roof_seconds)
× executions per run, collectives at workbench.partitioning's collective_time; on a
simulated mesh every device's kernels run on this host, so both sides add up over the devices.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re
import statistics
import time
from typing import Any, Callable

from partitioning.collectives import collective_time
from workbench.cost.hlo import (
    COLLECTIVE_KINDS,
    ELEMENTWISE_FLOP_OPS,
    Instr,
    Module,
    custom_call_target,
    parse_collectives,
    parse_kernels,
    parse_module,
)
from workbench.hardware.spec import HardwareSpec
from workbench.roofline.host import host_interconnect
from workbench.roofline.prediction import kernel_time

KERNEL_CLASSES = ("dot", "dot-fusion", "elementwise/reduce", "copy/transpose", "collective", "loop-control")
CONTROL_OPS = ("while", "call", "conditional")
LAYOUT_OPS = {"parameter", "constant", "bitcast", "copy", "transpose", "reshape", "broadcast", "get-tuple-element",
              "tuple", "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "reverse", "iota",
              "convert", "gather", "scatter"}


@dataclasses.dataclass(frozen=True, slots=True)
class KernelEvent:
    """One traced kernel execution (seconds on the trace's clock)."""

    name: str
    device: int
    run: str
    start_s: float
    dur_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class KernelTrace:
    """The kernel events of `steps` traced runs and the wall-clock time of each run (perf_counter around it)."""

    events: tuple[KernelEvent, ...]
    wall_s: tuple[float, ...]

    @property
    def steps(self) -> int:
        return len(self.wall_s)


class _Error:
    """predicted_s against measured_s for a row of the table, and the row as a record with its error."""

    __slots__ = ()

    @property
    def error(self) -> float | None:
        """predicted / measured − 1 (negative: the model is optimistic)."""
        return self.predicted_s / self.measured_s - 1 if self.measured_s else None

    def to_record(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["error"] = self.error
        return d


@dataclasses.dataclass(frozen=True, slots=True)
class KernelRow(_Error):
    """One kernel, per step (one run of the program), summed over the devices that run it on this host."""

    name: str
    kernel_class: str
    opcode: str  # the fusion kind (kLoop, kCustom, ...) or the unfused op
    executions: float  # per step, all devices (measured; the HLO count × devices when not traced)
    predicted_s: float
    measured_s: float | None  # its share of the wall clock (see the module docstring); None: never traced
    measured_raw_s: float | None  # the sum of its event durations
    flops: float  # per step, all devices
    dot_flops: float  # of `flops`, those of its dots
    bytes: float  # per step, all devices (in + out)
    roof: str  # compute | memory | comm
    what: str  # the dot's shapes, or the op_name it came from



@dataclasses.dataclass(frozen=True, slots=True)
class ClassError(_Error):
    kernel_class: str
    kernels: int
    predicted_s: float
    measured_s: float
    median_abs_error: float | None  # over its traced kernels, each |predicted / measured − 1|



@dataclasses.dataclass(frozen=True, slots=True)
class KernelTable:
    rows: tuple[KernelRow, ...]  # longest measured first
    classes: tuple[ClassError, ...]
    steps: int
    wall_s: float  # median traced step (wall clock)
    busy_s: float  # per step: time at least one kernel ran
    raw_kernel_s: float  # per step: the sum of all kernel event durations
    n_devices: int
    unmatched_events: int  # kernel events whose name is not an instruction of this program
    notes: tuple[str, ...] = ()

    @property
    def idle_s(self) -> float:
        """Per step: traced wall time with no kernel running (dispatch, argument handling, Python, host work)."""
        return max(self.wall_s - self.busy_s, 0.0)

    @property
    def concurrency(self) -> float:
        """Kernel-seconds per busy second: how many kernels ran at once on average."""
        return self.raw_kernel_s / self.busy_s if self.busy_s else 0.0

    def by_class(self) -> dict[str, ClassError]:
        return {c.kernel_class: c for c in self.classes}

    def to_record(self, top: int | None = 40) -> dict[str, Any]:
        return {"steps": self.steps, "wall_s": self.wall_s, "busy_s": self.busy_s, "idle_s": self.idle_s,
                "raw_kernel_s": self.raw_kernel_s, "concurrency": self.concurrency, "n_devices": self.n_devices,
                "unmatched_events": self.unmatched_events,
                "classes": {c.kernel_class: c.to_record() for c in self.classes},
                "kernels": [r.to_record() for r in (self.rows if top is None else self.rows[:top])],
                "notes": list(self.notes)}


# ------------------------------------------------------------------------------------------ trace
def trace_kernels(step: Callable[[int], Any], *, steps: int = 2, warmup: int = 1) -> KernelTrace:
    """Run step(i) `warmup` times, then trace `steps` runs with jax.profiler; the kernel events (those the thunk
    executor tags with `hlo_op`) and each traced run's wall-clock time."""
    raw, walls = trace_events(step, steps=steps, warmup=warmup)
    return KernelTrace(tuple(events_from_trace(raw)), tuple(walls))


def trace_events(step: Callable[[int], Any], *, steps: int = 2, warmup: int = 1) -> tuple[list[dict], list[float]]:
    """(the chrome-format trace events of `steps` traced runs of step(i) after `warmup` untraced ones, each traced
    run's wall-clock time): jax.profiler's own trace, unread."""
    import glob
    import gzip
    import json
    import shutil
    import tempfile

    import jax

    for i in range(max(warmup, 0)):
        jax.block_until_ready(step(i))
    logdir = tempfile.mkdtemp(prefix="workbench-trace-")
    walls = []
    try:
        jax.profiler.start_trace(logdir)
        try:
            for i in range(steps):
                t0 = time.perf_counter()
                jax.block_until_ready(step(warmup + i))
                walls.append(time.perf_counter() - t0)
        finally:
            jax.profiler.stop_trace()
        files = sorted(glob.glob(f"{logdir}/plugins/profile/*/*.trace.json.gz"))
        raw = []
        if files:
            with gzip.open(files[-1]) as f:
                raw = json.load(f).get("traceEvents", [])
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    return raw, walls


END_MARK = "end: "  # XLA:CPU's thunk executor names the event that marks a kernel's completion END_MARK + its name


def events_from_trace(raw: list[dict]) -> list[KernelEvent]:
    """Kernel events of a chrome-format trace: complete events whose args name an HLO op, each lasting until its
    completion mark. XLA:CPU's thunk executor records a kernel's event around its launch; a kernel it runs
    asynchronously (a copy or loop fusion split over the intra-op thread pool, whose partitions run after the launch
    returns) completes later, where the executor records an event named 'end: <kernel>'. In a `small` decode step
    the final copy of the KV cache spanned 0.26 ms from its launch and 1.9 ms to its mark: read from the launch
    alone, the copy looked 7× faster than it ran and the rest of its time looked like host overhead. Each kernel
    event is matched with the first unmatched mark of its name at or after its start (in time order per name)."""
    out = []
    devices = _device_tracks(raw)
    ends: dict[str, list[float]] = collections.defaultdict(list)
    for e in raw:
        name = str(e.get("name", ""))
        if name.startswith(END_MARK) and "ts" in e:
            ends[name[len(END_MARK):].strip()].append(float(e["ts"]) / 1e6)
    for v in ends.values():
        v.sort()
    starts: dict[str, list[int]] = collections.defaultdict(list)
    for e in raw:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args:
            continue
        if e.get("pid") in devices:  # an accelerator's kernel: named for its kernel (hlo_op names its command buffer)
            dev, name = devices[e["pid"]], str(e.get("name", ""))
        else:
            try:
                dev = int(args.get("device_ordinal", 0))
            except ValueError:
                dev = 0
            name = str(args["hlo_op"])
        starts[name].append(len(out))
        out.append(KernelEvent(name, dev, str(args.get("run_id", "")), float(e["ts"]) / 1e6,
                               float(e.get("dur", 0.0)) / 1e6))
    for name, idx in starts.items():
        marks = ends.get(name)
        if not marks:
            continue
        j = 0
        for i in sorted(idx, key=lambda i: out[i].start_s):
            ev = out[i]
            while j < len(marks) and marks[j] < ev.start_s:
                j += 1
            if j == len(marks):
                break
            if marks[j] - ev.start_s > ev.dur_s:
                out[i] = dataclasses.replace(ev, dur_s=marks[j] - ev.start_s)
            j += 1
    return out


def _device_tracks(raw: list[dict]) -> dict[Any, int]:
    """pid -> device ordinal of the trace's accelerator processes ('/device:GPU:0', ...). Their kernel events are the
    kernels the device ran, named as XLA:GPU named them (its fusion names with '.' written '_', or a library's
    kernel name for cuBLAS/cuDNN calls); their `hlo_op` names the CUDA graph (command buffer) that launched them."""
    out = {}
    for e in raw:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            m = re.match(r"/device:(GPU|TPU):(\d+)", str((e.get("args") or {}).get("name", "")))
            if m:
                out[e.get("pid")] = int(m.group(2))
    return out


# kernels a library launches for a custom call (cuBLAS's nvjet / xmma / cutlass gemms, cuDNN's attention and
# convolution kernels): their names are no HLO instruction's
LIBRARY_KERNEL = re.compile(r"^(nvjet|sm\d+_xmma|cutlass|cudnn|xmma|ampere_|hopper_|sm\d+_|cublas|gemv|gemmk|"
                            r"flash|fmha|void cutlass|void cudnn)", re.I)


LIBRARY_ROW = "library gemms (cuBLAS/cuDNN)"


def _kernel_of(name: str | None, instrs: dict) -> str | None:
    """The row a traced instruction's time goes to: the first of the call sites that share its kernel."""
    if name is None:
        return None
    lead = _dedup_name(instrs[name][1])
    return lead if lead in instrs else name


def _dedup_name(ins: Instr) -> str:
    """The kernel an instruction runs as: XLA:GPU's `deduplicated_name` when it shares another's, else its own."""
    m = re.search(r'deduplicated_name="([^"]+)"', ins.attrs)
    return m.group(1) if m else ins.name


def kernel_names(instrs: dict) -> dict[str, str]:
    """Traced kernel name -> HLO instruction: each name itself, and as XLA:GPU writes it in kernel names, '.' and
    '-' as '_' ('loop_add_fusion_20' is %loop_add_fusion.20)."""
    out = {re.sub(r"[.\-]", "_", n): n for n in instrs}
    out.update({n: n for n in instrs})
    return out


def wall_shares(events: list[KernelEvent], waits: list[bool] | None = None) -> tuple[list[float], float]:
    """(each event's share of the wall clock, the time at least one event ran), by a sweep over start and end
    points: every instant is split evenly among the events running then. Events flagged in `waits` (collectives on
    simulated devices: mostly a device waiting at the rendezvous for the others, which are computing meanwhile) are
    charged only for instants when no other kind of kernel runs — the time collectives were not hidden."""
    waits = waits or [False] * len(events)
    pts = []
    for i, e in enumerate(events):
        pts.append((e.start_s, 1, i))
        pts.append((e.start_s + e.dur_s, 0, i))  # ends sort before starts at the same instant
    pts.sort()
    share = [0.0] * len(events)
    work: set[int] = set()
    wait: set[int] = set()
    busy = 0.0
    last = None
    for t, kind, i in pts:
        if last is not None and (work or wait) and t > last:
            dt = t - last
            busy += dt
            charged = work or wait
            each = dt / len(charged)
            for j in charged:
                share[j] += each
        last = t
        target = wait if waits[i] else work
        if kind == 1:
            target.add(i)
        else:
            target.discard(i)
    return share, busy


# ------------------------------------------------------------------------------------------ classes
def _callee(ins: Instr) -> str:
    m = re.search(r"\bcalls=%?([\w.\-]+)", ins.attrs)
    return m.group(1) if m else ""


def _condition_computations(mod: Module) -> set[str]:
    """Computations that run as a while loop's condition (and what they call)."""
    out = set()
    for body in mod.computations.values():
        for ins in body:
            if ins.opcode == "while":
                m = re.search(r"\bcondition=%?([\w.\-]+)", ins.attrs)
                if m:
                    out.add(m.group(1))
    return out


def kernel_class(ins: Instr, mod: Module, in_condition: bool = False) -> str:
    """The class of one kernel instruction (see KERNEL_CLASSES)."""
    op = ins.opcode
    if in_condition:
        return "loop-control"
    if op.startswith(COLLECTIVE_KINDS):
        return "collective"
    if op in ("dot", "convolution"):
        return "dot"
    if op == "custom-call":  # a library's matmul kernel (cuBLAS gemm, cuDNN attention or convolution) is a dot
        target = custom_call_target(ins.attrs)
        if target.startswith(("__cublas$", "__cudnn$fmha", "__cudnn$conv")):
            return "dot"
    if op == "fusion":
        body = mod.computations.get(_callee(ins), [])
        if any(i.opcode.startswith(COLLECTIVE_KINDS) for i in body) or "all-reduce-scatter" in _callee(ins):
            return "collective"
        if any(i.opcode in ("dot", "convolution") for i in body):
            rest = [i for i in body if i.opcode not in ("dot", "convolution") and i.opcode not in LAYOUT_OPS]
            return "dot-fusion" if rest else "dot"
        if any(i.opcode in ELEMENTWISE_FLOP_OPS or i.opcode in ("reduce", "reduce-window", "map", "sort")
               for i in body):
            return "elementwise/reduce"
        return "copy/transpose"
    if op in LAYOUT_OPS:
        return "copy/transpose"
    return "elementwise/reduce"


def _what(ins: Instr, mod: Module) -> str:
    body = mod.computations.get(_callee(ins), []) if ins.opcode == "fusion" else [ins]
    dot = next((i for i in body if i.opcode in ("dot", "convolution")), None)
    if dot is not None:
        dims = re.findall(r"(lhs|rhs)_(contracting|batch)_dims=(\{[^}]*\})", dot.attrs)
        return " ".join([dot.type_str.split("{")[0]] + [f"{s}_{k[0]}={v}" for s, k, v in dims])
    m = re.search(r'op_name="([^"]+)"', ins.attrs) or next(
        (mm for mm in (re.search(r'op_name="([^"]+)"', i.attrs) for i in body) if mm), None)
    return "/".join(m.group(1).split("/")[-2:]) if m else ""


# ------------------------------------------------------------------------------------------ the join
@dataclasses.dataclass
class _Traced:
    """A trace's time per step by HLO instruction: wall-clock shares, raw durations, executions; what matched."""

    shares: dict[str, float] = dataclasses.field(default_factory=collections.Counter)
    raw: dict[str, float] = dataclasses.field(default_factory=collections.Counter)
    execs: dict[str, float] = dataclasses.field(default_factory=collections.Counter)
    unmatched: int = 0
    busy: float = 0.0
    raw_total: float = 0.0
    steps: int = 1
    library: int = 0  # library kernels (cuBLAS, cuDNN) traced: their time goes to the custom calls that launch them


def _attribute(trace: KernelTrace | None, instrs: dict, mod: Module, simulated_mesh: bool) -> _Traced:
    """Each traced kernel event charged to its HLO instruction (or the library row), per step."""
    t = _Traced()
    if trace is None:
        return t
    t.steps = max(trace.steps, 1)
    names_of = kernel_names(instrs)
    evs = [dataclasses.replace(e, name=_kernel_of(names_of.get(e.name), instrs) or e.name) for e in trace.events]
    evs = [e for e in evs if not (e.name in instrs and instrs[e.name][1].opcode in CONTROL_OPS)]
    waits = [simulated_mesh and e.name in instrs and kernel_class(instrs[e.name][1], mod) == "collective"
             for e in evs]
    sh, busy = wall_shares(evs, waits)
    for e, s in zip(evs, sh):
        if e.name not in instrs:
            if not LIBRARY_KERNEL.match(e.name):
                t.unmatched += 1
                continue
            t.library += 1
            e = dataclasses.replace(e, name=LIBRARY_ROW)
        t.shares[e.name] += s / t.steps
        t.raw[e.name] += e.dur_s / t.steps
        t.execs[e.name] += 1 / t.steps
        t.raw_total += e.dur_s / t.steps
    t.busy = busy / t.steps
    return t


@dataclasses.dataclass(frozen=True)
class _Pricing:
    """How the join prices a kernel: the chip, the dtype, the memory bandwidth, devices sharing this host."""

    spec: HardwareSpec
    dtype: Any
    bw: float
    mult: int
    interconnect: Any
    program_bytes: float = 0.0  # the program's footprint per device (prediction.kernel_time)

    def kernel(self, k, others=()) -> tuple[float, float, float, float, str, int]:
        """(predicted s, flops, dot flops, bytes, roof, count) of kernel k and the other call sites of the same
        kernel, over every device."""
        mult = self.mult
        kt = kernel_time(k, self.spec, dtype=self.dtype, memory_bw=self.bw, sharers=mult,
                         program_bytes=self.program_bytes)
        pred = kt.seconds * k.count * mult
        fl, nb, roof, count = k.flops * k.count * mult, k.bytes * k.count * mult, kt.roof, k.count
        dfl = k.dot_flops * k.count * mult
        for km in others:
            pred += kernel_time(km, self.spec, dtype=self.dtype, memory_bw=self.bw, sharers=mult,
                                program_bytes=self.program_bytes).seconds \
                * km.count * mult
            fl, nb, dfl = fl + km.flops * km.count * mult, nb + km.bytes * km.count * mult, \
                dfl + km.dot_flops * km.count * mult
            count += km.count
        return pred, fl, dfl, nb, roof, count

    def collective(self, c) -> tuple[float, float, float, float, str, int]:
        pred = collective_time(c.kind, c.payload_bytes, c.group_size, self.interconnect,
                               torus_axes=c.torus_axes or 1, operands=c.operands,
                               bidirectional=c.bidirectional) * c.count * self.mult
        return pred, 0.0, 0.0, c.payload_bytes * c.count * self.mult, "comm", c.count


def _dedup_groups(names: list[str], instrs: dict) -> dict[str, list[str]]:
    """XLA:GPU launches identical fusions under one kernel (the instructions' `deduplicated_name`): the trace names
    that kernel for every call site, so a group of call sites is one row, priced as the sum of its members."""
    members: dict[str, list[str]] = collections.defaultdict(list)
    for name in names:
        lead = _dedup_name(instrs[name][1])
        if lead != name and lead in instrs:
            members[lead].append(name)
    return members


def _rows(names: list[str], instrs: dict, mod: Module, costs: dict, colls: dict, t: _Traced, traced_run: bool,
          p: _Pricing) -> list[KernelRow]:
    """One KernelRow per kernel (a dedup group is one row), and the library row when library kernels were traced."""
    members = _dedup_groups(names, instrs)
    grouped = {m for ms in members.values() for m in ms}
    cond = _condition_computations(mod)
    lib = {"pred": 0.0, "fl": 0.0, "dfl": 0.0, "nb": 0.0, "count": 0}
    rows = []
    for name in dict.fromkeys(names):
        if name in grouped:
            continue
        comp, ins = instrs[name]
        if t.library and ins.opcode == "custom-call" and name in costs and name not in t.shares:
            k = costs[name]  # a library call whose kernels were traced under their own names: priced as one row
            kt = kernel_time(k, p.spec, dtype=p.dtype, memory_bw=p.bw, sharers=p.mult,
                             program_bytes=p.program_bytes)
            for key, v in (("pred", kt.seconds * k.count * p.mult), ("fl", k.flops * k.count * p.mult),
                           ("dfl", k.dot_flops * k.count * p.mult), ("nb", k.bytes * k.count * p.mult),
                           ("count", k.count * p.mult)):
                lib[key] += v
            continue
        k, c = costs.get(name), colls.get(name)
        if c is not None:
            pred, fl, dfl, nb, roof, count = p.collective(c)
        elif k is not None:
            pred, fl, dfl, nb, roof, count = p.kernel(k, [costs[m] for m in members.get(name, ()) if m in costs])
        else:  # traced but not priced (an op the HLO reader gives no cost)
            pred, fl, dfl, nb, roof, count = 0.0, 0.0, 0.0, 0.0, "none", 1
        traced = name in t.shares
        untraced = 0.0 if traced_run else None
        rows.append(KernelRow(name, kernel_class(ins, mod, in_condition=comp in cond),
                              (re.search(r"kind=(k\w+)", ins.attrs) or [None, ins.opcode])[1]
                              if ins.opcode == "fusion" else ins.opcode,
                              t.execs[name] if traced else count * p.mult, pred,
                              t.shares[name] if traced else untraced, t.raw[name] if traced else untraced,
                              fl, dfl, nb, roof, _what(ins, mod)))
    if t.library:
        rows.append(KernelRow(LIBRARY_ROW, "dot", "custom-call", t.execs[LIBRARY_ROW], lib["pred"],
                              t.shares[LIBRARY_ROW], t.raw[LIBRARY_ROW], lib["fl"], lib["dfl"], lib["nb"], "compute",
                              f"{lib['count']} library calls (cuBLAS/cuDNN), their kernels traced by library name"))
    return rows


def _class_errors(rows: list[KernelRow]) -> list[ClassError]:
    """Predicted against measured per kernel class, in KERNEL_CLASSES order; classes without kernels left out."""
    classes = []
    for cls in KERNEL_CLASSES:
        rs = [r for r in rows if r.kernel_class == cls]
        if not rs:
            continue
        errs = [abs(r.error) for r in rs if r.error is not None and r.measured_s and r.measured_s > 0]
        classes.append(ClassError(cls, len(rs), sum(r.predicted_s for r in rs),
                                  sum(r.measured_s or 0.0 for r in rs), statistics.median(errs) if errs else None))
    return classes


def join(trace: KernelTrace | None, hlo_text: str, spec: HardwareSpec, *, n_devices: int = 1, mesh=None,
         dtype="float32", memory_bw: float | None = None, simulated_mesh: bool | None = None,
         program_bytes: float = 0.0) -> KernelTable:
    """Join a kernel trace with the program's HLO: one KernelRow per kernel (traced or not), ClassError per class.

    trace None: predictions only (measured fields None). memory_bw: the bandwidth kernels are priced at (default:
    the spec's; pass workbench.roofline.prediction.memory_bw's choice to match a Prediction); program_bytes: the
    program's footprint per device (CostReport.peak_memory_bytes, as a Prediction prices with)."""
    mod = parse_module(hlo_text)
    instrs = {i.name: (comp, i) for comp, body in mod.computations.items() for i in body}
    costs = {k.name: k for k in parse_kernels(hlo_text, mod)}
    if simulated_mesh is None:
        simulated_mesh = spec.kind == "cpu" and n_devices > 1
    bw = memory_bw or spec.hbm_bw
    p = _Pricing(spec, dtype, bw, n_devices if simulated_mesh else 1,
                 host_interconnect(spec, bw) if simulated_mesh else spec.interconnect, program_bytes)
    colls = {c.name: c for c in parse_collectives(hlo_text, mesh=mesh, n_devices=n_devices, mod=mod)}
    t = _attribute(trace, instrs, mod, simulated_mesh)
    names = [n for n in costs] + [n for n in colls if n not in costs]
    names += [n for n in t.shares if n not in costs and n not in colls and n != LIBRARY_ROW]
    rows = _rows(names, instrs, mod, costs, colls, t, trace is not None, p)
    rows.sort(key=lambda r: -(r.measured_s if r.measured_s is not None else r.predicted_s))
    classes = _class_errors(rows)
    wall = statistics.median(trace.wall_s) if trace is not None and trace.wall_s else 0.0
    notes = []
    if trace is not None and t.busy > wall > 0:
        notes.append(f"kernels ran {t.busy:.3g}s per step against a {wall:.3g}s traced wall clock: the trace clock "
                     "and the timer disagree")
    if simulated_mesh:
        notes.append(f"{n_devices} simulated devices share this host: predicted and measured times add up over them")
    return KernelTable(tuple(rows), tuple(classes), t.steps, wall, t.busy, t.raw_total, n_devices, t.unmatched,
                       tuple(notes))


def kernel_table(program, step: Callable[[int], Any], spec: HardwareSpec, *, n_devices: int = 1, mesh=None,
                 dtype="float32", steps: int = 2, warmup: int = 1, memory_bw: float | None = None,
                 program_bytes: float = 0.0) -> KernelTable:
    """The per-kernel join for one program: `program` is a jax Compiled or its optimized HLO text, step(i) runs it
    once (feeding its own state forward) and returns what to block on."""
    text = program.as_text() if hasattr(program, "as_text") else str(program)
    trace = trace_kernels(step, steps=steps, warmup=warmup)
    return join(trace, text, spec, n_devices=n_devices, mesh=mesh, dtype=dtype, memory_bw=memory_bw,
                program_bytes=program_bytes)


def class_errors_text(table: KernelTable) -> str:
    """One line per class: predicted vs measured ms per step and the signed error."""
    lines = []
    for c in table.classes:
        e = c.error
        lines.append(f"{c.kernel_class:20s} {c.kernels:5d} kernels  predicted {c.predicted_s * 1e3:9.3f} ms  "
                     f"measured {c.measured_s * 1e3:9.3f} ms  "
                     + (f"error {e:+.0%}" if e is not None and math.isfinite(e) else "error n/a"))
    return "\n".join(lines)
