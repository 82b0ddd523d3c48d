# %% [markdown]
# # Mixture of experts: what routing costs against the experts' own work
# Records of kind `moe_layer` (`workbench moe layer ...`) and `moe_study` (`python -m benchmarks.moe_study`).

# %%
from workbench.results import paper
from workbench.results.store import Store

lay = Store().query(kind="moe_layer")

# %%
fig, ax = paper.figure("single")
if len(lay):
    lab = lay["spec.strategy"] + " " + lay["spec.mesh"]
    ax.barh(lab, lay["extra.flops_experts_useful_per_device"], label="useful expert flops")
    ax.barh(lab, lay["extra.flops_routing_dispatch_per_device"], left=lay["extra.flops_experts_per_device"],
            label="routing + dispatch")
    ax.set_xlabel("FLOP per device")
    ax.legend(fontsize=5)
else:
    paper.no_records(ax, "run `workbench --devices 8 moe layer --mesh data=2,expert=4`")
paper.save_figure(fig, "moe_layer", lay)

# %%
rows = [{"strategy": r["spec.strategy"], "mesh": r["spec.mesh"], "experts": r["spec.experts"], "top-k": r["spec.top_k"],
         "capacity": r["spec.capacity_factor"], "expert flop efficiency": r.get("extra.expert_flops_efficiency"),
         "all-to-all bytes": r.get("extra.all_to_all_bytes_per_device"), "dropped": r.get("extra.dropped_fraction")}
        for _, r in lay.iterrows()]
paper.save_table(rows, "moe_layer", lay, caption="One MoE layer per device: useful expert work, exchange, drops")
