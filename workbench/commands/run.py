"""`workbench run --preset P --strategy S --mesh SPEC [--devices N] --steps K [--precision P] [--batch B] [--json]`.

Trains on the stdlib corpus and records losses, validation loss, step time, tokens/s, MFU, the CostReport, the
prediction, the replication factor and the collectives by kind and mesh axis in the results store.
Several processes (`--processes N`, or a cluster's: workbench/programs/distributed.py) and orbax checkpoints
(`--checkpoint-dir`, `--resume`: workbench/programs/checkpoint.py); see docs/distributed.md.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Optional

import typer

from models.presets import get_config
from workbench.commands.options import platform_option
from workbench.errors import WorkbenchError, finite_number, positive_int
from workbench.results.console import emit_json, print_table
from workbench.results.store import Store, make_record
from workbench.results.waterfall import attach_waterfall

SUMMARY_KEYS = ("strategy", "mesh", "n_devices", "precision", "batch_size", "seq_len", "steps", "losses", "val_loss",
                "val_losses", "unigram_baseline_val", "step_s", "tokens_per_s", "mfu", "mfu_physical", "mfu_note", "replication",
                "collectives", "params_total", "compile_s", "hardware")
DISTRIBUTED_KEYS = ("processes", "hosts", "first_step", "resumed_from_step", "loss_history", "checkpoint")


def _child_args(ctx) -> list[str]:
    """This command line for the processes of a local group: every option given, less --processes."""
    out = [ctx.info_name]
    for p in ctx.command.params:
        value = ctx.params.get(p.name)
        if p.name == "processes" or value is None or value == p.default:
            continue
        if p.is_flag:
            out += [p.opts[0]] if value else []
        else:
            out += [p.opts[0], str(value)]
    return out


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """`workbench run`'s options as given (the sizes validated by _validate)."""
    preset: str
    strategy: str
    mesh: Optional[str]
    devices: Optional[int]
    platform: str
    hardware: Optional[str]
    steps: int
    precision: Optional[str]
    batch: int
    seq: Optional[int]
    microbatches: int
    pipeline_repeats: int
    pipeline_schedule: str
    overrides: Optional[str]
    lr: Optional[float]
    seed: int
    eval_every: Optional[int]
    json_out: bool
    full: bool
    profile: bool
    explain: bool
    processes: int
    coordinator: Optional[str]
    num_processes: Optional[int]
    process_id: Optional[int]
    distributed: bool
    checkpoint_dir: Optional[str]
    checkpoint_every: Optional[int]
    keep_checkpoints: int
    resume: bool


def run_cmd(
    ctx: typer.Context,
    preset: str = typer.Option(..., "--preset", help="model preset (see `workbench model-info`)"),
    strategy: str = typer.Option("dp", "--strategy", help="dp | fsdp | tp | fsdp+tp | sp | cp | fsdp+cp | fsdp+tp+cp "
                                 "(sequence over the `context` mesh axis: docs/distributed.md) | ep | pp | pp+fsdp | "
                                 "pp+tp | pp+fsdp+tp (pipeline over the `stage` mesh axis: docs/pipeline.md)"),
    mesh: Optional[str] = typer.Option(None, "--mesh", help="mesh spec, e.g. data=2,model=4 (default: data=N)"),
    devices: Optional[int] = typer.Option(None, "--devices", help="simulate N CPU devices (set before JAX starts; "
                                          "implies --platform cpu)"),
    platform: str = platform_option(),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="price the run (MFU, prediction) as this "
                                           "catalogue chip; default: the device's own kind, or the calibrated "
                                           "host on a CPU"),
    steps: int = typer.Option(20, "--steps", help="training steps"),
    precision: Optional[str] = typer.Option(None, "--precision",
                                            help="float32 | bf16 | ... (default: float32 on CPU, bf16 on "
                                                 "accelerators)"),
    batch: int = typer.Option(8, "--batch", help="global batch size (sequences)"),
    seq: Optional[int] = typer.Option(None, "--seq", help="sequence length (default: the model's seq_len)"),
    microbatches: int = typer.Option(1, "--microbatches", help="gradient-accumulation microbatches (pp "
                                     "strategies: the pipeline's microbatches, >= the stage count)"),
    pipeline_repeats: int = typer.Option(1, "--pipeline-repeats", help="pp strategies: virtual stages per "
                                         "device (1: GPipe; v > 1: the circular schedule, bubble / v)"),
    pipeline_schedule: str = typer.Option("gpipe", "--pipeline-schedule", help="pp strategies: gpipe (the "
                                          "default; circular with --pipeline-repeats > 1) | 1f1b (each "
                                          "microbatch's backward starts as it leaves the last stage: a stage "
                                          "holds at most 2p - 1 microbatches' inputs)"),
    overrides: Optional[str] = typer.Option(None, "--set", help="model config overrides k=v,k=v"),
    lr: Optional[float] = typer.Option(None, "--lr", help="peak learning rate (default by model size)"),
    seed: int = typer.Option(0, "--seed"),
    eval_every: Optional[int] = typer.Option(None, "--eval-every", help="validation interval (default steps/4)"),
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
    full: bool = typer.Option(False, "--full", help="with --json: print the whole record, not the summary"),
    profile: bool = typer.Option(False, "--profile", help="trace 2 more steps with jax.profiler: measured time per "
                                 "kernel class and the longest kernels, joined with their HLO costs"),
    explain: bool = typer.Option(False, "--explain", help="trace 2 more steps and explain the step from ideal "
                                 "to measured: JSON key `waterfall` (terms predicted and measured), "
                                 "reports/run-<record>/waterfall.png, MFU in both attention conventions"),
    # beyond one process (docs/distributed.md)
    processes: int = typer.Option(1, "--processes", help="start N local processes joined by jax.distributed, "
                                  "each owning --devices/N devices of one global mesh"),
    coordinator: Optional[str] = typer.Option(None, "--coordinator", help="HOST:PORT of process 0 (with "
                                              "--num-processes and --process-id, on every process)"),
    num_processes: Optional[int] = typer.Option(None, "--num-processes", help="processes in the group"),
    process_id: Optional[int] = typer.Option(None, "--process-id", help="this process's id, 0..N-1"),
    distributed: bool = typer.Option(False, "--distributed", help="join the group the cluster's environment "
                                     "describes (Cloud TPU pod slice, SLURM, Open MPI, Kubernetes)"),
    checkpoint_dir: Optional[str] = typer.Option(None, "--checkpoint-dir", help="save orbax checkpoints here"),
    checkpoint_every: Optional[int] = typer.Option(None, "--checkpoint-every",
                                                   help="save every K steps (default: after the last step)"),
    keep_checkpoints: int = typer.Option(3, "--keep-checkpoints", help="keep the newest K checkpoints"),
    resume: bool = typer.Option(False, "--resume", help="continue from the newest checkpoint in "
                                "--checkpoint-dir (any mesh, strategy or process count)"),
):
    """Train a model preset with a partitioning strategy on a mesh; record losses, timing, MFU and costs."""
    opts = RunOptions(**{k: v for k, v in locals().items() if k != "ctx"})
    _run(ctx, opts)


def _validate(o: RunOptions):
    """(the options with their sizes validated, the checkpoint spec or None); raises on what a user can fix."""
    o = dataclasses.replace(o, steps=positive_int("--steps", o.steps), batch=positive_int("--batch", o.batch),
                            microbatches=positive_int("--microbatches", o.microbatches),
                            pipeline_repeats=positive_int("--pipeline-repeats", o.pipeline_repeats))
    from models.pipeline import check_schedule_name

    check_schedule_name(o.pipeline_schedule)
    if o.seq is not None:
        positive_int("--seq", o.seq)
    if o.eval_every is not None:
        positive_int("--eval-every", o.eval_every)
    if o.lr is not None:
        finite_number("--lr", o.lr, minimum=0, strictly_above=True)
    from workbench.programs import distributed as dist
    from workbench.programs.checkpoint import CheckpointSpec

    dist.check_request(o.processes, o.devices, o.coordinator, o.num_processes, o.process_id, o.distributed)
    if (o.checkpoint_every is not None or o.resume) and o.checkpoint_dir is None:
        raise WorkbenchError("--checkpoint-every and --resume need --checkpoint-dir")
    ckpt = (CheckpointSpec(o.checkpoint_dir, o.checkpoint_every, o.resume, o.keep_checkpoints)
            if o.checkpoint_dir is not None else None)  # validated here: a bad directory stops every process
    return o, ckpt


def _run(ctx, o: RunOptions) -> None:
    """Validate, start a local group or join one, train, and (process 0) record and print."""
    o, ckpt = _validate(o)
    from workbench.programs import distributed as dist

    if o.processes > 1:  # this process starts the group and waits; JAX never starts here
        rc, why = dist.launch_local(_child_args(ctx), o.processes)
        if why:
            raise dist.GroupFailed(why, rc)
        if rc:
            sys.exit(rc)  # process 0 failed and said why
        return
    group = dist.join(o.devices, coordinator=o.coordinator, num_processes=o.num_processes, process_id=o.process_id,
                      distributed=o.distributed, platform=o.platform,
                      host_ceiling=o.hardware is None)  # before anything touches jax devices
    n = group.global_devices

    from partitioning.mesh import make_mesh
    from workbench.programs.train import train_model

    cfg = get_config(o.preset, o.overrides)
    m = make_mesh(o.mesh or f"data={n}")
    result = train_model(cfg, strategy=o.strategy, mesh=m, steps=o.steps, batch_size=o.batch, precision=o.precision,
                         seed=o.seed, eval_every=o.eval_every, seq_len=o.seq, microbatches=o.microbatches,
                         learning_rate=o.lr, progress=group.primary, profile_steps=2 if o.profile else 0,
                         checkpoint=ckpt, explain=o.explain, pipeline_repeats=o.pipeline_repeats,
                         pipeline_schedule=o.pipeline_schedule, hardware=o.hardware or "auto")
    if not group.primary:  # process 0 prints and records
        return
    r, rec = _record(o, result, group)
    summary = _summary(o, r, rec)
    if o.explain and r.get("waterfall"):
        attach_waterfall(summary, r, rec["id"], print_it=not o.json_out)
    if o.json_out:
        emit_json(rec if o.full else summary)
        return
    _print_run(o, r, m, summary)
    if o.profile:
        _print_profile(r)
    print(f"record {rec['id']} appended to the results store")


def _record(o: RunOptions, result, group) -> tuple[dict, dict]:
    """(the run's record fields, the record appended to the results store)."""
    r = result.to_record()
    r.update(process_group=group.to_record())
    spec = {"preset": o.preset, "overrides": o.overrides or "", "strategy": r["strategy"], "mesh": r["mesh"],
            "devices": r["n_devices"], "steps": o.steps, "batch": o.batch, "seq_len": r["seq_len"],
            "microbatches": o.microbatches, "precision": r["precision"], "seed": o.seed,
            "pipeline_repeats": o.pipeline_repeats, "pipeline_schedule": o.pipeline_schedule,
            "processes": group.processes}
    extra = {k: v for k, v in r.items() if k not in ("cost", "prediction", "measurement")}
    rec = make_record("train", spec, result.cost, result.prediction, result.measurement, extra=extra, seed=o.seed)
    Store().append(rec)
    return r, rec


def _summary(o: RunOptions, r: dict, rec: dict) -> dict:
    """What `--json` prints without --full: the run's headline figures and where its record is."""
    summary = {k: r[k] for k in SUMMARY_KEYS + DISTRIBUTED_KEYS}
    if r.get("pipeline"):
        summary["pipeline"] = r["pipeline"]
    summary.update(preset=o.preset, record_id=rec["id"], platform=rec["provenance"]["platform"],
                   device_kind=rec["provenance"]["device_kind"],
                   predicted_step_s=(r["prediction"] or {}).get("predicted_s"),
                   predicted_step_s_calibrated=(r.get("prediction_calibrated") or {}).get("predicted_s"),
                   bound=(r["prediction"] or {}).get("bound"),
                   flops_per_device=r["cost"]["flops"], bytes_per_device=r["cost"]["bytes_accessed"],
                   peak_memory_per_device=r["cost"]["memory"]["peak_bytes"])
    if o.profile:
        summary["kernel_profile"] = {k: r["kernel_profile"][k] for k in ("kernel_ms", "classes", "matmul_rate")}
        fl = r["kernel_profile"]["dot_floor"]
        summary["dot_floor"] = {k: fl[k] for k in ("dot_s", "step_floor_s", "mfu_bound", "gflop", "rate")}
    return summary


def _print_run(o: RunOptions, r: dict, m, summary: dict) -> None:
    """The run's table: losses, timing, MFU, prediction; the pipeline's shape; the collectives per step."""
    losses = r["losses"]
    print(f"{o.preset} {r['strategy']} on {m.shape} ({r['precision']}, {r['precision_reason']})")
    print_table([{"first loss": losses[0], "last loss": losses[-1], "val loss": r["val_loss"],
                  "unigram": r["unigram_baseline_val"], "step_s": r["step_s"], "tokens/s": r["tokens_per_s"],
                  "MFU": r["mfu"], **({"MFU physical": r["mfu_physical"]} if r.get("mfu_physical") else {}),
                  "predicted_s": summary["predicted_step_s"], "replication": r["replication"]}])
    if r.get("pipeline"):
        pl = r["pipeline"]
        print(f"pipeline: {pl['schedule']}, {pl['stages']} stages x {pl['microbatches']} microbatches"
              f" x {pl['repeats']} repeats = {pl['ticks']} ticks; analytic bubble {pl['bubble_fraction']:.1%}"
              + (f", {pl['bubble_s']:.3g} s at the host's peak" if pl.get("bubble_s") is not None else ""))
    print_table([{"collective": k, "count": v["count"], "bytes/device": v["bytes"]}
                 for k, v in r["collectives"].items()], title="collectives per step (per device)")


def _print_profile(r: dict) -> None:
    """--profile's tables: measured time per kernel class, the longest kernels, the step's dots timed alone."""
    kp = r["kernel_profile"]
    print_table([{"class": name, "ms/step": c["ms"], "share": c["ms"] / kp["kernel_ms"], "kernels": c["kernels"],
                  "GFLOP": c["gflop"]} for name, c in kp["classes"].items()],
                title=f"measured kernel time per step (jax.profiler; summed over devices), matmuls at "
                      f"{(kp['matmul_rate'] or 0) / 1e9:.0f} GFLOP/s")
    print_table([{"kernel": k["name"], "class": k["class"], "ms/step": k["ms"], "calls": k["calls"],
                  "GFLOP/s": k["gflop_per_s"], "GB/s": k["gb_per_s"], "what": (k["dot"] or k["op"])[:60]}
                 for k in kp["kernels"][:12]], title="longest kernels")
    fl = kp["dot_floor"]
    print_table([{"dot": d["dot"], "runs/step": d["count"], "ms each": d["ms_each"], "ms/step": d["ms_total"],
                  "GFLOP/s": d["gflop_per_s"]} for d in fl["dots"][:8]],
                title=f"the step's dots timed alone: {fl['step_floor_s']:.3f} s per step at "
                      f"{(fl['rate'] or 0) / 1e9:.0f} GFLOP/s, so MFU <= {fl['mfu_bound'] or 0:.1%} "
                      f"whatever the rest costs (measured step {r['step_s']:.3f} s)")


def register(app: typer.Typer) -> None:
    app.command("run")(run_cmd)
