"""`workbench serve`: serving on the roofline. Per batch size, time to first token (the prefill of a batch of prompts),
time per output token (one decode step of the batch), tokens/s per chip, memory and whether it fits, the roofline
point of prefill and of decode, and the batch at which decode turns compute-bound.

On the host (`--target host`) every figure is measured with the one harness (workbench.measure.harness) beside the
calibrated host's prediction of the same compiled program; for a TPU slice or GPU node the serving engine's prefill and
decode steps are compiled for the target (workbench.programs.predict) and predicted. Speculative decoding (`--draft`)
and a continuous-batching run over a stream of requests (`--requests`) run on the host.

The knee: decode's flops grow with the batch (a·B + f0) and so do its bytes (the weights w, read once per step, plus
each sequence's cache, kv·B); read off the compiled programs at the batches asked for, decode is compute-bound from
B* = (ridge·w − f0) / (a − ridge·kv), and never when a ≤ ridge·kv (each sequence's cache costs more bytes than its
flops can cover: attention over a long context stays memory-bound at any batch).
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Callable

import numpy as np

from models import inference
from models.config import ModelConfig
from models.inference import kv_dtype_name
from models.paged import fragmentation
from models.presets import get_config
from models.serving import Engine, Request, Sampling, Steps, check_quant, greedy_generate, speculative_generate, weight_bytes
from models.transformer import Transformer
from workbench.cost.compile import compile_program
from workbench.errors import WorkbenchError
from workbench.hardware.hostmem import available_bytes, check_fits
from workbench.measure.device import local_spec
from workbench.measure.harness import measure_steps, timed
from workbench.programs import predict as wp
from workbench.programs.checkpoint import complete_steps
from workbench.programs.data import get_batch, load_corpus
from workbench.results.store import Store, make_record
from workbench.roofline.prediction import predict

SAY: Callable[[str], None] = lambda s: None


@dataclasses.dataclass(frozen=True)
class ServeSpec:
    preset: str
    target: str = "host"
    batches: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 128
    gen_len: int = 64
    quant: str = "none"
    kv_dtype: str = "auto"
    policy: str | None = None      # None: float32 on the host, bf16 on a target
    strategy: str = "tp"
    mesh: str | None = None
    overrides: str | None = None
    draft: str | None = None
    draft_tokens: int = 4
    requests: str | None = None    # 'synthetic' or a JSON-lines file of {"prompt": str, "max_new": int}
    seed: int = 0
    checkpoint: str | None = None  # host: serve the weights a `workbench run --checkpoint-dir` saved
    paged: bool = False            # decode over a paged cache: the page-table gather form on the host, JAX's Pallas
    #                                paged attention kernel on a TPU target
    temperature: float = 0.0       # host: sampling of speculation and continuous batching (0: greedy)
    page_size: int = 16

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.gen_len

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def validate(spec: ServeSpec) -> None:
    if not spec.batches or any(b < 1 for b in spec.batches):
        raise WorkbenchError(f"--batch takes positive sizes (e.g. 1,8,64); got {','.join(map(str, spec.batches))}")
    if spec.prompt_len < 1 or spec.gen_len < 1:
        raise WorkbenchError(f"--prompt-len and --gen-len must be >= 1; got {spec.prompt_len} and {spec.gen_len}")
    check_quant(spec.quant)
    kv_dtype_name(spec.kv_dtype)
    if spec.draft is not None and spec.draft_tokens < 1:
        raise WorkbenchError(f"--draft-tokens must be >= 1, got {spec.draft_tokens}")
    if spec.target != "host" and (spec.draft or spec.requests or spec.checkpoint):
        raise WorkbenchError("--draft, --requests and --checkpoint run on the host; use --target host")
    if spec.paged and spec.target != "host" and not spec.target.startswith("tpu"):
        raise WorkbenchError(f"--paged on {spec.target}: the paged attention kernel compiled for a target is JAX's "
                             "Pallas TPU kernel; use a TPU target or --target host (the page-table gather form)")
    if not spec.temperature >= 0:
        raise WorkbenchError(f"--temperature must be >= 0, got {spec.temperature}")
    if spec.page_size < 1:
        raise WorkbenchError(f"--page-size must be >= 1, got {spec.page_size}")
    if spec.paged and spec.target != "host":  # the kernel's shape rules, before anything compiles
        wp.prepare(_phase_spec(spec, max(spec.batches), "decode"))
    _host_config(spec, spec.preset)  # an unknown preset, bad overrides or a context beyond learned positions
    if spec.draft:
        _host_config(spec, spec.draft, spec.draft_tokens + 1)


def serve(spec: ServeSpec, say: Callable[[str], None] = SAY) -> dict:
    validate(spec)
    out = serve_host(spec, say) if spec.target == "host" else serve_target(spec, say)
    out["knee"] = knee(out.pop("_decode_points"), out["ridge"], spec.batches)
    firsts = [r["batch"] for r in out["batches"] if r["decode"]["bound"] == "compute"]
    out["compute_bound_batch"] = firsts[0] if firsts else None
    # one record of the whole answer (per-batch latency and throughput, the knee, quality, speculation) for the
    # serving study (notebooks/serving.py); each phase's program has its own record too ('serve' or 'predict')
    Store().append(make_record("serve-run", spec.to_dict(), extra=out, seed=spec.seed))
    return out


# ------------------------------------------------------------------------------------------------- host


def _host_config(spec: ServeSpec, preset: str, extra: int = 0):
    cfg = get_config(preset, spec.overrides if preset == spec.preset else None)
    need = spec.max_len + extra
    if need > cfg.seq_len:
        if cfg.pos == "learned" and preset == spec.preset:
            raise WorkbenchError(f"--prompt-len + --gen-len = {need} exceeds {preset}'s learned position table "
                                 f"({cfg.seq_len}); shorten them or pass --set seq_len={need}")
        cfg = cfg.replace(seq_len=need)  # a draft's position table grows to the served context
    return cfg


def _prompts(batch: int, length: int, seed: int, vocab: int) -> np.ndarray:
    """Prompts from the standard-library corpus (byte-level), or random tokens for a model of another vocabulary."""
    if vocab == 256:
        return get_batch(load_corpus().val, batch, length, seed, 0)["inputs"]
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, length), dtype=np.int32)


def _steps(spec: ServeSpec, preset: str, extra: int = 0):
    """The serving steps of `preset` (random weights, seeded), or of the checkpoint's model for the served preset."""
    from flax import nnx


    if spec.checkpoint and preset == spec.preset:
        model, info = restore_model(spec.checkpoint, spec.seed)
        if model.cfg.pos == "learned" and spec.max_len + extra > model.cfg.seq_len:
            raise WorkbenchError(f"--prompt-len + --gen-len = {spec.max_len + extra} exceeds the checkpoint's "
                                 f"learned position table ({model.cfg.seq_len})")
        steps = Steps(model, quant=spec.quant, kv_dtype=spec.kv_dtype)
        steps.origin = f"checkpoint {info['checkpoint']} step {info['step']} (last training loss {info['last_loss']})"
        return steps
    cfg = _host_config(spec, preset, extra)
    model = Transformer(cfg, spec.policy or "float32", nnx.Rngs(spec.seed))
    steps = Steps(model, quant=spec.quant, kv_dtype=spec.kv_dtype)
    steps.origin = f"random initialisation (seed {spec.seed})"
    return steps


def _program(fn, args, hw, *, measure: bool, feed: int, repeats: int = 10):
    """Compile fn(*args) (its argument `feed` donated and fed forward from the output's second element), predict it on
    hw, and time it with the harness when `measure`. Returns (Compiled, Prediction, Measurement or None)."""
    import jax


    comp = compile_program(jax.jit(fn, donate_argnums=feed), *args)
    pred = predict(comp.cost, hw)
    if not measure:
        return comp, pred, None
    state = list(args)

    def step(i):
        out = comp.compiled(*state)
        state[feed] = out[1]
        return out

    meas = measure_steps(step, warmup=2, repeats=repeats, compile_s=comp.compile_s, min_total_s=0.5, max_repeats=200)
    return comp, pred, meas


def kernel_bytes(cost) -> float:
    """The program's bytes as the HLO reader sums its kernels (an in-place cache update costs its update, where XLA's
    cost_analysis counts a scatter's whole buffer)."""
    ks = cost.get("kernels") if isinstance(cost, dict) else cost.kernels
    if not ks:
        return cost.get("bytes_accessed") if isinstance(cost, dict) else cost.bytes_accessed
    get = (lambda k, f: k[f] if isinstance(k, dict) else getattr(k, f))
    return float(sum((get(k, "bytes_in") + get(k, "bytes_out")) * get(k, "count") for k in ks))


def _point(comp, pred, meas=None) -> dict:
    c = comp.cost
    return {"flops": c.flops, "bytes": kernel_bytes(c), "intensity": pred.intensity, "ridge": pred.ridge,
            "bound": pred.bound,
            "predicted_s": pred.predicted_s, "measured_s": meas.median_s if meas else None,
            "error": abs(pred.predicted_s - meas.median_s) / meas.median_s if meas else None,
            "peak_memory_bytes": c.peak_memory_bytes}


def _host_batch(steps, spec: ServeSpec, hw, batch: int, store) -> tuple[dict, dict]:
    import jax.numpy as jnp


    cache = steps.init_cache(batch, spec.max_len)
    kv = inference.cache_bytes(cache)
    check_fits(weight_bytes(steps.params) + kv, f"serving {spec.preset} at batch {batch}",
               "use a smaller --batch or --prompt-len/--gen-len")
    prompts = jnp.asarray(_prompts(batch, spec.prompt_len, spec.seed, steps.cfg.vocab_size))
    lengths = jnp.full((batch,), spec.prompt_len, jnp.int32)
    SAY(f"serve: batch {batch}: prefill {batch} x {spec.prompt_len}")
    pc, pp, pm = _program(steps.prefill, (steps.params, steps.rest, prompts, lengths, cache), hw, measure=True, feed=4,
                          repeats=5)
    filled = steps.init_paged(batch, spec.max_len, spec.page_size) if spec.paged else \
        steps.init_cache(batch, spec.max_len)
    filled["lengths"] = lengths
    SAY(f"serve: batch {batch}: decode against {spec.max_len} cached positions")
    dc, dp, dm = _program(steps.decode_paged if spec.paged else steps.decode,
                          (steps.params, steps.rest, prompts[:, -1], filled), hw, measure=True, feed=3)
    for what, comp, pred, meas in (("prefill", pc, pp, pm), ("decode", dc, dp, dm)):
        store.append(make_record("serve", dict(spec.to_dict(), batch=batch, phase=what, target=hw.name), comp.cost,
                                 pred, meas, seed=spec.seed))
    memory = max(pc.cost.peak_memory_bytes, dc.cost.peak_memory_bytes)
    free = available_bytes()
    row = {"batch": batch, "ttft_s": pm.median_s, "predicted_ttft_s": pp.predicted_s, "tpot_s": dm.median_s,
           "predicted_tpot_s": dp.predicted_s, "tokens_per_s": batch / dm.median_s,
           "predicted_tokens_per_s": batch / dp.predicted_s, "weight_bytes": weight_bytes(steps.params),
           "kv_cache_bytes": kv, "memory_bytes": memory, "fits": free is None or memory <= free,
           "prefill": _point(pc, pp, pm), "decode": _point(dc, dp, dm)}
    return row, {"batch": batch, "flops": dc.cost.flops, "bytes": kernel_bytes(dc.cost)}


def serve_host(spec: ServeSpec, say) -> dict:
    global SAY
    SAY = say
    steps = _steps(spec, spec.preset)
    hw = local_spec()
    store = Store()
    rows, points = [], []
    for b in spec.batches:
        row, point = _host_batch(steps, spec, hw, b, store)
        rows.append(row)
        points.append(point)
    out = {"preset": spec.preset, "target": hw.name, "policy": spec.policy or "float32", "quant": spec.quant,
           "kv_dtype": steps.kv_dtype, "prompt_len": spec.prompt_len, "gen_len": spec.gen_len, "chips": 1,
           "weights": steps.origin, "batches": rows,
           "ridge": rows[0]["decode"]["ridge"], "_decode_points": points}
    if spec.quant != "none" or steps.kv_dtype != "auto":
        out["quality"] = quality(spec, steps)
    if spec.draft:
        out["speculative"] = speculative(spec, steps, hw)
    if spec.requests:
        out["continuous_batching"] = continuous_batching(spec, steps)
    return out



# ------------------------------------------------------------------------------------------------- a TPU slice / GPU node


def _phase_spec(spec: ServeSpec, batch: int, mode: str) -> wp.PredictSpec:
    seq = spec.prompt_len if mode == "prefill" else spec.max_len
    return wp.PredictSpec(spec.preset, spec.target, spec.strategy, mesh=spec.mesh, batch=batch, seq=seq, mode=mode,
                          policy=spec.policy or "bf16", overrides=spec.overrides, quant=spec.quant,
                          kv_dtype=spec.kv_dtype, page_size=spec.page_size if spec.paged and mode == "decode" else 0)


def _target_phase(spec: ServeSpec, batch: int, mode: str):
    return wp.predict(_phase_spec(spec, batch, mode))


def _target_point(tp) -> dict:
    r = tp.record
    cost, pred = tp.cost, tp.prediction
    get = (lambda o, k: o.get(k) if isinstance(o, dict) else getattr(o, k, None))
    return {"flops": get(cost, "flops") if cost is not None else None,
            "bytes": kernel_bytes(cost) if cost is not None else None,
            "intensity": get(pred, "intensity") if pred is not None else None,
            "ridge": get(pred, "ridge") if pred is not None else None, "bound": r.get("bound"),
            "predicted_s": r.get("predicted_step_s"), "measured_s": None, "error": None,
            "peak_memory_bytes": r.get("memory_per_device_bytes"), "fits": r.get("fits"), "reason": r.get("reason")}


def target_phase(spec: ServeSpec, batch: int, mode: str) -> dict:
    """One phase ('prefill' of the prompts or 'decode' against a full cache) of `spec` at `batch`, compiled for its
    target and predicted: the roofline point serve_target reports, with `chips`. For callers that need one phase only
    (benchmarks.serving_validation)."""
    tp = _target_phase(spec, batch, mode)
    return dict(_target_point(tp), chips=tp.record.get("chips") or tp.record.get("n_devices") or 1)


def serve_target(spec: ServeSpec, say) -> dict:
    rows, points, chips, ridge = [], [], None, None
    for b in spec.batches:
        say(f"serve: {spec.preset} on {spec.target}, batch {b}: compiling prefill and decode")
        pre, dec = _target_phase(spec, b, "prefill"), _target_phase(spec, b, "decode")
        p, d = _target_point(pre), _target_point(dec)
        chips = chips or dec.record.get("chips") or dec.record.get("n_devices") or 1
        ridge = ridge or d["ridge"]
        tpot = d["predicted_s"]
        rows.append({"batch": b, "ttft_s": None, "predicted_ttft_s": p["predicted_s"], "tpot_s": None,
                     "predicted_tpot_s": tpot, "tokens_per_s": None,
                     "predicted_tokens_per_s": b / tpot if tpot else None,
                     "predicted_tokens_per_s_per_chip": b / tpot / chips if tpot else None,
                     "memory_bytes": max(x or 0 for x in (p["peak_memory_bytes"], d["peak_memory_bytes"])),
                     "memory_per": "device", "fits": bool(p["fits"] and d["fits"]),
                     "reason": d["reason"] or p["reason"], "prefill": p, "decode": d})
        if d["flops"] is not None:
            points.append({"batch": b, "flops": d["flops"], "bytes": d["bytes"]})
    return {"preset": spec.preset, "target": spec.target, "policy": spec.policy or "bf16", "quant": spec.quant,
            "kv_dtype": spec.kv_dtype, "strategy": spec.strategy, "prompt_len": spec.prompt_len,
            "gen_len": spec.gen_len, "chips": chips, "batches": rows, "ridge": ridge, "_decode_points": points}


# ------------------------------------------------------------------------------------------------- the knee


def knee(points: list[dict], ridge: float | None, batches) -> dict:
    """The batch from which decode is compute-bound, from the compiled decode programs' flops and bytes (per device)
    at the batches asked for: flops = a·B + f0 and bytes = w + kv·B fitted through them (see the module docstring)."""
    if ridge is None or len(points) < 2:
        return {"batch": None, "why": "needs decode programs at two or more batch sizes"}
    b = np.array([p["batch"] for p in points], float)
    a, f0 = np.polyfit(b, [p["flops"] for p in points], 1)
    kv, w = np.polyfit(b, [p["bytes"] for p in points], 1)
    fit = {"flops_per_sequence": float(a), "weight_bytes": float(w), "cache_bytes_per_sequence": float(kv),
           "ridge_flops_per_byte": float(ridge)}
    if a <= ridge * kv:
        return dict(fit, batch=None, why=(f"never: each sequence adds {a:.3g} FLOP and {kv:.3g} bytes of cache "
                                          f"({a / kv:.2f} FLOP/byte < ridge {ridge:.3g}); decode stays memory-bound"))
    bstar = max(1.0, (ridge * w - f0) / (a - ridge * kv))
    return dict(fit, batch=int(math.ceil(bstar)),
                why=f"decode's intensity reaches the ridge ({ridge:.3g} FLOP/byte) at batch {bstar:.0f}")


# ------------------------------------------------------------------------------------------------- speculative decoding


def speculative(spec: ServeSpec, target_steps, hw) -> dict:
    """Greedy speculative decoding on the host: acceptance, tokens per round, the measured speedup over plain greedy
    decoding of the same tokens, and the speedup the roofline predicts from the compiled steps and that acceptance."""
    import jax.numpy as jnp


    k, b = spec.draft_tokens, spec.batches[0]
    draft = _steps(dataclasses.replace(spec, quant="none", kv_dtype="auto"), spec.draft, extra=k + 1)
    if draft.cfg.vocab_size != target_steps.cfg.vocab_size:
        raise WorkbenchError(f"--draft {spec.draft} has a vocabulary of {draft.cfg.vocab_size}, {spec.preset} "
                             f"{target_steps.cfg.vocab_size}: a draft must share the target's tokens")
    max_len = spec.max_len + k + 1
    if target_steps.cfg.pos == "learned" and max_len > target_steps.cfg.seq_len:
        raise WorkbenchError(f"speculation needs {max_len} positions, {spec.preset} has {target_steps.cfg.seq_len}; "
                             f"shorten --gen-len by {max_len - target_steps.cfg.seq_len}")
    prompts = jnp.asarray(_prompts(b, spec.prompt_len, spec.seed + 1, target_steps.cfg.vocab_size))
    SAY(f"serve: speculative decoding, draft {spec.draft}, {k} tokens per round")
    runs = {"plain": lambda: greedy_generate(target_steps, prompts, spec.gen_len, max_len),
            "speculative": lambda: speculative_generate(target_steps, draft, prompts, spec.gen_len, k, max_len,
                                                        temperature=spec.temperature, seed=spec.seed)}
    times, outs = {}, {}
    for name, fn in runs.items():
        fn()  # compiles
        samples = [timed(fn) for _ in range(3)]
        outs[name] = samples[0][0]
        times[name] = float(np.median([s for _, s in samples]))
    plain_tokens, (spec_tokens, stats) = outs["plain"], outs["speculative"]
    same = bool(np.array_equal(np.asarray(plain_tokens), spec_tokens)) if spec.temperature == 0 else None
    predicted = _predicted_speedup(target_steps, draft, b, k, max_len, hw, stats["tokens_per_round"])
    return dict(stats, draft=spec.draft, draft_tokens=k, batch=b, temperature=spec.temperature,
                sampling="greedy" if spec.temperature == 0 else "rejection sampling (exact)", same_tokens_as_greedy=same,
                plain_s=times["plain"], speculative_s=times["speculative"],
                measured_speedup=times["plain"] / times["speculative"], **predicted)


def _predicted_speedup(target, draft, b, k, max_len, hw, tokens_per_round) -> dict:
    """Roofline step times of target decode, draft decode and target verify (k + 1 positions), compiled here."""
    import jax.numpy as jnp

    tok = jnp.zeros((b,), jnp.int32)
    td = _program(target.decode, (target.params, target.rest, tok, target.init_cache(b, max_len)), hw,
                  measure=False, feed=3)[1].predicted_s
    dd = _program(draft.decode, (draft.params, draft.rest, tok, draft.init_cache(b, max_len)), hw,
                  measure=False, feed=3)[1].predicted_s
    tv = _program(target.verify, (target.params, target.rest, jnp.zeros((b, k + 1), jnp.int32),
                                  target.init_cache(b, max_len)), hw, measure=False, feed=3)[1].predicted_s
    round_s = (k + 1) * dd + tv
    return {"predicted_target_decode_s": td, "predicted_draft_decode_s": dd, "predicted_verify_s": tv,
            "predicted_speedup": tokens_per_round * td / round_s,
            "predicted_speedup_how": "tokens_per_round × target decode step / ((k + 1) × draft decode step + verify "
                                     "step), roofline step times of the compiled programs, the run's acceptance"}


# ------------------------------------------------------------------------------------------------- continuous batching


def _requests(spec: ServeSpec, vocab: int):
    if spec.requests == "synthetic":
        rng = np.random.default_rng(spec.seed)
        n = 4 * max(spec.batches)
        lens = rng.integers(max(1, spec.prompt_len // 4), spec.prompt_len + 1, size=n)
        news = rng.integers(max(1, spec.gen_len // 4), spec.gen_len + 1, size=n)
        text = _prompts(n, spec.prompt_len, spec.seed + 2, vocab)
        return [Request(i, text[i, :lens[i]], int(news[i])) for i in range(n)]
    try:
        lines = [json.loads(line) for line in open(spec.requests) if line.strip()]
        return [Request(i, np.frombuffer(r["prompt"].encode(), np.uint8).astype(np.int32), int(r["max_new"]))
                for i, r in enumerate(lines)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise WorkbenchError(f"--requests {spec.requests}: {type(e).__name__}: {e}; give 'synthetic' or a JSON-lines "
                             'file of {"prompt": "...", "max_new": N}') from None


def continuous_batching(spec: ServeSpec, steps) -> dict:
    """Serve a stream of requests over max(batches) slots; the schedule and the generated text of the first one."""
    reqs = _requests(spec, steps.cfg.vocab_size)
    slots = max(spec.batches)
    SAY(f"serve: continuous batching of {len(reqs)} requests over {slots} slots")

    sampling = Sampling(temperature=spec.temperature)
    warm = Engine.from_steps(steps, slots, spec.max_len, sampling=sampling, seed=spec.seed)
    warm.serve(reqs[:min(len(reqs), slots)])  # compiles the decode step and the prefill buckets
    eng = Engine.from_steps(steps, slots, spec.max_len, sampling=sampling, seed=spec.seed)
    occupancy = []
    done, wall = timed(lambda: eng.serve(reqs, on_step=lambda s, d, live: occupancy.append(live)))

    tokens = sum(len(d.tokens) for d in done)
    schedule = [(d.prompt_len, d.admitted_step, d.finished_step) for d in done]
    first = min(done, key=lambda d: d.id)
    text = bytes(t % 256 for t in first.tokens).decode("utf-8", "replace") if steps.cfg.vocab_size == 256 else None
    return {"requests": len(reqs), "slots": slots, "decode_steps": len(occupancy), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "mean_slots_busy": float(np.mean(occupancy)) if occupancy else 0.0,
            "order_finished": [d.id for d in done][:16], "first_request_text": text,
            "paged_cache": fragmentation(schedule, slots, spec.max_len, spec.page_size)}


# ------------------------------------------------------------------------------------------------- trained weights


def restore_model(directory: str, seed: int = 0):
    """The model a `workbench run --checkpoint-dir DIR` saved, at its newest complete step: (model, what it is).
    Only the parameters are read back (the optimizer's moments stay on disk)."""
    import os

    import jax
    import orbax.checkpoint as ocp
    from flax import nnx


    steps = complete_steps(directory) if os.path.isdir(directory) else []
    if not steps:
        raise WorkbenchError(f"--checkpoint {directory}: no complete checkpoint there; train one with "
                             "`workbench run --checkpoint-dir DIR`")
    step = steps[-1]
    mgr = ocp.CheckpointManager(os.path.abspath(directory))
    try:
        got = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), state=ocp.args.StandardRestore()))
    except Exception as e:  # noqa: BLE001 - unreadable files: one line
        raise WorkbenchError(f"--checkpoint {directory}/{step} is unreadable ({str(e).splitlines()[0][:200]})") from None
    finally:
        mgr.close()
    meta, flat = got["meta"], got["state"]
    cfg = ModelConfig(**meta["run"]["model"])
    model = Transformer(cfg, meta["run"]["precision"], nnx.Rngs(seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    saved = {p: flat[f"{i:05d}"] for i, p in enumerate(meta["leaf_paths"]) if p.startswith("['params']")}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    missing = [jax.tree_util.keystr(p) for p, _ in leaves if "['params']" + jax.tree_util.keystr(p) not in saved]
    if missing:
        raise WorkbenchError(f"--checkpoint {directory}: its parameters do not match the model it names "
                             f"(missing {missing[0]})")
    values = [jax.numpy.asarray(saved["['params']" + jax.tree_util.keystr(p)]) for p, _ in leaves]
    model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, values), rest)
    losses = meta.get("losses") or []
    return model, {"checkpoint": os.path.abspath(directory), "step": step, "precision": meta["run"]["precision"],
                   "last_loss": losses[-1] if losses else None}


def quality(spec: ServeSpec, steps) -> dict:
    """What quantized weights or a quantized cache cost in accuracy: on held-out corpus text (prompt_len windows),
    the largest logit difference against the same model unquantized, and both perplexities."""
    import jax
    import jax.numpy as jnp


    base = Steps(steps._template)
    tokens = jnp.asarray(_prompts(4, spec.prompt_len + 1, spec.seed + 3, steps.cfg.vocab_size))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def run(st):
        logits, _ = jax.jit(st.verify)(st.params, st.rest, inputs, st.init_cache(4, spec.prompt_len))
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()
        return logits.astype(jnp.float32), float(jnp.exp(nll))

    ref, ppl_ref = run(base)
    got, ppl = run(steps)
    return {"text": "held-out standard-library sources" if steps.cfg.vocab_size == 256 else "random tokens",
            "tokens": int(targets.size), "perplexity": ppl, "perplexity_unquantized": ppl_ref,
            "max_abs_logit_diff": float(jnp.abs(got - ref).max()),
            "mean_abs_logit_diff": float(jnp.abs(got - ref).mean())}
