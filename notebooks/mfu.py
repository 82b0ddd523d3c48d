# %% [markdown]
# # Training steps: MFU per strategy, and where the step goes
# Records of kind `mfu` (`python -m benchmarks.mfu`) and `train` (`workbench run ...`; with `--explain`, the
# waterfall of the step from ideal to measured).

# %%
from workbench.results import paper
from workbench.results.store import Store

mfu = Store().query(kind="mfu")
train = Store().query(kind="train")

# %%
fig, ax = paper.figure("single")
src = mfu if len(mfu) else train


def mesh_of(r):
    """The mesh as 'data=8,model=2' whether the record kept it as text or as a dict (flattened to spec.mesh.AXIS)."""
    if isinstance(r.get("spec.mesh"), str):
        return r["spec.mesh"]
    return ",".join(f"{k.split('.')[-1]}={int(v)}" for k, v in r.items()
                    if k.startswith("spec.mesh.") and v == v and v is not None)


shown = src[src["extra.mfu"].notna()] if len(src) and "extra.mfu" in src.columns else src.iloc[0:0]
if len(shown):
    lab = [f"{r['spec.strategy']} {mesh_of(r)} b{r['spec.batch']}" for _, r in shown.iterrows()]
    ax.barh(lab, shown["extra.mfu"].astype(float))
    ax.set_xlabel("MFU (model flops / step time / measured ceiling)")
else:
    paper.no_records(ax, "run `python -m benchmarks.mfu` or `workbench run --preset tiny --steps 10`")
paper.save_figure(fig, "mfu", shown)

# %%
rows = [{"preset": r.get("spec.preset"), "strategy": r["spec.strategy"], "mesh": mesh_of(r),
         "batch": r["spec.batch"], "precision": r.get("spec.precision"), "step s": r.get("extra.step_s"),
         "tokens/s": r.get("extra.tokens_per_s"), "MFU": r.get("extra.mfu"),
         "predicted s": r.get("prediction.predicted_s")} for _, r in src.iterrows()]
paper.save_table(rows, "training_steps", src, caption="Training steps on this host: measured, predicted and MFU")

# %%
fig, ax = paper.figure("single")
w = train[train["extra.waterfall"].notna()] if len(train) and "extra.waterfall" in train.columns else train.iloc[0:0]
if len(w):
    terms = w.iloc[-1]["extra.waterfall"]
    terms = terms if isinstance(terms, list) else terms.get("terms", [])
    names = [t["name"] for t in terms]
    ax.barh(names, [t.get("measured_s") or 0 for t in terms], label="measured")
    ax.barh(names, [t.get("predicted_s") or 0 for t in terms], height=0.4, label="predicted")
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step")
    ax.legend(fontsize=5)
else:
    paper.no_records(ax, "run `workbench run --preset small --explain`")
paper.save_figure(fig, "waterfall", w)
