"""Console and report view of an explained step (`workbench run --explain`): the waterfall table, its chart under
reports/run-<record>/waterfall.png, MFU in both attention conventions."""
from __future__ import annotations

import os

from workbench.results.console import print_table
from workbench.results.figures import waterfall_chart


def attach_waterfall(summary: dict, r: dict, record_id: str, *, print_it: bool) -> None:
    """Put the waterfall into the run's summary (key `waterfall`: the list of terms), draw its chart, print it."""
    w = r["waterfall"]
    out_dir = os.path.join("reports", f"run-{record_id}")
    chart = waterfall_chart(w["terms"], os.path.join(out_dir, "waterfall.png"),
                            title=f"{summary.get('preset')} {r['strategy']} {r['mesh']}: the step from ideal to "
                                  f"measured")
    summary["waterfall"] = w["terms"]
    summary["waterfall_detail"] = {k: v for k, v in w.items() if k != "terms"} | {"chart": chart}
    summary["mfu_causal"] = w["mfu"]["causal"]
    summary["kernel_classes"] = r["kernel_classes"]["classes"]
    if print_it:
        print_table(w["terms"], ["name", "predicted_s", "measured_s"],
                    title=f"the step explained (measured terms sum to {w['measured_sum_s']:.4g}s; timed step "
                          f"{w['step_s']:.4g}s)")
        m = w["mfu"]
        print(f"MFU {m['full'] or 0:.1%} (full attention, the headline) / {m['causal'] or 0:.1%} (causal-halved "
              f"attention); chart: {chart}")
