"""Three flop counts of one compiled program, reconciled per device (`workbench predict`, key `flop_counts`).


    analytic   the model convention (models/analytics.py: 6·N_matmul + 12·L·heads·head_dim·seq per token for
               training) for the step's tokens, divided by the chips — what MFU is measured against
    compiler   XLA's cost_analysis of the compiled program. On libtpu it counts a while body ONCE (scanned layers,
               microbatch loops): a 4-layer scan reports about a quarter of its flops. XLA:GPU gives none (-1):
               recorded as None (CostReport.cost_analysis_unavailable), not 0
    hlo        every kernel of the optimized HLO (workbench.cost.hlo.parse_kernels) × the runs of its computation: loop
               bodies × their trip counts (libtpu's HLO carries no known_trip_count: read from the loop condition),
               called computations × their callers, dots written as convolutions counted by the window taps that
               meet real input (libtpu routes batch and head dimensions through windows, padding and lhs dilation)

`expected` = analytic × the recompute the remat policy implies (per-layer: the layers' forward runs again, but for
the MLP down projection; a named policy: also not the projections it keeps; dots: only non-matmul work is
recomputed, ≈ 1) —
the factor the record can explain. `used` is the count
the prediction prices: the HLO kernel sum when the optimized HLO was read (it is per kernel, loop-aware, and what the
kernel-level roofline sums), the compiler's count otherwise. Each count's ratio to `expected` is in the record; a
count more than 25 % away from it gets a note naming the likely cause.
"""
from __future__ import annotations

import dataclasses

from models.analytics import analytics
from models.remat import parse_remat

# Rematerialization recomputes each layer's forward in the backward pass (Chowdhery et al. 2022, PaLM, appendix B:
# the forward is 2 of the 6 FLOPs per parameter per token), except what the backward does not need and what the
# policy keeps (models/remat.py): the layer's last matmul (the MLP down projection feeds only the next layer's input,
# which is the saved checkpoint) is never recomputed; a kept (saved or offloaded) q/k/v, out or MLP input projection
# is not either. The attention matmuls are recomputed under every policy that keeps tensors by name (the backward
# needs the softmax, which no policy keeps), but for the value mix when the attention output (`context`) is kept.
# Measured on libtpu's HLO of an unrolled 6-layer program: the recomputed dots match this count exactly
# (docs/accuracy-tpu.md). `dots` keeps every matmul output: ≈ 1.


@dataclasses.dataclass(frozen=True)
class FlopCounts:
    analytic: float        # per device, the model convention
    compiler: float | None  # per device, cost_analysis; None where XLA gives none (XLA:GPU)
    hlo: float             # per device, HLO kernels × runs
    expected: float        # analytic × the remat recompute factor
    remat_factor: float
    used: float
    used_source: str       # 'hlo' | 'compiler'
    notes: tuple[str, ...] = ()

    def ratio(self, x: float | None) -> float | None:
        return x / self.expected if (self.expected and x is not None) else None

    def to_record(self) -> dict:
        return {"analytic_per_device": self.analytic, "compiler_per_device": self.compiler,
                "hlo_per_device": self.hlo, "expected_per_device": self.expected, "remat_factor": self.remat_factor,
                "used_per_device": self.used, "used_source": self.used_source,
                "compiler_over_expected": self.ratio(self.compiler), "hlo_over_expected": self.ratio(self.hlo),
                "used_over_analytic": self.used / self.analytic if self.analytic else None,
                "notes": list(self.notes)}


def layer_forward_flops(cfg, seq: int) -> dict[str, float]:
    """Forward matmul FLOPs per token of one layer, by part (dense layers; MoE: the active experts)."""
    d, n, k, h, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    experts = cfg.top_k if cfg.is_moe else 1
    up = (2 if cfg.mlp == "swiglu" else 1) * 2 * d * f * experts
    return {"qkv": 2 * d * (n + 2 * k) * h, "attention": 4 * n * h * seq, "out": 2 * n * h * d, "mlp_up": up,
            "mlp_down": 2 * f * d * experts, "router": 2 * d * cfg.n_experts if cfg.is_moe else 0}


def remat_factor(cfg, mode: str, seq: int) -> float:
    """Step flops / model flops the remat policy implies: 1 + recomputed forward flops / train flops."""
    policy = parse_remat(cfg.remat)
    if mode != "train" or policy.kind in ("none", "dots"):
        return 1.0
    a = analytics(cfg, seq)
    part = layer_forward_flops(cfg, seq)
    kept = policy.kept
    n, k = cfg.n_heads, cfg.n_kv_heads
    qkv_unkept = (n * ("query_proj" not in kept) + k * ("key_proj" not in kept) + k * ("value_proj" not in kept)) \
        / (n + 2 * k)
    up_kept = ("mlpwi" in kept) if cfg.mlp == "gelu" else \
        (("mlpwi_0" in kept) + ("mlpwi_1" in kept)) / 2
    dense_up = 0.0 if cfg.is_moe else part["mlp_up"] * (1 - up_kept)  # MoE experts: untagged, recomputed
    recompute = (part["qkv"] * qkv_unkept + part["attention"] * (0.5 if "context" in kept else 1.0)
                 + part["out"] * ("out_proj" not in kept) + (part["mlp_up"] if cfg.is_moe else dense_up)
                 + part["router"])
    return 1.0 + cfg.n_layers * recompute / a["train_flops_per_token"]


def reconcile(cost, model_flops_step: float, n_chips: int, cfg, mode: str, seq: int,
              used: float | None = None) -> FlopCounts:
    """The three counts of `cost` (a CostReport) against the model's flops for the step (see the module docstring).
    used: the count the prediction priced (workbench.roofline.prediction.Prediction.flops); None: the rule above."""
    analytic = model_flops_step / n_chips if n_chips else 0.0
    f = remat_factor(cfg, mode, seq)
    expected = analytic * f
    compiler = None if "flops" in cost.cost_analysis_unavailable else float(cost.flops)
    hlo = float(cost.hlo_flops)
    notes = []
    if used is None:
        used = hlo if (cost.kernels and hlo > 0) else (compiler or 0.0)
    src = "hlo" if (hlo and abs(used - hlo) <= 1e-9 * max(hlo, 1.0)) else "compiler"
    if expected:
        if compiler and abs(compiler / expected - 1) > 0.25:
            why = (" (the program has loops: cost_analysis counts a loop body once)"
                   if cost.has_loops and compiler < expected else "")
            notes.append(f"compiler's cost_analysis is {compiler / expected:.2f}× the expected count{why}")
        if hlo and abs(hlo / expected - 1) > 0.25:
            notes.append(f"HLO kernel sum is {hlo / expected:.2f}× the expected count (replicated work across the "
                         "mesh, or a kernel form the reader does not know)")
    return FlopCounts(analytic, compiler, hlo, expected, f, used, src, tuple(notes))
