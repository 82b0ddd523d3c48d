# %% [markdown]
# # Published large-scale runs: predicted here against measured there
# The latest record of kind `published_validation` (`python -m benchmarks.published_validation`): each published run
# (benchmarks/data/published_runs.csv, with its source) compiled for its target from this host and predicted.

# %%
from workbench.results import paper
from workbench.results.store import Store

val = Store().query(kind="published_validation")
runs = val.iloc[-1]["extra.runs"] if len(val) else []

# %%
fig, ax = paper.figure("single")
pts = [r for r in runs if r.get("published_mfu") and r.get("predicted_mfu")]
if pts:
    for chip in sorted({r["chip"] for r in pts}):
        sel = [r for r in pts if r["chip"] == chip]
        ax.scatter([r["published_mfu"] for r in sel], [r["predicted_mfu"] for r in sel], s=12, label=chip)
    ax.plot([0, 1], [0, 1], color="grey", lw=0.6)
    ax.set_xlabel("published MFU")
    ax.set_ylabel("predicted MFU")
    ax.legend(fontsize=5)
else:
    paper.no_records(ax, "run `python -m benchmarks.published_validation`")
paper.save_figure(fig, "published", val.iloc[-1:] if len(val) else val)

# %%
rows = [{"run": r.get("name"), "chip": r.get("chip"), "slice": r.get("slice"), "fits": r.get("fits"),
         "published step s": r.get("published_step_s"), "predicted step s": r.get("predicted_step_s"),
         "published MFU": r.get("published_mfu"), "predicted MFU": r.get("predicted_mfu"),
         "step error": r.get("step_error")} for r in runs]
paper.save_table(rows, "published", val.iloc[-1:] if len(val) else val,
                 caption="Published runs: predicted from a CPU host vs published")
