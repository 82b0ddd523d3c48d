"""MoE study: router × capacity factor × experts × top-k × expert-parallel degree on a simulated 8-device mesh.

For each case (a tiny GPT-style model, `tiny` preset shapes, every MLP an MoE layer):
  - train it for --steps steps on the stdlib corpus (workbench.programs.train.train_model): validation loss, step time on this
    host (median/IQR from workbench.measure.harness; only meaningful on a quiet machine), per-step routing metrics (dropped
    fraction, load max/mean, router entropy, lb/z losses, averaged over layers, last step), all-to-all bytes per
    device from the compiled step's CostReport;
  - predict the same training step on a TPU slice (compiled by libtpu for the topology, `workbench.programs.predict`) and a
    GPU node (XLA:CPU-compiled costs priced with the GPU's catalogue spec): predicted step time, per device;
  - compile one MoE layer forward (`workbench moe layer` machinery) to split its per-device flops into routing +
    dispatch + combine against expert compute;
  - one dense model with the same active parameters (d_ff = top_k × expert d_ff) as the baseline.
Records go to the results store (kind 'moe_study'); the table (CSV + Markdown) and a figure go to --out.

    python -m benchmarks.moe_study                    # the default sweep (~15 cases; run in a quiet window)
    python -m benchmarks.moe_study --quick            # 3 cases, 4 steps, no predictions: checks the plumbing
    python -m benchmarks.moe_study --grid full        # the full product (long)
    python -m benchmarks.moe_study --replot           # table + figure again from the stored records

One process, 8 simulated CPU devices (requested before JAX starts). Nothing here times anything itself.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import time

from models.analytics import analytics
from models.presets import get_config
from partitioning.mesh import make_mesh
from workbench.hardware.devices import request_devices
from workbench.programs.moe import layer_costs
from workbench.programs.predict import PredictSpec, predict_once
from workbench.programs.train import train_model
from workbench.results.store import Store, make_record

EXPERT_DFF = 128  # hidden size of each expert; the dense baseline uses top_k × this
BASE = dict(router="token-choice", score="softmax", experts=8, top_k=2, capacity_factor=1.25, ep=8)
MESHES = {1: "data=8", 2: "data=4,expert=2", 4: "data=2,expert=4", 8: "expert=8"}
TARGETS = {"tpu": "tpu-v5e:2x4", "gpu": "h100:8"}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    router: str = "token-choice"
    score: str = "softmax"
    experts: int = 8
    top_k: int = 2
    capacity_factor: float | None = 1.25
    ep: int = 8
    dense: bool = False

    @property
    def strategy(self) -> str:
        return "dp" if (self.dense or self.ep == 1) else "ep"

    @property
    def mesh(self) -> str:
        return MESHES[1 if self.dense else self.ep]

    def overrides(self) -> dict:
        if self.dense:
            return dict(n_experts=0, d_ff=self.top_k * EXPERT_DFF)
        return dict(n_experts=self.experts, top_k=self.top_k, d_ff=EXPERT_DFF, capacity_factor=self.capacity_factor,
                    router=self.router, router_score=self.score)

    def overrides_str(self) -> str:
        return ",".join(f"{k}={'none' if v is None else v}" for k, v in self.overrides().items())


def _case(name, **kw) -> Case:
    return Case(name, **{**BASE, **kw})


def default_cases() -> list[Case]:
    """One factor at a time around the base (token-choice softmax, E=8, k=2, C=1.25, EP=8), plus the dense twin."""
    return [
        _case("base"),
        _case("dropless", capacity_factor=None),
        _case("cf=1.0", capacity_factor=1.0),
        _case("cf=2.0", capacity_factor=2.0),
        _case("expert-choice", router="expert-choice"),
        _case("sigmoid", score="sigmoid"),
        _case("E=4", experts=4, ep=4),
        _case("E=16", experts=16),
        _case("k=1", top_k=1),
        _case("k=4", top_k=4),
        _case("EP=1", ep=1),
        _case("EP=2", ep=2),
        _case("EP=4", ep=4),
        Case("dense (k·d_ff)", top_k=2, dense=True),
        Case("dense (k=1)", top_k=1, dense=True),
    ]


def full_cases() -> list[Case]:
    out = []
    for router, cf, e, k, ep in itertools.product(("token-choice", "expert-choice"), (None, 1.0, 1.25, 2.0),
                                                  (4, 8, 16), (1, 2, 4), (1, 2, 4, 8)):
        if router == "expert-choice" and cf is None or k > e or e % ep:
            continue
        out.append(Case(f"{router[:2]} cf={cf} E={e} k={k} EP={ep}", router, "softmax", e, k, cf, ep))
    return out + [Case(f"dense k={k}", top_k=k, dense=True) for k in (1, 2, 4)]


def quick_cases() -> list[Case]:
    return [_case("base"), _case("dropless", capacity_factor=None, ep=4, experts=4), Case("dense", dense=True)]


# ------------------------------------------------------------------------------------------------- one case
def run_case(case: Case, *, steps: int, batch: int, seq: int, predict: bool, layer: bool, seed: int) -> dict:
    cfg = get_config("tiny", case.overrides())
    mesh = make_mesh(case.mesh)
    row: dict = {"case": case.name, **dataclasses.asdict(case), "strategy": case.strategy, "mesh": case.mesh,
                 "steps": steps, "batch": batch, "seq": seq, "seed": seed}
    if case.dense:  # no routing: blank the MoE fields rather than show the defaults
        row.update(router="dense", score=None, experts=0, capacity_factor=None, ep=None, d_ff=case.top_k * EXPERT_DFF)
    tr = train_model(cfg, strategy=case.strategy, mesh=mesh, steps=steps, batch_size=batch, seq_len=seq, seed=seed,
                     progress=False, hardware="auto", analytic=False).to_record()
    fm = tr["final_metrics"]
    a2a = tr["collectives_by_kind"].get("all-to-all", {})

    an = analytics(cfg, seq)
    row.update(
        val_loss=tr["val_loss"], train_loss=tr["losses"][-1], unigram_baseline_val=tr["unigram_baseline_val"],
        step_s=tr["step_s"], step_s_iqr=tr["step_s_iqr"], tokens_per_s=tr["tokens_per_s"],
        params_total=an["params_total"], params_active=an.get("params_active"),
        dropped_fraction=fm.get("aux_dropped_fraction"), load_max_over_mean=fm.get("aux_load_max_over_mean"),
        router_entropy=fm.get("aux_router_entropy"), lb_loss=fm.get("aux_lb_loss"), z_loss=fm.get("aux_z_loss"),
        a2a_bytes_per_device_step=a2a.get("bytes", 0.0), a2a_count_step=a2a.get("count", 0),
        collectives_step=tr["collectives"], step_flops_per_device=tr["cost"]["flops"],
        host_prediction_s=(tr["prediction"] or {}).get("predicted_s"),
    )
    row["_train"] = tr
    if predict:

        for key, target in TARGETS.items():
            spec = PredictSpec(preset="tiny", target=target, strategy=case.strategy, mesh=case.mesh, batch=batch,
                               seq=seq, overrides=case.overrides_str(), policy="bf16", remat="none")
            try:
                b = predict_once(spec)
            except Exception as e:  # a target that cannot compile is a result, not a crash
                row[f"{key}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                continue
            row[f"{key}_target"] = target
            row[f"{key}_predicted_step_s"] = b.get("predicted_step_s")
            row[f"{key}_bound"] = b.get("bound")
            row[f"{key}_compiler"] = b.get("compiler")
            row[f"{key}_a2a_bytes_per_device"] = sum(v["bytes"] for k, v in (b.get("collectives") or {}).items()
                                                    if k.startswith("all-to-all"))
            row[f"{key}_flops_per_device"] = b.get("flops_per_device")
    if layer and not case.dense:

        lc, _ = layer_costs(tokens=batch * seq, seq=seq, d_model=cfg.d_model, d_ff=EXPERT_DFF, experts=case.experts,
                            top_k=case.top_k, capacity_factor=case.capacity_factor, router=case.router,
                            score=case.score, mlp=cfg.mlp, mesh_spec=case.mesh, strategy=case.strategy, targets=())
        row.update(layer_flops_routing_dispatch=lc["flops_routing_dispatch_per_device"],
                   layer_flops_experts=lc["flops_experts_per_device"],
                   layer_flops_experts_useful=lc["flops_experts_useful_per_device"],
                   layer_a2a_bytes_per_device=lc["all_to_all_bytes_per_device"])
    return row


# ------------------------------------------------------------------------------------------------- outputs
COLUMNS = ["case", "router", "experts", "top_k", "capacity_factor", "ep", "val_loss", "dropped_fraction",
           "load_max_over_mean", "router_entropy", "a2a_bytes_per_device_step", "layer_flops_routing_dispatch",
           "layer_flops_experts", "layer_flops_experts_useful", "step_s", "tpu_predicted_step_s",
           "gpu_predicted_step_s", "params_total", "params_active"]


def _fmt(v):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_table(rows: list[dict], out: str) -> tuple[str, str]:
    import pandas as pd

    df = pd.DataFrame([{c: r.get(c) for c in COLUMNS} for r in rows])
    csv = os.path.join(out, "moe_study.csv")
    df.to_csv(csv, index=False)
    md = os.path.join(out, "moe_study.md")
    with open(md, "w") as f:
        f.write("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n")
        for r in rows:
            f.write("| " + " | ".join(_fmt(r.get(c)) for c in COLUMNS) + " |\n")
        f.write("\nPer device: a2a bytes (training step), layer flops (one MoE layer forward). step_s: this host, "
                "8 simulated devices (valid only from a quiet machine). Predicted: workbench.programs.predict on "
                f"{TARGETS['tpu']} (libtpu) and {TARGETS['gpu']} (XLA:CPU costs, GPU spec).\n")
    return csv, md


def write_figure(rows: list[dict], out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moe = [r for r in rows if not r.get("dense")]
    dense = [r for r in rows if r.get("dense")]
    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    # (a) validation loss per case, dense baselines as lines
    names = [r["case"] for r in moe]
    ax[0, 0].bar(range(len(moe)), [r.get("val_loss") or 0 for r in moe], color="tab:blue")
    for r, c in zip(dense, ("k", "gray", "silver")):
        if r.get("val_loss"):
            ax[0, 0].axhline(r["val_loss"], color=c, ls="--", label=r["case"])
    ax[0, 0].set_xticks(range(len(moe)), names, rotation=60, ha="right", fontsize=8)
    lo = min([r["val_loss"] for r in rows if r.get("val_loss")] or [0])
    ax[0, 0].set_ylim(lo * 0.97 if lo else 0, None)
    ax[0, 0].set_ylabel(f"validation loss (nats/byte) after {rows[0].get('steps')} steps")
    ax[0, 0].legend(fontsize=8)
    ax[0, 0].set_title("quality")
    # (b) dropped fraction and load imbalance per case
    x = range(len(moe))
    ax[0, 1].bar([i - 0.2 for i in x], [r.get("dropped_fraction") or 0 for r in moe], width=0.4,
                 label="dropped fraction", color="tab:red")
    ax2 = ax[0, 1].twinx()
    ax2.bar([i + 0.2 for i in x], [r.get("load_max_over_mean") or 0 for r in moe], width=0.4,
            label="load max/mean", color="tab:orange")
    ax[0, 1].set_xticks(list(x), names, rotation=60, ha="right", fontsize=8)
    h1, l1 = ax[0, 1].get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax[0, 1].legend(h1 + h2, l1 + l2, fontsize=8)
    ax[0, 1].set_ylabel("dropped fraction (last step)")
    ax2.set_ylabel("per-expert load max/mean")
    ax[0, 1].set_title("routing")
    # (c) all-to-all bytes per device and predicted step time
    ax[1, 0].bar(list(x), [(r.get("a2a_bytes_per_device_step") or 0) / 2**20 for r in moe], color="tab:purple")
    ax[1, 0].set_ylabel("all-to-all MiB per device per training step")
    ax3 = ax[1, 0].twinx()
    for key, m in (("tpu", "o"), ("gpu", "s")):
        ax3.plot(list(x), [(r.get(f"{key}_predicted_step_s") or float("nan")) * 1e3 for r in moe], m + "-",
                 label=f"predicted step ms, {TARGETS[key]}")
    ax3.set_ylabel("predicted step (ms)")
    ax3.legend(fontsize=8)
    ax[1, 0].set_xticks(list(x), names, rotation=60, ha="right", fontsize=8)
    ax[1, 0].set_title("communication and predicted time")
    # (d) flops of one MoE layer: routing + dispatch vs experts (useful vs padded)
    rd = [(r.get("layer_flops_routing_dispatch") or 0) / 1e6 for r in moe]
    ex = [(r.get("layer_flops_experts") or 0) / 1e6 for r in moe]
    us = [(r.get("layer_flops_experts_useful") or 0) / 1e6 for r in moe]
    ax[1, 1].bar(list(x), rd, label="routing + dispatch + combine", color="tab:gray")
    ax[1, 1].bar(list(x), ex, bottom=rd, label="experts (compiled)", color="tab:green")
    ax[1, 1].scatter(list(x), [a + b for a, b in zip(rd, us)], marker="_", s=200, color="k",
                     label="routing + useful expert flops", zorder=3)
    ax[1, 1].set_xticks(list(x), names, rotation=60, ha="right", fontsize=8)
    ax[1, 1].set_ylabel("MFLOP per device, one layer forward")
    ax[1, 1].legend(fontsize=8)
    ax[1, 1].set_title("where the flops go (XLA:CPU compile)")
    fig.tight_layout()
    path = os.path.join(out, "moe_study.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _store():
    return Store()


def stored_rows() -> list[dict]:
    rows = [r["extra"]["row"] for r in _store().records() if r.get("kind") == "moe_study" and "row" in r["extra"]]
    latest: dict = {}
    for r in rows:  # the latest record of each case
        latest[r["case"]] = r
    return list(latest.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", choices=("default", "full", "quick"), default="default")
    ap.add_argument("--quick", action="store_true", help="3 cases, 4 steps, no predictions (plumbing check)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-predict", action="store_true", help="skip the TPU/GPU compiles")
    ap.add_argument("--no-layer", action="store_true", help="skip the per-layer flop split")
    ap.add_argument("--only", default=None, help="comma-separated case names")
    ap.add_argument("--out", default=os.path.join("reports", "moe"))
    ap.add_argument("--replot", action="store_true", help="table and figure from stored records only")
    a = ap.parse_args(argv)


    request_devices(8)
    os.makedirs(a.out, exist_ok=True)
    if a.replot:
        rows = stored_rows()
    else:
        if a.quick:
            a.grid, a.steps, a.no_predict = "quick", min(a.steps, 4), True
        cases = {"default": default_cases, "full": full_cases, "quick": quick_cases}[a.grid]()
        if a.only:
            keep = set(a.only.split(","))
            cases = [c for c in cases if c.name in keep]

        rows = []
        for i, c in enumerate(cases):
            t0 = time.perf_counter()
            print(f"[{i + 1}/{len(cases)}] {c.name}: {c.strategy} on {c.mesh}", file=sys.stderr, flush=True)
            row = run_case(c, steps=a.steps, batch=a.batch, seq=a.seq, predict=not a.no_predict,
                           layer=not a.no_layer, seed=a.seed)
            tr = row.pop("_train")
            _store().append(make_record("moe_study", {"case": c.name, **dataclasses.asdict(c), "steps": a.steps,
                                                      "batch": a.batch, "seq": a.seq},
                                        tr["cost"], tr["prediction"], tr["measurement"],
                                        extra={"row": row, "study": "benchmarks/moe_study.py"}, seed=a.seed))
            rows.append(row)
            print(f"    val_loss {row['val_loss']:.4f}  dropped {_fmt(row.get('dropped_fraction'))}  "
                  f"a2a/dev {row['a2a_bytes_per_device_step']:.0f} B  ({time.perf_counter() - t0:.0f}s wall)",
                  file=sys.stderr, flush=True)
    csv, md = write_table(rows, a.out)
    fig = write_figure(rows, a.out)
    print(json.dumps({"cases": len(rows), "table_csv": csv, "table_md": md, "figure": fig}, indent=2))
    return 0


if __name__ == "__main__":
    from workbench.hardware.hostmem import reexec_with_hugepages

    reexec_with_hugepages()  # before JAX starts: huge pages for XLA:CPU buffers (workbench/hostmem.py)
    sys.exit(main())
