# %% [markdown]
# # Serving on the roofline: latency against throughput, prefill and decode, what quantization and speculation buy
# Every run is one record of kind `serve-run` (`workbench serve ...`, or the sweep in `notebooks/sweeps/serving.toml`):
# per batch size the time to first token and per output token, predicted from the compiled programs (and measured
# when the target is the host), the knee where decode turns compute-bound, and, where asked for, the quantized
# weights' error and the speculative decoder's acceptance and speedup. Reads only the results store.

# %%
import numpy as np
import pandas as pd

from workbench.results import paper
from workbench.results.store import Store

recs = Store().query(kind="serve-run")
key = ["spec.preset", "spec.target", "spec.quant", "spec.kv_dtype", "spec.prompt_len", "spec.gen_len",
       "spec.draft", "spec.paged"]
if len(recs):  # the latest run of each configuration
    ident = recs.reindex(columns=key).apply(lambda row: "|".join(str(v) for v in row), axis=1)
    recs = recs.assign(_key=ident).groupby("_key").tail(1)


def label(r) -> str:
    q = "" if r["spec.quant"] == "none" else f" {r['spec.quant']}"
    return f"{r['extra.preset']} · {r['extra.target']}{q}"


rows = []
for _, r in recs.iterrows():
    chips = r.get("extra.chips") or 1
    for b in r["extra.batches"]:
        tpot = b.get("tpot_s") or b.get("predicted_tpot_s")
        rows.append({"run": label(r), "preset": r["extra.preset"], "target": r["extra.target"],
                     "quant": r["spec.quant"], "batch": b["batch"], "measured": b.get("tpot_s") is not None,
                     "ttft predicted s": b.get("predicted_ttft_s"), "ttft measured s": b.get("ttft_s"),
                     "tpot predicted s": b.get("predicted_tpot_s"), "tpot measured s": b.get("tpot_s"),
                     "tokens/s/chip": b["batch"] / tpot / chips if tpot else None, "fits": b.get("fits"),
                     "knee batch": r.get("extra.knee.batch"),
                     "prefill": b.get("prefill") or {}, "decode": b.get("decode") or {}})
table = pd.DataFrame(rows)

# %% [markdown]
# Latency against throughput: each line is one run, each point a batch size (time per output token against tokens
# per second per chip; measured where the run measured, else predicted).

# %%
fig, ax = paper.figure("single")
if len(table):
    for run, g in table.groupby("run", sort=False):
        g = g.sort_values("batch")
        tpot = g["tpot measured s"].where(g["measured"], g["tpot predicted s"])
        ax.plot(tpot * 1e3, g["tokens/s/chip"], marker="o", ms=3, lw=0.8,
                label=run + (" (measured)" if g["measured"].all() else " (predicted)"))
        for t, y, b in zip(tpot * 1e3, g["tokens/s/chip"], g["batch"]):
            ax.annotate(str(b), (t, y), fontsize=4, xytext=(2, 2), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("time per output token (ms)")
    ax.set_ylabel("tokens/s per chip")
    ax.legend(fontsize=4)
else:
    paper.no_records(ax, "run `workbench serve ...` or `workbench sweep notebooks/sweeps/serving.toml`")
paper.save_figure(fig, "serving_latency_throughput", recs)

# %% [markdown]
# Prefill and decode on the roofline: each phase's compiled program at each batch, its arithmetic intensity against
# the FLOP/s its prediction attains, beside the ridge of its target (dashed). Decode climbs towards the ridge as the
# batch grows; prefill sits beyond it.

# %%
fig, ax = paper.figure("single")
pts = [(r["run"], phase, r[phase]) for _, r in table.iterrows() for phase in ("prefill", "decode")
       if r[phase].get("intensity") and r[phase].get("flops") and r[phase].get("predicted_s")] if len(table) else []
if pts:
    runs = list(dict.fromkeys(p[0] for p in pts))
    colours = dict(zip(runs, paper.PALETTE * 4))
    for run in runs:
        for phase, marker in (("prefill", "s"), ("decode", "o")):
            sel = [p[2] for p in pts if p[0] == run and p[1] == phase]
            if sel:
                ax.scatter([p["intensity"] for p in sel], [p["flops"] / p["predicted_s"] for p in sel], marker=marker,
                           s=12, color=colours.get(run), label=f"{run} {phase}")
        ridge = next((p[2].get("ridge") for p in pts if p[0] == run and p[2].get("ridge")), None)
        if ridge:
            ax.axvline(ridge, color=colours.get(run, "grey"), lw=0.6, ls="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("FLOP / byte (per device)")
    ax.set_ylabel("predicted FLOP/s (per device)")
    ax.legend(fontsize=4)
else:
    paper.no_records(ax, "run `workbench serve ...`")
paper.save_figure(fig, "serving_roofline", recs)

# %%
cols = ["run", "batch", "ttft predicted s", "ttft measured s", "tpot predicted s", "tpot measured s",
        "tokens/s/chip", "fits", "knee batch"]
paper.save_table(table[cols].to_dict("records") if len(table) else [], "serving", recs,
                 caption="Serving per batch: time to first token and per output token, predicted (and measured)",
                 columns=cols)

# %% [markdown]
# What quantized weights and a draft model buy: the quantized run's error against the unquantized weights on
# held-out text beside its throughput, and the speculative decoder's acceptance with its measured and predicted
# speedup over plain decoding.

# %%
trade = []
for _, r in recs.iterrows():
    row = {"run": label(r), "quant": r["spec.quant"], "kv": r["spec.kv_dtype"]}
    best = max((b["batch"] / (b.get("tpot_s") or b.get("predicted_tpot_s")) for b in r["extra.batches"]
                if b.get("tpot_s") or b.get("predicted_tpot_s")), default=None)
    row["best tokens/s"] = best
    if pd.notna(r.get("extra.quality.perplexity")):
        row["perplexity"] = r["extra.quality.perplexity"]
        row["perplexity unquantized"] = r["extra.quality.perplexity_unquantized"]
        row["max abs logit diff"] = r["extra.quality.max_abs_logit_diff"]
    if pd.notna(r.get("extra.speculative.acceptance_rate")):
        row["draft"] = f"{r['extra.speculative.draft']} k={int(r['extra.speculative.draft_tokens'])}"
        row["acceptance"] = r["extra.speculative.acceptance_rate"]
        row["speedup measured"] = r["extra.speculative.measured_speedup"]
        row["speedup predicted"] = r["extra.speculative.predicted_speedup"]
    if len(row) > 4:
        trade.append(row)
cols = ["run", "quant", "kv", "best tokens/s", "perplexity", "perplexity unquantized", "max abs logit diff", "draft",
        "acceptance", "speedup measured", "speedup predicted"]
paper.save_table([{c: t.get(c, np.nan) for c in cols} for t in trade], "serving_tradeoffs", recs,
                 caption="Quantized weights and speculative decoding: error and speedup", columns=cols)
