# %% [markdown]
# # The roofline of the built-in ops on this host
# Every point is one record of kind `roofline-op` (`workbench roofline OP ...`, `make demo`, or the sweep in
# `notebooks/sweeps/roofline.toml`): measured (filled) and predicted (hollow) FLOP/s against arithmetic intensity,
# under the host's calibrated ceilings. Reads only the results store.

# %%
import numpy as np

from workbench.results import paper
from workbench.results.store import Store

recs = Store().query(kind="roofline-op")
# this host when it has records (measured and predicted), else the chip with the most predictions
target = ("host" if (recs["spec.target"] == "host").any() else recs["spec.target"].mode()[0]) if len(recs) else None
host = recs[recs["spec.target"] == target] if len(recs) else recs

# %%
fig, ax = paper.figure("single")
if len(host):
    for op, g in host.groupby("spec.op"):
        x = g["prediction.intensity"]
        if "measurement.median_s" in g.columns and g["measurement.median_s"].notna().any():
            ax.scatter(x, g["prediction.flops"] / g["measurement.median_s"], s=12, label=f"{op} measured")
        ax.scatter(x, g["prediction.flops"] / g["prediction.predicted_s"], s=18, facecolors="none",
                   edgecolors="grey", linewidths=0.6, label=f"{op} predicted")
    peak = float(host["prediction.peak_flops"].median())
    bw = float(host["prediction.memory_bw"].median())
    xs = np.logspace(-2, 3, 100)
    ax.plot(xs, np.minimum(peak, bw * xs), color="black", lw=0.8, label=f"roof: {target}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("FLOP / byte")
    ax.set_ylabel("FLOP/s")
    ax.legend(fontsize=5)
else:
    paper.no_records(ax, "run `make demo` or `workbench sweep notebooks/sweeps/roofline.toml`")
paper.save_figure(fig, "roofline", host)

# %%
rows = []
for _, r in host.iterrows():
    meas, pred = r.get("measurement.median_s"), r.get("prediction.predicted_s")
    rows.append({"target": target, "op": r["spec.op"], "description": r["spec.description"], "bound": r["prediction.bound"],
                 "predicted s": pred, "measured s": meas,
                 "error": (pred - meas) / meas if meas and pred else None})
paper.save_table(rows, "roofline_ops", host, caption=f"Built-in ops on {target}: predicted (and measured) time",
                 columns=["target", "op", "description", "bound", "predicted s", "measured s", "error"])
