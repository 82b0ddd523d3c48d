# %% [markdown]
# # How good are the predictions? Held-out ops and whole programs
# The latest record of kind `prediction_error` (`python -m benchmarks.prediction_error`): every op and program with
# its predicted and measured time; in-sample ops (the calibration's own sizes) apart from held-out ones. Each row is
# measured at the median of three timings spread over the run (older records hold two): the line
# through a point spans its timings, the host's own repeatability.

# %%
from workbench.results import paper
from workbench.results.store import Store

pe = Store().query(kind="prediction_error")
last = pe.iloc[-1] if len(pe) else None
ops = list(last["extra.ops"]) if last is not None else []
progs = list(last["extra.programs"]) if last is not None else []

# %%
fig, ax = paper.figure("single")
pts = [(r, "in-sample op" if r.get("in_sample") else "held-out op") for r in ops] + [(r, "program") for r in progs]
pts = [(r, k) for r, k in pts if r.get("predicted_s") and r.get("measured_s")]
if pts:
    for kind in ("in-sample op", "held-out op", "program"):
        sel = [r for r, k in pts if k == kind]
        dots = ax.scatter([r["measured_s"] for r in sel], [r["predicted_s"] for r in sel], s=10, label=kind)
        for r in sel:
            span = r.get("measured_s_timings") or [t for t in (r["measured_s"], r.get("measured_s_repeat")) if t]
            if len(span) > 1:
                ax.plot([min(span), max(span)], [r["predicted_s"]] * 2, lw=0.5, color=dots.get_facecolor()[0])
    lo = min(min(r["measured_s"], r["predicted_s"]) for r, _ in pts)
    hi = max(max(r["measured_s"], r["predicted_s"]) for r, _ in pts)
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured s")
    ax.set_ylabel("predicted s")
    ax.legend(fontsize=5)
else:
    paper.no_records(ax, "run `python -m benchmarks.prediction_error`")
paper.save_figure(fig, "prediction_error", pe.iloc[-1:] if len(pe) else pe)

# %%
rows = [{"name": r["name"], "kind": "program" if r in progs else ("in-sample" if r.get("in_sample") else "held-out"),
         "predicted s": r.get("predicted_s"), "measured s": r.get("measured_s"), "error": r.get("error"),
         "first timing s": r.get("measured_s_first"), "second timing s": r.get("measured_s_repeat")}
        for r in ops + progs]
med = {k: (last.get(f"extra.{k}") if last is not None else None)
       for k in ("median_error_ops_heldout", "median_error_ops_in_sample", "median_error_programs")}
rep = {k: (last.get(f"extra.repeatability.{k}") if last is not None else None) for k in ("ops", "programs")}
paper.save_table(rows, "prediction_error", pe.iloc[-1:] if len(pe) else pe,
                 caption="Predicted vs measured on this host; median errors: " + ", ".join(
                     f"{k.replace('median_error_', '')} {v:.1%}" if v is not None else f"{k} n/a" for k, v in med.items())
                 + "; repeatability (median change between a row's two timings): " + ", ".join(
                     f"{k} {v:.1%}" if isinstance(v, float) and v == v else f"{k} n/a" for k, v in rep.items()))
