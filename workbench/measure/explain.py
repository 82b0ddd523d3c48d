"""An explained step: the time of one training step from ideal to measured, one term per cause, each predicted and
measured side by side (`workbench run ... --explain`, JSON key `waterfall`).

Terms, in order (seconds per step; on a simulated mesh all devices' work on this host):
    model flops at peak          model flops / the MFU ceiling (the same figure in both columns: a definition)
    compiler's extra flops       (the HLO's dot flops × executions − model flops) / ceiling: remat, replication
                                 (tensor-parallel duplicates), padding; negative when the compiler does fewer
    dots at their efficiency     the dot kernels' time (dots and fusions containing dots) minus the two terms above:
                                 the matmuls' distance from the ceiling
    memory-bound kernels         elementwise/reduce and copy/transpose kernels
    collectives not hidden       collectives, charged only when no other kernel runs (workbench.measure.kernels)
    dispatch/loop/host work      while-loop condition kernels, per-call overhead, and the traced wall time with no
                                 kernel running (dispatch, argument handling, Python, host-side data)
    unexplained remainder        measured: the timed step minus every measured term above (the difference between
                                 the timed steps and the traced ones); predicted: 0 (the model has no such term)
Measured terms come from a jax.profiler trace of extra steps joined kernel by kernel with the HLO
(workbench.measure.kernels.KernelTable); they add up to the timed step by construction of the remainder, which says how
far the trace is from the timer. Predicted terms are the same kernels priced at their own roofs.

MFU is reported in two conventions: 'full' (attention counted over the whole sequence: 6N + 12·L·H·d·s per token,
the headline `mfu` of `workbench run`) and 'causal' (the attention term halved: what a causal mask needs).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from workbench.measure.kernels import KernelTable, kernel_table
from workbench.roofline.prediction import memory_bw

TERMS = ("model flops at peak", "compiler's extra flops", "dots at their measured efficiency", "memory-bound kernels",
         "collectives not hidden", "dispatch/loop/host work", "unexplained remainder")


@dataclasses.dataclass(frozen=True, slots=True)
class WaterfallTerm:
    name: str
    predicted_s: float
    measured_s: float

    def to_record(self) -> dict[str, Any]:
        return {"name": self.name, "predicted_s": self.predicted_s, "measured_s": self.measured_s}


@dataclasses.dataclass(frozen=True, slots=True)
class Waterfall:
    terms: tuple[WaterfallTerm, ...]
    step_s: float  # the timed (median) step
    traced_step_s: float  # the median traced step
    predicted_s: float  # sum of the predicted terms
    model_flops: float  # per step, full attention
    model_flops_causal: float  # per step, causal-halved attention
    ceiling_flops: float
    mfu: float | None  # full convention
    mfu_causal: float | None
    notes: tuple[str, ...] = ()

    @property
    def measured_sum_s(self) -> float:
        return sum(t.measured_s for t in self.terms)

    def to_record(self) -> dict[str, Any]:
        return {"terms": [t.to_record() for t in self.terms], "step_s": self.step_s,
                "traced_step_s": self.traced_step_s, "predicted_s": self.predicted_s,
                "measured_sum_s": self.measured_sum_s, "model_flops": self.model_flops,
                "model_flops_causal": self.model_flops_causal, "ceiling_flops": self.ceiling_flops,
                "mfu": {"full": self.mfu, "causal": self.mfu_causal,
                        "headline": "full (attention over the whole sequence; `mfu` of the run)"},
                "notes": list(self.notes)}


def waterfall(table: KernelTable, *, step_s: float, model_flops: float, model_flops_causal: float,
              ceiling_flops: float, call_overhead_s: float = 0.0) -> Waterfall:
    """The explained step from a per-kernel join (workbench.measure.kernels.join) of the same program and its timed step."""
    rows = table.rows
    hlo_dot_flops = sum(r.dot_flops for r in rows)
    ideal = model_flops / ceiling_flops if ceiling_flops else 0.0
    extra = (hlo_dot_flops - model_flops) / ceiling_flops if ceiling_flops else 0.0

    def pm(classes):
        sel = [r for r in rows if r.kernel_class in classes]
        return sum(r.predicted_s for r in sel), sum(r.measured_s or 0.0 for r in sel)

    dots_p, dots_m = pm(("dot", "dot-fusion"))
    mem_p, mem_m = pm(("elementwise/reduce", "copy/transpose"))
    coll_p, coll_m = pm(("collective",))
    loop_p, loop_m = pm(("loop-control",))
    disp_p = loop_p + call_overhead_s
    disp_m = loop_m + table.idle_s
    terms = [WaterfallTerm(TERMS[0], ideal, ideal), WaterfallTerm(TERMS[1], extra, extra),
             WaterfallTerm(TERMS[2], dots_p - ideal - extra, dots_m - ideal - extra),
             WaterfallTerm(TERMS[3], mem_p, mem_m), WaterfallTerm(TERMS[4], coll_p, coll_m),
             WaterfallTerm(TERMS[5], disp_p, disp_m)]
    accounted = sum(t.measured_s for t in terms)
    terms.append(WaterfallTerm(TERMS[6], 0.0, step_s - accounted))
    notes = [f"measured terms from {table.steps} traced steps (median {table.wall_s:.4g}s) against the timed step "
             f"{step_s:.4g}s; the remainder is their difference"]
    if dots_m < ideal + extra:
        notes.append("the dot kernels measured faster than their flops at the ceiling: a dot that runs "
                     "asynchronously shows only its dispatch in the trace, or the calibrated ceiling is low")
    if hlo_dot_flops == 0:
        notes.append("no dot flops read from the HLO: the extra-flops term is the negative of the model term")
    pred = sum(t.predicted_s for t in terms)
    mfu = model_flops / step_s / ceiling_flops if (step_s and ceiling_flops) else None
    mfu_c = model_flops_causal / step_s / ceiling_flops if (step_s and ceiling_flops) else None
    return Waterfall(tuple(terms), step_s, table.wall_s, pred, model_flops, model_flops_causal, ceiling_flops, mfu,
                     mfu_c, tuple(notes) + table.notes)



def explain_step(step, hlo_text: str, cost, spec, *, dtype, step_s: float, model_flops: float,
                 model_flops_causal: float, ceiling_flops: float, mesh=None, steps: int = 2
                 ) -> tuple[Waterfall, KernelTable]:
    """Trace `steps` more runs of step(i) (workbench.measure.kernels.kernel_table, kernels priced at the bandwidth the
    program's Prediction uses) and explain the timed step `step_s` (see the module docstring)."""
    simulated = spec.kind == "cpu" and cost.n_devices > 1
    bw, _ = memory_bw(cost, spec, simulated)
    table = kernel_table(hlo_text, step, spec, n_devices=cost.n_devices, mesh=mesh, dtype=dtype, steps=steps,
                         memory_bw=bw, program_bytes=cost.peak_memory_bytes)
    return waterfall(table, step_s=step_s, model_flops=model_flops, model_flops_causal=model_flops_causal,
                     ceiling_flops=ceiling_flops, call_overhead_s=spec.measured.call_overhead_s or 0.0), table
