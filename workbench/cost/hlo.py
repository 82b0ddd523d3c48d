"""Read the optimized HLO text of a compiled program: its kernels (fusions and unfused ops) and its collectives.

Counts are per device (the SPMD-partitioned module is the program one device runs). Instructions inside a `while`
body are multiplied by the loop's known trip count (scanned layers), those in called computations by their callers.
Per-fusion flops are estimated from the fused computation's ops: dot = 2·|out|·|contracting|, elementwise = |out|,
transcendentals (exp, log, tanh, logistic, rsqrt, sqrt, power, sin, cos, erf, ...) counted apart. Custom calls are
priced where their work can be read (price_custom_call: a declared cost estimate, cuBLAS gemms, cuDNN attention and
convolutions, calls known to do no arithmetic); the others are listed (custom_calls), never counted as silently zero.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import re

import numpy as np

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
               "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1,
               "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "token": 0, "opaque": 0}
HLO_TO_NUMPY = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64", "s32": "int32",
                "s8": "int8", "u8": "uint8", "pred": "bool", "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2",
                "s64": "int64", "u32": "uint32", "f4e2m1fn": "float4_e2m1fn"}
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                    "collective-permute", "collective-broadcast")
TRANSCENDENTAL_OPS = {"exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic", "rsqrt",
                      "sqrt", "cbrt", "power", "sine", "cosine", "tan", "atan2", "erf"}
NO_COST_OPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
               "replica-id", "iota", "opt-barrier", "add-dependency"}
ELEMENTWISE_FLOP_OPS = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "compare",
                        "select", "clamp", "exponential", "log", "tanh", "logistic", "rsqrt", "sqrt", "power",
                        "sine", "cosine", "erf", "exponential-minus-one", "log-plus-one", "floor", "ceil",
                        "round-nearest-even", "sign", "and", "or", "xor", "not", "remainder", "atan2", "cbrt"}

_SHAPE_RE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    dtype: str
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        return int(np.prod(self.dims)) if self.dims else 1

    @property
    def bytes(self) -> float:
        return self.elements * DTYPE_BYTES.get(self.dtype, 4)

    def __str__(self):
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


def parse_shapes(text: str) -> list[Shape]:
    """All array shapes in a type string (a tuple gives several)."""
    out = []
    for dt, dims in _SHAPE_RE.findall(text):
        if dt in DTYPE_BYTES:
            out.append(Shape(dt, tuple(int(d) for d in dims.split(",") if d)))
    return out


_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")


def hbm_bytes(type_str: str) -> float:
    """Bytes of a type's arrays that live in device memory: an array whose layout names a memory space other than
    0 (libtpu's `S(1)`: the on-chip VMEM it prefetches weights into) costs no HBM traffic to write or read."""
    return float(sum(_array_bytes(a) for a in _ARRAY_RE.findall(type_str) if not (a[2] and re.search(r"S\([1-9]", a[2]))))


@dataclasses.dataclass
class Instr:
    name: str
    type_str: str
    opcode: str
    operands: list[str]
    attrs: str
    is_root: bool
    raw_operands: str = ""

    @property
    def shapes(self) -> list[Shape]:
        return parse_shapes(self.type_str)

    @property
    def out_bytes(self) -> float:
        return sum(s.bytes for s in self.shapes)


def _match_paren(s: str, i: int) -> int:
    """Index just past the bracket group that opens at s[i]."""
    open_c = s[i]
    close_c = {"(": ")", "{": "}", "[": "]"}[open_c]
    depth = 0
    for j in range(i, len(s)):
        if s[j] == open_c:
            depth += 1
        elif s[j] == close_c:
            depth -= 1
            if depth == 0:
                return j + 1
    return len(s)


_INSTR_HEAD = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR_HEAD.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        j = _match_paren(rest, 0)
        type_str, rest = rest[:j], rest[j:].lstrip()
    else:
        sp = rest.find(" ")
        if sp < 0:
            return None
        type_str, rest = rest[:sp], rest[sp + 1:]
    k = rest.find("(")
    if k < 0:
        return None
    opcode = rest[:k].strip()
    j = _match_paren(rest, k)
    operand_str = rest[k + 1:j - 1]
    operands = re.findall(r"%([\w.\-]+)", operand_str)
    if opcode == "fusion-start":  # an asynchronous fusion is the fusion it calls (below)
        opcode, type_str = "fusion", _async_result_type(type_str)
    return Instr(m.group(2), type_str, opcode, operands, rest[j:], bool(m.group(1)), operand_str)


def _tuple_elements(type_str: str) -> list[str]:
    """The top-level elements of a tuple type '(a, (b, c), d)'; [type_str] for an array type."""
    s = type_str.strip()
    if not s.startswith("("):
        return [s]
    out, depth, start = [], 0, 1
    for i, c in enumerate(s[1:-1], 1):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(s[start:i].strip())
            start = i + 1
    out.append(s[start:-1].strip())
    return out


def _async_result_type(type_str: str) -> str:
    """The result of an asynchronous op's start, whose type is ((operands), result, context): XLA:GPU runs
    dynamic-slice and dynamic-update-slice fusions on a second stream as fusion-start / fusion-done pairs. Read as
    the plain fusion with that result, the in-place update into a stacked buffer costs its slice (as any fusion's
    does), not the buffer, its operands again and the context."""
    parts = _tuple_elements(type_str)
    return parts[1] if len(parts) == 3 else type_str


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Instr]]
    entry: str

    def by_name(self) -> dict[str, Instr]:
        return {i.name: i for instrs in self.computations.values() for i in instrs}


def _open_braces(s: str) -> int:
    """'{' minus '}' outside double-quoted strings (a Triton call's serialized IR holds unbalanced braces)."""
    depth, i, n = 0, 0, len(s)
    while i < n:
        c = s[i]
        if c == '"':
            i += 1
            while i < n and s[i] != '"':
                i += 2 if s[i] == "\\" else 1
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        i += 1
    return depth


def parse_module(text: str) -> Module:
    comps: dict[str, list[Instr]] = {}
    entry = ""
    cur = None
    pending = ""  # an instruction whose attributes run over several lines (a Pallas kernel's frontend attributes)
    for line in text.splitlines():
        s = line.strip()
        if pending:
            pending += "\n" + line
            if _open_braces(pending) <= 0:
                s, pending = pending, ""
            else:
                continue
        elif cur is not None and " = " in s and s.count("{") != s.count("}") and _open_braces(s) > 0:
            pending = s
            continue
        if not s or s.startswith("//"):
            continue
        if s.endswith("{") and ("->" in s or s.startswith("ENTRY") or s.startswith("%")) and " = " not in s.split("(")[0]:
            is_entry = s.startswith("ENTRY")
            name = s.split()[1] if is_entry else s.split()[0]
            name = name.lstrip("%").split("(")[0]
            cur = name
            comps[cur] = []
            if is_entry:
                entry = cur
            continue
        if s == "}":
            cur = None
            continue
        if cur is not None:
            ins = _parse_instr(s)
            if ins:
                comps[cur].append(ins)
    return Module(comps, entry)


def attr(attrs: str, key: str) -> str | None:
    """The value of `key=` in an HLO instruction's attribute text (a balanced {...} or one token), or None."""
    m = re.search(rf"\b{key}=", attrs)
    if not m:
        return None
    i = m.end()
    if key == "replica_groups" and attrs.startswith("mesh[", i):
        mm = _MESH_GROUPS.match(attrs, i)
        return mm.group(0) if mm else None
    if key == "replica_groups" and attrs.startswith("[", i):
        mm = re.compile(r"\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?").match(attrs, i)
        return mm.group(0) if mm else None
    if i < len(attrs) and attrs[i] in "{[(":
        return attrs[i:_match_paren(attrs, i)]
    m2 = re.match(r"[^,\s]+", attrs[i:])
    return m2.group(0) if m2 else None


def _trip_count(attrs: str, mod: "Module | None" = None, init: dict[str, Instr] | None = None,
                operand: str | None = None) -> int:
    """A while loop's trip count: XLA's `known_trip_count` backend config (XLA:CPU/GPU), else read from the loop
    (libtpu's optimized HLO carries none): the condition `compare(get-tuple-element(param, k), constant(N))`,
    the counter's step from the body (element k of its root tuple, `add(get-tuple-element(param, k),
    constant(s))`; 1 when it is not of that form) and its start from the loop's initial tuple (the caller's
    instructions `init`, the while's operand `operand`; 0 when it is not a constant). A windowed einsum's loop
    unrolled by two steps its counter by 2: direction LT runs ceil((N − start) / step) times, LE one more when
    the last value lands on N. 1 when nothing says."""
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', attrs)
    if m:
        return int(m.group(1))
    if mod is not None:
        n = _trip_count_from_loop(mod, (attr(attrs, "condition") or "").lstrip("%"),
                                  (attr(attrs, "body") or "").lstrip("%"), init or {}, operand)
        if n:
            return n
    return 1


def _constant_int(ins: Instr | None) -> int | None:
    if ins is None or ins.opcode != "constant":
        return None
    mm = re.match(r"\s*(-?\d+)", ins.raw_operands)
    return int(mm.group(1)) if mm else None


def _tuple_index(ins: Instr) -> int | None:
    mm = re.search(r"index=(\d+)", ins.attrs)
    return int(mm.group(1)) if mm else None


def _through_copies(named: dict[str, Instr], ins: Instr | None) -> Instr | None:
    """The instruction a chain of copies and bitcasts starts from (libtpu copies a loop counter into scalar memory
    before it adds the step)."""
    while ins is not None and ins.opcode in ("copy", "bitcast") and len(ins.operands) == 1:
        ins = named.get(ins.operands[0])
    return ins


def _counter_step(mod: "Module", body: str, k: int) -> int:
    """The constant the loop body adds to tuple element k (1 when it is not `add(gte(param, k), constant)`, the
    element read through copies and bitcasts)."""
    instrs = mod.computations.get(body, [])
    root = next((i for i in instrs if i.is_root), None)
    if root is None or root.opcode != "tuple" or k >= len(root.operands):
        return 1
    named = {i.name: i for i in instrs}
    nxt = named.get(root.operands[k])
    if nxt is None or nxt.opcode != "add" or len(nxt.operands) != 2:
        return 1
    x, y = (_through_copies(named, named.get(o)) for o in nxt.operands)
    if _constant_int(x) is not None:
        x, y = y, x
    step = _constant_int(y)
    if x is None or x.opcode != "get-tuple-element" or _tuple_index(x) != k or not step or step < 1:
        return 1
    return step


def _counter_start(init: dict[str, Instr], operand: str | None, k: int) -> int:
    """Element k of the loop's initial tuple when it is a constant, else 0."""
    tup = init.get(operand or "")
    if tup is None or tup.opcode != "tuple" or k >= len(tup.operands):
        return 0
    v = _constant_int(_through_copies(init, init.get(tup.operands[k])))
    return v if v is not None else 0


def _trip_count_from_loop(mod: "Module", cond: str, body: str, init: dict[str, Instr],
                          operand: str | None) -> int | None:
    instrs = mod.computations.get(cond, [])
    root = next((i for i in instrs if i.is_root), None)
    if root is None or root.opcode != "compare" or len(root.operands) != 2:
        return None
    named = {i.name: i for i in instrs}
    direction = attr(root.attrs, "direction")
    a, b = (_through_copies(named, named.get(o)) for o in root.operands)
    if a is None or b is None:
        return None
    if a.opcode == "constant" and b.opcode == "get-tuple-element":  # N > i
        a, b = b, a
        direction = {"GT": "LT", "GE": "LE"}.get(direction, direction)
    n = _constant_int(b)
    if a.opcode != "get-tuple-element" or n is None:
        return None
    k = _tuple_index(a)
    step, start = (1, 0) if k is None else (_counter_step(mod, body, k), _counter_start(init, operand, k))
    if direction == "LT":
        return max(-(-(n - start) // step), 0)
    if direction == "LE":
        return max((n - start) // step + 1, 0)
    return None


def _multiplicities(mod: Module) -> dict[str, int]:
    """How many times each (non-fused) computation runs per program execution."""
    mult = {mod.entry: 1}
    order = [mod.entry]
    seen = set()
    while order:
        c = order.pop(0)
        if c in seen:
            continue
        seen.add(c)
        instrs = mod.computations.get(c, [])
        named = None
        for ins in instrs:
            if ins.opcode == "while":
                named = named if named is not None else {i.name: i for i in instrs}
                n = _trip_count(ins.attrs, mod, named, ins.operands[0] if ins.operands else None)
                for key in ("body", "condition"):
                    callee = (attr(ins.attrs, key) or "").lstrip("%")
                    if callee in mod.computations:
                        mult[callee] = mult.get(callee, 0) + mult[c] * n
                        order.append(callee)
            elif ins.opcode in ("call", "conditional", "async-start"):
                for key in ("to_apply", "calls", "branch_computations", "true_computation", "false_computation"):
                    v = attr(ins.attrs, key)
                    if not v:
                        continue
                    for callee in re.findall(r"%?([\w.\-]+)", v):
                        if callee in mod.computations:
                            mult[callee] = mult.get(callee, 0) + mult[c]
                            order.append(callee)
    return mult


@dataclasses.dataclass(frozen=True, slots=True)
class KernelCost:
    """One kernel of the per-device program: a fusion or an unfused op (per execution; `count` executions)."""

    name: str
    kind: str  # kLoop | kInput | kOutput | kCustom | the opcode of an unfused op
    output_shape: str
    bytes_in: float
    bytes_out: float
    flops: float
    transcendentals: float
    count: int = 1
    dot_flops: float = 0.0  # of `flops`, those in dots/convolutions
    dot_size: float = 0.0  # cube root of batch·m·n·k of the largest dot (its whole work); 0 without dots
    ops: tuple[tuple[str, int], ...] = ()  # the HLO ops inside, count by opcode (an unfused op: itself)
    library: str = ""  # a custom fusion's library kind from its backend config ('__ynn_fusion', ...), a custom call's
    # target ('__cublas$lt$matmul', ...); else ''
    reduce_elements: float = 0.0  # elements its reductions consume (the reduced operands' sizes)
    convert_elements: float = 0.0  # elements it converts between float32 and a narrower float (bf16, f16, fp8)
    # a reduction whose result the same kernel consumes again over the rows it reduced (softmax: max, then exp and
    # sum, then divide, all in one fusion): the kernel walks each row in dependent passes
    dependent_passes: bool = False
    # elements it moves through a strided transpose (a transpose or copy whose output's contiguous dimension is not
    # its input's: each element read is a different cache line's), in a kernel without dots (a dot library packs its
    # operands itself)
    transpose_elements: float = 0.0
    # bytes of the whole arrays it touches (its operands and its output, unsliced: a slice of a stacked array or an
    # in-place update of one keeps the stacked array's lines in play); 0 where unknown
    footprint: float = 0.0
    # bytes it moves over the host link per execution: to the host's memory (an offloaded activation's copy or
    # in-place write into a host buffer, memory space S(5)) and back from it
    host_out: float = 0.0
    host_in: float = 0.0
    # the rows of its largest dot where they are its smaller free side (a decode step's matrix-vector-like products,
    # one row per sequence); 0 otherwise and without dots (dot_rows; pricing.arithmetic_seconds)
    dot_rows: float = 0.0
    # of bytes_in, those it reads from the program's own parameters (arrays that live from one call to the next:
    # weights, a cache, optimizer state) where the entry computation hands them to it directly (through bitcasts);
    # 0 inside loops and called computations. Such a read's reuse distance is the whole program's footprint.
    param_bytes: float = 0.0
    # of reduce_elements, those whose operand the kernel computes itself (a sum over (x − mean)², over exp(x − max)),
    # not an array it reads as it is: a library fusion (XLA:CPU's YNN kernels) writes such an operand into a buffer
    # in a pass of its own before it reduces it (Measured.library_pass_per_s)
    produced_reduce_elements: float = 0.0

    @property
    def bytes(self) -> float:
        return self.bytes_in + self.bytes_out

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class CollectiveOp:
    """One collective of the per-device program. payload_bytes: the full array the collective acts on within one
    group (all-gather: the gathered result; reduce-scatter: the input before scattering; all-reduce, all-to-all,
    collective-permute: the operand)."""

    name: str
    kind: str  # one of COLLECTIVE_KINDS
    dtype: str
    payload_bytes: float
    group_size: int
    n_groups: int
    is_async: bool
    count: int = 1
    groups: tuple[tuple[int, ...], ...] = ()
    mesh_axes: tuple[str, ...] = ()
    # arrays it acts on: a combined (tuple) collective carries several; XLA:CPU's in-process all-reduce meets once
    # per array, so on simulated devices each costs a rendezvous (partitioning.collectives.collective_time)
    operands: int = 1
    # a collective-permute in flight together with one whose pairs are its own reversed (a bidirectional ring step,
    # as libtpu's collective matmuls send one chunk each way): on a torus the two use opposite links at once
    bidirectional: bool = False
    # torus dimensions its first group spans (TPU device coordinates); 0 when the devices carry none
    torus_axes: int = 0


def torus_axes_of_group(group, mesh) -> int:
    """Torus dimensions one replica group spans: its members' device coordinates (partition ids are positions in
    the mesh's flat device order) differ along that many dimensions; 0 without a mesh or coordinates."""
    if mesh is None or not group:
        return 0
    flat = mesh.devices.flat  # indexed in place: this runs for every collective of a program
    try:
        coords = [tuple(flat[i].coords) for i in group]
    except (AttributeError, IndexError, TypeError):  # ids that are not positions, or devices without coords
        return 0
    return sum(1 for dim in zip(*coords) if len(set(dim)) > 1)


def _dims(attrs: str, key: str) -> tuple[int, ...]:
    """The integers of a dimension-list attribute (lhs_contracting_dims={1,2} -> (1, 2)); () when absent."""
    return tuple(int(d) for d in re.findall(r"\d+", attr(attrs, key) or ""))


# float types narrower than float32 (bf16, f16, the fp8 and fp4 formats)
NARROW_FLOATS = {d for d, b in DTYPE_BYTES.items() if d.startswith(("f", "bf")) and 0 < b < 4}


def _computation_cost(instrs: list[Instr], shapes: dict[str, Shape], mod: "Module | None" = None,
                      depth: int = 0) -> tuple[float, float, float, float, float, float]:
    """(flops, transcendentals, dot flops, size of the largest dot, elements reduced, elements converted between
    float32 and a narrower float) of a computation's ops. A dot's size is the cube root of m·n·k per batch element:
    what decides how close a matmul library gets to peak. The last two are the work of the kernel forms whose
    throughput, not their bytes, bounds them on a CPU (a reduction's dependent adds; a bf16 <-> float32 conversion
    emulated with integer ops where the ISA has none). With `mod`, fusions nested inside the computation (libtpu
    nests convolution fusions in output fusions) are counted too."""
    flops = trans = dot_flops = dot_size = red = conv = 0.0
    for ins in instrs:
        if ins.opcode == "fusion" and mod is not None and depth < 4:
            f, t, df, ds, r, c = _computation_cost(mod.computations.get((attr(ins.attrs, "calls") or "").lstrip("%"),
                                                                        []), shapes, mod, depth + 1)
            flops, trans, dot_flops, dot_size = flops + f, trans + t, dot_flops + df, max(dot_size, ds)
            red, conv = red + r, conv + c
            continue
        out = ins.shapes
        n = out[0].elements if out else 0
        if ins.opcode in ("dot", "convolution"):
            k = 1
            if ins.opcode == "dot":
                lhs = shapes.get(ins.operands[0]) if ins.operands else None
                if lhs is not None:
                    k = int(np.prod([lhs.dims[d] for d in _dims(ins.attrs, "lhs_contracting_dims")]))
            else:
                lhs = shapes.get(ins.operands[0]) if ins.operands else None
                rhs = shapes.get(ins.operands[1]) if len(ins.operands) > 1 else None
                if lhs is not None and rhs is not None and out:
                    n, k = conv_macs(ins.attrs, lhs, rhs, out[0])
            flops += 2.0 * n * k
            dot_flops += 2.0 * n * k
            dot_size = max(dot_size, (max(n, 1) * k) ** (1.0 / 3.0))  # batch·m·n·k: the whole product's work
        elif ins.opcode in ELEMENTWISE_FLOP_OPS:
            flops += n
            if ins.opcode in TRANSCENDENTAL_OPS:
                trans += n
        elif ins.opcode == "reduce" and ins.operands:
            src = shapes.get(ins.operands[0])
            flops += src.elements if src else 0
            red += src.elements if src else 0
        elif ins.opcode == "convert" and ins.operands:
            src = shapes.get(ins.operands[0])
            pair = {src.dtype, out[0].dtype} if src is not None and out else set()
            if pair & NARROW_FLOATS and "f32" in pair:
                conv += n
        elif ins.opcode == "custom-call":
            c = price_custom_call(ins, shapes) or CallCost()  # unpriced ones are listed by custom_calls()
            flops, trans, dot_flops = flops + c.flops, trans + c.transcendentals, dot_flops + c.dot_flops
            dot_size = max(dot_size, c.dot_size)
    return flops, trans, dot_flops, dot_size, red, conv


_COST_ESTIMATE = re.compile(r'cost_estimate(?:_json)?\\*"?\s*[:=]\s*\\*"?\{([^}]*)\}')


def custom_call_cost(attrs: str) -> tuple[float, float]:
    """(flops, transcendentals) a custom call declares: a Pallas TPU kernel (`tpu_custom_call`) carries its
    `pl.CostEstimate` in the backend config (jax/_src/tpu_custom_call.py writes it as JSON: flops, transcendentals,
    bytes_accessed; the optimized HLO prints the numbers as strings), which is all the compiler knows of the
    kernel's work too (megablox's gmm sets one); a Pallas Mosaic GPU kernel (`mosaic_gpu_v2`) carries it as
    `cost_estimate_json` (jax/experimental/mosaic/gpu/core.py). Other custom calls: (0, 0); see has_cost_estimate
    and price_custom_call."""
    m = _COST_ESTIMATE.search(attrs)
    if not m:
        return 0.0, 0.0
    def field(name):
        f = re.search(name + r'\\*"?\s*:\s*\\*"?([0-9.eE+]+)', m.group(1))  # a number, or one in quotes
        return float(f.group(1)) if f else 0.0
    return field("flops"), field("transcendentals")


# ---- custom calls: what XLA:GPU hands to libraries, and calls that do no arithmetic -----------------------------------

# cuBLAS gemms (xla/service/gpu/cublas_cudnn.cc: kGemmCallTarget, kCublasLtMatmulCallTarget,
# kCublasLtMatmulF8CallTarget); any other `__cublas$` target that carries a gemm_backend_config is priced alike
CUBLAS_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
# cuDNN fused attention: `__cudnn$fmhaSoftmax`, `...ScaleBiasSoftmax`, `...SoftmaxDropout`, `...ScaleBiasSoftmaxDropout`,
# `...SoftmaxF8` and each with `Backward` (cublas_cudnn.cc; jax/_src/cudnn/fused_attention_stablehlo.py writes them)
CUDNN_FMHA_PREFIX = "__cudnn$fmha"
# the tensors each dot of a cudnn_fmha_backend_config multiplies, (lhs, rhs): q, k, v are operands 0, 1, 2; dO is
# operand 4 of a backward call (fused_attention_stablehlo.py: q, k, v, softmax stats, dO, ...); p is the BNTS
# score matrix (dP in the gradient dots), whose shape the config carries as intermediate_tensor_shape
FMHA_DOTS = {"bmm1_dot_dimension_numbers": ("q", "k"), "bmm2_dot_dimension_numbers": ("p", "v"),
             "bmm1_grad_gemm1_dot_dimension_numbers": ("p", "q"), "bmm1_grad_gemm2_dot_dimension_numbers": ("p", "k"),
             "bmm2_grad_gemm1_dot_dimension_numbers": ("p", "do"), "bmm2_grad_gemm2_dot_dimension_numbers": ("do", "v")}
FMHA_OPERANDS = {"q": 0, "k": 1, "v": 2, "do": 4}
# cuDNN convolutions: where the forward convolution's (input, filter, output) are among (operands, result 0)
# (xla/service/gpu/gpu_conv_runner.cc GetGpuConvParams); the HLO keeps the forward's window and dim_labels
CUDNN_CONV_TARGETS = {"__cudnn$convForward": ("op0", "op1", "out"), "__cudnn$convForwardGraph": ("op0", "op1", "out"),
                      "__cudnn$convBiasActivationForward": ("op0", "op1", "out"),
                      "__cudnn$convBackwardInput": ("out", "op1", "op0"),
                      "__cudnn$convBackwardFilter": ("op0", "out", "op1")}
# custom calls that do no arithmetic (their bytes, where they move any, are counted as any kernel's):
ZERO_FLOP_CUSTOM_CALLS = frozenset({
    "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "InspectSharding",  # sharding annotations
    "AllocateBuffer",  # an uninitialised buffer (XLA:GPU, scan carries)
    "MoveToHost", "MoveToDevice", "annotate_device_placement",  # host offload: memory-space moves
    "AsyncCollectiveStart", "AsyncCollectiveDone",  # libtpu's async collective halves (parse_collectives)
    "X64Combine", "X64SplitLow", "X64SplitHigh",  # libtpu: 64-bit values as two 32-bit halves
    "PadToStatic", "SliceToDynamic",  # dynamic-shape plumbing
    "AssumeGatherIndicesInBound", "GatherScatterIndicesBitpacked",  # libtpu: a gather's or scatter's index hints
    "__cub$DeviceRadixSort", "TopK", "__gpu$TopK",  # sorts and selections: compares, no flops (as for `sort`)
})
# libraries whose calls return a scratch buffer as the last tuple element (u8/s8 vector): not traffic
LIBRARY_PREFIXES = ("__cublas$", "__cudnn$")


@dataclasses.dataclass(frozen=True, slots=True)
class CallCost:
    """One execution of a custom call: flops (dot_flops of them in matrix products), transcendentals, the size of
    its largest product (cube root of batch·m·n·k) and a note on how it was priced ('' when plain)."""

    flops: float = 0.0
    transcendentals: float = 0.0
    dot_flops: float = 0.0
    dot_size: float = 0.0
    note: str = ""


def custom_call_target(attrs: str) -> str:
    """`custom_call_target="__cublas$gemm"` -> '__cublas$gemm'; '' when absent."""
    m = re.search(r'custom_call_target="([^"]*)"', attrs)
    return m.group(1) if m else ""


def backend_config(attrs: str) -> dict:
    """An instruction's backend config as a dict: printed as JSON (`backend_config={...}`) or as a quoted JSON
    string (`backend_config="{\\"k\\": ...}"`); {} when absent or not JSON (an MLIR attribute dictionary)."""
    m = re.search(r"\bbackend_config=", attrs)
    if not m:
        return {}
    i = m.end()
    if attrs.startswith("{", i):
        text = attrs[i:_match_paren(attrs, i)]
    elif attrs.startswith('"', i):
        q = re.match(r'"((?:[^"\\]|\\.)*)"', attrs[i:])
        if not q:
            return {}
        try:
            text = json.loads(f'"{q.group(1)}"')
        except ValueError:
            return {}
    else:
        return {}
    try:
        out = json.loads(text)
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def has_cost_estimate(attrs: str) -> bool:
    """Whether a custom call declares its cost (Pallas TPU `cost_estimate`, Mosaic GPU `cost_estimate_json`)."""
    return _COST_ESTIMATE.search(attrs) is not None


def _ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in values or ())


def _product_flops(lhs: Shape, rhs: Shape, dims: dict) -> tuple[float, float]:
    """(flops, batch·m·n·k) of one dot given its DotDimensionNumbers (proto JSON): 2·|lhs|·Π(rhs free dims), the lhs
    holding batch·m·k and the rhs's dims outside its contracting and batch ones holding n."""
    skip = set(_ints(dims.get("rhs_contracting_dimensions"))) | set(_ints(dims.get("rhs_batch_dimensions")))
    if any(d >= len(rhs.dims) for d in skip):
        raise ValueError(f"dot dimensions {sorted(skip)} outside rhs {rhs}")
    macs = float(lhs.elements) * int(np.prod([n for d, n in enumerate(rhs.dims) if d not in skip]))
    return 2.0 * macs, macs


def _library_results(ins: Instr) -> list[Shape]:
    """A custom call's result arrays, less the scratch buffer a cuBLAS / cuDNN call returns as its last tuple element
    (a u8/s8 vector: workspace, not traffic)."""
    shp = ins.shapes
    if (len(shp) > 1 and custom_call_target(ins.attrs).startswith(LIBRARY_PREFIXES) and shp[-1].dtype in ("u8", "s8")
            and len(shp[-1].dims) == 1):
        return shp[:-1]
    return shp


def gemm_cost(ins: Instr, shapes: dict[str, Shape], cfg: dict) -> CallCost | None:
    """A cuBLAS gemm: flops = 2·M·N·K·batch from the gemm_backend_config's dot_dimension_numbers and operands 0 (lhs)
    and 1 (rhs) (the fp8 form's further operands are scales), + one flop per output element for each epilogue stage
    (bias, activation) and for beta·C; a GELU epilogue one transcendental per output element. None when the config or
    operand shapes are missing."""
    g = cfg.get("gemm_backend_config")
    lhs, rhs = (shapes.get(o) for o in (ins.operands[:2] if len(ins.operands) >= 2 else ("", "")))
    if not isinstance(g, dict) or "dot_dimension_numbers" not in g or lhs is None or rhs is None:
        return None
    try:
        flops, macs = _product_flops(lhs, rhs, g["dot_dimension_numbers"])
    except ValueError:
        return None
    out = _library_results(ins)
    n_out = out[0].elements if out else 0
    epilogue = str(g.get("epilogue", "DEFAULT"))
    stages = ("BIAS" in epilogue) + any(a in epilogue for a in ("RELU", "GELU", "SILU", "SWISH"))
    stages += bool(float(g.get("beta", 0) or 0))
    extra = float(stages * n_out)
    trans = float(n_out) if "GELU" in epilogue else 0.0
    return CallCost(flops + extra, trans, flops, macs ** (1.0 / 3.0))


def fmha_cost(ins: Instr, shapes: dict[str, Shape], cfg: dict) -> CallCost | None:
    """cuDNN fused attention: each dot its cudnn_fmha_backend_config names (forward: bmm1 = Q·Kᵀ, bmm2 = P·V;
    backward: the four gradient products dK, dQ, dV, dP) priced 2·|lhs|·Π(rhs free dims), i.e. 2·B·N·T·S·H each:
    forward 4·B·N·T·S·H, backward 8·B·N·T·S·H (the dense backward's count; the flash kernel also recomputes Q·Kᵀ,
    which is not added); + the softmax's exponentials, one per score (B·N·T·S, the backward recomputing them from
    the saved statistics), counted as flops and as transcendentals. A causal mask is priced as the full products, as
    the model convention counts attention; the note says so."""
    c = cfg.get("cudnn_fmha_backend_config")
    if not isinstance(c, dict):
        return None
    inter = (c.get("intermediate_tensor_shape") or {}).get("dimensions")
    tensors: dict[str, Shape] = {"p": Shape("bf16", _ints(inter))} if inter else {}
    for key, idx in FMHA_OPERANDS.items():
        if idx < len(ins.operands) and ins.operands[idx] in shapes:
            tensors[key] = shapes[ins.operands[idx]]
    flops = size = 0.0
    dots = [(k, roles) for k, roles in FMHA_DOTS.items() if isinstance(c.get(k), dict)]
    if not dots:
        return None
    for key, (a, b) in dots:
        if a not in tensors or b not in tensors:
            return None
        try:
            f, macs = _product_flops(tensors[a], tensors[b], c[key])
        except ValueError:
            return None
        flops, size = flops + f, max(size, macs ** (1.0 / 3.0))
    trans = float(tensors["p"].elements if "p" in tensors else 0)  # exp of each score
    mask = str(c.get("mask_type", "NO_MASK"))
    note = (f"{custom_call_target(ins.attrs)}: {mask.lower()} mask priced as the full score matrix (the kernel skips "
            "the masked blocks: about half the products run)") if "CAUSAL" in mask else ""
    return CallCost(flops + trans, trans, flops, size, note)


def conv_call_cost(ins: Instr, shapes: dict[str, Shape], roles: tuple[str, str, str]) -> CallCost | None:
    """A cuDNN convolution (forward, backward input or filter): the forward convolution's multiply-adds (conv_macs,
    with its input, filter and output found per kind among the operands and result), 2 flops each."""
    out = _library_results(ins)
    pick = {"op0": shapes.get(ins.operands[0]) if ins.operands else None,
            "op1": shapes.get(ins.operands[1]) if len(ins.operands) > 1 else None, "out": out[0] if out else None}
    lhs, rhs, res = (pick[r] for r in roles)
    if lhs is None or rhs is None or res is None:
        return None
    n, k = conv_macs(ins.attrs, lhs, rhs, res)
    return CallCost(2.0 * n * k, 0.0, 2.0 * n * k, (max(n, 1) * k) ** (1.0 / 3.0))


# JAX's Pallas TPU splash attention (jax/experimental/pallas/ops/tpu/splash_attention): its kernels are named
# splash_{mha,mqa}_{fwd,dq,dkv}... (get_kernel_name) and declare no cost estimate. The products each kernel runs per
# visited (query block, key block) pair: fwd Q·Kᵀ and P·V; dq Q·Kᵀ (recomputed), dO·Vᵀ and dS·K; dkv Q·Kᵀ and dO·Vᵀ
# (recomputed), Pᵀ·dO and dSᵀ·Q; one exponential per visited score in each
SPLASH_KERNEL = re.compile(r"splash_(mha|mqa)_(fwd|dq|dkv)")
SPLASH_PRODUCTS = {"fwd": 2, "dq": 3, "dkv": 4}
SPLASH_BLOCKS = {"fwd": ("block_q", "block_kv"), "dq": ("block_q_dq", "block_kv_dq"),
                 "dkv": ("block_q_dkv", "block_kv_dkv")}
# the named scope models/fused_attention.py puts around its causal splash calls (the mask is not in the HLO)
SPLASH_CAUSAL_SCOPE = "splash_causal"
FLOAT_DTYPES = frozenset(d for d in DTYPE_BYTES if d.startswith(("f", "bf")))


def causal_block_fraction(t: int, s: int, bq: int, bkv: int) -> float:
    """The share of (query block, key block) pairs a causal mask leaves to compute (queries and keys at positions
    0..t-1 and 0..s-1, the last query at the last key): a block runs when its first key precedes its last query."""
    nq, nk = -(-t // bq), -(-s // bkv)
    off = s - t
    visited = sum(min(nk, (min((i + 1) * bq, t) - 1 + off) // bkv + 1) for i in range(nq))
    return visited / (nq * nk)


def splash_cost(ins: Instr, shapes: dict[str, Shape]) -> CallCost | None:
    """A splash attention kernel (SPLASH_KERNEL in its name or op_name), priced analytically: q, k, v are its first
    three floating operands ((..., n, t, h) and (..., k, s, h), or their sequence-minor layouts as the kernel's
    xprof_metadata says); each product of SPLASH_PRODUCTS costs 2·|q|·s, times the share of blocks a causal mask
    visits (causal_block_fraction, at the kernel's block sizes) when the call carries SPLASH_CAUSAL_SCOPE, the full
    matrix otherwise; one exponential per visited score. None when the operands cannot be read."""
    op_name = re.search(r'op_name="([^"]+)"', ins.attrs)
    m = SPLASH_KERNEL.search(ins.name) or (SPLASH_KERNEL.search(op_name.group(1)) if op_name else None)
    if m is None:
        return None
    floats = [shapes[o] for o in ins.operands if o in shapes and shapes[o].dtype in FLOAT_DTYPES]
    if len(floats) < 3 or len(floats[0].dims) < 2 or len(floats[1].dims) < 2:
        return None
    meta = re.search(r'xprof_metadata\\*"?\s*:\s*"(\{.*?\})"', ins.attrs)
    try:
        blocks = json.loads(meta.group(1).replace('\\"', '"')) if meta else {}
    except ValueError:
        blocks = {}
    q, k = floats[0], floats[1]
    seq_minor = lambda key: blocks.get(key) == 2  # QKVLayout.SEQ_MINOR: (..., h, t)
    t = q.dims[-1] if seq_minor("q_layout") else q.dims[-2]
    s = k.dims[-1] if seq_minor("k_layout") else k.dims[-2]
    kind = m.group(2)
    bq, bkv = (int(blocks.get(key) or 0) for key in SPLASH_BLOCKS[kind])
    causal = op_name is not None and SPLASH_CAUSAL_SCOPE in op_name.group(1)
    frac = causal_block_fraction(t, s, bq or t, bkv or s) if causal else 1.0
    h = q.dims[-2] if seq_minor("q_layout") else q.dims[-1]
    scores = q.elements // max(h, 1) * s  # batch × heads × t × s
    product = 2.0 * q.elements * s * frac  # one (..., n, t, h) × (s) product over the visited blocks
    dots = SPLASH_PRODUCTS[kind] * product
    trans = scores * frac
    mask = f"causal mask: {frac:.0%} of the {bq or t}x{bkv or s} blocks" if causal else "mask unknown: every block"
    note = (f"splash_{m.group(1)}_{kind}: analytic count (the kernel declares no cost): {SPLASH_PRODUCTS[kind]} "
            f"products, {mask}")
    return CallCost(dots + trans, trans, dots, (product / 2.0) ** (1.0 / 3.0), note)


PAGED_KERNEL = re.compile(r"\bpaged_attention\b")  # JAX's Pallas TPU paged attention (models/paged.py)


def paged_cost(ins: Instr, shapes: dict[str, Shape]) -> CallCost | None:
    """JAX's Pallas TPU paged attention kernel (decode: one query per row), priced analytically: its operands are
    the lengths, the page table (rows × pages per row, flattened), the query (rows, heads, [1,] head_dim) and the
    key and value pages (kv heads, pages, page size, head_dim). Each query head scores and mixes every position of
    its row's pages (pages per row × page size: the whole reserved context, the bound of a decode against a full
    cache): two products of 2·positions·head_dim flops, one exponential per score. None when the operands cannot be
    read."""
    op_name = re.search(r'op_name="([^"]+)"', ins.attrs)
    if not (PAGED_KERNEL.search(ins.name) or (op_name and PAGED_KERNEL.search(op_name.group(1)))):
        return None
    ops = [shapes[o] for o in ins.operands if o in shapes]
    floats = [sh for sh in ops if sh.dtype in FLOAT_DTYPES]
    ints = [sh for sh in ops if sh.dtype.startswith("s") and sh.elements > 1]
    if len(floats) < 3 or len(floats[1].dims) != 4 or len(ints) < 2:
        return None
    q, kp = floats[0], floats[1]
    rows, heads, h = q.dims[0], q.dims[1], q.dims[-1]
    pages_per_row = ints[1].elements // max(rows, 1)
    positions = pages_per_row * kp.dims[2]
    scores = rows * heads * positions
    dots = 2 * 2.0 * scores * h
    return CallCost(dots + scores, scores, dots, (scores * h) ** (1.0 / 3.0),
                    f"paged attention: analytic count (the kernel declares no cost): {pages_per_row} pages of "
                    f"{kp.dims[2]} positions per row, every position scored")


# JAX's Pallas GPU flash attention (jax/experimental/pallas/ops/gpu/attention.py, Triton: `__gpu$xla.gpu.triton`
# calls whose op_name names the kernel): the products per visited (query block, key block) pair of the forward kernel
# (Q·Kᵀ, P·V) and of the backward kernel (Q·Kᵀ recomputed, dO·Vᵀ, Pᵀ·dO, dSᵀ·Q, dS·K); the backward's preprocessing
# (rowsum(O ∘ dO)) two flops per element of O
FLASH_KERNELS = {"mha_forward": 2, "mha_backward": 5}
FLASH_CAUSAL_SCOPE = re.compile(r"flash_causal_b(\d+)")  # models/fused_attention.py: causal, with its block size


def flash_cost(ins: Instr, shapes: dict[str, Shape]) -> CallCost | None:
    """A Pallas GPU flash attention kernel (FLASH_KERNELS in its op_name), priced analytically from q (operand 0,
    (b, t, n, h)) and k (operand 1, (b, s, n, h)); a causal call (FLASH_CAUSAL_SCOPE) over the blocks its mask
    visits (causal_block_fraction), the full matrix otherwise. None when it is no such kernel."""
    op_name = re.search(r'op_name="([^"]+)"', ins.attrs)
    if op_name is None or len(ins.operands) < 2:
        return None
    q, k = shapes.get(ins.operands[0]), shapes.get(ins.operands[1])
    if q is None or k is None or len(q.dims) != 4 or len(k.dims) != 4:
        return None
    name = op_name.group(1)
    if "preprocess_backward" in name:
        return CallCost(2.0 * q.elements, 0.0, 0.0, 0.0, "mha_preprocess_backward: analytic count")
    kind = next((kk for kk in FLASH_KERNELS if kk in name), None)
    if kind is None:
        return None
    t, s = q.dims[1], k.dims[1]
    causal = FLASH_CAUSAL_SCOPE.search(name)
    blk = int(causal.group(1)) if causal else 0
    frac = causal_block_fraction(t, s, blk, blk) if causal else 1.0
    product = 2.0 * q.elements * s * frac
    dots = FLASH_KERNELS[kind] * product
    trans = q.elements / max(q.dims[3], 1) * s * frac
    mask = f"causal mask: {frac:.0%} of the {blk}x{blk} blocks" if causal else "mask unknown: every block"
    return CallCost(dots + trans, trans, dots, (product / 2.0) ** (1.0 / 3.0),
                    f"pallas {kind}: analytic count (the kernel declares no cost): {FLASH_KERNELS[kind]} products, "
                    + mask)


def price_custom_call(ins: Instr, shapes: dict[str, Shape]) -> CallCost | None:
    """What one execution of a custom call computes, or None when the reader cannot say (custom_calls lists those):
    a declared cost estimate (custom_call_cost); a cuBLAS gemm (gemm_cost); cuDNN attention (fmha_cost) or
    convolution (conv_call_cost); a Pallas splash or paged (TPU) or flash (GPU) attention kernel without one
    (splash_cost, paged_cost, flash_cost: analytic); a call known to do no arithmetic (ZERO_FLOP_CUSTOM_CALLS):
    zero."""
    target = custom_call_target(ins.attrs)
    if has_cost_estimate(ins.attrs):
        f, t = custom_call_cost(ins.attrs)
        return CallCost(f, t)
    if target in ZERO_FLOP_CUSTOM_CALLS:
        return CallCost()
    if target == "tpu_custom_call":
        return splash_cost(ins, shapes) or paged_cost(ins, shapes)
    if target == "__gpu$xla.gpu.triton":
        return flash_cost(ins, shapes)
    if target in CUBLAS_GEMM_TARGETS or target.startswith("__cublas$"):
        return gemm_cost(ins, shapes, backend_config(ins.attrs))
    if target.startswith(CUDNN_FMHA_PREFIX):
        return fmha_cost(ins, shapes, backend_config(ins.attrs))
    if target in CUDNN_CONV_TARGETS:
        return conv_call_cost(ins, shapes, CUDNN_CONV_TARGETS[target])
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class CustomCallUse:
    """One custom call target of the per-device program: executions per run, whether the reader priced it, and the
    note its pricing left ('' when none)."""

    target: str
    count: int
    priced: bool
    note: str = ""
    analytic: bool = False  # priced by the reader's count of a call that declares none and does arithmetic: the
    #                         compiler's cost_analysis does not hold its work (a Pallas TPU kernel without an estimate)


def custom_calls(text: str, mod: Module | None = None) -> list[CustomCallUse]:
    """Every custom call the device runs (unfused, or inside a fusion), grouped by (target, priced, note, analytic),
    with its executions per run (loop bodies × trip counts)."""
    mod = mod or parse_module(text)
    shapes = _array_shapes(mod)
    found: dict[tuple[str, bool, str, bool], int] = {}

    def walk(body: list[Instr], count: int, depth: int = 0) -> None:
        for ins in body:
            if ins.opcode == "custom-call":
                c = price_custom_call(ins, shapes)
                analytic = c is not None and c.flops > 0 and not has_cost_estimate(ins.attrs)
                key = (custom_call_target(ins.attrs) or "?", c is not None, c.note if c else "", analytic)
                found[key] = found.get(key, 0) + count
            elif ins.opcode == "fusion" and depth < 4:
                walk(mod.computations.get((attr(ins.attrs, "calls") or "").lstrip("%"), []), count, depth + 1)

    for comp, m in _multiplicities(mod).items():
        walk(mod.computations.get(comp, []), m)
    return [CustomCallUse(t, n, p, note, a) for (t, p, note, a), n in sorted(found.items())]


def unpriced_custom_calls(text: str, mod: Module | None = None) -> dict[str, int]:
    """Custom call target -> executions per run, for the calls the reader cannot price (their work is missing from
    the kernel flops)."""
    out: dict[str, int] = {}
    for u in custom_calls(text, mod):
        if not u.priced:
            out[u.target] = out.get(u.target, 0) + u.count
    return out


def _window(attrs: str) -> dict[str, list]:
    """window={size=4x8 stride=3x7 pad=3_3x7_7 lhs_dilate=4x8 rhs_dilate=1x1} -> lists per spatial dimension."""
    w = attr(attrs, "window") or ""
    out: dict[str, list] = {}
    for key, val in re.findall(r"(\w+)=([\d_x\-]+)", w.strip("{}")):
        if key == "pad":
            out[key] = [tuple(int(x) for x in p.split("_")) for p in val.split("x")]
        elif key in ("size", "stride", "lhs_dilate", "rhs_dilate"):
            out[key] = [int(x) for x in val.split("x")]
    return out


def _valid_taps(size_in: int, size_out: int, window: int, stride: int, lo: int, lhs_dilate: int,
                rhs_dilate: int) -> int:
    """(output position, window tap) pairs along one spatial dimension whose tap lands on a real input element
    (not padding, not a hole of lhs dilation): the multiply-adds that dimension contributes."""
    o = np.arange(size_out, dtype=np.int64)[:, None]
    total = 0
    for w0 in range(0, window, 4096):  # chunks of taps: bounded memory for long windows
        w = np.arange(w0, min(window, w0 + 4096), dtype=np.int64)[None, :]
        p = o * stride + w * rhs_dilate - lo
        ok = (p >= 0) & (p <= (size_in - 1) * lhs_dilate) & (p % lhs_dilate == 0)
        total += int(ok.sum())
    return total


def conv_macs(attrs: str, lhs: Shape, rhs: Shape, out: Shape) -> tuple[int, int]:
    """(output elements outside the spatial dims × the spatial (output, tap) pairs that touch real input,
    multiply-adds per such pair) of a convolution. libtpu writes batched matmuls as convolutions whose windows,
    padding, strides and lhs dilation only route batch or head dimensions (`window={size=1x8 pad=0_0x7_7
    rhs_reversal=0x1}`: each of 8 outputs meets one real input): counting every window tap of every output (2·|out|·
    |rhs|/out-features) overcounts those dots by the window size. Per pair the multiply-adds are the rhs's input
    features (feature groups already divide them; batch groups split the batch, not the features)."""
    labels = attr(attrs, "dim_labels") or ""
    m = re.match(r"([\w]+)_([\w]+)->([\w]+)", labels)
    if not m or len(m.group(1)) != len(lhs.dims) or len(m.group(2)) != len(rhs.dims) or len(m.group(3)) != len(out.dims):
        # unknown layout: every kernel element per output feature
        o = len(rhs.dims) - 1
        return out.elements, int(np.prod(rhs.dims)) // max(rhs.dims[o], 1)
    ll, rl, ol = m.groups()
    k = rhs.dims[rl.index("i")] if "i" in rl else 1
    win = _window(attrs)
    spatial = sorted(c for c in ol if c.isdigit())
    non_spatial = int(np.prod([out.dims[j] for j, c in enumerate(ol) if not c.isdigit()]))
    pairs = 1
    for d, c in enumerate(spatial):
        size_in = lhs.dims[ll.index(c)] if c in ll else 1
        size_out = out.dims[ol.index(c)]
        window = rhs.dims[rl.index(c)] if c in rl else 1
        def at(key, default, d=d):
            vals = win.get(key)
            return vals[d] if vals and d < len(vals) else default

        pairs *= _valid_taps(size_in, size_out, window, at("stride", 1), at("pad", (0, 0))[0], at("lhs_dilate", 1),
                             at("rhs_dilate", 1))
    return non_spatial * pairs, k


def _parameters(body: list[Instr]) -> dict[str, int | None]:
    """A computation's parameters: name -> parameter number."""
    params = {}
    for i in body:
        if i.opcode == "parameter":
            mnum = re.match(r"\s*(\d+)", i.raw_operands)
            params[i.name] = int(mnum.group(1)) if mnum else None
    return params


def _users(body: list[Instr]) -> dict[str, list[Instr]]:
    """Who reads each value of a computation: name -> the instructions that take it as an operand."""
    users: dict[str, list[Instr]] = {}
    for i in body:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    return users


def _slice_bytes(name: str, users: dict[str, list[Instr]], mod: "Module | None", depth: int = 0) -> float | None:
    """The bytes read of `name` when every reader takes a dynamic-slice of it, directly or as a parameter of a
    nested fusion that does (libtpu nests a layer's normalisation of a slice of the stacked saved inputs inside the
    output fusion of the dot that reads it); None when some reader reads it whole."""
    total = 0.0
    us = _readers(name, users)
    if not us:
        return None
    for u, via in us:
        if u.opcode == "dynamic-slice" and u.operands and u.operands[0] == via:
            total += u.out_bytes
            continue
        if u.opcode != "fusion" or mod is None or depth > 3:
            return None
        inner = mod.computations.get(called_computation(u), [])
        nums = [k for k, o in enumerate(u.operands) if o == via]
        inner_params = {n: i for n, i in _parameters(inner).items() if i in nums}
        if len(inner_params) != len(nums):
            return None
        inner_users = _users(inner)
        for pname in inner_params:
            got = _slice_bytes(pname, inner_users, mod, depth + 1)
            if got is None:
                return None
            total += got
    return total


def _sliced_traffic(body: list[Instr], operand_bytes: list[float], out_bytes: float,
                    shapes: dict[str, Shape], mod: "Module | None" = None) -> tuple[float, float]:
    """Bytes a fusion really moves when it slices its operands or updates a buffer in place: a parameter read only
    through dynamic-slice (here or in a nested fusion) costs the slices; a root dynamic-update-slice or scatter
    writes only the update (the buffer aliases the output)."""
    params = _parameters(body)
    users = _users(body)
    by = list(operand_bytes)
    for name, idx in params.items():
        if idx is None or idx >= len(by):
            continue
        sliced = _slice_bytes(name, users, mod)
        if sliced is not None:
            by[idx] = sliced
    root = next((i for i in body if i.is_root), None)
    if root is not None and root.opcode == "tuple" and any(_collective_kind(i.opcode) for i in body):
        return _in_flight_traffic(body, root, params, users, by, out_bytes)
    # a root scatter updates its operand in place like a dynamic-update-slice: scatter(buffer, indices, updates)
    if root is not None and root.opcode in ("dynamic-update-slice", "scatter") and len(root.operands) > 1:
        buf, upd = root.operands[0], root.operands[-1 if root.opcode == "scatter" else 1]
        local = {i.name: i for i in body}
        while buf in local and local[buf].opcode == "bitcast" and local[buf].operands:  # the same buffer, relabelled
            buf = local[buf].operands[0]
        if buf in params and params[buf] is not None and params[buf] < len(by):
            by[params[buf]] = 0.0  # aliased in place
        upd_bytes = shapes[upd].bytes if upd in shapes else out_bytes
        return sum(by), upd_bytes
    return sum(by), out_bytes


def _readers(name: str, users: dict[str, list[Instr]]) -> list[tuple[Instr, str]]:
    """The ops that read `name` inside a fusion, seen through bitcasts (a relabelling of the same bytes: XLA:GPU
    bitcasts a stacked weight to the layout its slice is taken in), each with the name it reads."""
    out = []
    for u in users.get(name, []):
        out += _readers(u.name, users) if u.opcode == "bitcast" else [(u, name)]
    return out


def _in_flight_traffic(body: list[Instr], root: Instr, params: dict, users: dict, by: list[float],
                       out_bytes: float) -> tuple[float, float]:
    """A compute fusion that carries a collective in flight (libtpu's windowed einsums and async collectives: the
    collective's operand comes in, its result and the buffers it fills pass through the fusion's tuple): the kernel
    moves its own operands and results only. The collective's result is written by the interconnect's DMA, and a
    buffer that passes straight through is the same allocation on both sides (counted, a 671 MB activation gathered
    across 16 chips was read and written by each of the four kernels of every loop trip that carried it)."""
    named = {i.name: i for i in body}
    carried = [o for o in root.operands if o in named and (named[o].opcode == "parameter"
                                                           or _collective_kind(named[o].opcode))]
    for name, idx in params.items():
        us = users.get(name, [])
        if idx is not None and idx < len(by) and us and all(
                u is root or _collective_kind(u.opcode) for u in us):
            by[idx] = 0.0
    return sum(by), max(0.0, out_bytes - sum(hbm_bytes(named[o].type_str) for o in carried))


def _array_shapes(mod: Module) -> dict[str, Shape]:
    """Instruction name -> its shape, for every instruction that yields one array."""
    shapes: dict[str, Shape] = {}
    for instrs in mod.computations.values():
        for i in instrs:
            ss = i.shapes
            if len(ss) == 1:
                shapes[i.name] = ss[0]
    return shapes


def runs_per_computation(mod: Module) -> dict[str, int]:
    """How many times each non-fused computation runs per execution (loop bodies × trip counts, callees × callers)."""
    return _multiplicities(mod)


def dot_rows(instrs: list[Instr], shapes: dict[str, Shape], mod: Module | None = None) -> float:
    """The rows of the largest dot among `instrs` (the product of its lhs free dimensions) where they are its smaller
    free side, else 0 (also 0 without dots; fusions nested inside followed with `mod`). A (b, d) · (d, f) decode
    product has b rows whatever f is. Few columns are not few rows: XLA:CPU ran an 8192×4096 by 4096×16 product at
    the square curve's rate (169 GFLOP/s on a Zen 3 VM, where an 8-row product over a 2048² weight ran at 73)."""
    return _largest_dot(instrs, shapes, mod)[1]


def _largest_dot(instrs, shapes, mod, depth: int = 0) -> tuple[float, float]:
    """(work m·n·k·batch, its rows m where m ≤ n else 0) of the largest dot among `instrs`; (0, 0) without dots."""
    best = (0.0, 0.0)
    for ins in instrs:
        if ins.opcode == "fusion" and mod is not None and depth < 4:
            best = max(best, _largest_dot(mod.computations.get(called_computation(ins), []), shapes, mod, depth + 1))
            continue
        if ins.opcode != "dot" or len(ins.operands) < 2:
            continue
        lhs, rhs = shapes.get(ins.operands[0]), shapes.get(ins.operands[1])
        if lhs is None or rhs is None:
            continue
        k = int(np.prod([lhs.dims[d] for d in _dims(ins.attrs, "lhs_contracting_dims")]))
        batch = int(np.prod([lhs.dims[d] for d in _dims(ins.attrs, "lhs_batch_dims")]))
        m, n = lhs.elements / max(batch * k, 1), rhs.elements / max(batch * k, 1)
        best = max(best, (batch * m * n * k, m if m <= n else 0.0))
    return best


def array_shapes(mod: Module) -> dict[str, Shape]:
    """Instruction name -> its shape, for every instruction that yields one array."""
    return _array_shapes(mod)


def computation_cost(instrs: list[Instr], shapes: dict[str, Shape]) -> tuple[float, float, float, float]:
    """(flops, transcendentals, dot flops, largest dot size) of a list of instructions (see _computation_cost)."""
    return _computation_cost(instrs, shapes)[:4]


def called_computation(ins: Instr) -> str:
    """The computation a fusion (or call) instruction calls, '' when none."""
    return (attr(ins.attrs, "calls") or attr(ins.attrs, "to_apply") or "").lstrip("%")


def parse_kernels(text: str, mod: Module | None = None) -> list[KernelCost]:
    """Every kernel (fusion or unfused op) the device runs, with bytes in/out and estimated flops."""
    mod = mod or parse_module(text)
    mult = _multiplicities(mod)
    shapes = _array_shapes(mod)
    by_name = mod.by_name()
    entry_params = _entry_parameters(mod)
    out = []
    for comp, m in mult.items():
        for ins in mod.computations.get(comp, []):
            op = ins.opcode
            if op in NO_COST_OPS or op in ("while", "call", "conditional") or op.endswith("-done"):
                continue
            if any(op.startswith(c) for c in COLLECTIVE_KINDS) or fusion_collective_role(mod, ins):
                continue
            operand_bytes = [hbm_bytes(by_name[o].type_str) if o in by_name else 0.0 for o in ins.operands]
            out_bytes = hbm_bytes(ins.type_str)
            if op == "custom-call" and out_bytes:
                out_bytes = sum(sh.bytes for sh in _library_results(ins))
            bytes_in, bytes_out = sum(operand_bytes), out_bytes
            shp = ins.shapes
            if op == "fusion":
                kind = (attr(ins.attrs, "kind") or "fusion")
                callee = (attr(ins.attrs, "calls") or "").lstrip("%")
                body = mod.computations.get(callee, [])
                flops, trans, dflops, dsize, red, conv = _computation_cost(body, shapes, mod)
                bytes_in, bytes_out = _sliced_traffic(body, operand_bytes, bytes_out, shapes, mod)
                fused = _fused_ops(body, mod)
                ops = _opcode_counts(fused)
                library = _custom_fusion_kind(ins.attrs) if kind == "kCustom" else ""
                passes = reduction_consumed(body, shapes)
                produced = produced_reductions(body, shapes)
                trans_el = strided_transposes(fused, by_name) if not dflops else 0.0
                rows = dot_rows(body, shapes, mod) if dflops else 0.0
            else:
                passes, produced = False, 0.0
                ops, library = ((op, 1),), custom_call_target(ins.attrs) if op == "custom-call" else ""
                kind = op
                flops, trans, dflops, dsize, red, conv = _computation_cost([ins], shapes)
                rows = dot_rows([ins], shapes) if dflops else 0.0
                if op == "dynamic-update-slice" and len(operand_bytes) > 1:
                    # in place: reads and writes the update, not the whole buffer
                    bytes_in, bytes_out = sum(operand_bytes[1:]), operand_bytes[1]
                elif op == "dynamic-slice":
                    bytes_in = bytes_out + sum(operand_bytes[1:])
                elif op == "slice":  # reads the slice only
                    bytes_in = bytes_out
                elif op in ("slice-start", "copy-start") and len(shp) >= 2:
                    # libtpu's asynchronous slice ((operand), slice, context) and copy ((destination), source,
                    # context): they read the slice or the source once and write the result (nothing to HBM when
                    # it goes to VMEM: a prefetch)
                    moved = shp[len(shp) - 2].bytes if op == "slice-start" else operand_bytes[0] if operand_bytes else 0
                    into = _ARRAY_RE.search(ins.type_str if op == "copy-start" else ins.type_str.split("}", 1)[-1])
                    on_chip = into is not None and re.search(r"S\([1-9]", into.group(3) or "")
                    bytes_in, bytes_out = moved, 0.0 if on_chip else moved
                trans_el = strided_transposes([ins], by_name)
            to_host, from_host = host_transfer(ins, by_name) if op != "fusion" else (0.0, 0.0)
            from_params = sum(b for o, b in zip(ins.operands, operand_bytes) if o in entry_params) \
                if comp == mod.entry else 0.0
            out.append(KernelCost(ins.name, kind, " ".join(map(str, shp)) if shp else "", bytes_in,
                                  bytes_out, flops, trans, m, dflops, dsize, ops, library, red, conv, passes,
                                  trans_el, sum(operand_bytes) + out_bytes, to_host, from_host, rows,
                                  min(from_params, bytes_in), produced))
    return out


def _entry_parameters(mod: Module) -> set[str]:
    """Names in the entry computation that hold the program's parameters: the parameters, bitcasts of them, and
    in-place updates of them (a dynamic-update-slice or scatter, or a fusion around one, of the parameter's shape: it
    writes a few rows into the parameter's buffer, whose other rows were last touched a call ago)."""
    names: set[str] = set()
    entry = mod.computations.get(mod.entry, [])
    shape_of = {i.name: i.shapes for i in entry}
    for ins in entry:
        src = ins.operands[0] if ins.operands else None
        if ins.opcode == "parameter" or (ins.opcode == "bitcast" and src in names):
            names.add(ins.name)
        elif src in names and ins.shapes == shape_of.get(src) and _updates_in_place(ins, mod):
            names.add(ins.name)
    return names


def _updates_in_place(ins: Instr, mod: Module) -> bool:
    """A dynamic-update-slice or scatter, or a fusion that performs one."""
    if ins.opcode in ("dynamic-update-slice", "scatter"):
        return True
    body = mod.computations.get((attr(ins.attrs, "calls") or "").lstrip("%"), []) if ins.opcode == "fusion" else []
    return any(i.opcode in ("dynamic-update-slice", "scatter") for i in body)


_HOST_MOVES = ("copy", "copy-start", "dynamic-update-slice", "dynamic-update-slice-start", "dynamic-slice",
               "dynamic-slice-start")


def _array_bytes(a: tuple[str, str, str]) -> float:
    dt, dims, _ = a
    return Shape(dt, tuple(int(d) for d in dims.split(",") if d)).bytes if dt in DTYPE_BYTES else 0.0


def _on_host(a: tuple[str, str, str] | None) -> bool:
    """Whether an array's layout puts it in the host's memory (memory space 5: XLA's host memory space, where host
    offloading keeps what it moves off the device)."""
    return a is not None and "S(5)" in (a[2] or "")


def host_transfer(ins: Instr, by_name: dict[str, Instr]) -> tuple[float, float]:
    """(bytes to the host, bytes from the host) that one execution of `ins` moves over the host link: a copy whose
    destination or source lives in host memory, an update written in place into a host buffer (the slice, not the
    buffer), a slice read out of one (the slice). Host offloading compiles to these: copy-start/copy-done pairs for
    unrolled layers, dynamic-update-slice-start / dynamic-slice-start on a stacked host buffer inside a scan."""
    if ins.opcode not in _HOST_MOVES or not ins.operands:
        return 0.0, 0.0
    first = _ARRAY_RE.findall(by_name[ins.operands[0]].type_str) if ins.operands[0] in by_name else []
    src = first[0] if len(first) == 1 else None
    if ins.opcode.startswith("copy"):
        dst = _ARRAY_RE.search(ins.type_str)
        dst = dst.groups() if dst else None
        if dst is None or src is None or _on_host(dst) == _on_host(src):
            return 0.0, 0.0
        return (_array_bytes(dst), 0.0) if _on_host(dst) else (0.0, _array_bytes(dst))
    if not _on_host(src):
        return 0.0, 0.0
    if ins.opcode.startswith("dynamic-update-slice"):
        upd = _ARRAY_RE.findall(by_name[ins.operands[1]].type_str) if len(ins.operands) > 1 and \
            ins.operands[1] in by_name else []
        return (_array_bytes(upd[0]), 0.0) if len(upd) == 1 and not _on_host(upd[0]) else (0.0, 0.0)
    # dynamic-slice(-start): the slice it reads is its result (a -start's result tuple: (operands), slice, context)
    out = [a for a in _ARRAY_RE.findall(ins.type_str) if a[1] and not _on_host(a)]  # not the scalar indices
    return (0.0, _array_bytes(out[-1])) if out else (0.0, 0.0)


def reduction_consumed(body: list[Instr], shapes: dict[str, Shape]) -> bool:
    """Whether a reduction in a fusion's ops feeds, through any chain of ops, an op as large as the reduction's own
    operand: the kernel then needs each row's reduction before it can finish that row (softmax's max and sum, a
    normalisation's mean), so it walks the row in dependent passes."""
    users = _users(body)
    for r in body:
        if r.opcode != "reduce" or not r.operands or r.operands[0] not in shapes:
            continue
        size = shapes[r.operands[0]].elements
        seen, todo = set(), [r.name]
        while todo:
            for u in users.get(todo.pop(), []):
                if u.name in seen or u.opcode == "tuple":
                    continue
                seen.add(u.name)
                if u.opcode not in ("reduce", "bitcast") and sum(sh.elements for sh in u.shapes) >= size:
                    return True
                todo.append(u.name)
    return False


# ops that hand an array on as it is (no arithmetic): a reduction over one of them reads the array itself
_PASS_THROUGH_OPS = ("bitcast", "reshape", "copy", "convert", "transpose", "broadcast", "slice")


def produced_reductions(body: list[Instr], shapes: dict[str, Shape]) -> float:
    """Elements reduced in a fusion whose operand the fusion computes (through an op with arithmetic), rather than
    reads from a parameter through ops that only move or convert it: see KernelCost.produced_reduce_elements."""
    by_name = {i.name: i for i in body}
    total = 0.0
    for r in body:
        if r.opcode != "reduce" or not r.operands or r.operands[0] not in shapes:
            continue
        src = by_name.get(r.operands[0])
        while src is not None and src.opcode in _PASS_THROUGH_OPS and src.operands:
            src = by_name.get(src.operands[0])
        if src is not None and src.opcode not in ("parameter", "constant", "iota"):
            total += shapes[r.operands[0]].elements
    return total


_LAYOUT_RE = re.compile(r"\[([0-9,]*)\]\{([0-9,]*)")


def minor_dim(type_str: str) -> int | None:
    """The logical dimension an array is contiguous along: the first of its layout's minor-to-major list with more
    than one element (row-major when the type carries no layout); None for a scalar, a tuple or a 1-element array."""
    if type_str.lstrip().startswith("("):
        return None
    m = _LAYOUT_RE.search(type_str)
    dims_m = m or re.search(r"\[([0-9,]*)\]", type_str)
    if dims_m is None:
        return None
    dims = [int(d) for d in dims_m.group(1).split(",") if d]
    order = [int(d) for d in m.group(2).split(",") if d] if m else list(range(len(dims) - 1, -1, -1))
    return next((d for d in order if d < len(dims) and dims[d] > 1), None)


def strided_transposes(instrs: list[Instr], by_name: dict[str, Instr]) -> float:
    """Output elements of the transposes and copies among `instrs` whose output is contiguous along a different
    logical dimension than their input (a transpose maps output dimension j to input dimension dimensions[j]): a
    layout change that reads its input at a stride. A transpose whose layouts make it a bitcast counts nothing."""
    n = 0.0
    for ins in instrs:
        if ins.opcode not in ("transpose", "copy") or not ins.operands or ins.operands[0] not in by_name:
            continue
        out_minor, in_minor = minor_dim(ins.type_str), minor_dim(by_name[ins.operands[0]].type_str)
        if out_minor is None or in_minor is None:
            continue
        src = out_minor
        if ins.opcode == "transpose":
            perm = _dims(ins.attrs, "dimensions")
            src = perm[out_minor] if out_minor < len(perm) else out_minor
        if src != in_minor:
            n += sum(sh.elements for sh in ins.shapes)
    return n


def _fused_ops(body: list[Instr], mod: Module, depth: int = 0) -> list[Instr]:
    """The ops a fusion computes (nested fusions opened; parameters, tuples and bitcasts left out)."""
    out = []
    for i in body:
        if i.opcode == "fusion" and depth < 4:
            out += _fused_ops(mod.computations.get((attr(i.attrs, "calls") or "").lstrip("%"), []), mod, depth + 1)
        elif i.opcode not in ("parameter", "tuple", "get-tuple-element", "bitcast"):
            out.append(i)
    return out


def _opcode_counts(instrs: list[Instr]) -> tuple[tuple[str, int], ...]:
    counts: dict[str, int] = {}
    for i in instrs:
        counts[i.opcode] = counts.get(i.opcode, 0) + 1
    return tuple(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _custom_fusion_kind(attrs: str) -> str:
    """'__ynn_fusion' from backend_config={"fusion_config":{"kind":"__ynn_fusion"}} (XLA:CPU library fusions);
    '__triton_gemm', '__triton_nested_gemm_fusion', '__cudnn$fusion', ... from XLA:GPU's
    {"fusion_backend_config":{"kind":...}} (their fused computations hold the dots, counted as any fusion's)."""
    m = re.search(r'"(?:fusion_config|fusion_backend_config)"\s*:\s*\{\s*"kind"\s*:\s*"([^"]+)"', attrs)
    return m.group(1) if m else ""


_JIT_PREFIX = re.compile(r"^jit\([^)]*\)/")


def kernel_sources(text: str, mod: Module | None = None) -> dict[str, dict[str, int]]:
    """Kernel name -> the source ops it computes, as 'opcode@op_name' -> count (op_name from the HLO metadata; '' when
    absent, its outer 'jit(NAME)/' dropped; convolution counted as dot). Two compiles of one program share these
    tokens, so kernels can be matched across fusion decisions (and across compilers)."""
    mod = mod or parse_module(text)
    out: dict[str, dict[str, int]] = {}
    for comp in _multiplicities(mod):
        for ins in mod.computations.get(comp, []):
            if ins.opcode in NO_COST_OPS or ins.opcode in ("while", "call", "conditional"):
                continue
            body = (_fused_ops(mod.computations.get((attr(ins.attrs, "calls") or "").lstrip("%"), []), mod)
                    if ins.opcode == "fusion" else [ins])
            toks: dict[str, int] = {}
            for i in body:
                if i.opcode in ("constant", "opt-barrier"):
                    continue
                m = re.search(r'op_name="([^"]+)"', i.attrs)
                op = "dot" if i.opcode == "convolution" else i.opcode  # the TPU compiler writes dots as convolutions
                t = f"{op}@{_JIT_PREFIX.sub('', m.group(1)) if m else ''}"
                toks[t] = toks.get(t, 0) + 1
            out[ins.name] = toks
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class DotOp:
    """One dot of the per-device program, with the operand shapes it multiplies and how often it runs per execution."""

    name: str
    lhs: Shape
    rhs: Shape
    out: Shape
    lhs_contracting: tuple[int, ...]
    rhs_contracting: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    count: int = 1

    @property
    def flops(self) -> float:
        """2·|out|·|contracting| per execution."""
        return 2.0 * self.out.elements * int(np.prod([self.lhs.dims[d] for d in self.lhs_contracting]))

    @property
    def signature(self) -> tuple:
        """What decides the kernel: shapes, dtypes and dimension numbers (not the name or the count)."""
        return (self.lhs, self.rhs, self.out.dtype, self.lhs_contracting, self.rhs_contracting, self.lhs_batch,
                self.rhs_batch)

    def __str__(self):
        b = f" batch={self.lhs_batch}/{self.rhs_batch}" if self.lhs_batch else ""
        return f"{self.lhs}·{self.rhs} c={self.lhs_contracting}/{self.rhs_contracting}{b} -> {self.out}"


def parse_dots(text: str, mod: Module | None = None) -> list[DotOp]:
    """Every dot the device runs (unfused, or inside a fusion; XLA:GPU's cuBLAS gemm custom calls too, read from
    their gemm_backend_config), with its operand shapes and executions per run."""
    mod = mod or parse_module(text)
    mult = _multiplicities(mod)
    shapes = _array_shapes(mod)

    def dots_in(body: list[Instr], count: int, depth: int = 0) -> list[DotOp]:
        found = []
        for ins in body:
            if ins.opcode == "dot" and len(ins.operands) >= 2 and ins.shapes:
                lhs, rhs = shapes.get(ins.operands[0]), shapes.get(ins.operands[1])
                if lhs is None or rhs is None:
                    continue
                found.append(DotOp(ins.name, lhs, rhs, ins.shapes[0], _dims(ins.attrs, "lhs_contracting_dims"),
                                   _dims(ins.attrs, "rhs_contracting_dims"), _dims(ins.attrs, "lhs_batch_dims"),
                                   _dims(ins.attrs, "rhs_batch_dims"), count))
            elif ins.opcode == "custom-call" and len(ins.operands) >= 2 and gemm_cost(
                    ins, shapes, cfg := backend_config(ins.attrs)) is not None:
                dn, out = cfg["gemm_backend_config"]["dot_dimension_numbers"], _library_results(ins)
                found.append(DotOp(ins.name, shapes[ins.operands[0]], shapes[ins.operands[1]], out[0],
                                   *(_ints(dn.get(f"{side}_{what}_dimensions")) for what in ("contracting", "batch")
                                     for side in ("lhs", "rhs")), count))
            elif ins.opcode == "fusion" and depth < 4:
                callee = (attr(ins.attrs, "calls") or "").lstrip("%")
                found += dots_in(mod.computations.get(callee, []), count, depth + 1)
        return found

    out = []
    for comp, m in mult.items():
        out += dots_in(mod.computations.get(comp, []), m)
    return out


_MESH_GROUPS = re.compile(r"mesh\[([^\]]*)\](?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?)?"
                          r"(?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}")


def _expand_mesh_groups(m: re.Match) -> tuple[tuple[int, ...], ...]:
    """replica_groups=mesh['a'=2,'b'=4] {'a'}: groups run along the named axes of an iota device mesh."""
    axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))
    names = [a for a, _ in axes]
    sizes = [int(n) for _, n in axes]
    ids = np.arange(int(np.prod(sizes)))
    for dims_g, perm_g in ((2, 3), (4, 5)):  # `<=[dims]T(perm)` or `device_ids=([dims]T(perm))`
        if m.group(dims_g):
            ids = ids.reshape([int(x) for x in m.group(dims_g).split(",")])
            if m.group(perm_g):
                ids = ids.transpose([int(x) for x in m.group(perm_g).split(",")])
            ids = ids.reshape(-1)
    ids = ids.reshape(sizes)
    group_axes = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(6))]
    rest = [i for i in range(len(names)) if i not in group_axes]
    gsize = int(np.prod([sizes[i] for i in group_axes])) if group_axes else 1
    arr = np.transpose(ids, rest + group_axes).reshape(-1, gsize)
    return tuple(tuple(int(x) for x in row) for row in arr)


def _expand_groups(spec: str | None) -> tuple[tuple[int, ...], ...]:
    if not spec:
        return ()
    spec = spec.strip()
    mm = _MESH_GROUPS.match(spec)
    if mm:
        return _expand_mesh_groups(mm)
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        arr = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(3):
            arr = arr.transpose([int(x) for x in m.group(3).split(",")])
        arr = arr.reshape(shape[0], -1) if len(shape) >= 1 else arr.reshape(1, -1)
        return tuple(tuple(int(x) for x in row) for row in arr)
    groups = re.findall(r"\{([\d,\s]*)\}", spec)
    return tuple(tuple(int(x) for x in g.split(",") if x.strip()) for g in groups if g.strip())


def mesh_axes_of_groups(groups, mesh) -> tuple[str, ...]:
    """Which mesh axes a collective's replica groups span. The groups hold partition ids: positions in the mesh's
    flat device order (the program's device assignment), not the devices' own ids, which differ wherever the mesh
    orders its devices physically (a TPU slice's mesh). Empty when they match no axis subset."""
    if mesh is None or not groups:
        return ()
    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    names = list(mesh.axis_names)
    target = {frozenset(g) for g in groups}

    def groups_along():  # (axis indices, the device groups they form), smallest axis sets first
        for r in range(1, len(names) + 1):
            for axes in itertools.combinations(range(len(names)), r):
                rest = [a for a in range(len(names)) if a not in axes]
                arr = np.transpose(ids, rest + list(axes)).reshape(-1, int(np.prod([ids.shape[a] for a in axes])))
                yield axes, [frozenset(int(x) for x in row) for row in arr]

    for axes, rows in groups_along():
        if set(rows) == target:
            return tuple(names[a] for a in axes)
    # groups inside one axis's groups but smaller (XLA split the axis): the smallest such axis set, marked "[part]"
    for axes, rows in groups_along():
        if all(any(g <= row for row in rows) for g in target if len(g) > 1):
            return tuple(f"{names[a]}[part]" for a in axes)
    return ()


ASYNC_START_TARGET = "AsyncCollectiveStart"
ASYNC_DONE_TARGET = "AsyncCollectiveDone"


def _collective_kind(opcode: str) -> str | None:
    return next((k for k in sorted(COLLECTIVE_KINDS, key=len, reverse=True) if opcode == k or opcode == k + "-start"),
                None)


def _fused_collectives(mod: Module, callee: str, depth: int = 0) -> list[tuple[str, Instr, float | None]]:
    """The collectives a fusion runs, as (kind it implements, the collective instruction, payload or None).

    libtpu wraps collectives in kCustom fusions: `%all-reduce-scatter.N` (an all-reduce of the whole array and a
    dynamic-slice of this device's part: a reduce-scatter, its payload the array before the slice); async pairs
    whose start fusion ends in custom-call AsyncCollectiveStart and whose done fusion (AsyncCollectiveDone) repeats
    the collective (not counted again); compute fusions that continue an in-flight collective carry a copy of it
    with the same channel (deduplicated by the caller)."""
    body = mod.computations.get(callee, [])
    if any(i.opcode == "custom-call" and ASYNC_DONE_TARGET in i.attrs for i in body):
        return []
    found: list[tuple[str, Instr, float | None]] = []
    users = _users(body)
    for i in body:
        kind = _collective_kind(i.opcode)
        if kind is None:
            if i.opcode == "fusion" and depth < 4:
                found += _fused_collectives(mod, (attr(i.attrs, "calls") or "").lstrip("%"), depth + 1)
            continue
        if kind == "all-reduce" and _feeds_dynamic_slice(i, users):
            found.append(("reduce-scatter", i, sum(sh.bytes for sh in i.shapes)))
        else:
            found.append((kind, i, None))
    return found


def _feeds_dynamic_slice(ins: Instr, users: dict[str, list[Instr]]) -> bool:
    """Whether an all-reduce's result (through tuple elements, bitcasts, copies) is sliced: a reduce-scatter."""
    frontier, seen = [ins.name], set()
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in users.get(n, []):
            if u.opcode == "dynamic-slice" and u.operands and u.operands[0] == n:
                return True
            if u.opcode in ("get-tuple-element", "bitcast", "copy", "reshape"):
                frontier.append(u.name)
    return False


def fusion_collective_role(mod: Module, ins: Instr) -> str | None:
    """'start' | 'done' | 'collective' for a fusion that is (half of) a collective, None for a compute fusion (which
    may still carry a copy of an in-flight collective). Such fusions are collectives, not kernels."""
    if ins.opcode != "fusion":
        return None
    body = mod.computations.get((attr(ins.attrs, "calls") or "").lstrip("%"), [])
    root = next((i for i in body if i.is_root), None)
    if any(i.opcode == "custom-call" and ASYNC_DONE_TARGET in i.attrs for i in body):
        return "done"
    if root is not None and root.opcode == "custom-call" and ASYNC_START_TARGET in root.attrs:
        return "start"
    if any(_collective_kind(i.opcode) for i in body) and all(
            i.opcode in _PLUMBING_OPS or _collective_kind(i.opcode) for i in body):
        return "collective"
    return None


# what a collective fusion holds besides its collective: operands, the offset of this device's slice, the slice
_PLUMBING_OPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy", "dynamic-slice", "slice",
                 "partition-id", "replica-id", "multiply", "add", "subtract", "convert", "reshape", "broadcast",
                 "iota", "compare", "select", "custom-call"}


def _collective_op(ins: Instr, kind: str, is_async: bool, count: int, by_name: dict[str, Instr], mesh,
                   n_devices: int | None, payload: float | None = None, bidirectional: bool = False) -> CollectiveOp:
    operand_bytes = sum(by_name[o].out_bytes for o in ins.operands if o in by_name)
    shapes = ins.shapes
    if payload is not None:
        pass
    elif kind == "all-gather":
        # async form's type is (operand, output): the gathered output is the last array
        payload = shapes[-1].bytes if shapes else 0
    elif kind == "collective-permute" and is_async:
        payload = shapes[0].bytes if shapes else operand_bytes
    elif kind == "all-reduce":
        payload = sum(s.bytes for s in shapes) if not is_async else operand_bytes or sum(s.bytes for s in shapes)
    else:
        payload = operand_bytes or (shapes[0].bytes if shapes else 0)
    dtype = shapes[0].dtype if shapes else "?"
    if kind == "collective-permute":
        groups = _expand_groups(attr(ins.attrs, "source_target_pairs"))
        gsize, ngroups = 2, max(len(groups), 1)
    else:
        groups = _expand_groups(attr(ins.attrs, "replica_groups"))
        if groups:
            gsize, ngroups = len(groups[0]), len(groups)
        else:  # empty replica_groups: all devices in one group
            gsize, ngroups = (n_devices or 1), 1
            if n_devices:
                groups = (tuple(range(n_devices)),)
    axes = mesh_axes_of_groups(groups, mesh)
    if kind == "collective-permute" and axes:  # point-to-point pairs lie along these axes
        axes = tuple(a if a.endswith("[part]") else f"{a}[part]" for a in axes) if len(groups) else axes
    arrays = max(1, sum(1 for o in ins.operands if o in by_name and len(by_name[o].shapes) == 1
                        and by_name[o].shapes[0].dtype != "token"))
    return CollectiveOp(ins.name, kind, HLO_TO_NUMPY.get(dtype, dtype), float(payload), gsize, ngroups, is_async,
                        count, groups if len(groups) <= 64 else (), axes, arrays, bidirectional,
                        torus_axes_of_group(groups[0] if groups else (), mesh))


def parse_collectives(text: str, mesh=None, n_devices: int | None = None, mod: Module | None = None
                      ) -> list[CollectiveOp]:
    """Every collective the device runs, with payload bytes per device, counted once as the kind it implements:
    sync and async forms (the -done halves skipped), inside while bodies and called computations (× their runs),
    and inside fusions (libtpu's kCustom collective fusions: reduce-scatter as all-reduce + dynamic-slice, async
    start/done fusion pairs; see _fused_collectives)."""
    mod = mod or parse_module(text)
    mult = _multiplicities(mod)
    by_name = mod.by_name()
    fusions = _collective_fusions(mod, mult)
    started = {_channel_key(inner, kind) for role, fused in fusions.values() if role is not None
               for kind, inner, _ in fused}
    out = []
    for comp, m in mult.items():
        seen: set[tuple] = set()
        both_ways = _bidirectional_permutes(mod.computations.get(comp, []))
        for ins in mod.computations.get(comp, []):
            op = ins.opcode
            if op.endswith("-done") or op.endswith("-update"):
                continue
            if op == "fusion":
                role, fused = fusions.get(ins.name, (None, []))
                for kind, inner, payload in fused:
                    key = _channel_key(inner, kind)
                    # a compute fusion carrying a copy of a collective in flight, started before it in this
                    # computation or by a collective fusion anywhere (a windowed einsum's loop body continues the
                    # all-gather its caller started: counted per loop trip, it was the collective × the trips)
                    if role is None and (key in seen or key in started):
                        continue
                    seen.add(key)
                    out.append(_collective_op(inner, kind, role != "collective", m, by_name, mesh, n_devices,
                                              payload))
                continue
            kind = _collective_kind(op)
            if kind is None:
                continue
            out.append(_collective_op(ins, kind, op.endswith("-start"), m, by_name, mesh, n_devices,
                                      bidirectional=ins.name in both_ways))
    return out


def _channel_key(inner: Instr, kind: str) -> tuple:
    return (attr(inner.attrs, "channel_id"), kind, tuple(inner.shapes))


def _collective_fusions(mod: Module, mult: dict[str, int]) -> dict[str, tuple[str | None, list]]:
    """Each fusion that runs collectives (by instruction name, unique in a module): its role
    (fusion_collective_role: None for a compute fusion carrying copies) and the collectives it runs."""
    out: dict[str, tuple[str | None, list]] = {}
    for comp in mult:
        for ins in mod.computations.get(comp, []):
            if ins.opcode == "fusion":
                fused = _fused_collectives(mod, (attr(ins.attrs, "calls") or "").lstrip("%"))
                if fused:
                    out[ins.name] = (fusion_collective_role(mod, ins), fused)
    return out


def _bidirectional_permutes(instrs: list[Instr]) -> set[str]:
    """Names of the async collective-permutes started while another is in flight (started, not yet done) whose
    source-target pairs are its own reversed: the two halves of one bidirectional ring step."""
    in_flight: dict[str, frozenset] = {}
    both: set[str] = set()
    for ins in instrs:
        if ins.opcode == "collective-permute-start":
            pairs = frozenset(_expand_groups(attr(ins.attrs, "source_target_pairs")))
            reverse = frozenset((t, s) for s, t in pairs)
            for other, theirs in in_flight.items():
                if pairs and theirs == reverse and pairs != reverse:
                    both.update((other, ins.name))
            in_flight[ins.name] = pairs
        elif ins.opcode == "collective-permute-done":
            for o in ins.operands:
                in_flight.pop(o, None)
    return both


def xla_flags_in(text: str) -> dict:
    """Backend config strings are JSON; exposed for debugging."""
    try:
        return json.loads(text)
    except ValueError:
        return {}
