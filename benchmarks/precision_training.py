"""Study (b): training curves of `tiny` and `small` on the stdlib corpus under every precision policy (same seed, same
data, same initial parameters), and the final validation-loss gap to float32. Records (kind 'precision_training')
and a figure.

    python -m benchmarks.precision_training [--presets tiny,small] [--steps-tiny 300] [--steps-small 200] [--tiny]

Uses workbench.programs.train.train_model (one device, strategy dp). The issue's target: bf16 and fp8-delayed within 2% of
float32's final validation loss on `tiny` after 300 steps. Step times in these records are of emulated formats on a
CPU host (XLA:CPU has no bf16/fp8/MX units): they say nothing about accelerator speed; study (c) does that.
"""
from __future__ import annotations

import argparse
import os
import sys

from models.precision import available
from models.presets import get_config
from models.quant import POLICY_ORDER
from partitioning.mesh import make_mesh
from workbench.hardware.devices import default_platform
from workbench.programs.data import Batches, shard_batch
from workbench.programs.step import build_train_step
from workbench.programs.train import train_model
from workbench.results import store as results


def grad_scaling_mode(cfg, seed: int = 0) -> str:
    """Whether workbench.programs.train's step commits fp8-delayed's gradient-scaling state (delayed E5M2 scales) or drops it
    (gradients then use this step's amax: current scaling). Measured: two steps, then read the state."""
    import jax
    import numpy as np


    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    prog = build_train_step(cfg, policy="fp8-delayed", mesh=mesh, strategy="dp", batch_size=2, seq_len=cfg.seq_len,
                            seed=seed, total_steps=2)
    b = Batches(2, cfg.seq_len, seed)
    state = prog.state
    for i in range(2):
        state, _ = prog.step(state, shard_batch(b.train(i), prog.batch_sharding))
    where = {k: state[k] for k in ("gmeta", "rest") if k in state}  # the train step keeps it in 'gmeta'
    hist = [np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(where)
            if "g_amax_history" in jax.tree_util.keystr(path)]
    committed = any(np.any(h > 0) for h in hist)
    return "delayed (committed by the train step)" if committed else \
        "current (the train step does not commit Fp8GradMeta; gradients use this step's amax)"


def run(presets=("tiny", "small"), steps=None, policies=None, batch_size: int = 8, seed: int = 0,
        out_dir: str = "reports/precision", record: bool = True, seeds=None) -> dict:
    """Train every (preset, policy[, seed]); gaps are to float32 with the same seed. With several seeds the summary
    also gives float32's own seed-to-seed spread: the noise floor a gap must clear to mean anything."""
    seeds = list(seeds) if seeds else [seed]
    outs = [_run_one(presets, steps, policies, batch_size, s, out_dir, record) for s in seeds]
    out = outs[0] if len(outs) == 1 else {"runs": [r for o in outs for r in o["runs"]], "seeds": seeds}
    if len(outs) > 1:
        out["gaps_per_seed"] = {s: o["gaps"] for s, o in zip(seeds, outs)}
        out["gaps"] = {}
        out["float32_seed_spread"] = {}
        for preset in presets:
            pols = {p for o in outs for p in o["gaps"].get(preset, {})}
            out["gaps"][preset] = {p: float(sum(o["gaps"][preset][p] for o in outs) / len(outs)) for p in pols
                                   if all(o["gaps"].get(preset, {}).get(p) is not None for o in outs)}
            f32 = [r["val_loss"] for r in out["runs"] if r["preset"] == preset and r.get("policy") == "float32"
                   and "failed" not in r]
            if len(f32) > 1:
                out["float32_seed_spread"][preset] = (max(f32) - min(f32)) / (sum(f32) / len(f32))
        if "fp8_delayed_gradient_scaling" in outs[0]:
            out["fp8_delayed_gradient_scaling"] = outs[0]["fp8_delayed_gradient_scaling"]
        if "tiny" in out["gaps"]:
            g = out["gaps"]["tiny"]
            out["target_tiny_within_2pct"] = {p: abs(g[p]) <= 0.02 for p in ("bf16", "fp8-delayed") if p in g}
        os.makedirs(out_dir, exist_ok=True)
        figure([r for r in out["runs"] if r.get("seed") == seeds[0]], os.path.join(out_dir, "precision_training.png"))
    return out


def _run_one(presets, steps, policies, batch_size, seed, out_dir, record) -> dict:
    import jax


    steps = steps or {"tiny": 300, "small": 200}
    policies = policies or [p for p in POLICY_ORDER if p in available()]
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    store = results.Store() if record else None
    out: dict = {"runs": [], "gaps": {}}
    for preset in presets:
        cfg = get_config(preset, None)
        n = steps[preset]
        base = None
        for p in policies:
            print(f"[precision_training] {preset} {p} {n} steps", file=sys.stderr, flush=True)
            try:
                r = train_model(cfg, strategy="dp", mesh=mesh, steps=n, batch_size=batch_size, precision=p, seed=seed,
                                eval_every=max(n // 12, 1), progress=True, analytic=False).to_record()
            except Exception as e:  # a diverged policy is a result, not a crash
                out["runs"].append({"preset": preset, "policy": p, "failed": f"{type(e).__name__}: {e}"[:300]})
                continue
            row = {"preset": preset, "policy": p, "steps": n, "losses": r["losses"], "val_losses": r["val_losses"],
                   "val_loss": r["val_loss"], "unigram_baseline_val": r["unigram_baseline_val"],
                   "compute_dtype": r["compute_dtype"], "step_s_host_emulated": r["step_s"], "seed": seed,
                   "batch_size": batch_size, "seq_len": r["seq_len"]}
            if p == "float32":
                base = r["val_loss"]
            if base is not None:
                row["val_gap_to_float32"] = (r["val_loss"] - base) / base
            out["runs"].append(row)
            if store is not None:
                spec = {"preset": preset, "policy": p, "steps": n, "batch": batch_size, "seed": seed}
                store.append(results.make_record("precision_training", spec, r["cost"], r["prediction"],
                                                 r["measurement"], extra=row, seed=seed))
        out["gaps"][preset] = {r["policy"]: r.get("val_gap_to_float32") for r in out["runs"]
                               if r["preset"] == preset and "failed" not in r}
    if "fp8-delayed" in policies:
        out["fp8_delayed_gradient_scaling"] = grad_scaling_mode(get_config(presets[0], None), seed)
    if "tiny" in out["gaps"]:
        g = out["gaps"]["tiny"]
        out["target_tiny_within_2pct"] = {p: (abs(g[p]) <= 0.02 if g.get(p) is not None else None)
                                          for p in ("bf16", "fp8-delayed") if p in g}
    os.makedirs(out_dir, exist_ok=True)
    figure(out["runs"], os.path.join(out_dir, "precision_training.png"))
    return out


def figure(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in runs if "failed" not in r]
    presets = list(dict.fromkeys(r["preset"] for r in ok))
    if not presets:
        return
    fig, axes = plt.subplots(1, len(presets), figsize=(6.5 * len(presets), 4.5), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        for r in [r for r in ok if r["preset"] == preset]:
            vs = r["val_losses"]
            gap = r.get("val_gap_to_float32")
            lab = r["policy"] + (f" ({gap:+.2%})" if gap is not None and r["policy"] != "float32" else "")
            ax.plot([s for s, _ in vs], [v for _, v in vs], marker="o", ms=3, label=lab)
        ax.set_title(f"{preset}: validation loss (stdlib corpus, same seed and data)", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/byte)")
        ax.legend(fontsize=8, title="final gap to float32", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--policies", default=None, help="comma list (default: all)")
    ap.add_argument("--steps-tiny", type=int, default=300)
    ap.add_argument("--steps-small", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", default=None, help="comma list: repeat every run per seed (gap noise floor)")
    ap.add_argument("--tiny", action="store_true", help="smoke run: tiny preset, 20 steps, three policies")
    ap.add_argument("--out", default="reports/precision")
    a = ap.parse_args(argv)

    default_platform()
    import json

    if a.tiny:
        out = run(("tiny",), {"tiny": 20}, ["float32", "bf16", "fp8-delayed"], a.batch, a.seed, a.out)
    else:
        pol = a.policies.split(",") if a.policies else None
        seeds = [int(x) for x in a.seeds.split(",")] if a.seeds else None
        out = run(tuple(a.presets.split(",")), {"tiny": a.steps_tiny, "small": a.steps_small}, pol, a.batch, a.seed,
                  a.out, seeds=seeds)
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    from workbench.hardware.hostmem import reexec_with_hugepages

    reexec_with_hugepages()  # before JAX starts: huge pages for XLA:CPU buffers (workbench/hostmem.py)
    sys.exit(main())
