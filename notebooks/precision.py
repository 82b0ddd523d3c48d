# %% [markdown]
# # Precision: what each number format costs in accuracy
# Records of kind `precision_error` (`workbench precision error --record`, `python -m benchmarks.precision_error`)
# and `precision_training` (`python -m benchmarks.precision_training`). Reads only the results store.

# %%
from workbench.results import paper
from workbench.results.store import Store

err = Store().query(kind="precision_error")

# %%
fig, ax = paper.figure("single")
if len(err):
    g = err.groupby(["extra.policy", "extra.inputs"])["extra.rel_error"].median().unstack()
    g.plot.bar(ax=ax, logy=True, width=0.8)
    ax.set_ylabel("relative error vs float64")
    ax.set_xlabel("")
else:
    paper.no_records(ax, "run `workbench precision error --inputs all --record`")
paper.save_figure(fig, "precision_error", err)

# %%
rows = [{"policy": r["extra.policy"], "inputs": r["extra.inputs"], "element": r.get("extra.matmul_element"),
         "bits": r.get("extra.matmul_bits"), "scale": r.get("extra.scale"), "rel. error": r["extra.rel_error"]}
        for _, r in err.iterrows()]
paper.save_table(rows, "precision_error", err, caption="Matmul error of each precision policy against float64")

# %%
tr = Store().query(kind="precision_training")
fig, ax = paper.figure("single")
if len(tr):
    for _, r in tr.iterrows():
        ax.plot(r["extra.losses"], lw=0.8, label=r["extra.policy"])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=5)
else:
    paper.no_records(ax, "run `python -m benchmarks.precision_training`")
paper.save_figure(fig, "precision_training", tr)
