# %% [markdown]
# # Tiling: the shape sawtooth on a TPU target
# Records of kind `tiling-sweep` (`workbench tiling sweep --target tpu-v5e:1x1 --m 4096 --n 4096 --k-from 1000
# --k-to 1160 --step 8`): the dot compiled for the target at each k, its padded shapes read from the compiled
# layouts, and the predicted time; tile boundaries dashed.

# %%
from workbench.results import paper
from workbench.results.store import Store

sw = Store().query(kind="tiling-sweep")

# %%
fig, ax = paper.figure("single")
last = sw.iloc[-1] if len(sw) else None
if last is not None:
    pts = last["extra.points"]
    ks = [p["k"] for p in pts]
    ax.plot(ks, [p["predicted_s"] * 1e3 for p in pts], marker=".", lw=0.8, label="predicted (padded shapes)")
    if any(p.get("measured_s") for p in pts):
        ax.plot(ks, [(p.get("measured_s") or float("nan")) * 1e3 for p in pts], marker="x", lw=0.6, label="measured")
    for b in last["extra.boundaries"]:
        ax.axvline(b, color="grey", ls="--", lw=0.5)
    ax.set_xlabel("k")
    ax.set_ylabel("ms per dot")
    ax.set_title(f"{last['extra.target']}: {last['extra.m']}×k·k×{last['extra.n']} {last['extra.dtype']}")
    ax.legend(fontsize=5)
else:
    paper.no_records(ax, "run `workbench tiling sweep --target tpu-v5e:1x1 --m 4096 --n 4096 --k-from 1000 --k-to 1160`")
paper.save_figure(fig, "tiling", sw.iloc[-1:] if len(sw) else sw)

# %%
rows = ([{"k": p["k"], "padded k": p["padded"]["k"] if isinstance(p.get("padded"), dict) else p.get("padded"),
          "layout": (p.get("layouts") or [""])[0], "predicted s": p["predicted_s"], "measured s": p.get("measured_s")}
         for p in last["extra.points"]] if last is not None else [])
paper.save_table(rows, "tiling", sw.iloc[-1:] if len(sw) else sw, caption="The sawtooth: padded k and predicted time")
