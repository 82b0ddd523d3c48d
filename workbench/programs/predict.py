"""Predict a model's step on a TPU slice or GPU node from this CPU host: compile for the target, check memory, predict.

    spec ─► target devices (libtpu compile-only TPU devices, or simulated CPU devices for GPU nodes)
         ─► mesh (partitioning.mesh.make_mesh over those devices) ─► abstract sharded train/prefill/decode step
         ─► jit.lower(abstract inputs).compile()  (no device memory is touched; the TPU compiler is libtpu's own)
         ─► CostReport (per device) ─► roofline.predict(cost, target chip's HardwareSpec) ─► record

Terms of a prediction (all per device, seconds; see workbench/roofline.py for the formulas):
    compute_s   flops / peak(compute dtype)         flops: the compiler's count for this device's program
    memory_s    bytes accessed / HBM bandwidth
    comm_s      Σ collectives: collective_time(kind, payload, group, the chip's interconnect)
    roofline_s  roofline.predict's headline: max(kernel-by-kernel roofline, comm_s) (perfect overlap)
    floor_s     analytic floor = model FLOPs per step / (chips × peak bf16)   (train: train_flops_per_token × tokens)
    predicted_step_s = max(roofline_s, floor_s)     — never below the floor
    predicted_mfu    = floor_s / predicted_step_s   — model FLOPs utilisation the prediction implies
    xla_estimate_s   the TPU compiler's own `optimal_seconds` when positive (ignored, and said so, otherwise)

Memory: per device = arguments + outputs + temporaries − aliased (donated) bytes, from the compiled program's
memory_analysis, against the chip's HBM. On TPU targets the compiler itself refuses programs that do not fit
(RESOURCE_EXHAUSTED): reported as fits=false with the compiler's words. Before compiling, the sharded parameters and
optimizer state alone are summed from their shard shapes; when they already exceed HBM the compile is skipped
(`--compile-anyway` forces it) and the record says so.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any

from models import inference, moe, paged, pipeline, serving
from models.analytics import analytics, moe_layer_memory, moe_memory_fused
from models.config import resolve_attention
from models.precision import PrecisionPolicy, get_policy
from models.presets import get_config
from models.remat import parse_remat
from models.transformer import Transformer
from partitioning import topology as topo
from partitioning.mesh import make_mesh, parse_mesh_spec
from partitioning.rules import Rules, get_rules
from partitioning.shard import activation_sharding, spec_for, state_shardings
from partitioning.strategy import Strategy, get_strategy
from workbench import compat
from workbench.cost.compile import UncompiledHlo, compile_keeping_oom_hlo, is_resource_exhausted
from workbench.cost.hlo import torus_axes_of_group
from workbench.cost.report import CostReport, costs_from_compiled
from workbench.errors import WorkbenchError
from workbench.hardware import spec as hardware
from workbench.hardware.spec import dtype_name
from workbench.programs.flop_counts import reconcile as reconcile_flops
from workbench.programs.step import build_train_step, pipeline_for
from workbench.results.console import say
from workbench.results.store import RecordView, Store, make_record
from workbench.roofline import prediction as roofline
from workbench.roofline.pricing import priced_dtype, tpu_float32_spec

MODES = ("train", "prefill", "decode")


@dataclasses.dataclass(frozen=True)
class PredictSpec:
    preset: str
    target: str
    strategy: str = "fsdp"
    mesh: str | None = None          # 'data=4,model=4'; None: the strategy's default for the target
    batch: int | None = None         # global batch (sequences); None: 4 per chip... see default_batch
    seq: int | None = None           # tokens per sequence (decode: the KV-cache length); None: preset's seq_len
    mode: str = "train"
    remat: str = "auto"              # a models/remat.py policy (none, full, minimal, save_dot_except_mlpwi, ..., or
    #                                  NAME=remat|device|offload,...) | auto (the preset's; per-layer when that does not fit)
    microbatches: int = 1
    policy: str = "bf16"
    overrides: str | None = None     # model config overrides 'k=v,k=v'
    gpu_compiler: str = "auto"       # GPU targets: auto | xla-gpu (deviceless XLA:GPU) | cpu-sim
    pipeline_repeats: int = 1        # pp strategies: virtual stages per device (models/pipeline.py)
    pipeline_schedule: str = "gpipe"  # pp strategies: gpipe (circular when repeats > 1) | 1f1b
    shard_activations: bool = False  # the residual stream's embed over the tensor axis (MaxText's activation_embed)
    quant: str = "none"              # prefill/decode: weight quantization (models/serving.py QUANTS)
    kv_dtype: str = "auto"           # prefill/decode: KV-cache dtype (models/inference.py KV_DTYPES)
    page_size: int = 0               # decode: a paged KV cache of pages of this many positions, attended by JAX's
    #                                  Pallas TPU paged attention (models/paged.py); 0: the contiguous cache

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A PredictSpec's names turned into the objects the programs take: resolved once per command (`resolve`),
    then passed down; the spec keeps the names for the record."""

    spec: PredictSpec
    target: topo.Target
    strategy: Strategy
    rules: Rules
    policy: PrecisionPolicy

    def with_remat(self, remat: str) -> "Resolved":
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, remat=remat))


def resolve(spec: PredictSpec | Resolved, target: topo.Target | None = None) -> Resolved:
    """Resolve a spec's target, strategy, rules and precision policy once (one-line errors for unknown names, before
    any target device is built). `target`: one the caller has parsed already."""
    if isinstance(spec, Resolved):
        return spec
    if spec.strategy is None:
        raise WorkbenchError("--strategy is required; choose one of dp, fsdp, tp, fsdp+tp, sp, cp, fsdp+cp, "
                             "fsdp+tp+cp, ep")
    return Resolver(target or topo.parse_target(spec.target), spec.policy)(spec)


class Resolver:
    """`resolve` for many specs on one target and policy (the planner's candidates): the target and the policy are
    resolved once, each strategy once, whatever the number of specs."""

    def __init__(self, target: topo.Target, policy: str):
        self.target, self.policy = target, get_policy(policy)
        self._strategies: dict[str, Strategy] = {}

    def strategy(self, name: str) -> Strategy:
        if name not in self._strategies:
            self._strategies[name] = get_strategy(name)
        return self._strategies[name]

    def __call__(self, spec: PredictSpec) -> Resolved:
        if spec.mode not in MODES:
            raise WorkbenchError(f"unknown mode {spec.mode!r}; choose one of {', '.join(MODES)}")
        st = self.strategy(spec.strategy)
        return Resolved(dataclasses.replace(spec, target=self.target.name), self.target, st,
                        get_rules(st.rules, shard_activations=spec.shard_activations), self.policy)


@dataclasses.dataclass(frozen=True)
class TargetPrediction(RecordView):
    """One step compiled for a target and predicted, per device: the record's JSON body (`predict --json`, the
    store's `extra`; read it like a mapping: `tp["fits"]`, `tp.get("reason")`) and the typed CostReport and
    Prediction behind it (None when nothing compiled; plain dicts when they come from the planner's cache)."""

    record: Mapping[str, Any]
    cost: CostReport | dict | None = None
    prediction: roofline.Prediction | dict | None = None

    @property
    def fits(self) -> bool:
        return bool(self.record.get("fits"))

    @property
    def predicted_step_s(self) -> float | None:
        return self.record.get("predicted_step_s")

    def with_fields(self, **fields) -> "TargetPrediction":
        return dataclasses.replace(self, record={**self.record, **fields})


# --------------------------------------------------------------------------------------------------- defaults


def default_batch(n_chips: int) -> int:
    """Global batch when none is given: 4 sequences per chip (room for microbatching in the planner)."""
    return 4 * n_chips


# ---------------------------------------------------------------------------------------------- hardware spec


def chip_spec(target: topo.Target):
    """The catalogue HardwareSpec of the target's chip (workbench.hardware.spec): per chip."""
    return hardware.catalogue_spec(target.chip)


def target_spec(target: topo.Target):
    """The HardwareSpec one JAX device of the target gets: the chip's, or its share where a chip is several devices
    (TPU v7x: two TensorCores, two devices; every figure halved, HardwareSpec.per_device). Costs are per device."""
    return chip_spec(target).per_device(target.devices_per_chip)


# ------------------------------------------------------------------------------------------------- programs


@dataclasses.dataclass
class Lowered:
    """A program lowered for the target, ready to compile (the planner compiles these in parallel)."""

    resolved: Resolved
    cfg: Any
    mesh: Any
    axes: dict[str, int]
    batch: int
    seq: int
    compiler: str                   # libtpu | xla-gpu | xla-cpu (simulated devices standing in for GPUs)
    lowered: Any                    # jax.stages.Lowered, or None when the pre-check already decided
    state_bytes_per_device: float   # parameters + optimizer state (+ cache), summed from shard shapes
    input_bytes_per_device: float   # every argument of the step, from shard shapes
    lower_s: float
    notes: list[str]

    @property
    def spec(self) -> PredictSpec:
        return self.resolved.spec

    @property
    def target(self) -> topo.Target:
        return self.resolved.target


def _shard_bytes(tree) -> float:
    import jax
    import numpy as np

    total = 0.0
    for a in jax.tree.leaves(tree):
        shape = getattr(a, "shape", None)
        if shape is None:
            continue
        sh = getattr(a, "sharding", None)
        shard = sh.shard_shape(tuple(shape)) if sh is not None and hasattr(sh, "shard_shape") else shape
        total += math.prod(shard) * np.dtype(a.dtype).itemsize
    return float(total)


def _build_program(cfg, r: Resolved, mesh, batch: int, seq: int):
    """(jitted step, abstract args tuple, abstract state) for the spec's mode, from the models' own builders."""
    spec, policy, rules = r.spec, r.policy, r.rules
    if spec.mode == "train":
        out = build_train_step(cfg, policy=policy, mesh=mesh, strategy=rules, batch_size=batch,
                               seq_len=seq, microbatches=spec.microbatches, abstract=True,
                               pipeline_repeats=spec.pipeline_repeats,
                               pipeline_schedule=spec.pipeline_schedule)
        return _unpack_step(out)
    return build_inference_step(cfg, policy, mesh, rules, batch, seq, spec.mode, spec.quant, spec.kv_dtype,
                                spec.page_size)


def build_inference_step(cfg, policy, mesh, strategy: str, batch: int, seq: int, mode: str, quant: str = "none",
                         kv_dtype: str = "auto", page_size: int = 0):
    """A jitted prefill or decode step of the serving engine (models/inference.py, models/serving.py), with abstract
    sharded inputs: the layers unrolled (each layer's KV cache a buffer of its own, written in place), weights in
    the policy's compute dtype (inference keeps no float32 master copy) or quantized (`quant`), the KV cache
    (batch, kv_heads, seq, head_dim) per layer in `kv_dtype` (the keys transposed for few rows on a CPU mesh,
    models/inference.py), sharded by the strategy's rules and donated.

    prefill: `seq` prompt tokens fill an empty cache of `seq` positions; the head runs on the last position only.
    decode:  one new token per sequence against a cache of `seq` positions (attention reads all of it); with
             `page_size`, a paged cache (per layer a pool (kv_heads, pages, page_size, head_dim), each row's pages
             with its batch shard) attended by JAX's Pallas TPU paged attention kernel (models/paged.py).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    cfg = cfg.replace(scan_layers=False)
    rules = get_rules(strategy)
    abs_model = nnx.eval_shape(lambda: Transformer(cfg, policy, nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abs_model, nnx.Param, ...)
    p_sh, r_sh = state_shardings(params, mesh, rules), state_shardings(rest, mesh, rules)
    cd = policy.compute_dtype
    abs_params = _quantized_abstract(params, p_sh, mesh, cd, quant)
    abs_rest = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), rest, r_sh)
    def placed(a, axes, what):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec_for(axes, a.shape, mesh, rules,
                                                                                              what=what)))

    if page_size:  # per layer a pool of pages, split with the rows, and the page table
        pools = jax.eval_shape(lambda: paged.init_paged(abs_model, batch, seq, page_size))
        pool = lambda a: placed(a, ("kv_heads", "batch", None, "head_dim"), "paged KV cache pool")
        row = lambda a: placed(a, ("batch",) + (None,) * (a.ndim - 1), "page table")
        cache = {"k": [pool(a) for a in pools["k"]], "v": [pool(a) for a in pools["v"]],
                 "page_table": row(pools["page_table"]), "lengths": row(pools["lengths"])}
    else:
        def place(a):
            if a.ndim == 1:
                return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
            axes = ("batch", "kv_heads", None, None)  # head_dim is never split (partitioning/rules.py)
            return placed(a, axes, "KV cache")

        cache = {n: ([place(a) for a in v] if isinstance(v, list) else place(v))
                 for n, v in jax.eval_shape(lambda: inference.init_cache(
                     abs_model, batch, seq, kv_dtype, keys_transposed=None if mesh.devices.flat[0].platform == "cpu" else False)).items()}
    t = seq if mode == "prefill" else 1
    tok_sh = NamedSharding(mesh, spec_for(("batch", "seq"), (batch, t), mesh, rules, what="input tokens"))
    tokens = jax.ShapeDtypeStruct((batch, t), jnp.int32, sharding=tok_sh)

    def step(params, rest, tokens_bt, cache):
        with activation_sharding(mesh, rules), compat.use_abstract_mesh(mesh.abstract_mesh):
            model = nnx.merge(graphdef, serving.dequantize_params(params, cd), rest)
            if mode == "prefill":
                logits_btv, cache = inference.prefill(model, tokens_bt, cache=cache, last_only=True, fresh=True)
            elif page_size:
                logits_btv, cache = paged.paged_decode(model, tokens_bt, cache)
            else:
                logits_btv, cache = inference.decode_step(model, tokens_bt, cache)
            return logits_btv[:, -1], cache

    shardings = lambda tree: jax.tree.map(lambda a: a.sharding, tree)
    jitted = jax.jit(step, in_shardings=(shardings(abs_params), shardings(abs_rest), tok_sh, shardings(cache)),
                     out_shardings=(None, shardings(cache)), donate_argnums=3)
    return jitted, (abs_params, abs_rest, tokens, cache), (abs_params, abs_rest, cache)


def _quantized_abstract(params, p_sh, mesh, compute_dtype, quant: str):
    """Abstract parameters as the serving step takes them: floating ones in the compute dtype, matmul weights
    quantized (a qwix.QArray: the values sharded as the weight, each scale axis as the weight's axis where the
    scale has as many entries as the axis, or whole groups of them per device, else replicated)."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    abs_q = jax.eval_shape(lambda p: serving.quantize_params(serving.cast_params(p, compute_dtype), quant), params)
    sh_of = {path: var.get_value() for path, var in nnx.to_flat_state(p_sh)}
    size = lambda ax: 1 if ax is None else math.prod(mesh.shape[a] for a in ((ax,) if isinstance(ax, str) else ax))
    pairs = []
    for path, var in nnx.to_flat_state(abs_q):
        v, sh = var.get_value(), sh_of[path]
        if serving.is_quantized(v):
            spec = tuple(sh.spec) + (None,) * (v.qvalue.ndim - len(sh.spec))
            scale_spec = [ax if n % size(ax) == 0 and n > 1 else None for ax, n in zip(spec, v.scale.shape)]
            v = dataclasses.replace(
                v, qvalue=jax.ShapeDtypeStruct(v.qvalue.shape, v.qvalue.dtype, sharding=sh),
                scale=jax.ShapeDtypeStruct(v.scale.shape, v.scale.dtype,
                                           sharding=NamedSharding(mesh, PartitionSpec(*scale_spec))))
        else:
            v = jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh)
        pairs.append((path, var.replace(v)))
    return nnx.from_flat_state(pairs)


def _unpack_step(out):
    """Accept the builders' return forms: an object with .step/.args (or .state/.batch), or a tuple (step, *args)."""
    if isinstance(out, tuple):
        step, *args = out
        return step, tuple(args), args[0] if args else None
    step = getattr(out, "step", None) or getattr(out, "fn", None)
    if hasattr(out, "args"):
        args = tuple(out.args)
    else:
        args = tuple(x for x in (getattr(out, "state", None), getattr(out, "batch", None)) if x is not None)
    return step, args, getattr(out, "state", args[0] if args else None)


def prepare(spec: PredictSpec | Resolved) -> tuple[topo.Target, Any, dict[str, int], int, int, list[str]]:
    """Validate a spec: target, config, mesh axes, batch, sequence. One-line errors for bad input."""
    r = resolve(spec)
    spec, target, strategy = r.spec, r.target, r.strategy
    cfg = get_config(spec.preset, spec.overrides)
    if spec.remat not in ("auto", None):
        try:
            parse_remat(spec.remat)
        except WorkbenchError as e:
            raise WorkbenchError(f"--remat {spec.remat!r}: {e}; or auto") from None
        cfg = cfg.replace(remat=spec.remat)
    notes: list[str] = []
    seq = spec.seq if spec.seq is not None else cfg.seq_len
    if seq < 1:
        raise WorkbenchError(f"--seq must be >= 1, got {seq}")
    if seq > cfg.seq_len:
        if cfg.pos == "learned":  # a compile of fresh parameters: the table grows, as --set seq_len would make it
            notes.append(f"--seq {seq} exceeds {spec.preset}'s learned position table ({cfg.seq_len} rows): compiled "
                         f"with the table grown to {seq} rows (as --set seq_len={seq})")
        cfg = cfg.replace(seq_len=seq)
    axes = parse_mesh_spec(spec.mesh) if spec.mesh else strategy.default_mesh(target.n_devices, cfg)
    topo.check_mesh_size(axes, target.n_devices, target.name)
    nb = strategy.batch_ways(axes)
    batch = spec.batch if spec.batch is not None else default_batch(target.n_chips)
    if batch < 1:
        raise WorkbenchError(f"--batch must be >= 1, got {batch}")
    if batch % nb:
        raise WorkbenchError(f"--batch {batch} is not divisible by the data axes of the mesh "
                             f"({'*'.join(f'{a}={axes[a]}' for a in axes if a in ('data', 'expert'))} = {nb}); "
                             f"use a multiple of {nb}")
    if spec.microbatches < 1:
        raise WorkbenchError(f"--microbatches must be >= 1, got {spec.microbatches}")
    if spec.mode == "train" and (batch // nb) % spec.microbatches:
        raise WorkbenchError(f"--microbatches {spec.microbatches} does not divide the per-shard batch "
                             f"{batch // nb} (batch {batch} over {nb} data shards)")
    if spec.mode == "train" and (spec.quant != "none" or spec.kv_dtype != "auto"):
        raise WorkbenchError("weight quantization and the KV-cache dtype apply to --mode prefill|decode only")
    serving.check_quant(spec.quant)
    inference.kv_dtype_name(spec.kv_dtype)
    if spec.page_size and (spec.mode != "decode" or spec.page_size < 1 or spec.kv_dtype not in ("auto", "bf16",
                                                                                                "bfloat16")):
        raise WorkbenchError(f"a paged cache (page size {spec.page_size}) is for decode steps over a bf16 cache; "
                             "drop --paged for this mode or KV dtype")
    if spec.page_size and (target.kind != "tpu" or cfg.head_dim % 128 or spec.page_size % 8):
        raise WorkbenchError(f"the paged attention kernel (JAX's Pallas TPU kernel) needs a TPU target, a head_dim "
                             f"that is a multiple of 128 and pages of a multiple of 8 positions; here {target.name}, "
                             f"head_dim {cfg.head_dim}, pages of {spec.page_size}: change them (--set head_dim=128, "
                             f"--page-size 16) or serve without --paged")
    if spec.mode != "train" and spec.microbatches != 1:
        raise WorkbenchError("--microbatches applies to --mode train only")
    if strategy.pipelined and spec.mode != "train":
        raise WorkbenchError(f"{spec.strategy} pipelines the training step only; use --mode train")
    pipe, stacked = pipeline_for(cfg, strategy.rules, int(axes.get(pipeline.STAGE_AXIS, 1)), spec.microbatches,
                                       spec.pipeline_repeats, spec.pipeline_schedule, batch, r.policy)
    if stacked is not cfg:
        notes.append("pipelined: the layers are stacked (scan_layers=true) so that their axis shards over stage")
        cfg = stacked
    return target, cfg, axes, batch, seq, notes


def pipeline_spec(spec: PredictSpec, axes: dict[str, int]) -> pipeline.PipelineSpec:
    """The schedule a pipelined spec runs: the mesh's stage size, its microbatches, repeats and schedule."""
    return pipeline.PipelineSpec(int(axes.get(pipeline.STAGE_AXIS, 1)), spec.microbatches, spec.pipeline_repeats,
                                 spec.pipeline_schedule)


def lower(spec: PredictSpec | Resolved, *, precheck: bool = True, devices=None) -> Lowered:
    """Build the target's mesh and the abstract sharded step, and lower it (no compile yet). `devices`: real devices
    of the target's kind to lower for instead of compile-only ones (a GPU host predicting the program it runs)."""
    r = resolve(spec)
    spec, target = r.spec, r.target
    _, cfg, axes, batch, seq, notes = prepare(r)
    if devices is not None and len(devices) != target.n_devices:
        raise WorkbenchError(f"{target.name} has {target.n_devices} devices; {len(devices)} were given")
    devices = list(devices) if devices is not None else topo.target_devices(target, spec.gpu_compiler)
    grid = topo.device_grid(devices, tuple(axes.values()))
    mesh = make_mesh(axes, devices=list(grid.flat))
    # attention 'auto' made concrete for the devices compiled for (the record says which); a decode step attends
    # over its cache with the model's own products whatever the choice
    cfg = resolve_attention(cfg, devices[0].platform, r.policy.compute_dtype, seq)
    t0 = time.perf_counter()
    step, args, state = _build_program(cfg, r, mesh, batch, seq)
    state_b = _shard_bytes(state)
    input_b = _shard_bytes(args)
    lowered = None
    hbm = target_spec(target).hbm_bytes
    if not (precheck and state_b > hbm):
        lowered = step.lower(*args)
    compiler = {"tpu": "libtpu", "gpu": "xla-gpu"}[target.kind] if devices[0].platform != "cpu" else "xla-cpu"
    return Lowered(r, cfg, mesh, axes, batch, seq, compiler, lowered, state_b, input_b,
                   time.perf_counter() - t0, notes)


def compile_lowered(lw: Lowered):
    """lowered.compile() → (compiled, seconds, error words or None). Resource exhaustion is an answer, not a crash."""
    compiled, secs, words, _ = _compile(lw, keep_oom_hlo=False)
    return compiled, secs, words


def _compile(lw: Lowered, keep_oom_hlo: bool):
    """(compiled, seconds, error words or None, optimized HLO of a refused program or None). keep_oom_hlo: compile
    with an XLA dump (compile_keeping_oom_hlo), so that a program refused for want of memory is priced without a
    second compile."""
    t0 = time.perf_counter()
    try:
        if not keep_oom_hlo:
            return lw.lowered.compile(), time.perf_counter() - t0, None, None
        compiled, err, hlo, largest = compile_keeping_oom_hlo(lw.lowered)
        if err is None:
            return compiled, time.perf_counter() - t0, None, None
        return None, time.perf_counter() - t0, _words(err) + _largest_words(largest), hlo
    except Exception as e:  # noqa: BLE001
        if is_resource_exhausted(e):
            return None, time.perf_counter() - t0, _words(e), None
        raise


def _largest_words(largest: list[dict]) -> str:
    """'; largest allocations: 20 GiB bf16[80,4,4096,8192] (×5), ...' from compile.largest_allocations; '' for none."""
    if not largest:
        return ""
    return "; largest allocations: " + ", ".join(
        f"{_gib(a['bytes'])} {a['shape']}" + (f" (×{a['repeats']})" if a["repeats"] > 1 else "") for a in largest)


def _words(e: BaseException) -> str:
    """The compiler's refusal on one line (the record's `reason` quotes it)."""
    return " ".join(str(e).strip().split())[:600]


# ----------------------------------------------------------------------------------------------- prediction


def xla_estimate(compiled) -> tuple[float | None, str | None]:
    """The compiler's own time estimate (`optimal_seconds`, TPU) when positive; else None and why."""
    raw, why = compat.cost_analysis(compiled)
    if not raw and why and "unavailable" in why[0]:
        return None, f"{why[0]}: no compiler time estimate"
    v = raw.get("optimal_seconds")
    if v is None:
        return None, "the compiler gives no time estimate for this platform (no optimal_seconds)"
    v = float(v)
    if not math.isfinite(v) or v <= 0:
        return None, f"the compiler's time estimate optimal_seconds={v:.3g} is not positive: ignored"
    return v, None


def torus_axes_of(cost, mesh) -> int:
    """Torus dimensions spanned by the heaviest collective's groups (TPU device coords); 1 when unknown. Each
    collective is priced at its own groups' count (CollectiveOp.torus_axes); this one figure is the report's
    summary and the fallback for a collective whose groups were not kept."""
    colls = [c for c in cost.collectives if c.groups]
    if not colls:
        return 1
    heavy = max(colls, key=lambda c: c.payload_bytes * c.count)
    return max(1, torus_axes_of_group(heavy.groups[0], mesh))


def model_flops(cfg, mode: str, batch: int, seq: int) -> tuple[float, str]:
    """Model FLOPs of one step (the convention of models/analytics.py) and how they were counted."""
    a = analytics(cfg, seq)
    if mode == "train":
        return a["train_flops_per_token"] * batch * seq, (
            f"train_flops_per_token {a['train_flops_per_token']:.4g} × {batch}·{seq} tokens")
    if mode == "prefill":
        head = 2 * cfg.vocab_size * cfg.d_model  # the output head runs on the last position only
        return a["forward_flops_per_token"] * batch * seq - head * batch * (seq - 1), (
            f"forward_flops_per_token {a['forward_flops_per_token']:.4g} × {batch}·{seq} tokens − the output head "
            f"(2·vocab·d_model) on all but the last position")
    # decode: one new token per sequence, attending over a cache of `seq` tokens
    return a["forward_flops_per_token"] * batch, (
        f"forward_flops_per_token(context {seq}) {a['forward_flops_per_token']:.4g} × {batch} new tokens")


def _base_fields(lw: Lowered, hw, tokens: int, mflops: float, floor_s: float, compute_dtype: str,
                 compile_s: float | None) -> dict[str, Any]:
    """The fields every prediction has, compiled or not: the target, the spec, the shapes, the floor."""
    target, spec = lw.target, lw.spec
    return {
        "target": target.name, "target_kind": target.kind, "chip": chip_spec(target).name, "n_chips": target.n_chips,
        "n_devices": target.n_devices, "devices_per_chip": target.devices_per_chip, "device_spec": hw.name,
        "target_description": target.describe(),
        "preset": spec.preset, "strategy": spec.strategy, "shard_activations": spec.shard_activations,
        "mode": spec.mode, "mesh": ",".join(f"{k}={v}" for k, v in lw.axes.items()), "batch": lw.batch, "seq": lw.seq,
        "tokens_per_step": tokens, "remat": lw.cfg.remat, "attention": lw.cfg.attention,
        "microbatches": spec.microbatches,
        "policy": spec.policy, "compute_dtype": compute_dtype, "priced_dtype": priced_dtype(lw.resolved.policy),
        "compiler": lw.compiler,
        "compiler_version": _compiler_version(lw.compiler),
        "hbm_bytes": hw.hbm_bytes, "state_bytes_per_device": lw.state_bytes_per_device,
        "input_bytes_per_device": lw.input_bytes_per_device,
        "model_flops_per_step": mflops, "analytic_floor_s": floor_s,
        "build_and_lower_s": lw.lower_s, "compile_s": compile_s,
    }


def _precheck_refusal(lw: Lowered, hw) -> dict[str, Any]:
    """The fields of a program the pre-check did not compile: its state alone exceeds HBM."""
    return dict(fits=False, memory_per_device_bytes=lw.state_bytes_per_device,
                memory_source="parameters + optimizer state summed from shard shapes (a lower bound)",
                overshoot_bytes=(
        lw.state_bytes_per_device - hw.hbm_bytes), compiled=False, flops_per_device=None, collectives={},
        predicted_step_s=None, predicted_mfu=None, xla_estimate_s=None, tokens_per_s=None, bound=None,
        reason=(f"parameters and optimizer state alone need {_gib(lw.state_bytes_per_device)} per device "
                f"(summed from their shard shapes) > {_gib(hw.hbm_bytes)} HBM of {hw.name}; not compiled "
                "(--compile-anyway to ask the compiler)"))


def _oom_refusal(error: str, target: topo.Target) -> dict[str, Any]:
    """The fields of a program the compiler refused for want of memory, with its overshoot when it says so."""
    over = _overshoot_from_words(error)
    return dict(fits=False, compiled=False, memory_per_device_bytes=over[0] if over else None,
                memory_source="the compiler's out-of-memory message" if over else None,
                overshoot_bytes=(over[0] - over[1]) if over else None, flops_per_device=None, collectives={},
                predicted_step_s=None, predicted_mfu=None, xla_estimate_s=None, tokens_per_s=None, bound=None,
                reason=f"the {target.kind.upper()} compiler ran out of memory: {error}")


@dataclasses.dataclass(frozen=True)
class _Priced:
    """A compiled program priced on its target: its costs, the torus axes its heaviest collective spans, the dtype
    and spec it is priced at, the roofline prediction."""

    cost: CostReport
    torus_axes: int
    price: str
    price_hw: Any
    pred: roofline.Prediction


def _price_compiled(lw: Lowered, compiled, hw, compute_dtype: str, notes: list[str]) -> _Priced:
    """Read the compiled program's costs and price them on the target (float32 on a TPU at its MXU pass count)."""
    target = lw.target
    # XLA:GPU gives no cost_analysis: the report holds the HLO reader's sums and says so (cost_analysis_unavailable)
    cost = costs_from_compiled(compiled, n_devices=target.n_devices, mesh=lw.mesh, compute_dtype=compute_dtype)
    k = torus_axes_of(cost, lw.mesh) if target.kind == "tpu" else 1
    price = priced_dtype(lw.resolved.policy)  # the one rule `workbench run` uses too (workbench/roofline/pricing.py)
    price_hw = hw
    if price == "float32" and target.kind == "tpu":
        price_hw, f32_note = tpu_float32_spec(hw, compiled.as_text())
        if f32_note:
            notes.append(f32_note)
    pred = roofline.predict(cost, price_hw, dtype=price, simulated_mesh=False, torus_axes=k)
    return _Priced(cost, k, price, price_hw, pred)


def _fits(lw: Lowered, mem: float, hw, notes: list[str]) -> bool:
    """Whether the compiled program fits the target's HBM, and the notes on how the compiler judged it."""
    target, n = lw.target, lw.target.n_devices
    if target.kind == "tpu":
        # the TPU compiler assigns every buffer in HBM and refuses programs that overflow it: compiling is fitting
        fits = True
        if mem > hw.hbm_bytes:
            notes.append(f"compiled, so the TPU compiler found room, though {_gib(mem)} exceeds the catalogue's "
                         f"{_gib(hw.hbm_bytes)} (the compiler counts HBM in GiB and reserves some)")
    else:
        fits = mem <= hw.hbm_bytes
    if lw.compiler == "xla-cpu":
        notes.append(f"{target.name}: compiled for {n} simulated CPU devices, the XLA:CPU stand-in (--gpu-compiler "
                     "cpu-sim, or the JAX CUDA plugin is not importable; see docs/targets.md): memory is XLA:CPU's "
                     "buffer assignment and the costs are the CPU program's, priced with the GPU's catalogue peaks "
                     "and NVLink/InfiniBand collective models")
    elif lw.compiler == "xla-gpu":
        notes.append(f"{target.name}: compiled by XLA:GPU for a compile-only {n}-GPU topology (JAX CUDA plugin, no GPU "
                     "attached); memory is its buffer assignment, judged against the catalogue HBM")
    return fits


def _compiled_fields(lw: Lowered, p: _Priced, hw, *, fits: bool, flop_counts, step: float, floor_s: float,
                     tokens: int, mflops: float, xla_s: float | None) -> dict[str, Any]:
    """The fields of a compiled program: memory, costs, the roofline's terms, the prediction and its bound."""
    cost, pred, n = p.cost, p.pred, lw.target.n_devices
    mem = cost.peak_memory_bytes
    return dict(
        fits=bool(fits), compiled=True,
        memory_per_device_bytes=mem, memory_source="memory_analysis of the compiled program",
        memory_breakdown={"argument_bytes": cost.argument_bytes, "output_bytes": cost.output_bytes,
                          "temp_bytes": cost.temp_bytes, "alias_bytes": cost.alias_bytes,
                          "generated_code_bytes": cost.generated_code_bytes},
        overshoot_bytes=max(0.0, mem - hw.hbm_bytes),
        flops_per_device=pred.flops, bytes_per_device=pred.bytes,
        flop_counts=flop_counts.to_record(),
        unpriced_custom_calls=dict(cost.unpriced_custom_calls),  # targets the reader cannot price: executions per run
        transcendentals_per_device=cost.transcendentals,
        collectives=cost.collectives_by_kind_and_axis(), collectives_by_kind=cost.collectives_by_kind(),
        collective_bytes_per_device=cost.collective_bytes(),
        compute_s=pred.compute_s, memory_s=pred.memory_s, comm_s=pred.comm_s, kernel_s=pred.kernel_s,
        host_s=pred.host_s, host_bytes_out_per_device=cost.host_bytes_out, host_bytes_in_per_device=cost.host_bytes_in,
        roofline_s=pred.predicted_s, roofline_serial_s=pred.predicted_serial_s,
        predicted_step_s=step, predicted_mfu=floor_s / step if step > 0 else None,
        tokens_per_s=tokens / step if step > 0 else None,
        xla_estimate_s=xla_s, bound=pred.bound, bottleneck=explain_bottleneck(pred, step, floor_s),
        torus_axes=p.torus_axes if lw.target.kind == "tpu" else None,
        replication=(pred.flops * n / mflops) if mflops else None,
        reason=None if fits else (f"needs {_gib(mem)} per device > {_gib(hw.hbm_bytes)} HBM of {hw.name}"),
    )


def _pipeline_fields(lw: Lowered, p: _Priced, step: float, floor_s: float) -> dict | None:
    """pp strategies: the schedule's bubble terms and how the compiled program holds the bubble; None otherwise."""
    spec, strat = lw.spec, lw.resolved.strategy
    if not strat.pipelined:
        return None
    shape = dict(lw.axes)
    bt = pipeline.bubble_terms(pipeline_spec(spec, shape), lw.cfg, lw.batch, lw.seq, strat.batch_ways(shape),
                               math.prod(shape.get(a, 1) for a in strat.rules.mesh_axes_for("mlp")),
                               p.price_hw.peak(p.price))
    bt["predicted_step_without_bubble_s"] = max(step - bt.get("bubble_s", 0.0), floor_s)
    if bt["schedule"] == "1f1b":
        bt["explain"] = ("1f1b skips idle slots (lax.cond), but the HLO counter counts a conditional's branch "
                         "every time it could run: the compiled per-device flops are those of m + 2p - 2 ticks "
                         "of F + B (with the backward's recompute of the stage forward), an upper bound on the "
                         "critical path (m + p - 1)(F + B); bubble_s = (p - 1) x one tick's layer FLOPs at "
                         "peak (analytic)")
    else:
        bt["explain"] = ("every stage computes every tick of the SPMD program, so the compiled per-device "
                         "program (its roofline) is the critical path through the stages and already holds the "
                         "(p - 1) bubble ticks; bubble_s = (p - 1) x one tick's layer FLOPs at peak (analytic)")
    return bt


def _explain_fields(lw: Lowered, p: _Priced, hw, flop_counts, mflops: float, mflops_how: str) -> dict[str, str]:
    """How each term of the prediction was computed, in words with the figures used."""
    cost, pred, n, k = p.cost, p.pred, lw.target.n_devices, p.torus_axes
    return {
        "memory_per_device_bytes": "memory_analysis: arguments + outputs + temporaries − aliased (donated) bytes",
        "compute_s": f"flops per device {pred.flops:.4g} ({flop_counts.used_source}; see flop_counts) / "
                     f"{hw.name} peak {pred.peak_dtype} {pred.peak_flops:.4g} "
                     f"FLOP/s{_src(hw, 'peak_flops.' + pred.peak_dtype)}"
                     + (f" + transcendentals {pred.transcendental_s:.3g}s" if pred.transcendental_s else ""),
        "memory_s": f"bytes per device {cost.bytes_accessed:.4g} / HBM {hw.hbm_bw:.4g} B/s{_src(hw, 'hbm_bw')}",
        "comm_s": f"Σ collective_time over {sum(c.count for c in cost.collectives)} collectives on "
                  f"{hw.interconnect.kind} (link {hw.interconnect.link_bw:.3g} B/s × {hw.interconnect.links}"
                  f"{', torus axes ' + str(k) if lw.target.kind == 'tpu' else ''}); partitioning/collectives.py",
        "roofline_s": "workbench.roofline.prediction.predict: max(kernel-by-kernel roofline, comm_s), perfect overlap",
        "analytic_floor_s": f"{mflops_how} = {mflops:.4g} FLOP / ({n} devices × {hw.peak('bfloat16'):.4g} bf16 FLOP/s)",
        "predicted_step_s": "max(roofline_s, analytic_floor_s)",
        "predicted_mfu": "analytic_floor_s / predicted_step_s",
        "xla_estimate_s": "the compiler's cost_analysis optimal_seconds (TPU), when positive",
    }


def predict_lowered(lw: Lowered, compiled=None, compile_s: float | None = None,
                    error: str | None = None, oom_hlo: str | None = None) -> TargetPrediction:
    """Turn a lowered (and compiled, or failed) program into the prediction record's body.

    oom_hlo: the optimized HLO of a program the compiler refused for want of memory (compile_keeping_oom_hlo); the
    record then says it does not fit and still prices the step it would take (`priced_from`)."""
    target, spec = lw.target, lw.spec
    hw = target_spec(target)  # per device (the chip's share on v7x)
    n = target.n_devices
    tokens = lw.batch * (lw.seq if spec.mode != "decode" else 1)
    mflops, mflops_how = model_flops(lw.cfg, spec.mode, lw.batch, lw.seq)
    floor_s = mflops / (n * hw.peak("bfloat16"))  # = mflops / (chips × chip peak)
    notes = list(lw.notes)
    compute_dtype = dtype_name(lw.resolved.policy.compute_dtype)
    out = _base_fields(lw, hw, tokens, mflops, floor_s, compute_dtype, compile_s)
    if lw.cfg.is_moe:  # the analytic MoE buffers, beside (or instead of, when it does not compile) memory_analysis
        out["moe_memory"] = moe_memory_of(lw)
    if lw.lowered is None or (error is not None and oom_hlo is None):  # the pre-check decided, or the compiler
        out.update(_precheck_refusal(lw, hw) if lw.lowered is None else _oom_refusal(error, target))  # ran out
        out["notes"] = notes
        return TargetPrediction(out)
    if error is not None:
        compiled = UncompiledHlo(oom_hlo)
    p = _price_compiled(lw, compiled, hw, compute_dtype, notes)
    cost, pred = p.cost, p.pred
    fits = False if error is not None else _fits(lw, cost.peak_memory_bytes, hw, notes)
    flop_counts = reconcile_flops(cost, mflops, n, lw.cfg, spec.mode, lw.seq, used=pred.flops)
    notes.extend(flop_counts.notes)
    if pred.compute_s < 0.95 * floor_s:
        notes.append(f"the compute term {pred.compute_s:.3g}s is below the analytic floor {floor_s:.3g}s: the priced "
                     f"count ({pred.flops:.3g} FLOP, {flop_counts.used_source}) is under the model's "
                     f"{flop_counts.analytic:.3g} per device")
    xla_s, xla_note = xla_estimate(compiled)
    if xla_note:
        notes.append(xla_note)
    step = max(pred.predicted_s, floor_s)
    if pred.predicted_s < floor_s:
        notes.append(f"the roofline's {pred.predicted_s:.3g}s is below the analytic floor {floor_s:.3g}s (the "
                     "compiler counted fewer FLOPs than the model convention): the floor is the prediction")
    out.update(_compiled_fields(lw, p, hw, fits=fits, flop_counts=flop_counts, step=step, floor_s=floor_s,
                                tokens=tokens, mflops=mflops, xla_s=xla_s))
    bt = _pipeline_fields(lw, p, step, floor_s)
    if bt is not None:
        out["pipeline"] = bt
    if out.get("moe_memory"):
        out["moe_memory"] = {**out["moe_memory"], "compiled_temp_bytes": cost.temp_bytes,
                             "share_of_compiled_temp": out["moe_memory"]["peak_bytes"] / cost.temp_bytes
                             if cost.temp_bytes else None}
    out["explain"] = _explain_fields(lw, p, hw, flop_counts, mflops, mflops_how)
    if error is not None:  # what the compiler said about memory replaces what an uncompiled program cannot say
        out.update({k: v for k, v in _oom_refusal(error, target).items() if k in _MEMORY_FIELDS})
        out.pop("memory_breakdown", None)
        out["priced_from"] = ("the optimized HLO the compiler wrote before it ran out of memory: the step this "
                              "program would take were there room (its memory is the compiler's message's)")
        notes.append("does not fit; the step is priced from the optimized HLO the compiler wrote before it ran out "
                     "of memory")
    out["notes"] = notes + list(pred.notes)
    return TargetPrediction(out, cost, pred)


_MEMORY_FIELDS = ("fits", "compiled", "memory_per_device_bytes", "memory_source", "overshoot_bytes", "reason")


def moe_memory_of(lw: Lowered) -> dict:
    """The analytic MoE layer memory (models.analytics.moe_layer_memory) for this step's per-device token group."""
    cfg, spec = lw.cfg, lw.spec
    if not cfg.is_moe:
        return {}
    s = lw.resolved.strategy
    ways = s.batch_ways(lw.axes)
    t = lw.seq if spec.mode != "decode" else 1
    tokens = lw.batch // ways // max(spec.microbatches, 1) * t
    ep = lw.axes.get("expert", 1) if s.needs_moe else 1
    tensor = lw.axes.get("model", 1) if s.splits_tensors else 1
    fsdp = lw.axes.get("data", 1) if "data" in s.rules.mesh_axes_for("embed") else 1
    cb = int(jnp_itemsize(dtype_name(lw.resolved.policy.compute_dtype)))
    return moe_layer_memory(cfg, max(tokens, 1), compute_bytes=cb, ep=ep, tensor=tensor, fsdp=fsdp,
                            backward=spec.mode == "train", fused=moe_memory_fused(cfg, moe.platform_of(lw.mesh)))


def jnp_itemsize(dtype_name: str) -> int:
    import numpy as np

    return 2 if dtype_name in ("bfloat16", "float16") else (1 if "8" in dtype_name else np.dtype(dtype_name).itemsize)


def _compiler_version(compiler: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    pkgs = {"libtpu": ("libtpu",), "xla-gpu": ("jax-cuda13-plugin", "jax-cuda12-plugin"),
            "xla-cpu": ("jaxlib",)}.get(compiler.split(" ")[0], ())
    for pkg in pkgs:
        try:
            return f"{pkg} {version(pkg)}"
        except PackageNotFoundError:
            continue
    return None


def _src(hw, key: str) -> str:
    s = getattr(hw, "sources", {}).get(key)
    return f" [{s.source}, {s.date}]" if s else ""


def explain_bottleneck(pred, step: float, floor_s: float) -> str:
    """One line: which term sets the step time."""
    terms = {("memory (HBM)" if k == "memory" else k): v for k, v in pred.terms.items()
             if v or k != "host transfer"}  # the host link only where the program offloads
    name, t = max(terms.items(), key=lambda kv: kv[1])
    others = ", ".join(f"{k} {v:.3g}s" for k, v in terms.items() if k != name)
    if floor_s >= pred.predicted_s:
        return (f"compute floor: the model's FLOPs at peak bf16 ({floor_s:.3g}s) exceed the compiled program's "
                f"roofline ({pred.predicted_s:.3g}s)")
    return f"{name}-bound: {name} {t:.3g}s of a {step:.3g}s step ({others})"


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def _overshoot_from_words(words: str) -> tuple[float, float] | None:
    """(needed, available) bytes when the compiler's message states them ('... (24.00G) exceeds available HBM
    (15.75G)' or 'Used 20.5G of 15.75G hbm')."""
    import re

    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    m = re.search(r"\(([\d.]+)([KMGT]?)\)\s*exceeds available \w+\s*\(([\d.]+)([KMGT]?)\)", words)
    if not m:
        m = re.search(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?)", words)
    if not m:
        return None
    return float(m.group(1)) * units[m.group(2)], float(m.group(3)) * units[m.group(4)]


# ----------------------------------------------------------------------------------------------- entry points


def predict_once(spec: PredictSpec | Resolved, *, compile_anyway: bool = False,
                 price_unfit: bool = False) -> TargetPrediction:
    """Lower, compile and predict one spec exactly as given (no automatic remat).

    price_unfit: compile with an XLA dump, so that when the compiler runs out of memory the optimized HLO it wrote is
    priced all the same (the record still says it does not fit); one compile either way."""
    return _predict_lowered_spec(lower(spec, precheck=not compile_anyway), price_unfit)


def _predict_lowered_spec(lw: Lowered, price_unfit: bool) -> TargetPrediction:
    spec = lw.spec
    compiled, cs, err, oom_hlo = (None, None, None, None)
    if lw.lowered is not None:
        n = lw.mesh.size
        say(f"predict: compiling {spec.preset} {spec.mode} (remat {lw.cfg.remat}) for {spec.target}: {n} devices, "
            f"{lw.compiler}" + (" — pod-scale programs take minutes on a CPU host" if n >= 64 else ""))
        compiled, cs, err, oom_hlo = _compile(lw, keep_oom_hlo=price_unfit)
        say(f"predict: compiled in {cs:.0f} s" + ("" if err is None else " — the compiler ran out of memory"))
    return predict_lowered(lw, compiled, cs, err, oom_hlo)


def predict(spec: PredictSpec | Resolved, *, store: bool = True, compile_anyway: bool = False) -> TargetPrediction:
    """Compile `spec` for its target and predict one step (also stored).

    remat='auto' (train): the preset's rematerialization first; when the compiler runs out of memory with none,
    per-layer rematerialization is compiled too and becomes the answer; the record keeps what the first try said.
    """
    r = resolve(spec)
    spec = r.spec
    lw = lower(r, precheck=not compile_anyway)
    # a program that does not fit is priced all the same when it is the answer (not when auto remat tries again)
    retries = spec.remat in ("auto", None) and spec.mode == "train" and lw.cfg.remat != "per-layer"
    body = _predict_lowered_spec(lw, price_unfit=not retries)
    if store:
        record(body, spec, kind="predict")
    if retries and not body["fits"] and body.get("compile_s") is not None:
        first = {k: body.get(k) for k in ("fits", "reason", "memory_per_device_bytes", "compile_s")}
        say(f"predict: with remat {body['remat']} the step does not fit; trying per-layer rematerialization")
        second = predict_once(r.with_remat("per-layer"), compile_anyway=compile_anyway, price_unfit=True)
        second = second.with_fields(remat_auto={
            "tried_first": body["remat"], **first, "chosen": "per-layer",
            "why": ("without rematerialization" if body["remat"] == "none" else f"with remat {body['remat']}")
            + " the program does not fit"})
        if store:
            record(second, dataclasses.replace(spec, remat="per-layer"), kind="predict")
        body = second
    elif spec.remat in ("auto", None):
        body = body.with_fields(remat_auto={"chosen": body["remat"], "why": "the preset's setting" + (
            "" if body["fits"] or body["remat"] == "per-layer" else "; per-layer remat cannot help: the state alone "
            "does not fit")})
    return body


def record(tp: TargetPrediction, spec: PredictSpec | dict, kind: str = "predict", extra: dict | None = None) -> dict:
    """Append the prediction to the results store (spec + CostReport + Prediction + the fit/floor/MFU fields)."""
    s = spec.to_dict() if hasattr(spec, "to_dict") else dict(spec)
    rec = make_record(kind, s, cost=tp.cost, prediction=tp.prediction, measurement=None,
                      extra={**tp.to_record(), **(extra or {})})
    return Store().append(rec)
