"""Predictions checked against published training runs: the table's rows as predict specs, the published step time
each implies, and the error a prediction for a chip family has shown (what `workbench plan` prints beside every
predicted step time).

The table is benchmarks/data/published_runs.csv (facts with their sources, see docs/accuracy-tpu.md);
`python -m benchmarks.published_validation` compiles each row for its target and stores a `published_validation`
record in the results store. `validation_error(chip)` reads the latest such record.
"""
from __future__ import annotations

import csv
import dataclasses
import os
import statistics

from partitioning.mesh import parse_mesh_spec
from partitioning.strategy import STAGE_AXIS, TENSOR_AXIS
from workbench.errors import WorkbenchError
from workbench.programs.predict import PredictSpec
from workbench.results.store import Store

TABLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks",
                     "data", "published_runs.csv")
# the published model's MLP -> the nearest MLP the models implement with the same matmuls
MLP_HERE = {"relu": "gelu", "gelu": "gelu", "swiglu": "swiglu"}
POLICY_HERE = {"bf16": "bf16", "fp8": "fp8-current"}


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    row: dict

    @property
    def name(self) -> str:
        return self.row["name"]

    @property
    def chip(self) -> str:
        return self.row["chip"]

    @property
    def block(self) -> str:
        """The decoder block the framework ran: 'parallel' for MaxText's default decoder layer (attention and MLP
        on one normed input, its 2023 model family), 'sequential' otherwise (the table's `block` column)."""
        return self.row.get("block") or "sequential"

    def vocab_size(self) -> int:
        """The vocabulary as the framework allocates it: Megatron (NeMo) pads it to a multiple of
        make_vocab_size_divisible_by (128) × the tensor-parallel size (`_vocab_size_with_padding`: GPT-3's 50257
        becomes 50688 at TP 4); the others as published."""
        v = int(self.row["vocab_size"])
        if self.megatron:
            multiple = 128 * parse_mesh_spec(self.row["mesh"]).get(TENSOR_AXIS, 1)
            v = -(-v // multiple) * multiple
        return v

    @property
    def megatron(self) -> bool:
        """NeMo runs Megatron-LM: its vocabulary padding, its 1F1B pipeline schedule, its distributed optimizer
        (NeMo-Framework-Launcher's training configs, e.g. conf/training/llama/llama3_8b.yaml: `optim.name:
        distributed_fused_adam`; llama3_70b.yaml: `mcore_distributed_optim`) and its O2 mixed precision (the same
        files: `megatron_amp_O2: true`)."""
        return self.row["framework"].startswith("NeMo")

    def overrides(self) -> str:
        r = self.row
        keys = ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff")
        kv = [f"{k}={int(r[k])}" for k in keys] + [f"vocab_size={self.vocab_size()}"]
        kv += [f"mlp={MLP_HERE[r['mlp']]}", f"tie_embeddings={r['tie_embeddings']}", f"seq_len={int(r['seq'])}",
               "scan_layers=true"]  # MaxText's default scan_layers=True; compile time independent of depth
        if self.block == "parallel":
            kv += ["block=parallel"]
        if self.megatron:  # NeMo's distributed optimizer: the Adam state split over the data-parallel ranks, and
            # megatron_amp_O2 (bf16 parameters and gradients, grad_sync_dtype=bf16 in NeMo-Framework-Launcher's
            # examples/training/llama/h100/*.sh): the float32 master weights live in that optimizer state
            kv += ["optimizer_sharding=data", "master_weights=optimizer"]
        if self.row["framework"].startswith("MaxText"):  # its DenseGeneral's lax.dot_general returns the bf16
            # compute dtype (maxtext:MaxText/layers/linears.py _compute_dot_general), so the weight gradients are bf16
            # until they are widened to the float32 weights: reduce-scattered over the data-parallel devices in bf16
            kv += ["weight_grad_dtype=compute"]
        return ",".join(kv)

    def policy(self) -> str:
        return POLICY_HERE[self.row["precision"].split()[0]]

    def spec(self):
        r = self.row
        # with a tensor axis every framework here splits the residual stream over it between layers: MaxText its
        # embed (logical rule activation_embed -> tensor), torchtitan and Megatron its sequence (torchtitan's apply_tp:
        # SequenceParallel norms, the embedding's output Shard(1); NeMo-Framework-Launcher's llama2_70b.yaml,
        # llama3_70b.yaml and gpt3/175b.yaml: `sequence_parallel: true`). The same saved bytes per device; compiled
        # here as MaxText's rule (--shard-activations)
        shard = "model=" in r["mesh"]
        # Megatron (NeMo) pipelines run 1F1B: a stage holds at most 2p − 1 microbatches' activations, not all of them
        schedule = "1f1b" if self.megatron and STAGE_AXIS in parse_mesh_spec(r["mesh"]) else "gpipe"
        return PredictSpec(preset="llama2-7b", target=r["target"], strategy=r["parallelism"], mesh=r["mesh"],
                           batch=int(r["global_batch"]), seq=int(r["seq"]), remat=r["remat"],
                           microbatches=int(r["microbatches"] or 1), policy=self.policy(), overrides=self.overrides(),
                           shard_activations=shard, pipeline_schedule=schedule)

    def published_step(self, model_flops_per_step: float) -> tuple[float | None, str]:
        """The published step time: stated, or from tokens/s per chip, or from model TFLOP/s per chip (the same
        non-causal convention as the workbench's analytic count)."""
        r = self.row
        tokens_per_chip = int(r["global_batch"]) * int(r["seq"]) / int(r["n_chips"])
        if r.get("step_s"):
            return float(r["step_s"]), "published step time"
        if r.get("tokens_per_s_per_chip"):
            return tokens_per_chip / float(r["tokens_per_s_per_chip"]), (
                f"{tokens_per_chip:.0f} tokens per chip / {float(r['tokens_per_s_per_chip']):.0f} published tokens/s")
        if r.get("tflops_per_chip"):
            t = float(r["tflops_per_chip"]) * 1e12
            return model_flops_per_step / (int(r["n_chips"]) * t), (
                f"model FLOPs {model_flops_per_step:.4g} / ({r['n_chips']} chips × {r['tflops_per_chip']} published "
                "TFLOP/s)")
        return None, "no step time, tokens/s or TFLOP/s published"


def load_runs(path: str | None = None) -> list[PublishedRun]:
    path = path or TABLE
    try:
        with open(path, encoding="utf-8") as f:
            return [PublishedRun(r) for r in csv.DictReader(f)]
    except OSError as e:
        raise WorkbenchError(f"cannot read the published-runs table {path}: {e.strerror}") from None


def summarize_errors(rows: list[dict]) -> dict:
    """Median |step-time error| over the rows that compiled, overall and per chip family."""
    errs = [r for r in rows if r.get("step_error") is not None]
    by_chip: dict[str, list[float]] = {}
    for r in errs:
        by_chip.setdefault(r["chip"], []).append(abs(r["step_error"]))
    return {"median_error": statistics.median([abs(r["step_error"]) for r in errs]) if errs else None,
            "n_compared": len(errs),
            "median_error_by_chip": {c: statistics.median(v) for c, v in by_chip.items()},
            "n_by_chip": {c: len(v) for c, v in by_chip.items()}}


def validation_error(chip: str, store=None) -> dict | None:
    """{median_error, n_runs, time} of the latest published_validation record for this chip family (catalogue or
    target family name: 'tpu-v5e', 'h100'), None when none covers it."""
    recs = (store or Store()).records("published_validation")
    key = chip.split(":")[0].lower()
    for rec in reversed(recs):
        ex = rec.get("extra", {})
        for c, med in (ex.get("median_error_by_chip") or {}).items():
            if c.lower() == key:
                return {"median_error": med, "n_runs": ex.get("n_by_chip", {}).get(c), "chip": c,
                        "time": rec.get("provenance", {}).get("time")}
    return None
