"""Plan the partitioning of a model on a target: enumerate, compile, drop what does not fit, rank by predicted step.

Candidates = strategies × mesh factorizations × rematerialization (none / per-layer) × microbatches (1, 2, 4 where
the per-shard batch divides; pipelined strategies: stage counts 2..8 that divide the chips and n_layers, and p, 2p,
4p pipeline microbatches for p stages, the fewest being their "plain" program). Remat and microbatching only save
memory, so by default they are compiled only for the strategy × mesh pairs whose plain program does not fit, right
after it (four pairs at a time: `--max-candidates` then reaches the variants that fit even where no plain program
does; `exhaustive=True` compiles every candidate). Every candidate goes through the same path as `workbench predict`
(workbench.programs.predict): lowered for the target's devices in this thread (tracing is Python), compiled in a
thread pool (the XLA compilers release the GIL), then predicted with workbench.roofline.prediction. Candidates whose
rules cannot shard the model (a head count not divisible by the model axis, say) are listed as invalid with the
reason; those that do not fit are dropped and kept for the overshoot report; the rest are ranked by predicted step
time.

Caching. GPU targets compiled for simulated CPU devices use JAX's persistent compilation cache
(workbench.hardware.devices.enable_compilation_cache). JAX 0.10's persistent cache cannot read back executables
compiled for libtpu's compile-only devices (deserialising needs a TPU client: "PjRtCompiler must be constructed with
a Client"), so TPU candidates use an outcome cache instead: the candidate's record (costs, prediction, fit) is stored
under .cache/plan/ keyed by a hash of the lowered StableHLO text, the target, and the jax/jaxlib/libtpu versions — a
changed model, strategy or library misses the cache. `--no-cache` ignores it."""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Mapping
from typing import Any, Callable

from models.presets import get_config
from partitioning import topology as topo
from partitioning.rules import strategies as all_strategies
from partitioning.strategy import get_strategy
from workbench.errors import WorkbenchError
from workbench.hardware.devices import enable_compilation_cache
from workbench.programs import predict as wp
from workbench.programs.executor import Task
from workbench.programs.validation import validation_error
from workbench.results.store import RecordView, Store, make_record, versions

REMATS = ("none", "per-layer", "offload")  # offload (host memory): TPU targets only (pinned host memory)
MICROBATCHES = (1, 2, 4)
PIPELINE_MICROBATCHES = (1, 2, 4)  # × the stage count: the pipeline's microbatch counts a planner tries (bubble
#                                    (p-1)/(m+p-1): 43%, 27%, 16% at p = 4)


def microbatch_choices(strategy, axes: dict[str, int]) -> tuple[int, ...]:
    """Microbatch counts for a strategy × mesh: gradient accumulation 1, 2, 4; a pipeline of p stages p, 2p, 4p."""
    st = get_strategy(strategy)
    if st.pipelined:
        p = axes.get("stage", 1)
        return tuple(f * p for f in PIPELINE_MICROBATCHES)
    return MICROBATCHES


def enumerate_candidates(preset: str, target: str | wp.Resolver, batch: int | None = None, seq: int | None = None,
                         strategies: list[str] | None = None, policy: str = "bf16", overrides: str | None = None,
                         gpu_compiler: str = "auto") -> list[wp.PredictSpec]:
    """All candidate specs in priority order: every strategy × mesh without remat or microbatching first, then
    per-layer remat, then microbatching (so --max-candidates keeps the widest variety). `target`: a target name or
    the plan's Resolver (its target, each strategy resolved once)."""
    res = target if isinstance(target, wp.Resolver) else wp.Resolver(topo.parse_target(target), policy)
    t = res.target
    cfg = get_config(preset, overrides)
    seq = seq or cfg.seq_len
    batch = batch or wp.default_batch(t.n_chips)
    strats = strategies or [s for s in all_strategies() if s != "ep" or cfg.is_moe]
    for s in strats:
        if s not in all_strategies():
            raise WorkbenchError(f"unknown strategy {s!r}; choose from {', '.join(all_strategies())}")
    tiers: list[list[wp.PredictSpec]] = [[], [], []]
    for s in strats:
        st = res.strategy(s)
        if st.pipelined and cfg.is_moe:
            continue
        for axes in st.mesh_candidates(t.n_devices, cfg, seq):
            nb = st.batch_ways(axes)
            if batch % nb:
                continue
            mesh = ",".join(f"{k}={v}" for k, v in axes.items())
            for remat in REMATS:
                if remat == "offload" and t.kind != "tpu":
                    continue
                choices = microbatch_choices(st, axes)
                for mb in choices:
                    if (batch // nb) % mb:
                        continue
                    spec = wp.PredictSpec(preset, t.name, s, mesh=mesh, batch=batch, seq=seq, remat=remat,
                                          microbatches=mb, policy=policy, overrides=overrides,
                                          gpu_compiler=gpu_compiler)
                    tiers[_tier(spec, choices[0])].append(spec)
    return [c for tier in tiers for c in tier]


# ------------------------------------------------------------------------------------------------ outcome cache


def _versions() -> str:
    v = versions()
    return ";".join(f"{k}={v.get(k) or 'none'}" for k in ("jax", "jaxlib", "libtpu", "jax_cuda12_plugin"))


def cache_key(lw: wp.Lowered) -> str:
    h = hashlib.sha256()
    h.update(lw.lowered.as_text().encode())
    h.update(f"|{lw.target.name}|{lw.compiler}|{_versions()}|{os.environ.get('XLA_FLAGS', '')}|"
             f"{os.environ.get('LIBTPU_INIT_ARGS', '')}".encode())
    return h.hexdigest()[:32]


def _cache_dir() -> str:
    return os.environ.get("WORKBENCH_PLAN_CACHE", os.path.join(os.getcwd(), ".cache", "plan"))


def cache_get(key: str) -> dict | None:
    path = os.path.join(_cache_dir(), key + ".json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def cache_put(key: str, entry: dict) -> None:
    d = _cache_dir()
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{key}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(entry, f, default=str)
    os.replace(tmp, os.path.join(d, key + ".json"))  # atomic: a reader never sees half an entry


# --------------------------------------------------------------------------------------------------- planning


@dataclasses.dataclass
class Outcome:
    spec: wp.PredictSpec
    status: str                # ranked | does-not-fit | invalid
    body: dict | None = None   # the prediction record's body (public fields)
    reason: str | None = None
    cached: bool = False


@dataclasses.dataclass(frozen=True)
class PlanResult(RecordView):
    """A plan: the ranking and what was compiled, pruned or refused (`record`, the JSON body `plan --json` prints and
    the store keeps; read it like a mapping: `r["winner"]`) and every candidate's Outcome."""

    record: Mapping[str, Any]
    outcomes: tuple[Outcome, ...]

    @property
    def winner(self) -> dict | None:
        return self.record.get("winner")


PAIRS_AT_ONCE = 4  # strategy × mesh pairs whose plain programs compile before their variants (plan)


def _reached_compiler(o: Outcome) -> bool:
    """Whether a candidate was compiled (now, or when its cached outcome was made), as --max-candidates counts."""
    return o.status != "invalid" and bool(o.body) and o.body.get("compile_s") is not None


def default_workers() -> int:
    """Compile threads: the cores this process may use, at most 4 (each compile holds its own memory)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, min(4, n))


def _mesh_axes(spec: wp.PredictSpec) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in (spec.mesh or "").split(",") if "=" in kv)}


def _tier(spec: wp.PredictSpec, base: int | None = None) -> int:
    """0: the plain program (no remat, the fewest microbatches `base`: 1, or p for a pipeline of p stages); 1: remat;
    2: more microbatches."""
    if base is None:
        base = microbatch_choices(spec.strategy, _mesh_axes(spec))[0]
    return 0 if (spec.remat == "none" and spec.microbatches == base) else (1 if spec.microbatches == base else 2)


def plan(preset: str, target: str | topo.Target, *, batch: int | None = None, seq: int | None = None,
         max_candidates: int | None = 24, strategies: list[str] | None = None, policy: str = "bf16",
         overrides: str | None = None, workers: int | None = None, use_cache: bool = True, store: bool = True,
         exhaustive: bool = False, gpu_compiler: str = "auto",
         on_progress: Callable[[int, int, str], None] | None = None, executor=None) -> PlanResult:
    """Enumerate, compile (in parallel), drop non-fitting, rank by predicted step time.

    Pruning (unless exhaustive): rematerialization and microbatching only save memory — they add recompute or
    serialize the step — so a strategy × mesh whose plain program fits is not compiled again with them; per-layer
    remat is tried where the plain one does not fit, microbatching where neither does. A mesh whose sharded state
    alone overflows HBM, or that the rules cannot shard, gets no variants either (neither can help). Pruned
    candidates are listed with the reason.

    `executor` (workbench.programs.executor; None: this process, compiling in `workers` threads): a back-end that runs
    each candidate whole (lower, cache, compile, predict) on its own worker (`candidate_outcome`); the outcome comes
    back here, where the records are written and the tiers pruned, as in-process.
    """
    t0 = time.perf_counter()
    t = target if isinstance(target, topo.Target) else topo.parse_target(target)
    res = wp.Resolver(t, policy)
    cands = enumerate_candidates(preset, res, batch, seq, strategies, policy, overrides, gpu_compiler)
    if not cands:
        raise WorkbenchError(f"no candidate partitioning for {preset} on {t.name} with batch {batch}: the batch "
                             "divides no data axis; use a batch that is a multiple of the chip count")
    total = len(cands)
    if max_candidates is not None and max_candidates < 1:
        raise WorkbenchError(f"--max-candidates must be >= 1, got {max_candidates}")
    budget = max_candidates if max_candidates is not None else total
    compiler = topo.gpu_compiler_for(t, gpu_compiler)
    if compiler == "cpu-sim" and use_cache:
        enable_compilation_cache()
    workers = executor.slots() if executor is not None else (workers or default_workers())
    outcomes: list[Outcome] = []
    pruned: list[dict] = []
    tier_of = {c: _tier(c, microbatch_choices(res.strategy(c.strategy), _mesh_axes(c))[0]) for c in cands}
    state = {"done": 0, "expected": min(budget, sum(1 for c in cands if exhaustive or tier_of[c] == 0))}

    def tick(msg: str):
        state["done"] += 1
        if on_progress:
            on_progress(state["done"], max(state["expected"], state["done"]), msg)

    def run(group: list[wp.PredictSpec], pool) -> None:
        # the budget counts the candidates that reach the compiler: those the rules cannot shard and those whose
        # state alone overflows HBM are decided while lowering, so the next ones in line take their places
        while group and (room := budget - sum(1 for o in outcomes if _reached_compiler(o))) > 0:
            chunk, group = group[:room], group[room:]
            state["expected"] = max(state["expected"], len(outcomes) + len(chunk))
            if executor is not None:
                outcomes.extend(_run_on(executor, chunk, t, gpu_compiler, use_cache, store, tick))
            else:
                outcomes.extend(_run(chunk, res, pool, workers, compiler, use_cache, store, tick))

    def variants(tier: int, pairs: set) -> list[wp.PredictSpec]:
        group = [c for c in cands if tier_of[c] == tier and (c.strategy, c.mesh) in pairs]
        if exhaustive:
            return group
        keep = []
        for c in group:
            why = _prune_reason(c, outcomes)
            if why:
                pruned.append({"strategy": c.strategy, "mesh": c.mesh, "remat": c.remat,
                               "microbatches": c.microbatches, "reason": why})
            else:
                keep.append(c)
        return keep

    # PAIRS_AT_ONCE strategy × mesh pairs at a time, each followed by the remat and microbatched variants its plain
    # program calls for, so that a budget smaller than the candidates still reaches the variants that fit; a fixed
    # number, not the worker count, so that every back-end compiles the same candidates (exhaustive: every plain
    # program first, then every variant)
    plain = [c for c in cands if tier_of[c] == 0]
    step = len(plain) if exhaustive else PAIRS_AT_ONCE
    all_pairs = {(c.strategy, c.mesh) for c in cands}
    with cf.ThreadPoolExecutor(max_workers=workers) as pool:
        for start in range(0, len(plain), step):
            pairs = {(c.strategy, c.mesh) for c in plain[start:start + step]}
            run(plain[start:start + step], pool)
            for tier in (1, 2):
                run(variants(tier, pairs), pool)
            all_pairs -= pairs
        for tier in (1, 2):  # variants of a pair without a plain program
            run(variants(tier, all_pairs), pool)
    elapsed = time.perf_counter() - t0
    result = summarize(preset, t, cands, outcomes, total, elapsed, workers,
                       compiler if t.kind == "gpu" else "libtpu")
    result["pruned"] = pruned
    result["n_pruned"] = len(pruned)
    result["exhaustive"] = exhaustive
    result["backend"] = executor.name if executor is not None else "in-process"
    if store:
        Store().append(make_record("plan", {"preset": preset, "target": t.name, "batch": result["batch"],
                                            "seq": result["seq"], "max_candidates": max_candidates,
                                            "strategies": strategies, "policy": policy, "overrides": overrides,
                                            "exhaustive": exhaustive},
                                   extra=result))
    return PlanResult(result, tuple(outcomes))


def _prune_reason(c: wp.PredictSpec, outcomes: list[Outcome]) -> str | None:
    """Why a remat/microbatched variant need not be compiled, judging by its strategy × mesh's earlier outcomes."""
    same = [o for o in outcomes if o.spec.strategy == c.strategy and o.spec.mesh == c.mesh]
    if not same:
        return None
    if any(o.status == "invalid" for o in same):
        return "the rules cannot shard the model on this mesh"
    if any(o.body and o.body.get("compiled") is False and o.body.get("compile_s") is None for o in same):
        return "the sharded state alone exceeds HBM: remat and microbatching cannot help"
    fitting = [o for o in same if o.status == "ranked"]
    if fitting:
        f = fitting[0].spec
        return (f"{c.strategy} on {c.mesh} already fits with remat {f.remat}, {f.microbatches} microbatch(es); "
                "remat/microbatching would only add recompute or serialize the step")
    return None


def _run(group: list[wp.PredictSpec], res: wp.Resolver, pool, workers: int, compiler: str, use_cache: bool,
         store: bool, tick) -> list[Outcome]:
    """Lower each spec on this thread, compile in the pool (cache first), predict; outcomes in input order."""
    outcomes: list[Outcome | None] = [None] * len(group)
    pending: dict[cf.Future, tuple[int, wp.Lowered, str | None]] = {}
    for i, spec in enumerate(group):
        label = f"{spec.strategy} {spec.mesh} remat={spec.remat} mb={spec.microbatches}"
        try:
            lw = wp.lower(res(spec))  # tracing stays on this thread
        except Exception as e:  # noqa: BLE001 - a candidate that does not trace must not end the plan
            outcomes[i] = Outcome(spec, "invalid", reason=_failure(e, "did not lower"))
            tick(label + " (invalid)")
            continue
        if lw.lowered is None:  # the sharded state alone overflows HBM: no compile needed
            outcomes[i] = _finish(spec, wp.predict_lowered(lw), store)
            tick(label + " (state exceeds HBM)")
            continue
        key = cache_key(lw) if (use_cache and compiler != "cpu-sim") else None
        hit = cache_get(key) if key else None
        if hit is not None:
            outcomes[i] = _finish(spec, wp.TargetPrediction(hit["body"], hit.get("costs"), hit.get("prediction")),
                                  store, cached=True)
            tick(label + " (cached)")
            continue
        pending[pool.submit(wp.compile_lowered, lw)] = (i, lw, key)
        while len(pending) >= 2 * workers:  # at most 2x workers lowered programs held in memory
            _drain(pending, outcomes, store, tick, cf.FIRST_COMPLETED)
    while pending:
        _drain(pending, outcomes, store, tick, cf.FIRST_COMPLETED)
    return [o for o in outcomes if o is not None]


def _failure(e: BaseException, what: str) -> str:
    """A candidate's failure as its one-line reason: the workbench's own words, else what failed and JAX's error."""
    return str(e) if isinstance(e, WorkbenchError) else f"{what}: {type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _drain(pending, outcomes, store, tick, how):
    finished, _ = cf.wait(list(pending), return_when=how)
    for fut in finished:
        i, lw, key = pending.pop(fut)
        spec = lw.spec
        label = f"{spec.strategy} {spec.mesh} remat={spec.remat} mb={spec.microbatches}"
        try:
            compiled, secs, err = fut.result()
            body = wp.predict_lowered(lw, compiled, secs, err)
        except Exception as e:  # noqa: BLE001 - a compiler failure on one candidate must not end the plan
            outcomes[i] = Outcome(spec, "invalid", reason=_failure(e, "compile failed"))
            tick(label + " (invalid)")
            continue
        cost, pred = body.cost, body.prediction
        if key:
            cache_put(key, {"body": body.to_record(), "costs": cost.to_dict() if cost is not None else None,
                            "prediction": pred.to_dict() if pred is not None else None})
        outcomes[i] = _finish(spec, body, store)
        tick(label)


def candidate_outcome(spec: wp.PredictSpec, gpu_compiler: str, use_cache: bool, cache_dir: str) -> dict:
    """One candidate, whole, on whichever worker runs it (a fresh process: the target's devices are set up before
    JAX starts): lower, look in the outcome cache (`cache_dir`, shared by every worker), compile, predict, fill the
    cache. Returns {"invalid": reason} or the cache entry's {"body", "costs", "prediction", "cached"}."""
    os.environ["WORKBENCH_PLAN_CACHE"] = cache_dir
    t = topo.setup_target_devices(spec.target, gpu_compiler)
    compiler = topo.gpu_compiler_for(t, gpu_compiler)
    if compiler == "cpu-sim" and use_cache:
        enable_compilation_cache()
    try:
        lw = wp.lower(spec)
        if lw.lowered is None:  # the sharded state alone overflows HBM: no compile needed
            tp = wp.predict_lowered(lw)
            key = None
        else:
            key = cache_key(lw) if (use_cache and compiler != "cpu-sim") else None
            hit = cache_get(key) if key else None
            if hit is not None:
                return {**hit, "cached": True}
            tp = wp.predict_lowered(lw, *wp.compile_lowered(lw))
    except Exception as e:  # noqa: BLE001 - a candidate that fails must not end the plan
        return {"invalid": _failure(e, "did not lower or compile")}
    entry = {"body": tp.to_record(), "costs": tp.cost.to_dict() if hasattr(tp.cost, "to_dict") else tp.cost,
             "prediction": tp.prediction.to_dict() if hasattr(tp.prediction, "to_dict") else tp.prediction}
    if key:
        cache_put(key, entry)
    return {**entry, "cached": False}


def candidate_memory(t: topo.Target) -> int:
    """Host memory one candidate's compile is given (Ray requests it per task): 2 GiB for the process, JAX and XLA,
    plus 32 MiB per device of the target (the partitioner's per-device copies grow with the mesh)."""
    return 2 * 2**30 + 32 * 2**20 * t.n_devices


def _run_on(executor, group: list[wp.PredictSpec], t: topo.Target, gpu_compiler: str, use_cache: bool, store: bool,
            tick) -> list[Outcome]:
    """Each candidate on the executor's workers (candidate_outcome); outcomes (and records) written here, in input
    order."""
    def label(spec):
        return f"{spec.strategy} {spec.mesh} remat={spec.remat} mb={spec.microbatches}"

    outcomes: list[Outcome | None] = [None] * len(group)
    tasks = [Task(str(i), label(spec), candidate_outcome, (spec, gpu_compiler, use_cache, os.path.abspath(_cache_dir())),
                  candidate_memory(t), fresh_process=True) for i, spec in enumerate(group)]
    for r in executor.run(tasks):
        i = int(r.task.key)
        spec = group[i]
        v = r.value if r.ok else {"invalid": f"{r.error} (on {r.worker or 'a worker that died'})"}
        if "invalid" in v:
            outcomes[i] = Outcome(spec, "invalid", reason=v["invalid"])
            tick(label(spec) + " (invalid)")
            continue
        tp = wp.TargetPrediction(v["body"], v.get("costs"), v.get("prediction"))
        outcomes[i] = _finish(spec, tp, store, cached=v.get("cached", False))
        tick(label(spec) + (" (cached)" if v.get("cached") else ""))
    return [o for o in outcomes if o is not None]


def _finish(spec, tp: wp.TargetPrediction, store: bool, cached: bool = False) -> Outcome:
    pub = tp.to_record()
    if cached:
        pub = dict(pub, cached=True)
    if store:
        wp.record(tp, spec, kind="predict", extra={"planner": True, "cached": cached})
    status = "ranked" if pub.get("fits") and pub.get("predicted_step_s") else "does-not-fit"
    return Outcome(spec, status, pub, pub.get("reason"), cached)


def _row(o: Outcome) -> dict:
    b = o.body or {}
    return {"strategy": o.spec.strategy, "mesh": o.spec.mesh, "remat": o.spec.remat,
            "microbatches": o.spec.microbatches, "status": o.status,
            "predicted_step_s": b.get("predicted_step_s"), "predicted_mfu": b.get("predicted_mfu"),
            "tokens_per_s": b.get("tokens_per_s"), "memory_per_device_bytes": b.get("memory_per_device_bytes"),
            "overshoot_bytes": b.get("overshoot_bytes"), "bound": b.get("bound"),
            "compute_s": b.get("compute_s"), "memory_s": b.get("memory_s"), "comm_s": b.get("comm_s"),
            "collective_bytes_per_device": b.get("collective_bytes_per_device"),
            "xla_estimate_s": b.get("xla_estimate_s"), "compile_s": b.get("compile_s"),
            "cached": o.cached, "reason": o.reason if o.status != "ranked" else None}


def prediction_error(t: topo.Target) -> dict:
    """The error this target's predictions have shown against published runs (benchmarks.published_validation's
    latest record for the chip family), or why none is known. Printed beside every predicted step time."""
    fam = t.name.split(":")[0]
    v = validation_error(fam)
    if v is None:
        return {"median_error": None, "text": f"error unknown: no published run of {fam} validated in this results "
                                              "store (python -m benchmarks.published_validation)"}
    return {**v, "text": f"±{v['median_error']:.0%} (median over {v['n_runs']} published {v['chip']} runs, "
                         f"{v['time']})"}


def summarize(preset: str, t: topo.Target, cands, outcomes: list[Outcome], total: int, elapsed: float,
              workers: int, compiler: str) -> dict:
    ranked = sorted((o for o in outcomes if o.status == "ranked"),
                    key=lambda o: (o.body["predicted_step_s"], o.body["memory_per_device_bytes"]))
    unfit = [o for o in outcomes if o.status == "does-not-fit"]
    invalid = [o for o in outcomes if o.status == "invalid"]
    first = cands[0] if cands else None
    out: dict[str, Any] = {
        "preset": preset, "target": t.name, "n_chips": t.n_chips, "n_devices": t.n_devices, "compiler": compiler,
        "batch": first.batch if first else None, "seq": first.seq if first else None,
        "candidates_enumerated": total, "candidates_tried": len(outcomes), "n_feasible": len(ranked),
        "n_does_not_fit": len(unfit), "n_invalid": len(invalid), "workers": workers, "elapsed_s": elapsed,
        "compiled_fresh": sum(1 for o in outcomes if o.body and not o.cached and o.body.get("compile_s")),
        "ranking": [dict(_row(o), rank=i + 1) for i, o in enumerate(ranked)],
        "prediction_error": prediction_error(t),
        "does_not_fit": [_row(o) for o in unfit], "invalid": [_row(o) for o in invalid],
    }
    if ranked:
        w = ranked[0]
        out["winner"] = _row(w)
        out["explanation"] = (f"best: {w.spec.strategy} on {w.spec.mesh} (remat {w.spec.remat}, "
                              f"{w.spec.microbatches} microbatch{'es' if w.spec.microbatches > 1 else ''}) — "
                              f"{w.body.get('bottleneck')}")
    else:
        known = [o for o in unfit if o.body and o.body.get("overshoot_bytes") is not None]
        if known:
            c = min(known, key=lambda o: o.body["overshoot_bytes"])
            out["smallest_overshoot"] = _row(c)
            out["explanation"] = (
                f"no candidate fits {t.name}: the closest, {c.spec.strategy} on {c.spec.mesh} (remat "
                f"{c.spec.remat}, {c.spec.microbatches} microbatches), needs "
                f"{c.body['memory_per_device_bytes'] / 2**30:.2f} GiB per device, "
                f"{c.body['overshoot_bytes'] / 2**30:.2f} GiB over the chip's HBM; use a larger slice or a "
                "smaller batch")
        else:
            out["explanation"] = f"no candidate fits or compiles for {t.name} (see does_not_fit and invalid)"
        out["winner"] = None
    return out
