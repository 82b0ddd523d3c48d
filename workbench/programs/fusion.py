"""The fusion explorer: what XLA fused, what each kernel costs, and what fusing saved — on the host or a TPU target.

    prog = op_program("elementwise", n=1 << 24)              # or model_program("small", "layer"), function_program
    result = explore(prog, disable_passes=[("fusion",)], barrier_after=("add",))
    result.variants["no-fusion"].bytes, result.saved_bytes, result.speedup

A study is a program here: it builds a `Program` (a function and its abstract inputs, for the host or a target's
compile-only devices), compiles it once per `Variant` through workbench.cost.compile (the compiler options go to that one
compile: `lowered.compile(compiler_options=...)`, so every variant lives in one process), reads every kernel with
workbench.cost.hlo.parse_kernels, prices each at its own roof with workbench.roofline.prediction.kernel_roof, and on the host
measures the program with workbench.measure.harness.measure and each kernel from a jax.profiler trace
(workbench.measure.harness.profile_kernels). Records go to the results store, one per variant.

Variants:
    default         the compiler as it is
    no-fusion       every pass that fused ops in this program's default compile switched off. The passes are read
                    from the compiler's own dump (xla_dump_hlo_pass_re): a pass fuses when, after it, the program has
                    fewer kernels and more ops inside fusions (XLA:CPU in jax 0.10: `fusion`, the loop/input/output
                    fusion pass, and `dot-library-rewriter`, which builds the YNNPACK/oneDNN dot fusions)
    no:<a>+<b>      named passes off (xla_disable_hlo_passes), checked against the passes the pipeline ran
    flags:<...>     an XLA flag set given by the user, as compile options
    barriers        the program rewritten with jax.lax.optimization_barrier after every equation of the chosen
                    primitives; XLA:CPU drops optimization barriers early (the pass is found in the dump the same
                    way: the one after which the barriers are gone; `cse_barrier_expander` in jax 0.10), so that pass
                    is switched off for this variant and the barriers then split the fusions at those points

Kernel kinds: loop, input/reduction (XLA's kInput), output (kOutput), dot/convolution (a fusion around a dot or
convolution), ynnpack / onednn (XLA:CPU's library fusions, kCustom), custom (other kCustom), unfused (one op alone,
XLA:CPU's fusion-wrapper shell included).
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend.core import Literal
from jax.sharding import NamedSharding, PartitionSpec

from models.layers import Block
from models.precision import get_policy
from models.presets import get_config
from partitioning import topology as topo
from partitioning.mesh import make_mesh
from workbench.compat import no_persistent_cache
from workbench.cost.compile import compile_program
from workbench.cost.hlo import kernel_sources, parse_kernels, parse_module
from workbench.errors import WorkbenchError
from workbench.hardware.devices import default_platform
from workbench.hardware.spec import dtype_name
from workbench.measure.calibrate import cache_dir, get_spec
from workbench.measure.harness import measure, measure_steps, profile_kernels, random_inputs
from workbench.programs.ops import build
from workbench.programs.predict import target_spec
from workbench.programs.step import build_train_step
from workbench.results.store import Store, make_record
from workbench.roofline.prediction import kernel_roof, predict, roof_seconds

KINDS = ("loop", "input/reduction", "output", "dot/convolution", "ynnpack", "onednn", "custom", "unfused")
_PASS_LIST_RE = re.compile(r"^[A-Za-z0-9_.\-]+(,[A-Za-z0-9_.\-]+)*$")
_DUMP_RE = re.compile(r"\.(\d{4})\.[^.]*\.after_(.+?)\.before_(.+?)\.txt$")


# ------------------------------------------------------------------------------------------------------ programs
@dataclasses.dataclass(frozen=True)
class Program:
    """One program to explore: `fn(*args)` with abstract `args` (ShapeDtypeStructs, sharded for a target)."""

    name: str
    fn: Callable  # plain or jitted
    args: tuple
    target: str = "host"  # 'host' or a target name (tpu-v5e:2x2, ...)
    platform: str = "cpu"  # cpu | tpu | gpu: the compiler
    n_devices: int = 1
    compute_dtype: str | None = None  # the dtype priced; None: the compiled program's dominant float dtype
    stateful: bool = False  # fn(state, *rest) -> (new state, ...) with state donated (a training step)
    make_inputs: Callable[[], tuple] | None = None  # concrete inputs for measuring (default: random_inputs(args))
    description: str = ""
    spec: dict = dataclasses.field(default_factory=dict)

    @property
    def local(self) -> bool:
        return self.target == "host"

    def to_record(self) -> dict:
        return {"name": self.name, "target": self.target, "platform": self.platform, "n_devices": self.n_devices,
                "compute_dtype": self.compute_dtype, "description": self.description, **self.spec}


def _target_devices(target: str | None):
    """(target name, platform, devices) for 'host'/None or a TPU/GPU target (compile-only devices)."""
    if target in (None, "host"):


        default_platform()
        return "host", "cpu", [jax.devices("cpu")[0]]

    t = topo.parse_target(target)
    if t.kind == "gpu" and topo.gpu_compiler_for(t, "auto") != "xla-gpu":
        raise WorkbenchError(f"--target {t.name}: the fusion explorer needs XLA:GPU's own compiler, which is not "
                             "installed here (the JAX CUDA plugin); without it a GPU program would be XLA:CPU's. "
                             "Use the host or a TPU target")
    devices = topo.target_devices(t)
    return t.name, t.kind, devices


def _sharded(args, sharding):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)


def function_program(fn: Callable, *args, name: str = "function", target: str | None = None,
                     description: str = "") -> Program:
    """A user function (plain, not jitted) on abstract args; on a target it is compiled for one of its chips."""
    tname, platform, devices = _target_devices(target)
    if tname != "host":
        args = _sharded(args, jax.sharding.SingleDeviceSharding(devices[0]))
    return Program(name, fn, tuple(args), tname, platform, 1, None, description=description,
                   spec={"program": "function"})


def op_program(op: str, dtype: str = "float32", target: str | None = None, **sizes) -> Program:
    """A built-in op (workbench.programs.ops: matmul, elementwise, softmax, layernorm, attention) with its size options."""
    o = build(op, dtype, **sizes)
    p = function_program(o.fn, *o.args, name=op, target=target, description=o.description)
    return dataclasses.replace(p, compute_dtype=o.dtype, spec={"program": "op", "op": op, "sizes": o.sizes,
                                                               "dtype": o.dtype})


MODEL_PROGRAMS = ("train", "forward", "layer", "mlp", "attention")


def model_program(preset: str, program: str = "layer", *, target: str | None = None, batch: int = 8,
                  seq: int | None = None, precision: str = "float32", overrides: str | None = None) -> Program:
    """A model's full training step (`train`), its forward pass and loss (`forward`), one transformer block
    (`layer`: x + attn(norm(x)), then x + mlp(norm(x)), on a (batch, seq, d_model) float32 residual stream), or one
    half of it (`mlp`: x + mlp(norm(x)); `attention`: x + attn(norm(x))), data parallel over the target's chips (the
    host: one device)."""
    if program not in MODEL_PROGRAMS:
        raise WorkbenchError(f"--program {program!r}: choose one of {', '.join(MODEL_PROGRAMS)}")
    cfg = get_config(preset, overrides)
    seq = cfg.seq_len if seq is None else int(seq)
    tname, platform, devices = _target_devices(target)
    n = len(devices)
    if batch < 1 or batch % n:
        raise WorkbenchError(f"--batch {batch} must be a positive multiple of the {n} chips of {tname}")
    if seq < 1 or (cfg.pos == "learned" and seq > cfg.seq_len):
        raise WorkbenchError(f"--seq {seq}: give 1..{cfg.seq_len} for {preset}")
    mesh = make_mesh({"data": n}, devices=devices)
    spec = {"program": program, "preset": preset, "batch": batch, "seq": seq, "precision": precision,
            "overrides": overrides, "strategy": "dp"}
    desc = f"{preset} {program} (batch {batch}, seq {seq}, {precision}, data-parallel over {n} device(s))"
    if program in ("train", "forward"):
        prog = build_train_step(cfg, policy=precision, mesh=mesh, strategy="dp", batch_size=batch,
                                      seq_len=seq, abstract=True)
        st, bt = prog.state, prog.batch
        if program == "train":
            def concrete():
                p2 = build_train_step(cfg, policy=precision, mesh=mesh, strategy="dp", batch_size=batch,
                                            seq_len=seq)
                return (p2.state, p2.batch)

            return Program(f"{preset}:{program}", prog.step, (st, bt), tname, platform, n, precision_dtype(precision),
                           stateful=True, make_inputs=concrete if tname == "host" else None, description=desc,
                           spec=spec)
        return Program(f"{preset}:{program}", prog.eval_step, (st["params"], st["gmeta"], st["rest"], bt), tname,
                       platform, n, precision_dtype(precision), description=desc, spec=spec)

    policy = get_policy(precision)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Block(cfg, policy, nnx.Rngs(0))))
    rep, data = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    abs_state = _sharded(state, rep)
    x = jax.ShapeDtypeStruct((batch, seq, cfg.d_model), jnp.float32, sharding=data)
    pos = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=data)

    def layer(state, x_btd, positions_bt):
        return nnx.merge(graphdef, state)(x_btd, positions_bt)[0]

    def mlp(state, x_btd, positions_bt):
        blk = nnx.merge(graphdef, state)
        return blk.add(x_btd, blk.mlp((blk.norm_attn if blk.parallel else blk.norm_mlp)(x_btd))[0])

    def attention(state, x_btd, positions_bt):
        blk = nnx.merge(graphdef, state)
        return blk.add(x_btd, blk.attn(blk.norm_attn(x_btd), positions_bt))

    fn = {"layer": layer, "mlp": mlp, "attention": attention}[program]
    return Program(f"{preset}:{program}", fn, (abs_state, x, pos), tname, platform, n, precision_dtype(precision),
                   description=desc, spec=spec)


def precision_dtype(policy: str) -> str:
    return dtype_name(get_policy(policy).compute_dtype)


# ------------------------------------------------------------------------------------------------------ variants
@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    compiler_options: tuple[tuple[str, Any], ...] = ()
    barrier_after: tuple[str, ...] = ()  # primitives after which the program gets an optimization barrier
    description: str = ""

    def to_record(self) -> dict:
        return {"name": self.name, "compiler_options": dict(self.compiler_options),
                "barrier_after": list(self.barrier_after), "description": self.description}


def parse_pass_list(text: str) -> tuple[str, ...]:
    """'fusion,dot-library-rewriter' -> ('fusion', 'dot-library-rewriter'); one-line error otherwise."""
    t = (text or "").strip()
    if not _PASS_LIST_RE.match(t):
        raise WorkbenchError(f"--disable-passes {text!r}: give XLA pass names joined by commas, e.g. "
                             "--disable-passes fusion,dot-library-rewriter (--list-passes shows the passes the "
                             "compiler runs on the program)")
    return tuple(t.split(","))


def parse_xla_flags(text: str) -> tuple[tuple[str, Any], ...]:
    """'--xla_cpu_enable_fast_math=true --xla_foo=3' -> (('xla_cpu_enable_fast_math', 'true'), ...)."""
    out = []
    for tok in (text or "").split():
        name, eq, val = tok.lstrip("-").partition("=")
        if not re.match(r"^xla_[A-Za-z0-9_]+$", name):
            raise WorkbenchError(f"--xla-flags: {tok!r} is not an XLA flag; write --xla_NAME=VALUE, e.g. "
                                 "--xla-flags '--xla_cpu_enable_fast_math=true'")
        out.append((name, _typed(val) if eq else True))
    if not out:
        raise WorkbenchError("--xla-flags is empty; write e.g. --xla-flags '--xla_cpu_enable_fast_math=true'")
    return tuple(out)


def _typed(v: str):
    """XLA flag text -> the Python value compile options take (bool and int options refuse strings)."""
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    if re.fullmatch(r"-?\d+", v):
        return int(v)
    return v


def flag_variant(text: str) -> Variant:
    opts = parse_xla_flags(text)
    return Variant("flags:" + " ".join(f"{k}={v}" for k, v in opts), opts, description=f"XLA flags {text.strip()}")


def passes_variant(passes: tuple[str, ...]) -> Variant:
    return Variant("no:" + "+".join(passes), (("xla_disable_hlo_passes", ",".join(passes)),),
                   description=f"passes {', '.join(passes)} off")


# ------------------------------------------------------------------------------------------ barriers (rewriting)
def with_barriers(fn: Callable, args: tuple, after: tuple[str, ...] | Callable) -> tuple[Callable, int, set]:
    """`fn` rewritten so that the outputs of every equation whose primitive is in `after` (or for which
    `after(index, eqn)` is true) pass through jax.lax.optimization_barrier. Calls of jitted functions are inlined so
    their equations count too; other higher-order primitives (scan, cond, remat) are kept whole.

    Returns (the rewritten function, how many barriers it inserts, the primitive names the program has)."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    pred = after if callable(after) else (lambda i, e: e.primitive.name in after)
    seen: set[str] = set()
    count = [0]

    def run(jaxpr, consts, vals, depth=0):
        env = {}
        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, vals):
            env[v] = x
        for i, eqn in enumerate(jaxpr.eqns):
            inv = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
            seen.add(eqn.primitive.name)
            sub = eqn.params.get("jaxpr")
            if eqn.primitive.name in ("pjit", "jit", "closed_call") and sub is not None and depth < 16:
                outs = run(sub.jaxpr, sub.consts, inv, depth + 1)
            else:
                bp = eqn.primitive.get_bind_params(eqn.params)  # jax < 0.7: (subfuns, params); now: params
                subfuns, bp = bp if isinstance(bp, tuple) else ((), bp)
                outs = eqn.primitive.bind(*subfuns, *inv, **bp)
                outs = list(outs) if eqn.primitive.multiple_results else [outs]
                if pred(i, eqn) and outs:
                    outs = list(jax.lax.optimization_barrier(tuple(outs)))
                    count[0] += 1
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        return [v.val if isinstance(v, Literal) else env[v] for v in jaxpr.outvars]

    def rewritten(*a):
        outs = run(closed.jaxpr, closed.consts, jax.tree.leaves(a))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    jax.eval_shape(rewritten, *args)  # counts the barriers
    n = count[0]
    return rewritten, n, seen


# ------------------------------------------------------------------------------------------ the compiler's passes
@dataclasses.dataclass(frozen=True)
class PassEffect:
    """What one pass of the compiler's pipeline did to this program (from its dump)."""

    name: str
    kernels_before: int
    kernels_after: int
    fused_ops_before: int
    fused_ops_after: int
    barriers_before: int
    barriers_after: int

    @property
    def fuses(self) -> bool:
        return self.kernels_after < self.kernels_before and self.fused_ops_after > self.fused_ops_before

    @property
    def drops_barriers(self) -> bool:
        return self.barriers_after < self.barriers_before

    def to_record(self) -> dict:
        return dataclasses.asdict(self)


def _shape_of_hlo(text: str) -> tuple[int, int, int]:
    """(kernels, ops inside fusions, optimization barriers) of one HLO module text."""
    mod = parse_module(text)
    ks = parse_kernels(text, mod)
    fused = sum(sum(c for _, c in k.ops) for k in ks if k.kind.startswith("k"))
    barriers = sum(1 for body in mod.computations.values() for i in body if i.opcode == "opt-barrier")
    return len(ks), fused, barriers


def read_pass_dump(dump_dir: str) -> tuple[list[str], list[PassEffect]]:
    """The passes a compile ran (names in its per-pass dump: every pass that changed the module and the pass after
    it) and what each changing pass did to kernels, fused ops and barriers."""
    files = []
    for f in glob.glob(os.path.join(dump_dir, "*.txt")):
        m = _DUMP_RE.search(os.path.basename(f))
        if m:
            files.append((int(m.group(1)), m.group(2), m.group(3), f))
    files.sort()
    names: list[str] = []
    effects = []
    prev = None
    for _, after, before, f in files:
        for nm in (after, before):
            if nm not in ("pipeline-start", "pipeline-end") and nm not in names:
                names.append(nm)
        with open(f, encoding="utf-8", errors="replace") as fh:
            cur = _shape_of_hlo(fh.read())
        if prev is not None and after not in ("pipeline-start", "pipeline-end"):
            effects.append(PassEffect(after, prev[0], cur[0], prev[1], cur[1], prev[2], cur[2]))
        prev = cur
    return names, effects


# ------------------------------------------------------------------------------------------------------ results
@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of a variant's program (per device, one execution; `count` executions per program run)."""

    name: str
    kind: str  # one of KINDS
    xla_kind: str  # kLoop | kInput | kOutput | kCustom | an unfused op's opcode
    library: str
    ops: dict  # opcode -> count inside
    output_shape: str
    bytes_in: float
    bytes_out: float
    flops: float
    transcendentals: float
    count: int
    predicted_s: float  # per program run (count executions), at the kernel's own roof
    bound: str  # compute | memory
    measured_s: float | None = None  # per program run, from the trace (host only)
    calls: float | None = None
    traced_async: bool = False  # a dot XLA:CPU hands to Eigen asynchronously: the trace shows only its dispatch

    @property
    def bytes(self) -> float:
        return self.bytes_in + self.bytes_out

    def to_record(self) -> dict:
        d = dataclasses.asdict(self)
        d["bytes"] = self.bytes
        return d


@dataclasses.dataclass(frozen=True)
class VariantResult:
    variant: Variant
    kernels: tuple[Kernel, ...]
    bytes: float  # Σ kernel bytes in + out × executions (per device)
    flops: float
    transcendentals: float
    xla_bytes: float  # the compiler's cost_analysis bytes accessed
    predicted_s: float  # workbench.roofline.prediction.predict's headline
    kernel_predicted_s: float  # Σ kernels at their roofs (no first-touch or call overhead)
    measured_s: float | None
    measured_iqr_s: float | None
    kernel_measured_s: float | None  # Σ traced kernel times per run
    compile_s: float
    barriers: int
    notes: tuple[str, ...]
    record_id: str | None = None

    def to_record(self) -> dict:
        return {"kernels": len(self.kernels), "kernel_launches": sum(k.count for k in self.kernels),
                "bytes": self.bytes, "flops": self.flops, "transcendentals": self.transcendentals,
                "xla_bytes": self.xla_bytes, "predicted_s": self.predicted_s,
                "kernel_predicted_s": self.kernel_predicted_s, "measured_s": self.measured_s,
                "measured_iqr_s": self.measured_iqr_s, "kernel_measured_s": self.kernel_measured_s,
                "compile_s": self.compile_s, "barriers": self.barriers, "by_kind": by_kind(self.kernels),
                **self.variant.to_record(), "notes": list(self.notes), "record_id": self.record_id}


def kernel_kind(xla_kind: str, library: str, ops: dict) -> str:
    if not xla_kind.startswith("k"):
        return "unfused"
    if xla_kind == "kCustom":
        lib = library.lower()
        return "ynnpack" if "ynn" in lib else "onednn" if ("onednn" in lib or "mkl" in lib) else "custom"
    real = {o: c for o, c in ops.items() if o not in ("constant", "opt-barrier")}
    if sum(real.values()) <= 1:
        return "unfused"  # XLA:CPU's fusion-wrapper puts single ops in a kLoop shell
    if "dot" in ops or "convolution" in ops:
        return "dot/convolution"
    return {"kLoop": "loop", "kInput": "input/reduction", "kOutput": "output"}.get(xla_kind, "custom")


def by_kind(kernels) -> dict:
    """Per fusion kind: kernels, bytes, predicted and measured seconds, and the prediction's error where measured
    (median over kernels of (predicted − measured) / measured, and of the kind's totals). Kernels whose traced time is
    an asynchronous dot's dispatch (profile_kernels' `async`) are left out of the measured side."""
    out: dict[str, dict] = {}
    for k in kernels:
        d = out.setdefault(k.kind, {"kernels": 0, "bytes": 0.0, "predicted_s": 0.0, "measured_s": None, "_err": [],
                                    "_pm": 0.0})
        d["kernels"] += 1
        d["bytes"] += k.bytes * k.count
        d["predicted_s"] += k.predicted_s
        if k.measured_s is not None and not k.traced_async:  # an async dot's trace is its dispatch only
            d["measured_s"] = (d["measured_s"] or 0.0) + k.measured_s
            d["_pm"] += k.predicted_s
            if k.measured_s > 0:
                d["_err"].append((k.predicted_s - k.measured_s) / k.measured_s)
    for d in out.values():
        errs, pm = d.pop("_err"), d.pop("_pm")
        d["median_error"] = statistics.median(errs) if errs else None
        d["error"] = (pm - d["measured_s"]) / d["measured_s"] if d["measured_s"] else None  # over measured kernels
    return dict(sorted(out.items(), key=lambda kv: -(kv[1]["measured_s"] or kv[1]["predicted_s"])))


@dataclasses.dataclass(frozen=True)
class FusionResult:
    program: Program
    variants: dict  # name -> VariantResult (default first)
    diffs: dict  # name -> diff against the default
    fusion_passes: tuple[str, ...]
    barrier_pass: str | None
    passes: tuple[str, ...]
    compiler: str
    host_compare: dict | None
    notes: tuple[str, ...]

    @property
    def default(self) -> VariantResult:
        return self.variants["default"]

    @property
    def saved_bytes(self) -> float | None:
        v = self.variants.get("no-fusion")
        return v.bytes - self.default.bytes if v else None

    @property
    def speedup(self) -> dict:
        v, d = self.variants.get("no-fusion"), self.default
        if v is None:
            return {"measured": None, "predicted": None}
        return {"measured": v.measured_s / d.measured_s if v.measured_s and d.measured_s else None,
                "predicted": v.predicted_s / d.predicted_s if d.predicted_s else None}

    def tradeoffs(self, variant: str = "no-fusion", top: int = 10) -> list[dict]:
        """Per default kernel that `variant` split: the fused kernel against its parts — bytes, predicted and (host)
        measured time, the dots' achieved rate — and which side wins: where fusion loses, the kernels say why."""
        d = self.diffs.get(variant)
        if not d:
            return []
        dk = {k.name: k for k in self.default.kernels}
        vk = {k.name: k for k in self.variants[variant].kernels}
        rows = []
        for s in d["split"]:
            f, parts = dk[s["kernel"]], [vk[p] for p in s["into"]]
            dot_parts = [p for p in parts if "dot" in p.ops or "convolution" in p.ops]
            meas = f.measured_s is not None and all(p.measured_s is not None for p in parts) and not (
                f.traced_async or any(p.traced_async for p in parts))  # an async dot's trace is its dispatch only
            fused_dot_rate = (f.flops * f.count / f.measured_s if meas and f.measured_s and dot_parts else None)
            part_dot_rate = (sum(p.flops * p.count for p in dot_parts) / sum(p.measured_s for p in dot_parts)
                             if meas and dot_parts and sum(p.measured_s for p in dot_parts) > 0 else None)
            row = {"kernel": f.name, "kind": f.kind, "ops": f.ops, "parts": len(parts),
                   "bytes_fused": f.bytes * f.count, "bytes_parts": sum(p.bytes * p.count for p in parts),
                   "predicted_fused_s": f.predicted_s, "predicted_parts_s": sum(p.predicted_s for p in parts),
                   "measured_fused_s": f.measured_s if meas else None,
                   "measured_parts_s": sum(p.measured_s for p in parts) if meas else None,
                   "fused_flops_per_s": fused_dot_rate, "parts_dot_flops_per_s": part_dot_rate}
            t_f, t_p = row["measured_fused_s"], row["measured_parts_s"]
            row["fusion"] = ("loses" if t_f > t_p else "wins") if meas and t_p else None
            rows.append(row)
        rows.sort(key=lambda r: -abs((r["measured_fused_s"] or r["predicted_fused_s"])
                                     - (r["measured_parts_s"] or r["predicted_parts_s"])))
        return rows[:top]

    def to_record(self) -> dict:
        return {"program": self.program.to_record(), "compiler": self.compiler,
                "tradeoffs": {n: self.tradeoffs(n) for n in self.diffs},
                "variants": {n: v.to_record() for n, v in self.variants.items()},
                "kernels": {n: [k.to_record() for k in v.kernels] for n, v in self.variants.items()},
                "saved_bytes": self.saved_bytes, "speedup": self.speedup, "diff": self.diffs,
                "prediction_error_by_kind": {n: {k: {kk: vv for kk, vv in d.items()
                                                     if kk in ("kernels", "predicted_s", "measured_s", "error",
                                                               "median_error")}
                                                 for k, d in by_kind(v.kernels).items()}
                                             for n, v in self.variants.items() if v.measured_s is not None},
                "fusion_passes": list(self.fusion_passes), "barrier_pass": self.barrier_pass,
                "passes_seen": len(self.passes), "host_compare": self.host_compare, "notes": list(self.notes)}


# ------------------------------------------------------------------------------------------------------ diffs
def _match(a_src: dict[str, dict], b_src: dict[str, dict]) -> dict[str, str]:
    """Each kernel of A -> the kernel of B that computes most of its source ops (by 'opcode@op_name' tokens)."""
    index: dict[str, list[str]] = {}
    for name, toks in b_src.items():
        for t in toks:
            index.setdefault(t, []).append(name)
    out = {}
    for name, toks in a_src.items():
        score: dict[str, int] = {}
        for t, c in toks.items():
            for other in index.get(t, []):
                score[other] = score.get(other, 0) + min(c, b_src[other][t])
        if score:
            out[name] = max(score, key=lambda o: (score[o], o))
    return out


def diff(base: VariantResult, base_src: dict, other: VariantResult, other_src: dict) -> dict:
    """What `other` did differently from `base`: kernels of base it split (into which of its own), kernels of its
    own that merge several of base's, and the bytes moved and saved. Kernels are matched by the source ops they
    compute (opcode and the op_name of the HLO metadata), so it holds across two compiles of one program."""
    a_of_b = _match(other_src, base_src)  # other kernel -> base kernel it mostly computes
    b_of_a = _match(base_src, other_src)
    bk = {k.name: k for k in base.kernels}
    ok = {k.name: k for k in other.kernels}
    split, merged = [], []
    for b in bk:
        parts = sorted(o for o, bb in a_of_b.items() if bb == b and o in ok)
        if len(parts) > 1:
            split.append({"kernel": b, "kind": bk[b].kind, "into": parts, "bytes_before": bk[b].bytes * bk[b].count,
                          "bytes_after": sum(ok[p].bytes * ok[p].count for p in parts)})
    for o in ok:
        parts = sorted(b for b, oo in b_of_a.items() if oo == o and b in bk)
        if len(parts) > 1:
            merged.append({"kernel": o, "kind": ok[o].kind, "from": parts,
                           "bytes_before": sum(bk[p].bytes * bk[p].count for p in parts),
                           "bytes_after": ok[o].bytes * ok[o].count})
    split.sort(key=lambda d: -d["bytes_after"])
    merged.sort(key=lambda d: -d["bytes_before"])
    return {"kernels": len(other.kernels) - len(base.kernels), "bytes": other.bytes - base.bytes,
            "saved_bytes_by_base": other.bytes - base.bytes,
            "predicted_s": other.predicted_s - base.predicted_s,
            "measured_s": (other.measured_s - base.measured_s) if other.measured_s and base.measured_s else None,
            "split": split[:40], "merged": merged[:40], "n_split": len(split), "n_merged": len(merged),
            "method": "kernels matched by the source ops they compute (HLO opcode + op_name metadata)"}


# ------------------------------------------------------------------------------------------------------ explore
def _hw(prog: Program):
    if prog.local:
        return get_spec("host")

    return target_spec(topo.parse_target(prog.target))


def _xla_error(e: Exception) -> str:
    msg = (str(e).strip().splitlines() or [type(e).__name__])[0].strip()
    for p in ("INVALID_ARGUMENT: ", "JaxRuntimeError: "):
        msg = msg.split(p, 1)[-1] if p in msg else msg
    return msg[:300]


def _compile(prog: Program, fn, options: dict, dump_dir: str | None = None, analytic: bool = False):
    opts = dict(options)
    if dump_dir:
        opts.update(xla_dump_to=dump_dir, xla_dump_hlo_pass_re=".*")
    try:
        try:
            return compile_program(fn, *prog.args, n_devices=prog.n_devices, analytic=analytic,
                                   compute_dtype=prog.compute_dtype, compiler_options=opts or None)
        except Exception as e:  # noqa: BLE001 - a string option given a number: once more as text
            if "not a valid string value" not in str(e):
                raise
            opts = {k: (str(v).lower() if isinstance(v, bool) else str(v)) if k.startswith("xla_") else v
                    for k, v in opts.items()}
            return compile_program(fn, *prog.args, n_devices=prog.n_devices, analytic=analytic,
                                   compute_dtype=prog.compute_dtype, compiler_options=opts)
    except WorkbenchError:
        raise
    except Exception as e:  # noqa: BLE001 - the compiler's words, one line
        if "compile option" in str(e) or "While setting option" in str(e):
            bad = ", ".join(f"{k}={v}" for k, v in options.items())
            raise WorkbenchError(f"XLA rejected the compile options {bad}: {_xla_error(e)}") from None
        raise


def _inputs(prog: Program):
    return prog.make_inputs() if prog.make_inputs else random_inputs(prog.args)


def _measure(prog: Program, compiled, hlo_text: str, repeats: int, profile_steps: int, ceiling: float | None):
    """(Measurement, profile_kernels rows by name) of one compiled variant on the host."""
    inputs = _inputs(prog)
    if prog.stateful:
        box = [inputs[0]]

        def step(_):
            out = compiled(box[0], *inputs[1:])
            box[0] = out[0]
            return out[1]

        m = measure_steps(step, warmup=1, repeats=repeats)
    else:
        def step(_):
            return compiled(*inputs)

        m = measure(compiled, *inputs, warmup=1, repeats=repeats)
    prof = (profile_kernels(step, hlo_text, steps=profile_steps, top=10**6, ceiling_flops=ceiling)
            if profile_steps else None)
    jax.block_until_ready(step(0))
    return m, ({r["name"]: r for r in prof["kernels"]} if prof else {})


def _variant(prog: Program, v: Variant, comp, hw, *, measure_it: bool, repeats: int, profile_steps: int,
             barriers: int = 0, notes=(), store=None):
    """A compiled variant read, priced per kernel, measured (host) and recorded."""
    cost = comp.cost
    pred = predict(cost, hw, dtype=prog.compute_dtype or cost.compute_dtype, simulated_mesh=False)
    meas, prof = (None, {})
    if measure_it:
        meas, prof = _measure(prog, comp.compiled, comp.hlo_text, repeats, profile_steps,
                              hw.peak(prog.compute_dtype or cost.compute_dtype))
    kernels = []
    for k in cost.kernels:
        kc, km = kernel_roof(k, hw, pred.peak_dtype, pred.memory_bw)
        ops = dict(k.ops)
        r = prof.get(k.name)
        traced = measure_it and profile_steps
        kernels.append(Kernel(k.name, kernel_kind(k.kind, k.library, ops), k.kind, k.library, ops, k.output_shape,
                              k.bytes_in, k.bytes_out, k.flops, k.transcendentals, k.count, roof_seconds(k, hw, kc, km) * k.count,
                              "compute" if kc >= km else "memory",
                              r["ms"] / 1e3 if (traced and r) else None, r["calls"] if r else None,
                              bool(r and r.get("async"))))
    traced = measure_it and profile_steps
    kms = sum(k.measured_s or 0.0 for k in kernels) if traced else None
    if traced and any(k.measured_s is None for k in kernels):
        notes = tuple(notes) + (f"{sum(1 for k in kernels if k.measured_s is None)} of {len(kernels)} kernels "
                                "have no event in the trace (not timed)",)
    res = VariantResult(v, tuple(kernels), sum(k.bytes * k.count for k in kernels),
                        sum(k.flops * k.count for k in kernels), sum(k.transcendentals * k.count for k in kernels),
                        cost.bytes_accessed, pred.predicted_s, sum(k.predicted_s for k in kernels),
                        meas.median_s if meas else None, meas.iqr_s if meas else None, kms, comp.compile_s, barriers,
                        tuple(notes) + tuple(meas.notes if meas else ()))
    rec = make_record("fusion", {**prog.to_record(), "variant": v.name, "variant_spec": v.to_record()}, cost, pred,
                      meas, extra={"fusion": {**res.to_record(), "kernels": [k.to_record() for k in kernels]}})
    rid = (store or Store()).append(rec)["id"]
    return dataclasses.replace(res, record_id=rid), kernel_sources(comp.hlo_text)


def _compile_dumped(prog: Program, fn) -> tuple:
    """(compiled, pass names, pass effects) of `fn` compiled once with the per-pass HLO dump on."""
    dump = tempfile.mkdtemp(prefix="workbench-fusion-dump-")
    try:
        with no_persistent_cache() as uncached:  # a cached executable would come back without its dump
            comp = _compile(prog, fn, uncached, dump)
        passes, effects = read_pass_dump(dump)
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    return comp, passes, effects


def _check_in_pipeline(pass_lists: list[tuple[str, ...]], pipeline: list[str], compiler: str) -> None:
    """On XLA:CPU the whole pipeline is known before anything compiles (or calibrates): reject unknown passes."""
    for pl in pass_lists:
        unknown = [p for p in pl if pipeline and p not in pipeline]
        if unknown:
            raise WorkbenchError(f"--disable-passes: {', '.join(unknown)} is not a pass of {compiler}'s pipeline; "
                                 "give comma-separated pass names from it, e.g. --disable-passes "
                                 "fusion,dot-library-rewriter (--list-passes shows them all)")


def _check_ran(pass_lists: list[tuple[str, ...]], passes: list[str], effects, compiler: str) -> None:
    """Reject a pass to disable that the compiler did not run on this program."""
    for pl in pass_lists:
        unknown = [p for p in pl if p not in passes]
        if unknown:
            raise WorkbenchError(f"--disable-passes: {', '.join(unknown)} is not a pass {compiler} ran on this "
                                 f"program; give comma-separated pass names from its pipeline, e.g. "
                                 f"--disable-passes {','.join(p.name for p in effects if p.fuses) or 'fusion'} "
                                 "(--list-passes shows them all)")


def _barrier_variant(prog: Program, barrier_after: tuple[str, ...] | Callable, compiler: str,
                     say: Callable[[str], None]) -> tuple[tuple, str | None]:
    """((variant, fn, options, barriers, notes), the pass that drops barriers before fusing or None)."""
    if barrier_after:
        fn_b, nb, prims = with_barriers(prog.fn, prog.args, barrier_after)
        if nb == 0:
            raise WorkbenchError(f"--barrier-after {','.join(barrier_after) if not callable(barrier_after) else '(predicate)'}"
                                 f" matched no operation of {prog.name}; its primitives: {', '.join(sorted(prims))}")
        label = ",".join(barrier_after) if not callable(barrier_after) else "predicate"
    else:
        fn_b, nb, label = prog.fn, None, "in the program"
    vnotes = []
    say("barriers: finding the pass that drops optimization barriers")
    _, _, beff = _compile_dumped(prog, fn_b)
    first_fusing = next((i for i, e in enumerate(beff) if e.fuses), len(beff))
    drops = tuple(dict.fromkeys(e.name for i, e in enumerate(beff) if e.drops_barriers and i < first_fusing))
    late = tuple(dict.fromkeys(e.name for i, e in enumerate(beff) if e.drops_barriers and i >= first_fusing))
    opts = {}
    barrier_pass = None
    if drops:
        barrier_pass = ",".join(drops)
        opts = {"xla_disable_hlo_passes": barrier_pass}
        vnotes.append(f"{compiler} removes optimization barriers in pass {barrier_pass} before it fuses (read "
                      "from its dump: the barriers are gone after it), so a barrier alone does not block fusion "
                      "there; this variant compiles with that pass off")
    elif late:
        vnotes.append(f"{compiler} keeps optimization barriers through fusion (its pass {', '.join(late)} "
                      "removes them afterwards): the barriers block fusion as written")
    v = Variant(f"barriers({label})", tuple(opts.items()), tuple(barrier_after) if not callable(barrier_after)
                else (), description=f"optimization barriers after {label}")
    return (v, fn_b, opts, nb, vnotes), barrier_pass


def _compile_variants(prog: Program, run_list: list, compiler: str, notes: list[str],
                      say: Callable[[str], None]) -> list:
    """Every variant compiled before anything is measured or recorded; a compiler failure becomes a note."""
    compiled = []
    failed = {}
    for v, fn, opts, nb, vnotes in run_list:
        say(f"{v.name}: compiling")
        try:
            compiled.append((v, _compile(prog, fn, opts), nb, vnotes))
        except WorkbenchError:
            raise  # options XLA rejects: the user's to fix
        except Exception as e:  # noqa: BLE001 - the compiler failed on this variant: an answer, not a crash
            failed[v.name] = _xla_error(e)
            notes.append(f"variant {v.name}: {compiler} failed to compile it: {failed[v.name]}")
    return compiled


def explore(prog: Program, *, disable_passes: list[tuple[str, ...]] = (), xla_flags: list[str] = (),
            barrier_after: tuple[str, ...] | Callable = (), barriers_in_program: bool = False, no_fusion: bool = True,
            measure_it: bool | None = None, repeats: int = 5, profile_steps: int = 2, compare_host: bool = True,
            store=None, progress: Callable[[str], None] | None = None) -> FusionResult:
    """Compile `prog` under each fusion variant, read, price and (on the host) measure every kernel; record each.

    barrier_after: primitive names (or a predicate (index, eqn) -> bool) after which to insert optimization barriers.
    barriers_in_program: the program already holds optimization barriers (a user function): add a variant that keeps
    them. measure_it: default True on the host, never on a target. compare_host: for a target, also compile the same
    program for XLA:CPU and report the fusions each compiler makes that the other does not.
    """
    say = progress or (lambda s: None)
    measure_it = prog.local if measure_it is None else (measure_it and prog.local)
    compiler = _compiler_name(prog.platform)
    notes: list[str] = []
    user_flag_variants = [flag_variant(t) for t in xla_flags]  # form checked before any compile
    pass_lists = [tuple(p) for p in disable_passes]
    pipeline = cpu_pass_pipeline() if prog.platform == "cpu" else []
    _check_in_pipeline(pass_lists, pipeline, compiler)
    hw = _hw(prog)
    say(f"default: compiling {prog.name} for {prog.target}")
    default_comp, passes, effects = _compile_dumped(prog, prog.fn)
    if prog.platform == "cpu":
        passes = list(dict.fromkeys(passes + pipeline))
    _check_ran(pass_lists, passes, effects, compiler)
    fusing = tuple(dict.fromkeys(e.name for e in effects if e.fuses))
    run_list: list[tuple[Variant, Callable, dict, int, list]] = []
    if no_fusion:
        if fusing:
            v = Variant("no-fusion", (("xla_disable_hlo_passes", ",".join(fusing)),),
                        description=f"every pass that fused ops in the default compile off: {', '.join(fusing)}")
            run_list.append((v, prog.fn, dict(v.compiler_options), 0, []))
        else:
            notes.append(f"no pass of {compiler} fused anything in this program: no no-fusion variant")
    for v in [passes_variant(pl) for pl in pass_lists] + user_flag_variants:
        run_list.append((v, prog.fn, dict(v.compiler_options), 0, []))
    barrier_pass = None
    if barrier_after or barriers_in_program:
        entry, barrier_pass = _barrier_variant(prog, barrier_after, compiler, say)
        run_list.append(entry)
    compiled = _compile_variants(prog, run_list, compiler, notes, say)
    variants, sources = _read_variants(prog, default_comp, compiled, hw, measure_it=measure_it, repeats=repeats,
                                       profile_steps=profile_steps, barriers_in_program=barriers_in_program,
                                       store=store, say=say)
    diffs = {n: diff(variants["default"], sources["default"], v, sources[n]) for n, v in variants.items()
             if n != "default"}
    host_cmp = None
    if compare_host and not prog.local:
        say("host: compiling the same program for XLA:CPU (not run)")
        host_cmp = _compare_host(prog, variants["default"], sources["default"])
    if prog.platform != "cpu":
        notes.append(f"{prog.target}: compiled by {compiler} for compile-only devices; predicted, not run")
    return FusionResult(prog, variants, diffs, fusing, barrier_pass, tuple(passes), compiler, host_cmp,
                        tuple(notes))


def _read_variants(prog: Program, default_comp, compiled: list, hw, *, measure_it: bool, repeats: int,
                   profile_steps: int, barriers_in_program: bool, store, say: Callable[[str], None]):
    """({name: VariantResult}, {name: kernel sources}): the default and each compiled variant read, priced,
    measured (host) and recorded, in that order."""
    variants: dict[str, VariantResult] = {}
    sources: dict[str, dict] = {}
    say(f"default: reading{' and measuring' if measure_it else ''}")
    variants["default"], sources["default"] = _variant(
        prog, Variant("default", description="the compiler as it is"), default_comp, hw, measure_it=measure_it,
        repeats=repeats, profile_steps=profile_steps, store=store)
    for v, comp, nb, vnotes in compiled:
        say(f"{v.name}: reading{' and measuring' if measure_it else ''}")
        res, src = _variant(prog, v, comp, hw, measure_it=measure_it, repeats=repeats,
                            profile_steps=profile_steps, barriers=nb or 0, notes=vnotes, store=store)
        if v.barrier_after or barriers_in_program and v.name.startswith("barriers"):
            res = dataclasses.replace(res, barriers=res.barriers or sum(
                1 for k in res.kernels if k.xla_kind == "opt-barrier"))
        variants[v.name], sources[v.name] = res, src
    return variants, sources


def _compiler_name(platform: str) -> str:
    pkg = {"tpu": "libtpu", "gpu": "jax-cuda12-plugin"}.get(platform, "jaxlib")
    try:
        v = version(pkg)
    except PackageNotFoundError:
        v = "?"
    return {"tpu": "libtpu (TPU)", "gpu": "XLA:GPU"}.get(platform, "XLA:CPU") + f" {pkg} {v}"


def _compare_host(prog: Program, tgt: VariantResult, tgt_src: dict) -> dict:
    """The same program compiled by XLA:CPU for one host device: which kernels each compiler makes that the other
    splits (matched by source ops), kinds side by side. The host program is the whole batch, the target's is per
    chip, so bytes differ by the split; the kernel structure is what compares."""
    s = prog.spec
    try:
        if s.get("program") in MODEL_PROGRAMS:
            hp = model_program(s["preset"], s["program"], batch=s["batch"], seq=s["seq"], precision=s["precision"],
                               overrides=s.get("overrides"))
        elif s.get("program") == "op":
            hp = op_program(s["op"], s["dtype"], **s["sizes"])
        else:
            hp = dataclasses.replace(prog, args=jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                                             prog.args), target="host", platform="cpu", n_devices=1)
        comp = _compile(hp, hp.fn, {})
    except Exception as e:  # noqa: BLE001 - a comparison, not the answer
        return {"error": f"XLA:CPU could not compile the same program: {_xla_error(e)}"}

    hw = get_spec("host")
    pred = predict(comp.cost, hw, dtype=prog.compute_dtype or comp.cost.compute_dtype)
    ks = []
    for k in comp.cost.kernels:
        kc, km = kernel_roof(k, hw, pred.peak_dtype, pred.memory_bw)
        ops = dict(k.ops)
        ks.append(Kernel(k.name, kernel_kind(k.kind, k.library, ops), k.kind, k.library, ops, k.output_shape,
                         k.bytes_in, k.bytes_out, k.flops, k.transcendentals, k.count, roof_seconds(k, hw, kc, km) * k.count,
                         "compute" if kc >= km else "memory"))
    host = VariantResult(Variant("host-default"), tuple(ks), sum(k.bytes * k.count for k in ks),
                         sum(k.flops * k.count for k in ks), 0.0, comp.cost.bytes_accessed, pred.predicted_s,
                         sum(k.predicted_s for k in ks), None, None, None, comp.compile_s, 0, ())
    hsrc = kernel_sources(comp.hlo_text)
    d = diff(host, hsrc, tgt, tgt_src)  # 'merged': target kernels fusing several host kernels
    return {"host_kernels": len(ks), "target_kernels": len(tgt.kernels),
            "host_by_kind": {k: v["kernels"] for k, v in by_kind(ks).items()},
            "target_by_kind": {k: v["kernels"] for k, v in by_kind(tgt.kernels).items()},
            "host_bytes": host.bytes, "target_bytes_per_chip": tgt.bytes,
            "host_predicted_s": host.predicted_s, "target_predicted_s": tgt.predicted_s,
            "target_fuses_host_does_not": [{"kernel": m["kernel"], "kind": m["kind"], "host_kernels": m["from"]}
                                           for m in d["merged"]],
            "host_fuses_target_does_not": [{"kernel": s["kernel"], "kind": s["kind"], "target_kernels": s["into"]}
                                           for s in d["split"]],
            "host_kernel_list": [k.to_record() for k in ks],
            "note": "host program: the whole batch on one XLA:CPU device (compiled, not run); target: per chip"}


_PIPELINE_PROBE = """
import jax, jax.numpy as jnp
def f(x, w):
    y = jax.nn.softmax(jnp.tanh(x @ w) + 1.0, axis=-1)
    return jax.lax.fori_loop(0, 3, lambda i, a: a * 0.5 + y, y).sum()
s = jax.ShapeDtypeStruct((64, 64), jnp.float32)
jax.jit(f).lower(s, s).compile()
"""


def cpu_pass_pipeline() -> list[str]:
    """Every pass XLA:CPU's pipeline runs (a pass that changes nothing leaves no dump, so this asks the compiler's
    own log: a small program is compiled once in a child process with TF_CPP_VMODULE=hlo_pass_pipeline=1 and the
    'HLO pass NAME' lines are read). Cached per jaxlib version; [] when the log gives nothing."""
    path = os.path.join(cache_dir(), f"xla-cpu-passes-jaxlib-{version('jaxlib')}.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        pass
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="hlo_pass_pipeline=1", JAX_PLATFORMS="cpu")
    try:
        p = subprocess.run([sys.executable, "-c", _PIPELINE_PROBE], env=env, capture_output=True, text=True,
                           timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return []
    names = list(dict.fromkeys(re.findall(r"\]\s+HLO pass (\S+)\s*$", p.stderr, flags=re.M)))
    if names:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(names, f)
    return names


def list_passes(prog: Program) -> tuple[list[str], list[PassEffect]]:
    """The passes the compiler runs on `prog` (those in its dump) and what the changing ones did."""
    _, names, effects = _compile_dumped(prog, prog.fn)
    return (list(dict.fromkeys(names + cpu_pass_pipeline())) if prog.platform == "cpu" else names), effects


def finite(x) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None
