"""Analytic count of the unoptimized program: jax.experimental.roofline where it works, own jaxpr rules otherwise.

The count is of the global (unpartitioned) program as traced: divide by the device count to compare with a fully
partitioned per-device compiler count; a strategy that repeats work shows a per-device compiler count above it.
"""
from __future__ import annotations

import math

import numpy as np

from workbench.cost.report import AnalyticCount


def _dot_flops(eqn) -> float:
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    k = math.prod(lhs.shape[d] for d in lc)
    out = eqn.outvars[0].aval
    return 2.0 * math.prod(out.shape) * k


def jaxpr_flops(jaxpr) -> tuple[float, float]:
    """(flops, bytes) by own rules: dot_general 2·|out|·K; elementwise |out|; bytes = inputs + outputs of each eqn
    (unfused). Recurses into sub-jaxprs; scan bodies × length; while bodies once (unknown trip count)."""
    flops = 0.0
    nbytes = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        subs = []
        for p in eqn.params.values():
            if hasattr(p, "jaxpr") and hasattr(p, "consts"):
                subs.append(p.jaxpr)
            elif hasattr(p, "eqns"):
                subs.append(p)
            elif isinstance(p, (tuple, list)):
                subs += [q.jaxpr if hasattr(q, "consts") else q for q in p if hasattr(q, "eqns") or hasattr(q, "consts")]
        if subs:
            mult = eqn.params.get("length", 1) if name == "scan" else 1
            for s in subs[:1] if name == "cond" else subs:
                f, b = jaxpr_flops(s)
                flops += f * mult
                nbytes += b * mult
            continue
        if name == "dot_general":
            flops += _dot_flops(eqn)
        else:
            out = eqn.outvars[0].aval if eqn.outvars else None
            if out is not None and hasattr(out, "shape"):
                flops += math.prod(out.shape) if name not in ("broadcast_in_dim", "reshape", "transpose",
                                                              "convert_element_type", "slice", "concatenate") else 0
        for v in list(eqn.invars) + list(eqn.outvars):
            a = getattr(v, "aval", None)
            if a is not None and hasattr(a, "shape") and hasattr(a, "dtype"):
                nbytes += math.prod(a.shape) * np.dtype(a.dtype).itemsize
    return flops, nbytes


def analytic_count(fn, *args, **kwargs) -> AnalyticCount:
    """Count flops and HBM bytes of fn(*args) (abstract args welcome) without compiling."""
    import jax

    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    own_f, own_b = jaxpr_flops(closed.jaxpr)
    try:
        from jax.experimental import roofline

        _, res = roofline.roofline(fn)(*args, **kwargs)
        rf, rb = float(res.flops), float(res.unfused_hbm_bytes)
    except Exception as e:  # rules missing for some primitive, or a tracing corner
        return AnalyticCount(own_f, own_b, "workbench.cost.analytic.jaxpr_dots",
                             f"jax.experimental.roofline failed ({type(e).__name__}: {str(e)[:120]}); own rules used")
    if own_f > 1.5 * rf:
        # jax.experimental.roofline counts a scan body once; own rules multiply by the scan length
        return AnalyticCount(own_f, own_b, "workbench.cost.analytic.jaxpr_dots",
                             f"jax.experimental.roofline counted {rf:.4g} flops (scan bodies once); own rules, which "
                             "scale scan bodies by their length, used")
    return AnalyticCount(rf, rb, "jax.experimental.roofline")
