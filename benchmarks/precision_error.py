"""Study (a): matmul error of every precision policy against a float64 reference, on normal inputs and on inputs
with outlier channels of growing size. Records (kind 'precision_error') and a figure.

    python -m benchmarks.precision_error [--tiny] [--out reports/precision]

The error is ||y - y64||_F / ||y64||_F of einsum('mk,kn->mn') after `steps` calls (delayed scaling sees earlier
draws from the same distribution first). Nothing here is timed, so it can run any time.
"""
from __future__ import annotations

import argparse
import os
import sys

from models.precision import available
from models.quant import POLICY_ORDER
from workbench.hardware.devices import default_platform
from workbench.programs.precision import matmul_error
from workbench.results import store as results
from workbench.results.console import progress

FULL = {"shapes": [(256, 1024, 256), (512, 4096, 512)], "outlier_scales": [10.0, 100.0, 1e3, 1e4], "steps": 4}
TINY = {"shapes": [(32, 64, 32)], "outlier_scales": [100.0], "steps": 2}


def run(tiny: bool = False, out_dir: str = "reports/precision", seed: int = 0, record: bool = True) -> list[dict]:
    cfg = TINY if tiny else FULL
    policies = [p for p in POLICY_ORDER if p in available()]
    jobs = []
    for (m, k, n) in cfg["shapes"]:
        for p in policies:
            jobs.append((p, "normal", m, k, n, None))
            for s in cfg["outlier_scales"]:
                jobs.append((p, "outliers", m, k, n, s))
                jobs.append((p, "outlier_damage", m, k, n, s))
    rows = []
    store = results.Store() if record else None
    for p, kind, m, k, n, s in progress(jobs, total=len(jobs), desc="precision error"):
        r = matmul_error(p, kind, m=m, k=k, n=n, seed=seed, steps=cfg["steps"],
                         **({"outlier_scale": s} if s is not None else {}))
        rows.append(r)
        if store is not None:
            spec = {"policy": p, "inputs": kind, "shape_mkn": [m, k, n], "outlier_scale": s, "seed": seed}
            store.append(results.make_record("precision_error", spec, extra=r, seed=seed))
    os.makedirs(out_dir, exist_ok=True)
    figure(rows, os.path.join(out_dir, "precision_error.png"))
    write_table(rows, os.path.join(out_dir, "precision_error.md"))
    return rows


def figure(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({tuple(r["shape_mkn"]) for r in rows})
    shape = shapes[-1]
    sel = [r for r in rows if tuple(r["shape_mkn"]) == shape]
    policies = list(dict.fromkeys(r["policy"] for r in sel))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, okind, title in ((axes[0], "outliers", "whole product (outlier channels included)"),
                             (axes[1], "outlier_damage", "normal channels only (outlier channels' weights zero)")):
        series = [("normal", None)] + sorted({(okind, r["outlier_scale"]) for r in sel if r["inputs"] == okind},
                                             key=lambda t: t[1])
        w = 0.8 / len(series)
        for i, (kind, s) in enumerate(series):
            ys = []
            for p in policies:
                hit = [r for r in sel if r["policy"] == p and r["inputs"] == kind and r["outlier_scale"] == s]
                ys.append(max(hit[0]["rel_error"], 1e-9) if hit else float("nan"))
            label = "normal inputs" if kind == "normal" else f"4 outlier channels x{s:g}"
            ax.bar([j + i * w for j in range(len(policies))], ys, w, label=label)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(policies))], policies, rotation=30)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("relative error vs float64 (Frobenius)")
    fig.suptitle(f"matmul error per precision policy, (m,k,n)={shape}; fp8/MX emulated exactly on this host")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_table(rows: list[dict], path: str) -> None:
    lines = ["| policy | inputs | outlier scale | (m,k,n) | rel. error | max abs error | element | bits |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['inputs']} | {r['outlier_scale'] or ''} | {tuple(r['shape_mkn'])} | "
                     f"{r['rel_error']:.3g} | {r['max_abs_error']:.3g} | {r['matmul_element']} | {r['matmul_bits']} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="one small shape (a smoke run)")
    ap.add_argument("--out", default="reports/precision")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    default_platform()
    rows = run(a.tiny, a.out, a.seed)
    for r in rows:
        print(f"{r['policy']:12s} {r['inputs']:8s} {str(r['outlier_scale'] or ''):8s} {tuple(r['shape_mkn'])} "
              f"rel_error {r['rel_error']:.3g}")
    print(f"wrote {a.out}/precision_error.png and .md; {len(rows)} records")
    return 0


if __name__ == "__main__":
    from workbench.hardware.hostmem import reexec_with_hugepages

    reexec_with_hugepages()  # before JAX starts: huge pages for XLA:CPU buffers (workbench/hostmem.py)
    sys.exit(main())
