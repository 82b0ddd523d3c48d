"""`workbench model-info --preset P [--set k=v,...] [--json]`: analytic counts of a model config (no compile)."""
from __future__ import annotations

from typing import Optional

import typer

from models.analytics import analytics, moe_layer_memory, moe_memory_fused
from models.presets import get_config, source
from workbench.errors import WorkbenchError, positive_int
from workbench.results.console import emit_json, fmt, print_table


def register(app: typer.Typer) -> None:
    @app.command("model-info")
    def model_info_cmd(
        preset: str = typer.Option(..., "--preset", help="tiny | small | gpt2-small | gpt3-175b | llama2-7b | "
                                                         "llama3-8b | llama3-70b | mixtral-8x7b"),
        overrides: Optional[str] = typer.Option(None, "--set", help="config overrides, e.g. n_layers=4,d_model=128"),
        seq: Optional[int] = typer.Option(None, "--seq", help="sequence length for the attention FLOP term "
                                                              "(default: the config's seq_len)"),
        tokens_per_device: Optional[int] = typer.Option(
            None, "--tokens-per-device", help="MoE memory model: tokens each device routes (default: one sequence)"),
        fsdp: int = typer.Option(1, "--fsdp", help="MoE memory model: ways the expert weights are fsdp-sharded"),
        ep: int = typer.Option(1, "--ep", help="MoE memory model: expert-parallel degree"),
        tensor: int = typer.Option(1, "--tensor", help="MoE memory model: tensor-parallel ways splitting d_ff"),
        platform: str = typer.Option("cpu", "--platform", help="MoE memory model: the compiler's platform, cpu | gpu | "
                                                               "tpu (tpu: libtpu's fused buffer set, docs/moe.md)"),
        json_out: bool = typer.Option(False, "--json", help="print JSON"),
    ):
        """Parameters, FLOPs per token, KV-cache bytes and training-memory estimates of a model config."""
        if seq is not None:
            positive_int("--seq", seq)
        cfg = get_config(preset, overrides)
        a = analytics(cfg, seq)
        out = {"preset": preset, "source": source(preset), "overrides": overrides or "", "config": cfg.to_dict(), **a}
        if cfg.is_moe:
            for name, v in (("--fsdp", fsdp), ("--ep", ep), ("--tensor", tensor)):
                positive_int(name, v)
            t = positive_int("--tokens-per-device", tokens_per_device) if tokens_per_device else (seq or cfg.seq_len)
            if platform not in ("cpu", "gpu", "tpu"):
                raise WorkbenchError(f"--platform {platform!r} is not one of cpu, gpu, tpu")
            out["moe_memory"] = moe_layer_memory(cfg, t, compute_bytes=2, ep=ep, tensor=tensor, fsdp=fsdp,
                                                 fused=moe_memory_fused(cfg, platform))
        if json_out:
            emit_json(out)
            return
        print(f"{preset}: {source(preset)}")
        rows = [{"quantity": k, "value": fmt(float(v)) if isinstance(v, (int, float)) else str(v)}
                for k, v in a.items() if k not in ("conventions",)]
        print_table(rows, ["quantity", "value"])
        if "moe_memory" in out:
            m = out["moe_memory"]
            print_table([{"buffer (one MoE layer, per device, bf16)": k, "bytes": fmt(float(v))}
                         for k, v in m.items() if k.endswith("_bytes")],
                        title=f"MoE memory model: {m['tokens_per_group']} tokens per group, capacity "
                              f"{m['capacity_per_expert'] or 'dropless'}")
        print("conventions:", a["conventions"])
