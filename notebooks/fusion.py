# %% [markdown]
# # Fusion: what XLA fused, and what fusing saved
# Records of kind `fusion` (`workbench fusion --op elementwise --n 16777216`, `python -m benchmarks.fusion_study`):
# one record per program × fusion variant, with its kernel count, bytes, predicted and measured time.

# %%
from workbench.results import paper
from workbench.results.store import Store

fu = Store().query(kind="fusion")

# %%
fig, ax = paper.figure("single")
if len(fu):
    last = fu.groupby("spec.variant").tail(1)
    lab = last["spec.variant"].astype(str)
    ax.barh(lab, last["costs.hlo_bytes"] / 1e6, label="bytes (MB)")
    ax.set_xlabel("HLO kernel bytes per call (MB)")
    ax.set_title(str(last.iloc[-1].get("spec.name", last.iloc[-1].get("spec.op", ""))))
else:
    paper.no_records(ax, "run `workbench fusion --op elementwise --n 16777216`")
paper.save_figure(fig, "fusion", fu)

# %%
rows = [{"program": r.get("spec.name", r.get("spec.op")), "variant": r["spec.variant"],
         "kernels": r.get("costs.n_kernels"), "bytes": r.get("costs.hlo_bytes"),
         "predicted s": r.get("prediction.predicted_s"), "measured s": r.get("measurement.median_s")}
        for _, r in fu.iterrows()]
paper.save_table(rows, "fusion", fu, caption="Fusion variants: kernels, bytes, predicted and measured time")
