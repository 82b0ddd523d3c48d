"""`workbench predict`: compile a model's step for a TPU slice or GPU node from this host; memory fit and prediction.

    workbench predict --preset llama3-8b --target tpu-v5e:4x4 --strategy fsdp --batch 16 --seq 2048 --json
    workbench predict --preset tiny --target h100:8 --strategy fsdp+tp --mesh data=2,model=4
"""
from __future__ import annotations

from typing import Optional

import typer

from partitioning.topology import setup_target_devices
from workbench.commands.options import check_inputs
from workbench.errors import positive_int
from workbench.results.console import emit_json, fmt, print_table, stderr_console


def summary_rows(r: dict) -> list[dict]:
    gib = 2**30
    rows = [
        {"field": "target", "value": f"{r['target']} ({r['target_description']}; compiler {r['compiler']})"},
        {"field": "program", "value": f"{r['preset']} {r['mode']} · {r['strategy']} · mesh {r['mesh']} · "
                                      f"batch {r['batch']} × seq {r['seq']} · remat {r['remat']} · "
                                      f"microbatches {r['microbatches']} · {r['policy']}"},
        {"field": "fits", "value": str(r["fits"]) + (f" — {r['reason']}" if r.get("reason") else "")},
    ]
    if r.get("memory_per_device_bytes") is not None:
        rows.append({"field": "memory / device", "value": f"{r['memory_per_device_bytes'] / gib:.2f} GiB of "
                                                          f"{r['hbm_bytes'] / gib:.2f} GiB HBM"})
    for k, label in (("flops_per_device", "FLOP / device"), ("bytes_per_device", "bytes / device"),
                     ("collective_bytes_per_device", "collective bytes / device"), ("compute_s", "compute term s"),
                     ("memory_s", "memory term s"), ("comm_s", "communication term s"),
                     ("roofline_s", "roofline s"), ("analytic_floor_s", "analytic floor s"),
                     ("predicted_step_s", "predicted step s"), ("tokens_per_s", "tokens/s"),
                     ("predicted_mfu", "predicted MFU"), ("xla_estimate_s", "compiler estimate s"),
                     ("compile_s", "compile s")):
        if k == "roofline_s" and r.get("host_s"):
            rows.append({"field": "host transfer term s", "value": f"{fmt(float(r['host_s']))} — "
                         f"{r['host_bytes_out_per_device'] / 1e9:.3g} GB to host memory, "
                         f"{r['host_bytes_in_per_device'] / 1e9:.3g} GB back, per device"})
        if r.get(k) is not None:
            unfit = k == "predicted_step_s" and r.get("priced_from")
            rows.append({"field": label + (" (were there room)" if unfit else ""), "value": fmt(float(r[k]))
                         + (" — priced from the optimized HLO the compiler wrote before it ran out of memory"
                            if unfit else "")})
    for kind, v in (r.get("collectives") or {}).items():
        rows.append({"field": f"  {kind}", "value": f"{int(v['count'])}× {v['bytes'] / 2**20:.3g} MiB"})
    if r.get("pipeline"):
        pl = r["pipeline"]
        rows.append({"field": "pipeline", "value": f"{pl['schedule']}: {pl['stages']} stages × {pl['microbatches']} "
                     f"microbatches × {pl['repeats']} repeats = {pl['ticks']} ticks"})
        rows.append({"field": "bubble", "value": f"{pl['bubble_fraction']:.1%} of the layer ticks "
                     "((p − 1)/(v·m + p − 1))" + (f"; {fmt(pl['bubble_s'])} s of the predicted step"
                                                 if pl.get("bubble_s") is not None else "")})
        if pl.get("held_microbatches") is not None:
            rows.append({"field": "held for the backward", "value": f"{pl['held_microbatches']} microbatches on "
                         f"stage 0 ({pl.get('held_what', '')})"})
    if r.get("remat_auto", {}).get("tried_first"):
        ra = r["remat_auto"]
        rows.append({"field": "remat auto", "value": f"none did not fit ({ra.get('reason')}); per-layer chosen"})
    if r.get("bottleneck"):
        rows.append({"field": "bottleneck", "value": r["bottleneck"]})
    return rows


def register(app: typer.Typer) -> None:
    @app.command("predict")
    def predict_cmd(
        preset: str = typer.Option(..., "--preset", help="model preset (tiny, small, llama3-8b, ...)"),
        target: str = typer.Option(..., "--target", help="tpu-v5e:4x4, tpu-v4:2x2x1, tpu-v5p:2x2x2, tpu-v6e:2x4, "
                                                         "h100:8, h200:16, b200:8 (see docs/targets.md)"),
        strategy: str = typer.Option(..., "--strategy", help="dp | fsdp | tp | fsdp+tp | sp | cp | fsdp+cp | "
                                     "fsdp+tp+cp (sequence over the `context` mesh axis) | ep | pp | pp+fsdp | "
                                     "pp+tp | pp+fsdp+tp"),
        mesh: Optional[str] = typer.Option(None, "--mesh", help="e.g. data=4,model=4 (default: the strategy's)"),
        batch: Optional[int] = typer.Option(None, "--batch", help="global batch in sequences (default 4 per chip)"),
        seq: Optional[int] = typer.Option(None, "--seq", help="sequence length (decode: KV-cache length)"),
        mode: str = typer.Option("train", "--mode", help="train | prefill | decode"),
        remat: str = typer.Option("auto", "--remat", help="none | full (= per-layer) | dots | MaxText's minimal, "
                                                          "minimal_with_context, save_dot_except_mlpwi, "
                                                          "save_dot_except_mlp, save_dot_with_context_except_mlp, "
                                                          "save_qkv_proj, save_out_proj, qkv_proj_offloaded, "
                                                          "minimal_offloaded | offload | torchtitan_selective_op | "
                                                          "per tensor NAME=remat|device|offload,... (e.g. "
                                                          "decoder_layer_input=offload,query_proj=offload; "
                                                          "docs/models.md) | auto (the preset's; per-layer when "
                                                          "that does not fit)"),
        microbatches: int = typer.Option(1, "--microbatches", help="gradient accumulation steps per train step (pp "
                                         "strategies: the pipeline's microbatches)"),
        pipeline_repeats: int = typer.Option(1, "--pipeline-repeats", help="pp strategies: virtual stages per "
                                             "device (circular schedule)"),
        pipeline_schedule: str = typer.Option("gpipe", "--pipeline-schedule", help="pp strategies: gpipe (circular "
                                              "with --pipeline-repeats > 1) | 1f1b"),
        policy: str = typer.Option("bf16", "--policy", help="precision policy (bf16, float32, ...)"),
        set_: Optional[str] = typer.Option(None, "--set", help="model config overrides k=v,k=v"),
        gpu_compiler: str = typer.Option("auto", "--gpu-compiler",
                                         help="GPU targets: auto | xla-gpu (deviceless, needs the JAX CUDA plugin) "
                                              "| cpu-sim (compile for simulated CPU devices)"),
        shard_activations: bool = typer.Option(False, "--shard-activations",
                                               help="tensor-parallel strategies: split the residual stream's embed "
                                                    "over the tensor axis too (MaxText's activation_embed rule)"),
        compile_anyway: bool = typer.Option(True, "--compile-anyway/--precheck",
                                            help="compile even when the sharded state alone exceeds HBM, so that a "
                                                 "program that does not fit still shows its temporaries and the "
                                                 "step it would take (the default); --precheck refuses such a "
                                                 "program without compiling (fast, as the planner does)"),
        as_json: bool = typer.Option(False, "--json", help="JSON on stdout"),
    ):
        """Compile for the target (abstract inputs, no device memory), check memory, predict step time and MFU."""
        check_inputs(batch=batch, seq=seq, microbatches=microbatches)
        positive_int("--pipeline-repeats", pipeline_repeats)
        from models.pipeline import check_schedule_name

        check_schedule_name(pipeline_schedule)
        from workbench.programs.predict import PredictSpec, predict, resolve

        # the names resolved once (target, strategy, rules, policy); the programs take the objects
        resolved = resolve(PredictSpec(
            preset=preset, target=target, strategy=strategy, mesh=mesh, batch=batch, seq=seq, mode=mode, remat=remat,
            microbatches=microbatches, policy=policy, overrides=set_, gpu_compiler=gpu_compiler,
            pipeline_repeats=pipeline_repeats, pipeline_schedule=pipeline_schedule,
            shard_activations=shard_activations))
        tgt = setup_target_devices(resolved.target, gpu_compiler)
        con = stderr_console()
        with con.status(f"compiling {preset} {mode} for {tgt.name} ({strategy})"):
            r = predict(resolved, compile_anyway=compile_anyway)
        if as_json:
            emit_json(r)
        else:
            print_table(summary_rows(r), ["field", "value"], title=f"workbench predict · {tgt.name}")
