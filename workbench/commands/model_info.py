"""`workbench model-info --preset P [--set k=v,...] [--json]`: analytic counts of a model config (no compile)."""
from __future__ import annotations

from typing import Optional

import typer

from models.analytics import analytics
from models.presets import get_config, source
from workbench.errors import positive_int
from workbench.results.console import emit_json, fmt, print_table


def register(app: typer.Typer) -> None:
    @app.command("model-info")
    def model_info_cmd(
        preset: str = typer.Option(..., "--preset", help="tiny | small | gpt2-small | gpt3-175b | llama2-7b | "
                                                         "llama3-8b | llama3-70b | mixtral-8x7b"),
        overrides: Optional[str] = typer.Option(None, "--set", help="config overrides, e.g. n_layers=4,d_model=128"),
        seq: Optional[int] = typer.Option(None, "--seq", help="sequence length for the attention FLOP term "
                                                              "(default: the config's seq_len)"),
        json_out: bool = typer.Option(False, "--json", help="print JSON"),
    ):
        """Parameters, FLOPs per token, KV-cache bytes and training-memory estimates of a model config."""

        if seq is not None:
            positive_int("--seq", seq)
        cfg = get_config(preset, overrides)
        a = analytics(cfg, seq)
        out = {"preset": preset, "source": source(preset), "overrides": overrides or "", "config": cfg.to_dict(), **a}
        if json_out:
            emit_json(out)
            return
        print(f"{preset}: {source(preset)}")
        rows = [{"quantity": k, "value": fmt(float(v)) if isinstance(v, (int, float)) else str(v)}
                for k, v in a.items() if k not in ("conventions",)]
        print_table(rows, ["quantity", "value"])
        print("conventions:", a["conventions"])
