"""Reports from records: roofline charts (matplotlib, PNG) and Markdown tables."""
from __future__ import annotations

import os

from workbench.results.console import fmt


def roofline_chart(points: list[dict], spec, path: str, title: str = "", dtype: str = "float32") -> str:
    """Log-log roofline: the spec's ceilings (measured XLA and, for the host, physical), its ridge point, and each
    point at (intensity, achieved FLOP/s) measured (filled) and predicted (hollow).

    points: dicts with label, intensity, flops, measured_s (or None), predicted_s.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    ints = [p["intensity"] for p in points if p.get("intensity")] or [1.0]
    lo, hi = min(min(ints) / 4, 0.05), max(max(ints) * 4, 1e3)
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    bw = spec.hbm_bw
    styles = [("-", "C0"), ("--", "C1"), (":", "C2")]
    peaks = {f"{dt} (XLA, measured)" if spec.kind == "cpu" else dt: v for dt, v in spec.peak_flops.items()}
    if spec.physical_peak_flops:
        peaks.update({f"{dt} (physical)": v for dt, v in spec.physical_peak_flops.items()})
    for i, (name, pk) in enumerate(sorted(peaks.items(), key=lambda kv: kv[1])):
        ls, c = styles[i % len(styles)][0], plt.cm.Greys(0.45 + 0.15 * i)
        ax.plot(x, np.minimum(pk, bw * x), ls, color=c, lw=1.5, label=f"roof {name}: {pk / 1e9:.0f} GFLOP/s")
    ridge = spec.ridge(dtype)
    ax.axvline(ridge, color="grey", lw=0.8, ls=":")
    ax.annotate(f"ridge {ridge:.1f} FLOP/B\n(bw {bw / 1e9:.1f} GB/s)", (ridge, spec.peak(dtype)),
                textcoords="offset points", xytext=(5, -30), fontsize=8, color="grey")
    markers = "osD^vP*Xh"
    for j, p in enumerate(points):
        c = plt.cm.tab10((j + 4) % 10)
        mk = markers[j % len(markers)]
        if p.get("predicted_s"):
            ax.scatter(p["intensity"], p["flops"] / p["predicted_s"], facecolors="none", edgecolors=[c], s=60,
                       marker=mk)
        if p.get("measured_s"):
            ax.scatter(p["intensity"], p["flops"] / p["measured_s"], color=[c], s=35, marker=mk, label=p["label"])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte accessed)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title or f"Roofline: {spec.name} (filled: measured, hollow: predicted)")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def markdown_table(rows: list[dict], columns: list[str]) -> str:

    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        out.append("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(out)


def mfu_chart(rows: list[dict], path: str, targets: dict[int, float] | None = None, title: str = "") -> str:
    """Two panels from benchmarks.mfu rows: MFU per case (devices × strategy × mesh × batch) with the target for
    its device count drawn as a dashed tick and, where the row has one, the bound its dots alone set (`mfu_bound`,
    workbench.measure.harness.dot_floor) as a hollow bar; below, the measured kernel time per class as shares of each
    case's total."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("mfu") is not None]
    labels = [f"{r['devices']}× {r['strategy']}\n{r['mesh']}\nbatch {r['batch']}" for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6.0, 1.1 * len(rows) + 2), 8), sharex=True)
    xs = range(len(rows))
    ax1.bar(xs, [100 * r["mfu"] for r in rows], color=["tab:blue" if r["devices"] == 1 else "tab:orange" for r in rows])
    bounds = [r.get("mfu_bound") for r in rows]
    if any(b is not None for b in bounds):
        ax1.bar(xs, [100 * min(b, 1.0) if b is not None else 0 for b in bounds], fill=False, edgecolor="tab:gray",
                linewidth=1.0, label="bound: the step's dots timed alone")
        ax1.legend(fontsize=7, loc="upper right")
    for x, r in zip(xs, rows):
        ax1.text(x, 100 * r["mfu"] + 1, f"{100 * r['mfu']:.0f}%", ha="center", fontsize=8)
        if targets and r["devices"] in targets:
            ax1.hlines(100 * targets[r["devices"]], x - 0.4, x + 0.4, colors="k", linestyles="--")
    ax1.set_ylabel("MFU, % of the calibrated XLA matmul ceiling")
    ax1.set_ylim(0, 110)
    ax1.set_title(title or "MFU per case (dashed: the target)")
    classes = sorted({c for r in rows for c in (r.get("kernel_profile") or {}).get("classes", {})},
                     key=lambda c: -sum((r.get("kernel_profile") or {}).get("classes", {}).get(c, {}).get("ms", 0)
                                        for r in rows))
    bottom = [0.0] * len(rows)
    for c in classes:
        share = []
        for r in rows:
            kp = r.get("kernel_profile") or {}
            tot = kp.get("kernel_ms") or 0
            share.append(100 * kp.get("classes", {}).get(c, {}).get("ms", 0) / tot if tot else 0)
        ax2.bar(xs, share, bottom=bottom, label=c)
        bottom = [b + s for b, s in zip(bottom, share)]
    ax2.set_ylabel("measured kernel time, % (jax.profiler)")
    ax2.set_xticks(list(xs), labels, fontsize=7)
    ax2.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def waterfall_chart(terms: list[dict], path: str, title: str = "") -> str:
    """A waterfall of a step's time: one pair of floating bars per term (predicted hollow, measured filled), each
    starting where the previous term's ended, the totals at the right. terms: dicts with name, predicted_s,
    measured_s (workbench.explain.Waterfall.to_record()['terms'])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5), dpi=120)
    cum = {"predicted_s": 0.0, "measured_s": 0.0}
    top = 0.0
    for i, t in enumerate(terms):
        for key, dx, style in (("predicted_s", -0.2, dict(fill=False, edgecolor="C0", hatch="//")),
                               ("measured_s", 0.2, dict(color="C1"))):
            v = t[key] or 0.0
            ax.bar(i + dx, v, bottom=cum[key], width=0.38, **style)
            top = max(top, cum[key], cum[key] + v)
            cum[key] += v
    n = len(terms)
    ax.bar(n - 0.2, cum["predicted_s"], width=0.38, fill=False, edgecolor="C0", hatch="//", label="predicted")
    ax.bar(n + 0.2, cum["measured_s"], width=0.38, color="C1", label="measured")
    ax.set_xticks(range(n + 1), [t["name"] for t in terms] + ["step"], rotation=25, ha="right", fontsize=8)
    ax.set_ylim(min(0.0, *cum.values()), top * 1.06 or 1.0)
    ax.set_ylabel("seconds per step (cumulative)")
    ax.axhline(0, color="k", lw=0.5)
    ax.legend()
    ax.set_title(title or "The step from ideal to measured", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
