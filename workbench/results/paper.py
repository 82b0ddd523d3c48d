"""Paper output from stored records: one figure style, figures as PDF (vector) and PNG, tables as LaTeX (booktabs)
and Markdown, each carrying a provenance line (commit, record ids, date). The notebooks in notebooks/ use these.

    style()                                   # sizes for one and two columns, fonts, colour-blind-safe palette
    fig, ax = figure("single")                # 3.35 in wide (one column) or "double" (7.0 in)
    save_figure(fig, "roofline", records)     # paper/figures/roofline.pdf + .png, provenance in the footer
    save_table(rows, "prediction_error", records, caption="...", columns=[...])   # .tex + .md
    no_records(ax, "run `python -m benchmarks.mfu`")   # an honest empty panel when the study has not run

Output goes to $WORKBENCH_PAPER_OUT (default ./paper).
"""
from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Iterable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from workbench.results.console import fmt  # noqa: E402
from workbench.results.store import git_info  # noqa: E402

# Okabe & Ito (2008), "Color Universal Design": distinguishable under the common colour-vision deficiencies
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
WIDTHS = {"single": 3.35, "double": 7.0}   # inches: one and two columns of a two-column paper (IEEE/ACM)


def out_dir(sub: str = "") -> str:
    d = os.path.join(os.environ.get("WORKBENCH_PAPER_OUT", "paper"), sub)
    os.makedirs(d, exist_ok=True)
    return d


def style() -> None:
    matplotlib.rcParams.update({
        "font.family": "serif", "font.size": 8, "axes.titlesize": 8, "axes.labelsize": 8, "legend.fontsize": 7,
        "xtick.labelsize": 7, "ytick.labelsize": 7, "axes.prop_cycle": matplotlib.cycler(color=PALETTE),
        "axes.grid": True, "grid.alpha": 0.25, "figure.dpi": 150, "savefig.bbox": "tight", "pdf.fonttype": 42,
    })


def figure(width: str = "single", aspect: float = 0.7, ncols: int = 1):
    style()
    w = WIDTHS[width]
    return plt.subplots(1, ncols, figsize=(w, w * aspect / (1 if ncols == 1 else ncols / 1.6)), squeeze=True)


def record_ids(records) -> list[str]:
    """Ids of the records a figure or table was made from (a DataFrame with an `id` column, or dicts)."""
    if records is None:
        return []
    if hasattr(records, "columns"):
        return [str(x) for x in records["id"]] if "id" in records.columns else []
    return [str(r["id"]) for r in records if isinstance(r, dict) and "id" in r]


def provenance_line(records) -> str:
    ids = record_ids(records)
    g = git_info()
    sha = (g["git_sha"] or "unknown")[:10] + ("+dirty" if g["git_dirty"] else "")
    shown = ",".join(ids[:6]) + (f",…(+{len(ids) - 6})" if len(ids) > 6 else "")
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    return f"commit {sha} · {len(ids)} records [{shown or 'none'}] · {date}"


def no_records(ax, how: str) -> None:
    """An empty panel that says why: the study's records are not in the store yet, and how to make them."""
    ax.text(0.5, 0.5, f"no stored records yet\n{how}", ha="center", va="center", transform=ax.transAxes, fontsize=7)
    ax.set_xticks([])
    ax.set_yticks([])


def save_figure(fig, name: str, records) -> list[str]:
    """paper/figures/NAME.pdf and .png with the provenance line in the footer and in the PDF's metadata."""
    line = provenance_line(records)
    fig.text(0.0, -0.09, line, fontsize=5, color="grey", ha="left", va="top", transform=fig.transFigure)
    d = out_dir("figures")
    paths = [os.path.join(d, f"{name}.{ext}") for ext in ("pdf", "png")]
    fig.savefig(paths[0], metadata={"Subject": line, "Creator": "workbench"})
    fig.savefig(paths[1])
    plt.close(fig)
    return paths


def _tex(v) -> str:
    s = fmt(v)
    for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#"), ("$", r"\$")):
        s = s.replace(a, b)
    return s


def save_table(rows: Iterable[dict], name: str, records, caption: str, columns: list[str] | None = None) -> list[str]:
    """paper/tables/NAME.tex (booktabs, with the provenance as a comment and in the caption) and NAME.md."""
    rows = list(rows)
    columns = columns or (list(rows[0]) if rows else ["(no rows)"])
    line = provenance_line(records)
    d = out_dir("tables")
    tex = [f"% provenance: {line}", r"\begin{table}[t]", r"\centering", r"\small",
           r"\begin{tabular}{" + "l" * len(columns) + "}", r"\toprule",
           " & ".join(_tex(c) for c in columns) + r" \\", r"\midrule"]
    tex += [" & ".join(_tex(r.get(c)) for c in columns) + r" \\" for r in rows] or [r"\multicolumn{"
                                                                                   f"{len(columns)}" r"}{l}{no stored records yet} \\"]
    tex += [r"\bottomrule", r"\end{tabular}", r"\caption{" + _tex(caption) + r" {\scriptsize(" + _tex(line) + ")}}",
            r"\label{tab:" + name + "}", r"\end{table}", ""]
    md = [f"<!-- provenance: {line} -->", f"**{caption}**", "", "| " + " | ".join(columns) + " |",
          "|" + "---|" * len(columns)]
    md += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows] or ["| no stored records yet |"]
    paths = [os.path.join(d, f"{name}.tex"), os.path.join(d, f"{name}.md")]
    with open(paths[0], "w") as f:
        f.write("\n".join(tex))
    with open(paths[1], "w") as f:
        f.write("\n".join(md) + f"\n\n{line}\n")
    return paths
