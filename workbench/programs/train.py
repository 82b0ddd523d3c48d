"""Training a model on this host's devices: the loop that records what it saw.

The step it trains is built by workbench.programs.step (build_train_step).
`train_model(...)` compiles the step through workbench.cost.compile (CostReport), trains on the stdlib corpus, times the
steps with workbench.measure.harness, predicts with workbench.roofline.prediction and returns a JSON-ready dict.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from models import pipeline as pp
from models.analytics import analytics
from models.config import ModelConfig
from workbench.cost.compile import compile_program
from workbench.cost.report import CostReport
from workbench.errors import NothingToDo, WorkbenchError
from workbench.hardware.devices import is_simulated
from workbench.measure.calibrate import get_spec
from workbench.measure.device import chip_for, with_device_calibration
from workbench.measure.explain import explain_step
from workbench.measure.harness import Measurement, dot_floor, measure_steps, profile_kernels, summarize
from workbench.programs.checkpoint import Checkpointer, CheckpointSpec, CheckpointStats, fault_point, step_overhead
from workbench.programs.data import Batches, unigram_baseline
from workbench.programs.distributed import count_hosts
from workbench.programs.step import TrainProgram, abstract_with, build_train_step, default_precision, prog_batch_ways, prog_tensor_ways
from workbench.results.console import ProgressBar
from workbench.roofline.prediction import Prediction, predict
from workbench.roofline.pricing import priced_dtype


# ------------------------------------------------------------------------------------------------- training loop
@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a training run saw: its spec, losses, timings, costs (per device), prediction and MFU.

    `to_record()` is the JSON body `workbench run --json` prints and the results store keeps; the fields derived
    from others (step_s, tokens_per_s, mfu, replication, collectives) are properties so they cannot disagree.
    """

    config: ModelConfig
    strategy: str
    mesh: dict[str, int]
    precision: str
    precision_reason: str
    compute_dtype: str
    priced_dtype: str
    batch_size: int
    seq_len: int
    microbatches: int
    steps: int
    seed: int
    tokens_per_step: int
    losses: tuple[float, ...]
    val_losses: tuple[tuple[int, float], ...]      # (step, validation loss), step 0 first
    unigram_baseline_val: float
    final_metrics: dict[str, float]
    measurement: Measurement | None                # the timed steps (median/IQR over them)
    mfu_ceiling_flops: float | None                # FLOP/s of the whole mesh the MFU is taken against
    mfu_note: str
    model_flops_per_step: float
    per_device_flops: float                        # the compiled program's count (CostReport.counted_flops)
    compile_s: float
    lower_s: float
    params_total: int
    cost: CostReport
    prediction: Prediction | None
    hardware: str | None
    kernel_profile: dict | None
    first_step: int = 1                            # the step losses[0] belongs to (> 1 when resumed)
    resumed_from_step: int | None = None           # the checkpoint's step a resumed run started from
    loss_history: tuple[float, ...] = ()           # every step's loss from step 1 (the checkpoint's, then these)
    processes: int = 1                             # processes of the group that ran the global mesh
    hosts: int = 1                                 # distinct hosts among them
    checkpoint: CheckpointStats | None = None      # what saving and restoring did and cost
    model_flops_causal_per_step: float = 0.0  # the attention term halved (a causal mask's work)
    waterfall: dict | None = None  # run --explain: workbench.measure.explain.Waterfall.to_record()
    kernel_classes: dict | None = None  # run --explain: the per-kernel join (KernelTable.to_record(top=15))
    pipeline: dict | None = None  # pp strategies: schedule, analytic bubble, its predicted seconds (bubble_terms)
    # accelerators: the prediction against this device's own calibration (workbench calibrate), where one is cached
    prediction_calibrated: Prediction | None = None
    physical_ceiling_flops: float | None = None  # CPU hosts: the precision's physical peak (derived from the CPU's
    #                                              features: cores x FLOP/cycle x clock), the ceiling of mfu_physical

    @property
    def n_devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def val_loss(self) -> float:
        return self.val_losses[-1][1]

    @property
    def step_s(self) -> float | None:
        return self.measurement.median_s if self.measurement else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens_per_step / self.step_s if self.step_s else None

    @property
    def mfu(self) -> float | None:
        """Model flops per step / step time / the ceiling (full-attention convention, see model_flops_convention)."""
        if not (self.step_s and self.mfu_ceiling_flops):
            return None
        return self.model_flops_per_step / self.step_s / self.mfu_ceiling_flops

    @property
    def mfu_causal(self) -> float | None:
        """As mfu, with the attention term halved (the causal-mask convention)."""
        if not (self.step_s and self.mfu_ceiling_flops):
            return None
        return self.model_flops_causal_per_step / self.step_s / self.mfu_ceiling_flops

    @property
    def mfu_physical(self) -> float | None:
        """As mfu, against the physical peak of the priced dtype (CPU hosts: XLA's measured ceiling may sit below or
        above it; both are reported)."""
        if not (self.step_s and self.physical_ceiling_flops):
            return None
        return self.model_flops_per_step / self.step_s / self.physical_ceiling_flops

    @property
    def replication(self) -> float | None:
        return self.per_device_flops * self.n_devices / self.model_flops_per_step if self.model_flops_per_step else None

    def to_record(self) -> dict[str, Any]:
        return {
            "preset_config": self.config.to_dict(), "strategy": self.strategy, "mesh": dict(self.mesh),
            "n_devices": self.n_devices, "precision": self.precision, "precision_reason": self.precision_reason,
            "compute_dtype": self.compute_dtype, "priced_dtype": self.priced_dtype, "batch_size": self.batch_size,
            "seq_len": self.seq_len, "microbatches": self.microbatches, "steps": self.steps, "seed": self.seed,
            "tokens_per_step": self.tokens_per_step, "losses": list(self.losses),
            "val_losses": [[s, v] for s, v in self.val_losses], "val_loss": self.val_loss,
            "unigram_baseline_val": self.unigram_baseline_val, "final_metrics": dict(self.final_metrics),
            "step_s": self.step_s, "step_s_iqr": self.measurement.iqr_s if self.measurement else None,
            "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "mfu_ceiling_flops": self.mfu_ceiling_flops,
            "mfu_note": self.mfu_note, "mfu_physical": self.mfu_physical,
            "physical_ceiling_flops": self.physical_ceiling_flops, "model_flops_per_step": self.model_flops_per_step,
            "model_flops_convention": "train_flops_per_token (6N + 12*L*n_heads*head_dim*seq, full attention) x tokens",
            "replication": self.replication,
            "replication_note": "sum over devices of compiled per-device flops / analytic model flops per step "
                                "(about 1 when no device repeats work; includes optimizer and elementwise flops)",
            "collectives": self.cost.collectives_by_kind_and_axis(),
            "collectives_by_kind": self.cost.collectives_by_kind(),
            "compile_s": self.compile_s, "lower_s": self.lower_s, "params_total": self.params_total,
            "cost": self.cost.to_dict(), "prediction": self.prediction.to_dict() if self.prediction else None,
            "measurement": self.measurement.to_dict() if self.measurement else None,
            "hardware": self.hardware, "kernel_profile": self.kernel_profile,
            "mfu_causal": self.mfu_causal, "waterfall": self.waterfall, "kernel_classes": self.kernel_classes,
            "first_step": self.first_step, "resumed_from_step": self.resumed_from_step,
            "loss_history": list(self.loss_history), "processes": self.processes, "hosts": self.hosts,
            "checkpoint": self.checkpoint.to_record() if self.checkpoint else None,
            "pipeline": self.pipeline,
            "prediction_calibrated": self.prediction_calibrated.to_dict() if self.prediction_calibrated else None,
        }


def _ceiling(n_devices: int, dtype: str, hardware: str | None):
    """(spec, FLOP/s ceiling for the whole mesh, note). Simulated CPU devices share the host: the host ceiling."""
    if hardware is None:
        return None, None, "no hardware ceiling requested"
    if hardware == "auto":
        if is_simulated():
            spec = get_spec("host")
            return spec, spec.peak(dtype), (f"{n_devices} simulated devices share this host: MFU is the whole mesh's "
                                            "model flops against the calibrated host ceiling")
        spec = chip_for(jax.devices()[0].device_kind)  # warns once, naming --hardware, when the kind is unknown
        if spec is None:
            return None, None, f"device kind {jax.devices()[0].device_kind!r} not in the catalogue: no MFU"
        return spec, spec.peak(dtype) * n_devices, f"ceiling: {n_devices} x {spec.name} peak ({spec.peak_dtype(dtype)})"
    spec = get_spec(hardware)
    mult = 1 if spec.kind == "cpu" else n_devices
    return spec, spec.peak(dtype) * mult, f"ceiling: {mult} x {spec.name} peak"


def _precision(precision: str | None) -> tuple[str, str]:
    """(the precision policy's name, why it was chosen)."""
    if precision is None:
        precision = default_precision()
        return precision, ("default on a CPU host: XLA:CPU has no faster bfloat16 matmul path (it computes bf16 in "
                           "float32)" if precision == "float32" else "default on accelerators")
    return precision, "requested"


def _compile_step(prog: TrainProgram, mesh, analytic: bool):
    """(the step compiled with its CostReport, the abstract state it takes)."""
    abs_state = abstract_with(jax.eval_shape(lambda s: s, prog.state), prog.state_shardings)
    abs_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=prog.batch_sharding) for k, v in prog.batch.items()}
    comp = compile_program(prog.step, abs_state, abs_batch, mesh=mesh, n_devices=mesh.size, analytic=analytic,
                           compute_dtype=np.dtype(prog.policy.compute_dtype).name)
    return comp, abs_state


def _open_checkpoint(checkpoint: CheckpointSpec | None, prog: TrainProgram, mesh, steps: int, seed: int,
                     abs_state):
    """(the Checkpointer or None, the state to start from, the step it is at)."""
    state = prog.state
    ckpt, start = None, 0
    if checkpoint is not None:  # the data position is the step: batch i is a pure function of (seed, i)
        ckpt = Checkpointer(checkpoint, {"model": prog.cfg.to_dict(), "precision": prog.policy.name,
                                         "batch_size": prog.batch_size, "seq_len": prog.seq_len,
                                         "microbatches": prog.microbatches, "seed": seed,
                                         "schedule_steps": steps, "strategy": prog.rules.name,
                                         "mesh": dict(mesh.shape), "processes": jax.process_count()}, steps)
        if checkpoint.resume:
            state, start = ckpt.restore(abs_state)
            if start >= steps:
                ckpt.close()
                raise NothingToDo(f"the checkpoint in {checkpoint.directory} is at step {start}: --steps {steps} "
                                     "is already reached: nothing left to train (the run that saved it is complete)")
    return ckpt, state, start


class _Loop:
    """Training as it runs: the compiled step, the state it carries forward, the batch fetched ahead, what each
    counted step saw (losses, metrics, checkpoints, progress)."""

    def __init__(self, run, state, prog: TrainProgram, batches: Batches, ckpt: Checkpointer | None, start: int,
                 bar: ProgressBar, val_batches: list):
        self.run, self.state, self.prog, self.batches, self.ckpt, self.bar = run, state, prog, batches, ckpt, bar
        self.val_batches = val_batches
        self.losses: list = []
        self.metrics_log: list = []
        self.next_batch = batches.train_sharded(start, prog.batch_sharding)

    def evaluate(self) -> float:
        """Mean validation loss over the validation batches at the current state."""
        vals = [self.prog.eval_step(self.state["params"], self.state["gmeta"], self.state["rest"], b)
                for b in self.val_batches]
        return float(np.mean([float(v) for v in vals]))

    def step(self, i: int, count: bool = True):
        """Run step i + 1 on the batch fetched ahead and return its loss. count=False: a step after training (traced
        by --profile or --explain): the batch is not advanced and the step is in neither the losses nor the timings."""
        self.state, metrics = self.run(self.state, self.next_batch)
        if not count:
            return metrics["loss"]
        fault_point("in-step", i + 1)
        self.next_batch = self.batches.train_sharded(i + 1, self.prog.batch_sharding)  # overlaps the device step
        self.losses.append(metrics["loss"])
        self.metrics_log.append(metrics)
        if self.ckpt is not None:
            self.ckpt.maybe_save(i + 1, self.state, self.losses)
        fault_point("after-step", i + 1, wait=metrics["loss"])
        self.bar.advance()
        return metrics["loss"]

    def uncounted_step(self, i: int):
        return self.step(i, count=False)


@dataclasses.dataclass
class _Trained:
    """What the training loop saw."""

    start: int  # the step training started from (> 0 when resumed)
    losses: list[float]
    val_losses: list[tuple[int, float]]
    last_metrics: dict[str, float]
    measurement: Measurement | None
    times: list[float]
    timed_steps: list[int]  # the 1-based step of each entry of times
    ckpt: Checkpointer | None
    ckpt_stats: CheckpointStats | None


def _run_steps(loop: _Loop, start: int, steps: int, eval_every: int, val_losses: list) -> tuple[list, list, int]:
    """Steps start+1..steps in chunks ending at each evaluation; every chunk of >= 2 steps is timed but its first.
    Returns (step times, their 1-based steps, untimed steps)."""
    times: list[float] = []
    timed_steps: list[int] = []
    untimed = 0
    done = start
    with loop.bar:
        while done < steps:
            chunk = min(eval_every - done % eval_every, steps - done)
            if chunk >= 2:
                m = measure_steps(lambda j, base=done: loop.step(base + j), warmup=1, repeats=chunk - 1)
                times.extend(m.times_s)
                timed_steps.extend(range(done + 2, done + chunk + 1))
                untimed += 1
            else:
                jax.block_until_ready(loop.step(done))
                untimed += 1
            done += chunk
            if done % eval_every == 0 or done == steps:
                val_losses.append((done, loop.evaluate()))
    return times, timed_steps, untimed


def _train(prog: TrainProgram, comp, abs_state, *, steps: int, seed: int, checkpoint: CheckpointSpec | None, mesh,
           eval_every: int | None, eval_batches: int, progress: bool) -> tuple[_Loop, _Trained]:
    """Restore (when resuming), train, evaluate at the chunk ends and close the checkpointer."""
    ckpt, state, start = _open_checkpoint(checkpoint, prog, mesh, steps, seed, abs_state)
    batches = Batches(prog.batch_size, prog.seq_len, seed)
    val_batches = [batches.val_sharded(i, prog.batch_sharding) for i in range(eval_batches)]
    loop = _Loop(comp.compiled, state, prog, batches, ckpt, start, ProgressBar(steps - start, progress, "training"),
                 val_batches)  # comp.compiled cannot recompile: a changed input raises instead of retracing
    eval_every = eval_every or (steps if steps < 20 else steps // 4)  # chunks >= 2 steps so each one is timed
    val_losses: list[tuple[int, float]] = [(start, loop.evaluate())]
    times, timed_steps, untimed = _run_steps(loop, start, steps, eval_every, val_losses)
    ckpt_stats = ckpt.close() if ckpt is not None else None  # waits for the last background write
    measurement = summarize(times, warmup=untimed, calls=1, compile_s=comp.compile_s) if times else None
    losses_f = [float(x) for x in loop.losses]
    if not all(math.isfinite(x) for x in losses_f):
        raise WorkbenchError(f"training diverged (loss {losses_f[-1]}); lower the learning rate")
    last = {k: float(v) for k, v in loop.metrics_log[-1].items()} if loop.metrics_log else {}
    return loop, _Trained(start, losses_f, val_losses, last, measurement, times, timed_steps, ckpt, ckpt_stats)


@dataclasses.dataclass
class _Priced:
    """The run against its hardware: the ceiling MFU is taken against, the predictions, what tracing found."""

    spec: Any
    ceiling: float | None
    ceiling_note: str
    hosts: int
    prediction: Prediction | None
    prediction_calibrated: Prediction | None
    kernel_profile: dict | None
    explained: tuple | None
    pipeline: dict | None


def _kernel_profile(loop: _Loop, comp, profile_steps: int, ceiling: float | None, mesh,
                    model_flops_step: float) -> dict:
    """profile_kernels over more (uncounted) steps, with the floor under the step: its dots alone (simulated devices
    share the host, so theirs add up)."""
    kernel_profile = profile_kernels(loop.uncounted_step, comp.hlo_text, steps=profile_steps, ceiling_flops=ceiling)
    floor = dot_floor(comp.hlo_text, ceiling_flops=ceiling)
    floor["step_floor_s"] = floor["dot_s"] * (mesh.size if mesh.devices.flat[0].platform == "cpu" else 1)
    floor["mfu_bound"] = (model_flops_step / floor["step_floor_s"] / ceiling
                          if (ceiling and floor["step_floor_s"]) else None)
    kernel_profile["dot_floor"] = floor
    return kernel_profile


def _pipeline_terms(prog: TrainProgram, mesh, spec, price_dtype: str, measured: bool) -> dict | None:
    """pp strategies: the schedule, its analytic bubble and the bubble's predicted seconds; None otherwise."""
    if prog.pipeline is None:
        return None
    shape = dict(mesh.shape)
    pipeline = pp.bubble_terms(prog.pipeline, prog.cfg, prog.batch_size, prog.seq_len,
                               prog_batch_ways(prog.rules, shape), prog_tensor_ways(prog.rules, shape),
                               spec.peak(price_dtype) if spec else None)
    if measured:
        pipeline["note"] = ("step_s on simulated CPU devices is the work of all stages sharing the host, not one "
                            "stage's critical path: the bubble is measured by benchmarks/pipeline_study.py "
                            "(docs/pipeline.md)" if is_simulated() else "measured step on one device per stage")
    return pipeline


def _price(prog: TrainProgram, comp, loop: _Loop, measurement: Measurement | None, an: dict, *, mesh,
           hardware: str | None, price_dtype: str, profile_steps: int, explain: bool) -> _Priced:
    """The ceiling, the predictions (catalogue and device calibration), --profile's and --explain's traces (after
    the timed steps: the traced steps are in neither the losses nor the timings) and the pipeline's terms."""
    model_flops_step = an["train_flops_per_token"] * prog.tokens_per_step
    spec, ceiling, ceiling_note = _ceiling(mesh.size, price_dtype, hardware)
    hosts = count_hosts()  # a group over several hosts: each host's simulated devices share that host's ceiling
    if hosts > 1 and ceiling and is_simulated():
        ceiling, ceiling_note = ceiling * hosts, f"{ceiling_note}; x {hosts} hosts"
    kernel_profile = None
    if profile_steps > 0:
        kernel_profile = _kernel_profile(loop, comp, profile_steps, ceiling, mesh, model_flops_step)
    prediction = predict(comp.cost, spec, dtype=price_dtype) if spec is not None else None
    cal_spec = with_device_calibration(spec) if spec is not None and hardware == "auto" else None
    prediction_cal = predict(comp.cost, cal_spec, dtype=price_dtype) if cal_spec else None  # the device's own ceilings
    explained = None
    if explain and spec is not None and measurement is not None:
        explained = explain_step(loop.uncounted_step, comp.hlo_text, comp.cost, spec, dtype=price_dtype, mesh=mesh,
                                 step_s=measurement.median_s, model_flops=model_flops_step, ceiling_flops=ceiling,
                                 model_flops_causal=an["train_flops_per_token_causal"] * prog.tokens_per_step)
    pipeline = _pipeline_terms(prog, mesh, spec, price_dtype, measurement is not None)
    return _Priced(spec, ceiling, ceiling_note, hosts, prediction, prediction_cal, kernel_profile, explained, pipeline)


def train_model(cfg: ModelConfig, *, strategy: str, mesh, steps: int, batch_size: int = 8,
                precision: str | None = None, seed: int = 0, eval_every: int | None = None, eval_batches: int = 4,
                seq_len: int | None = None, microbatches: int = 1, learning_rate: float | None = None,
                progress: bool = True, hardware: str | None = "auto", analytic: bool = True,
                profile_steps: int = 0, checkpoint: CheckpointSpec | None = None,
                explain: bool = False, pipeline_repeats: int = 1, pipeline_schedule: str = "gpipe") -> TrainResult:
    """Train `cfg` for `steps` steps on the stdlib corpus and return losses, timings, costs, prediction, MFU.

    profile_steps > 0: after the timed steps, trace that many more under jax.profiler and return per-kernel times
    joined with their costs as 'kernel_profile' (workbench.measure.harness.profile_kernels; not in the losses or timings),
    with 'dot_floor' in it: the step's dots timed alone (workbench.measure.harness.dot_floor), 'step_floor_s' (their time
    per step; on simulated devices all devices' dots, which share the host) and 'mfu_bound' (the MFU of a step that
    took only that long: no strategy or fusion of the rest gets above it with these dot kernels).

    checkpoint: save (and with .resume, first restore) orbax checkpoints (workbench/programs/checkpoint.py); a
    resumed run trains steps restored+1..steps: 'losses' holds those, 'first_step' the first of them,
    'loss_history' every step's from 1 on, 'checkpoint' what saving and restoring did and cost.

    precision None: float32 on a CPU host, bf16 on accelerators (see default_precision). hardware: 'auto' (the
    calibrated host for simulated devices, the catalogue chip otherwise), a chip name, or None (no MFU/prediction).
    """
    steps = int(steps)
    if steps < 1:
        raise WorkbenchError(f"--steps must be >= 1, got {steps}")
    precision, precision_reason = _precision(precision)
    if cfg.vocab_size < 256:
        raise WorkbenchError(f"the byte-level corpus needs vocab_size >= 256, got {cfg.vocab_size}")
    prog = build_train_step(cfg, policy=precision, mesh=mesh, strategy=strategy, batch_size=batch_size,
                            seq_len=seq_len, microbatches=microbatches, seed=seed, learning_rate=learning_rate,
                            total_steps=steps, pipeline_repeats=pipeline_repeats,
                            pipeline_schedule=pipeline_schedule)
    cfg = prog.cfg  # pipelined strategies stack the layers (scan_layers=true)
    comp, abs_state = _compile_step(prog, mesh, analytic)
    loop, tr = _train(prog, comp, abs_state, steps=steps, seed=seed, checkpoint=checkpoint, mesh=mesh, eval_every=eval_every,
                      eval_batches=eval_batches, progress=progress)
    an = analytics(cfg, prog.seq_len)
    tokens = prog.tokens_per_step
    price_dtype = priced_dtype(prog.policy)  # the one rule predict uses too: fp8/MX policies at the fp8/fp4 peak
    pr = _price(prog, comp, loop, tr.measurement, an, mesh=mesh, hardware=hardware, price_dtype=price_dtype,
                profile_steps=profile_steps, explain=explain)
    spec, ckpt, explained = pr.spec, tr.ckpt, pr.explained
    return TrainResult(
        config=cfg, strategy=prog.rules.name, mesh=dict(mesh.shape), precision=prog.policy.name,
        precision_reason=precision_reason, compute_dtype=np.dtype(prog.policy.compute_dtype).name,
        priced_dtype=price_dtype, batch_size=batch_size, seq_len=prog.seq_len, microbatches=microbatches, steps=steps,
        seed=seed, tokens_per_step=tokens, losses=tuple(tr.losses), val_losses=tuple(tr.val_losses),
        unigram_baseline_val=unigram_baseline(loop.batches.corpus)["val_cross_entropy_nats"],
        final_metrics=tr.last_metrics, measurement=tr.measurement, mfu_ceiling_flops=pr.ceiling,
        mfu_note=pr.ceiling_note, model_flops_per_step=an["train_flops_per_token"] * tokens,
        per_device_flops=comp.cost.counted_flops, compile_s=comp.compile_s, lower_s=comp.lower_s,
        params_total=an["params_total"], cost=comp.cost, prediction=pr.prediction,
        hardware=spec.name if spec else None, kernel_profile=pr.kernel_profile,
        model_flops_causal_per_step=an["train_flops_per_token_causal"] * tokens,
        waterfall=explained[0].to_record() if explained else None,
        kernel_classes=explained[1].to_record(top=15) if explained else None,
        physical_ceiling_flops=spec.physical_peak(price_dtype) if spec is not None else None,
        first_step=tr.start + 1, resumed_from_step=tr.start if ckpt is not None and checkpoint.resume else None,
        loss_history=tuple((ckpt.history if ckpt is not None else []) + tr.losses), processes=jax.process_count(),
        hosts=pr.hosts,
        checkpoint=(dataclasses.replace(tr.ckpt_stats, **step_overhead(tr.times, tr.timed_steps,
                                                                        tr.ckpt_stats.saved_steps))
                    if tr.ckpt_stats is not None else None), pipeline=pr.pipeline,
        prediction_calibrated=pr.prediction_calibrated)
