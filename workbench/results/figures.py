"""Reports from records: roofline charts (matplotlib, PNG) and Markdown tables."""
from __future__ import annotations

import os

from workbench.results.console import fmt


def _save(fig, path: str) -> str:
    """Lay out, write (making the folder), close; the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def physical_label(spec, dtype: str, physical: float) -> str:
    """A physical roof's legend: the clock its derivation assumes, and where XLA measured more than it allows, the
    clock that measurement implies (the physical figure is then a bound at the assumed clock, not the machine's)."""
    ghz = spec.measured.physical_clock_ghz
    if not ghz:
        return f"{dtype} (physical)"
    label = f"{dtype} (physical at {ghz:.2f} GHz"
    measured = spec.peak_flops.get(dtype)
    if measured and measured > physical:
        label += f"; XLA's measured {measured / 1e9:.0f} GFLOP/s implies ≥ {ghz * measured / physical:.2f} GHz"
    return label + ")"


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
    if spec.measured.physical_peak_flops:
        peaks.update({physical_label(spec, dt, v): v for dt, v in spec.measured.physical_peak_flops.items()})
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
    return _save(fig, path)


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


def fusion_chart(result: dict, path: str, title: str = "", top: int = 12) -> str:
    """The fusion explorer's figure (workbench.programs.fusion's record): bytes and time per variant (predicted
    hollow, measured filled), and the longest kernels of the default and no-fusion variants, predicted beside
    measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    vs = result["variants"]
    names = list(vs)
    shown = [n for n in ("default", "no-fusion") if n in result["kernels"]]
    fig, axes = plt.subplots(1, 2 + len(shown), figsize=(6 + 5 * (1 + len(shown)), 5), dpi=110)
    x = np.arange(len(names))
    axes[0].bar(x, [vs[n]["bytes"] / 1e6 for n in names], color="C0")
    axes[0].set_ylabel("MB moved (Σ kernel bytes in + out)")
    axes[0].set_title("bytes per variant")
    pred = [vs[n]["predicted_s"] * 1e3 for n in names]
    meas = [(vs[n]["measured_s"] or 0) * 1e3 for n in names]
    axes[1].bar(x - 0.2, pred, 0.4, facecolor="none", edgecolor="C1", label="predicted")
    if any(meas):
        axes[1].bar(x + 0.2, meas, 0.4, color="C1", label="measured")
    axes[1].set_ylabel("ms per run")
    axes[1].set_title("time per variant")
    axes[1].legend(fontsize=8)
    for ax in axes[:2]:
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    for ax, name in zip(axes[2:], shown):
        ks = sorted(result["kernels"][name], key=lambda r: -(r["measured_s"] if r["measured_s"] is not None
                                                              else r["predicted_s"]))[:top]
        y = np.arange(len(ks))
        ax.barh(y - 0.2, [r["predicted_s"] * 1e3 for r in ks], 0.4, facecolor="none", edgecolor="C2",
                label="predicted")
        if any(r["measured_s"] for r in ks):
            ax.barh(y + 0.2, [(r["measured_s"] or 0) * 1e3 for r in ks], 0.4, color="C2", label="measured")
        ax.set_yticks(y)
        ax.set_yticklabels([f"{r['name'][:28]} [{r['kind']}]" for r in ks], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("ms per run")
        ax.set_title(f"{name}: longest kernels", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def fusion_study_chart(rows: list[dict], path: str, title: str = "") -> str:
    """benchmarks.fusion_study's figure: per case, bytes fused against unfused (log scale), and time per run fused
    against unfused, measured (filled) beside predicted (hollow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [r["case"] for r in rows]
    x = np.arange(len(names))
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(max(10, 1.4 * len(names)), 4.8), dpi=110)
    a0.bar(x - 0.2, [r["bytes_fused"] / 1e6 for r in rows], 0.4, color="C0", label="fused (default)")
    a0.bar(x + 0.2, [(r["bytes_unfused"] or 0) / 1e6 for r in rows], 0.4, color="C3", label="unfused")
    a0.set_yscale("log")
    a0.set_ylabel("MB moved per run")
    a0.set_title("bytes")
    w = 0.2
    for i, (key, c, lab) in enumerate((("fused", "C0", "fused"), ("unfused", "C3", "unfused"))):
        a1.bar(x + (2 * i - 1.5) * w, [(r[f"measured_{key}_s"] or 0) * 1e3 for r in rows], w, color=c,
               label=f"{lab} measured")
        a1.bar(x + (2 * i - 0.5) * w, [(r[f"predicted_{key}_s"] or 0) * 1e3 for r in rows], w, facecolor="none",
               edgecolor=c, label=f"{lab} predicted")
    a1.set_yscale("log")
    a1.set_ylabel("ms per run")
    a1.set_title("time")
    for ax in (a0, a1):
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def peer_chart(result: dict, path: str) -> str:
    """benchmarks.peer: tokens/s of the workbench and PyTorch per precision (bars), the ratio above each pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    precs = list(result["precisions"])
    sides = result.get("sides") or ["workbench", "torch"]
    fig, ax = plt.subplots(figsize=(max(4.5, 1.1 * len(sides) * len(precs) + 1.5), 4.2), dpi=120)
    w = 0.76 / len(sides)
    labels = {"workbench": ("workbench (JAX/XLA)", "tab:blue"),
              "torch": (f"PyTorch {result.get('torch', '')}" + (" eager" if "torch-compile" in sides else ""),
                        "tab:orange"),
              "torch-compile": (f"PyTorch {result.get('torch', '')} torch.compile", "tab:red")}
    for j, side in enumerate(sides):
        label, color = labels[side]
        vals = [result["precisions"][p][side]["tokens_per_s"] for p in precs]
        ax.bar([i + (j - (len(sides) - 1) / 2) * w for i in range(len(precs))], vals, w, label=label, color=color)
    for i, p in enumerate(precs):
        v = result["precisions"][p]
        top = max(v[s]["tokens_per_s"] for s in sides)
        ax.text(i, top * 1.03, f"{v['ratio_tokens_per_s']:.2f}×", ha="center", fontsize=9)
        for kind, style in (("physical", "-"), ("measured", ":")):  # tokens/s were every flop at that ceiling
            peak = (v.get("ceilings_flops_per_s") or {}).get(kind)
            if peak and result.get("model_flops_per_step"):
                tps = peak / result["model_flops_per_step"] * result["tokens_per_step"]
                ax.hlines(tps, i - 2 * w * 0.6, i + 2 * w * 0.6, colors="black", linestyles=style, linewidth=1,
                          label=f"at the {kind} peak" if i == 0 else None)
    ax.set_xticks(range(len(precs)), precs)
    ax.set_ylabel("tokens/s (median step)")
    note = " — contended: void for reporting" if result.get("contended") else ""
    where = f" on {result['gpu']}" if result.get("gpu") else ""
    ax.set_title(f"{result['preset']}, batch {result['batch']}×{result['seq_len']}{where}, one process each, "
                 f"alternating; ratio: workbench / fastest PyTorch{note}",
                 fontsize=8)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
    return _save(fig, path)


def waterfall_chart(terms: list[dict], path: str, title: str = "") -> str:
    """A waterfall of a step's time: one pair of floating bars per term (predicted hollow, measured filled), each
    starting where the previous term's ended, the totals at the right. terms: dicts with name, predicted_s,
    measured_s (workbench.measure.explain.Waterfall.to_record()['terms'])."""
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
    return _save(fig, path)


def pipeline_bubble_chart(rows: list[dict], path: str, title: str = "") -> str:
    """benchmarks.pipeline_study's figure: bubble fraction against microbatches m, per (stages p, repeats v): the
    analytic (p − 1)/(v·m + p − 1) as a line; measured as the fill/drain ticks' share of the step (dots) and against
    the bubble-free reference (crosses); from compiled flops (hollow squares)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    keys = sorted({(r["stages"], r["repeats"]) for r in rows})
    for i, (p, v) in enumerate(keys):
        sel = sorted((r for r in rows if (r["stages"], r["repeats"]) == (p, v)), key=lambda r: r["microbatches"])
        ms = np.array([r["microbatches"] for r in sel])
        c = plt.cm.tab10(i % 10)
        mm = np.linspace(ms.min(), ms.max(), 50)
        ax.plot(mm, (p - 1) / (v * mm + p - 1), "-", color=c, lw=1.2, label=f"p={p} v={v} analytic")
        if all("bubble_measured_ticks" in r for r in sel):
            ax.scatter(ms, [r["bubble_measured_ticks"] for r in sel], color=[c], s=35, marker="o",
                       label=f"p={p} v={v} measured (fill/drain ticks)")
        ax.scatter(ms, [r["bubble_measured"] for r in sel], color=[c], s=30, marker="x",
                   label=f"p={p} v={v} measured (vs bubble-free reference)")
        ax.scatter(ms, [r["bubble_flops"] for r in sel], facecolors="none", edgecolors=[c], s=70, marker="s",
                   label=f"p={p} v={v} compiled flops")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("microbatches m")
    ax.set_ylabel("bubble fraction of the pipelined layers' time")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(title, fontsize=10)
    return _save(fig, path)


def serving_chart(result: dict, path: str) -> str:
    """workbench serve: the latency–throughput curve (time per output token against tokens/s, one point per batch
    size, labelled), measured where measured and predicted beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.0), dpi=120)
    rows = result["batches"]
    for kind, style, tkey, pkey in (("measured", "o-", "tpot_s", "tokens_per_s"),
                                    ("predicted", "s--", "predicted_tpot_s", "predicted_tokens_per_s")):
        pts = [(r[pkey], r[tkey] * 1e3, r["batch"]) for r in rows if r.get(tkey) and r.get(pkey)]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=kind)
        for x, y, b in pts:
            ax.annotate(f"B={b}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("tokens/s (all sequences)")
    ax.set_ylabel("time per output token (ms)")
    knee = (result.get("knee") or {}).get("batch")
    ax.set_title(f"{result['preset']} on {result['target']}: prompt {result['prompt_len']} + {result['gen_len']}, "
                 f"weights {result['quant']}; decode compute-bound from batch {knee or 'never'}", fontsize=8)
    ax.legend(fontsize=8)
    return _save(fig, path)
