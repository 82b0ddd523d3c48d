"""One object per partitioning strategy: its rule table, the mesh it gets by default, the meshes a planner may try,
and how many ways it splits the batch. Every caller (predict, plan, run, the MoE layer, the analytic memory model)
asks it instead of repeating `if strategy in (...)` chains.

    s = get_strategy("fsdp+tp")
    s.default_mesh(16, cfg)                 # {'data': 2, 'model': 8}
    s.mesh_candidates(16, cfg, seq=2048)    # [{'data': 8, 'model': 2}, {'data': 4, 'model': 4}, ...]
    s.batch_ways({'data': 2, 'model': 8})   # 2: the product of the mesh axes `batch` maps to
    s.splits_tensors                        # True: heads, kv_heads, mlp and vocab over the `model` axis
    get_strategy("pp+fsdp").pipelined      # True: stacked layers over the `stage` axis (models/pipeline.py)
"""
from __future__ import annotations

import dataclasses
import functools
import math

from partitioning.mesh import CONTEXT_AXIS, STAGE_AXIS, TENSOR_AXIS
from partitioning.rules import STRATEGIES, Rules, get_rules
from workbench.errors import WorkbenchError


def divisors(n: int) -> list[int]:
    """Every d with n % d == 0, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A strategy's rule table and the mesh axes it uses beyond `data`.

    extra_axis: the mesh axis the strategy needs besides data (model for tp/fsdp+tp, seq for sp, expert for ep;
    None for dp/fsdp). The default size on n chips: the largest divisor of n that is <= 8 and divides the attention
    heads, kv heads and d_ff (model); <= 4 (seq); gcd(n, n_experts) (expert).
    The context-parallel strategies (cp, fsdp+cp, fsdp+tp+cp) add the `context` axis to those of the strategy without
    it (dp, fsdp, fsdp+tp): by default the largest divisor of n <= 4; a planner tries 2..MAX_CONTEXT that divide the
    sequence.
    """

    name: str
    rules: Rules
    extra_axis: str | None

    @property
    def splits_tensors(self) -> bool:
        """Whether the strategy shards heads / mlp / vocab over the tensor-parallel mesh axis."""
        return bool(self.rules.mesh_axes_for("mlp"))

    @property
    def pipelined(self) -> bool:
        """Whether the strategy runs the stacked layers as a pipeline over the `stage` mesh axis."""
        return STAGE_AXIS in self.rules.mesh_axes_for("layers")

    @functools.cached_property
    def base(self) -> "Strategy":
        """pp+fsdp -> fsdp, pp+tp -> tp, pp+fsdp+tp -> fsdp+tp, pp -> dp; itself for the others."""
        if not self.pipelined:
            return self
        return get_strategy(self.name.removeprefix("pp").removeprefix("+") or "dp")

    def stage_sizes(self, n: int, cfg) -> list[int]:
        """Pipeline stage counts a planner may try on n chips: divisors of both n and n_layers, 2..8."""
        return [d for d in divisors(math.gcd(n, cfg.n_layers)) if 2 <= d <= 8] if self.pipelined else []

    @property
    def context_parallel(self) -> bool:
        """Whether the strategy splits the sequence over the `context` mesh axis (cp, fsdp+cp, fsdp+tp+cp)."""
        return CONTEXT_AXIS in self.rules.mesh_axes_for("seq")

    @functools.cached_property
    def without_context(self) -> "Strategy":
        """cp -> dp, fsdp+cp -> fsdp, fsdp+tp+cp -> fsdp+tp (the rest of the mesh); itself for the others."""
        if not self.context_parallel:
            return self
        return get_strategy(self.name.removesuffix("cp").removesuffix("+") or "dp")

    def context_sizes(self, n: int, seq: int | None = None) -> list[int]:
        """Context-axis sizes a planner may try on n chips: divisors of n from 2 to MAX_CONTEXT dividing the sequence."""
        if not self.context_parallel:
            return []
        return [d for d in divisors(n) if 2 <= d <= MAX_CONTEXT and (seq is None or seq % d == 0)]

    @property
    def needs_moe(self) -> bool:
        return self.extra_axis == "expert"

    def _check_model(self, cfg) -> None:
        if self.needs_moe and not cfg.is_moe:
            raise WorkbenchError(f"strategy {self.name} needs a mixture-of-experts model; this preset is dense "
                                 "(n_experts=0). Choose mixtral-8x7b or --set n_experts=8")

    def extra_sizes(self, n: int, cfg, seq: int | None = None) -> list[int]:
        """Sizes > 1 the extra axis can take on n chips for this model (ascending)."""
        if self.extra_axis == TENSOR_AXIS:
            return [d for d in divisors(n) if d > 1]
        if self.extra_axis == "seq":
            return [d for d in divisors(n) if d > 1 and (seq is None or seq % d == 0)]
        if self.extra_axis == "expert":
            return [d for d in divisors(math.gcd(n, cfg.n_experts)) if d > 1] if cfg.is_moe else []
        return []

    def default_mesh(self, n: int, cfg) -> dict[str, int]:
        """The mesh this strategy gets on n chips when none is given (see the class docstring)."""
        self._check_model(cfg)
        if self.context_parallel:  # the largest context size <= 4 that divides n, the strategy without it on the rest
            context = max(d for d in divisors(n) if d <= 4)
            return {**self.without_context.default_mesh(n // context, cfg), CONTEXT_AXIS: context}
        if self.pipelined:  # the largest stage count <= 4 that divides n and n_layers, the base strategy on the rest
            stage = max([d for d in divisors(math.gcd(n, cfg.n_layers)) if d <= 4])
            return {STAGE_AXIS: stage, **self.base.default_mesh(n // stage, cfg)}
        if self.extra_axis is None:
            return {"data": n}
        if self.extra_axis == TENSOR_AXIS:
            size = max(d for d in divisors(n) if d <= 8 and cfg.n_heads % d == 0 and cfg.n_kv_heads % d == 0
                       and cfg.d_ff % d == 0)
        elif self.extra_axis == "seq":
            size = max(d for d in divisors(n) if d <= 4)
        else:
            size = math.gcd(n, cfg.n_experts)
        return {"data": n // size, self.extra_axis: size} if size > 1 or self.extra_axis != TENSOR_AXIS else {"data": n}

    def mesh_candidates(self, n: int, cfg, seq: int | None = None) -> list[dict[str, int]]:
        """Every factorization of n chips into data × the extra axis this strategy can use (none for a dense
        model under ep). Pipelined strategies: every stage count of stage_sizes × the base strategy's candidates on
        the rest."""
        if self.pipelined:
            return [{STAGE_AXIS: st, **axes} for st in self.stage_sizes(n, cfg)
                    for axes in self.base.mesh_candidates(n // st, cfg, seq)]
        if self.context_parallel:
            return [{**axes, CONTEXT_AXIS: c} for c in self.context_sizes(n, seq)
                    for axes in self.without_context.mesh_candidates(n // c, cfg, seq)]
        if self.extra_axis is None:
            return [{"data": n}]
        return [{"data": n // e, self.extra_axis: e} for e in self.extra_sizes(n, cfg, seq)]

    def batch_ways(self, axes: dict[str, int]) -> int:
        """How many ways the batch is split: the product of the mesh axes the strategy maps `batch` to."""
        return math.prod(axes.get(a, 1) for a in self.rules.mesh_axes_for("batch"))


MAX_CONTEXT = 8  # the largest context axis a planner tries
_EXTRA = {"dp": None, "fsdp": None, "tp": TENSOR_AXIS, "fsdp+tp": TENSOR_AXIS, "sp": "seq", "ep": "expert",
          "cp": None, "fsdp+cp": None, "fsdp+tp+cp": TENSOR_AXIS,
          "pp": None, "pp+fsdp": None, "pp+tp": TENSOR_AXIS, "pp+fsdp+tp": TENSOR_AXIS}
assert set(_EXTRA) == set(STRATEGIES), "every strategy in partitioning.rules needs its extra mesh axis here"


def get_strategy(name: str | Strategy) -> Strategy:
    """The Strategy for a name (dp, fsdp, tp, fsdp+tp, sp, cp, fsdp+cp, fsdp+tp+cp, ep, pp, pp+fsdp, pp+tp,
    pp+fsdp+tp); an unknown name is a one-line error."""
    if isinstance(name, Strategy):
        return name
    rules = get_rules(name)
    return Strategy(rules.name, rules, _EXTRA[rules.name])
