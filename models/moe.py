"""Mixture-of-experts layer: routing as small pure functions, one Flax NNX block, expert parallelism in shard_map.

The pipeline (each step a function below, testable alone):

    logits_te = x_td @ w_router_de                       # router, always float32 (Switch Transformer, §2.4)
    route      token-choice top-k (softmax | sigmoid scores)  or  expert-choice (each expert takes its top-C tokens)
    permute    capacity:  scatter tokens into a padded (E, C, D) buffer, tokens over capacity are dropped
               dropless:  sort the T·K assignments by expert, group sizes per expert
    experts    capacity:  einsum 'ecd,edf->ecf' through the precision policy
               dropless:  jax.lax.ragged_dot (grouped matmul) on the sorted rows
    unpermute  gather each assignment's output, weight by its combine weight, sum over the k choices

Letters: t tokens (batch·sequence flattened), g token groups, e experts, c capacity slots, d d_model, f d_ff,
k top-k choices.

Conventions (stated once, tested in tests/models/test_moe.py):
- Capacity per expert (per token group) C = min(T, ceil(capacity_factor · T · k / E)); capacity_factor=None is dropless.
- Drop priority (token-choice with capacity): every token's first choice is placed before any token's second choice,
  and within a choice rank earlier tokens (batch-major, then sequence position) win. So a token loses its
  lower-ranked experts first, and late tokens of a busy expert are the ones dropped (GShard / Switch "top-1 first").
- Combine weights: softmax (or sigmoid) score of each chosen expert; with k > 1 they are renormalised over the k
  chosen experts so each token's kept-and-dropped weights sum to 1 (Mixtral, DeepSeek-V3). With k = 1 the raw score
  is kept (Switch), otherwise the router would get no gradient. Dropped assignments contribute zero (the residual
  connection carries the token).
- Load-balancing loss (Switch Transformer eq. 4, generalised to top-k): lb = E · Σ_e f_e · P_e, where f_e is the
  fraction of the T·k routed assignments (before dropping) that chose expert e and P_e the mean router probability of
  e. Uniform router probabilities give exactly 1 whatever the choices; perfect balance gives 1; collapse onto one
  expert gives up to E. For sigmoid scores P uses the scores normalised to sum to 1 per token.
- Router z-loss (ST-MoE eq. 5): z = mean_t (logsumexp_e logits_te)²; zero logits give (ln E)².
- Router entropy: mean over tokens of -Σ_e p_te ln p_te, in nats (ln E at uniform).
- Expert-choice (Zhou et al. 2022): probabilities are a softmax over experts, each expert takes its top-C tokens by
  probability, combine weight = that probability (no renormalisation). A token chosen by no expert is "dropped".
  Expert-choice looks at all tokens of a group at once, so it is not causal within a sequence: fine for the study,
  not for autoregressive decoding.
- Loss-free balancing (DeepSeek-V3, Wang et al. 2024): an optional per-expert bias added to the scores for the top-k
  *selection only*, updated outside the gradient by bias_rate · sign(mean load - load) each training call.
- Router jitter (Switch): multiply the router input by U(1-ε, 1+ε) in training.

Expert parallelism (`ep_forward`): tokens are split over every mesh axis except the tensor axis; experts over the
`expert` axis. Each device routes its own tokens (one token group per device). Two exchanges (`choose_a2a`):
- padded (capacity routing, and dropless on CPU): scatter into a padded (E, C, D) buffer, `all_to_all` over `expert`
  sends expert e's rows to the device holding e, experts run on (E/ep, ep·C, D), a second `all_to_all` brings the
  results back, the device combines. A dropless block uses C = T_local here (nothing can be dropped, at the price of
  padding, visible in the flops and all-to-all bytes).
- ragged (dropless token-choice on TPU/GPU): assignments sorted by expert, `jax.lax.ragged_all_to_all` sends each
  expert exactly its rows (sizes and offsets exchanged first by small all_to_alls), experts run `ragged_dot` on the
  received rows, a second ragged all-to-all returns them. XLA:CPU in jax 0.10.2 does not implement it ("HLO opcode
  ragged-all-to-all is not supported by XLA:CPU ThunkEmitter"), so on CPU the same code is tested through
  `ragged_all_to_all_emulated` (all_gather based), and the real op is checked by compiling for a TPU slice.
A tensor axis, when present, splits d_ff inside each expert and a psum adds the partial outputs.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.analytics import MOE_CHUNK_BYTES, row_chunks
from models.config import A2A_MODES, MLPS, ROUTER_SCORES, ROUTERS
from models.kernels.grouped import choose_impl, grouped_matmul
from models.params import normal, param, zeros
from models.precision import Einsum, ragged_dot_f32
from partitioning.mesh import TENSOR_AXIS
from partitioning.shard import constrain, current, spec_for
from workbench import compat
from workbench.errors import WorkbenchError

EXPERT_AXIS = "expert"
# mesh axes that split d_ff (tensor parallel) rather than tokens; every other mesh axis splits tokens under EP


# ---------------------------------------------------------------------------------------------------------------
# validation and capacity
# ---------------------------------------------------------------------------------------------------------------
def check_routing_args(n_experts: int, top_k: int, capacity_factor: float | None, router: str,
                       score: str = "softmax", expert_axis_size: int = 1) -> None:
    """One-line WorkbenchError for any impossible routing request."""
    if isinstance(n_experts, bool) or not isinstance(n_experts, (int, np.integer)) or n_experts < 1:
        raise WorkbenchError(f"number of experts must be a positive whole number, got {n_experts!r}")
    if router not in ROUTERS:
        raise WorkbenchError(f"unknown router {router!r}; choose one of {', '.join(ROUTERS)}")
    if score not in ROUTER_SCORES:
        raise WorkbenchError(f"unknown router score {score!r}; choose one of {', '.join(ROUTER_SCORES)}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= n_experts:
        raise WorkbenchError(f"top-k must be between 1 and the number of experts ({n_experts}), got {top_k!r}")
    if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and 0 < capacity_factor < math.inf):
        raise WorkbenchError(f"capacity factor must be a finite number > 0 (or omitted for dropless), got {capacity_factor!r}")
    if router == "expert-choice" and capacity_factor is None:
        raise WorkbenchError("expert-choice routing needs a capacity factor (each expert takes C tokens); "
                             "pass one, e.g. 1.0")
    if expert_axis_size < 1 or n_experts % expert_axis_size:
        raise WorkbenchError(f"{n_experts} experts are not divisible by the expert axis of size {expert_axis_size}; "
                             "choose an expert-parallel degree that divides the number of experts")


def expert_capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Slots per expert for a group of `tokens` tokens: min(T, ceil(cf·T·k/E)); dropless (None) gives T."""
    if capacity_factor is None:
        return tokens
    return int(max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / n_experts))))


# ---------------------------------------------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------------------------------------------
class Routing(NamedTuple):
    """Token-choice routing of T tokens. All float32."""

    expert_tk: jax.Array  # (T, K) int32 chosen experts, rank order
    weight_tk: jax.Array  # (T, K) combine weights (before dropping)
    probs_te: jax.Array  # (T, E) router distribution used for the aux loss and entropy (sums to 1 per token)


def router_scores(logits_te: jax.Array, score: str) -> jax.Array:
    """Per-expert scores: softmax over experts, or independent sigmoids."""
    logits_te = logits_te.astype(jnp.float32)
    if score == "softmax":
        return jax.nn.softmax(logits_te, axis=-1)
    if score == "sigmoid":
        return jax.nn.sigmoid(logits_te)
    raise WorkbenchError(f"unknown router score {score!r}; choose one of {', '.join(ROUTER_SCORES)}")


def top_k_route(logits_te: jax.Array, top_k: int, score: str = "softmax", *, renormalize: bool | None = None,
                bias_e: jax.Array | None = None) -> Routing:
    """Token-choice top-k. `bias_e` (loss-free balancing) shifts the selection only, never the combine weights."""
    scores_te = router_scores(logits_te, score)
    select_te = scores_te if bias_e is None else scores_te + jax.lax.stop_gradient(bias_e.astype(jnp.float32))
    _, expert_tk = jax.lax.top_k(select_te, top_k)
    # the chosen scores by a one-hot select (elementwise, exact): the TPU compiler's cost analysis prices the
    # equivalent take_along_axis gather at ~700x its kernels' bytes, which swamped every TPU prediction
    onehot_tke = jax.nn.one_hot(expert_tk, scores_te.shape[-1], dtype=scores_te.dtype)
    weight_tk = jnp.sum(onehot_tke * scores_te[:, None, :], axis=-1)
    if renormalize is None:
        renormalize = top_k > 1
    if renormalize:
        weight_tk = weight_tk / jnp.sum(weight_tk, axis=-1, keepdims=True)
    if score == "softmax":
        probs_te = scores_te
    else:
        probs_te = scores_te / jnp.sum(scores_te, axis=-1, keepdims=True)
    return Routing(expert_tk.astype(jnp.int32), weight_tk, probs_te)


def assign_slots(expert_tk: jax.Array, n_experts: int, capacity: int | None):
    """Position of each assignment in its expert's queue, and whether it fits.

    Priority: choice rank first (all first choices, then all second choices, ...), token order within a rank.
    Returns (position_tk int32, keep_tk bool); with capacity None everything is kept.
    """
    T, K = expert_tk.shape
    order_e = expert_tk.T.reshape(K * T)  # rank-major
    onehot = jax.nn.one_hot(order_e, n_experts, dtype=jnp.int32)  # (K·T, E)
    pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)  # (K·T,)
    position_tk = pos.reshape(K, T).T.astype(jnp.int32)
    keep_tk = jnp.ones_like(position_tk, bool) if capacity is None else position_tk < capacity
    return position_tk, keep_tk


def expert_choice_route(logits_te: jax.Array, capacity: int):
    """Each expert takes its `capacity` highest-probability tokens. Returns (token_ec, gate_ec, probs_te)."""
    probs_te = jax.nn.softmax(logits_te.astype(jnp.float32), axis=-1)
    gate_ec, token_ec = jax.lax.top_k(probs_te.T, capacity)  # ties: lower token index first
    return token_ec.astype(jnp.int32), gate_ec, probs_te


# ---------------------------------------------------------------------------------------------------------------
# losses and statistics (sums first, so shards/groups can be added before the ratios are taken)
# ---------------------------------------------------------------------------------------------------------------
def load_balancing_loss(probs_te: jax.Array, expert_tk: jax.Array, n_experts: int) -> jax.Array:
    """Switch convention: E · Σ_e f_e · P_e (see module docstring); uniform probabilities give exactly 1."""
    T, K = expert_tk.shape
    f_e = jnp.sum(jax.nn.one_hot(expert_tk, n_experts, dtype=jnp.float32), axis=(0, 1)) / (T * K)
    P_e = jnp.mean(probs_te, axis=0)
    return n_experts * jnp.sum(f_e * P_e)


def z_loss(logits_te: jax.Array) -> jax.Array:
    """ST-MoE router z-loss: mean_t logsumexp(logits_t)²."""
    return jnp.mean(jax.nn.logsumexp(logits_te.astype(jnp.float32), axis=-1) ** 2)


def entropy(probs_te: jax.Array) -> jax.Array:
    """Mean over tokens of the router distribution's entropy (nats)."""
    return jnp.mean(-jnp.sum(probs_te * jnp.log(jnp.clip(probs_te, 1e-30)), axis=-1))


STAT_KEYS = ("tokens", "assignments", "dropped", "load_e", "prob_sum_e", "z_sum", "entropy_sum")


def routing_sums(logits_te, probs_te, load_e, assignments, dropped):
    """Additive statistics of one token group (floats), finalised by `finalize_stats` after any psum/sum."""
    f32 = jnp.float32
    return {
        "tokens": jnp.asarray(logits_te.shape[0], f32),
        "assignments": jnp.asarray(assignments, f32),
        "dropped": jnp.asarray(dropped, f32),
        "load_e": load_e.astype(f32),
        "prob_sum_e": jnp.sum(probs_te, axis=0),
        "z_sum": jnp.sum(jax.nn.logsumexp(logits_te.astype(f32), axis=-1) ** 2),
        "entropy_sum": jnp.sum(-jnp.sum(probs_te * jnp.log(jnp.clip(probs_te, 1e-30)), axis=-1)),
    }


def finalize_stats(s: dict, aux_loss_coef: float, z_loss_coef: float) -> dict:
    """Ratios from the additive sums: the aux dict every MoE block returns (float32 scalars)."""
    E = s["load_e"].shape[-1]
    f_e = s["load_e"] / jnp.maximum(s["assignments"], 1.0)
    P_e = s["prob_sum_e"] / jnp.maximum(s["tokens"], 1.0)
    lb = E * jnp.sum(f_e * P_e)
    z = s["z_sum"] / jnp.maximum(s["tokens"], 1.0)
    mean_load = jnp.mean(s["load_e"])
    return {
        "loss": (aux_loss_coef * lb + z_loss_coef * z).astype(jnp.float32),
        "lb_loss": lb.astype(jnp.float32),
        "z_loss": z.astype(jnp.float32),
        "dropped_fraction": (s["dropped"] / jnp.maximum(s["assignments"], 1.0)).astype(jnp.float32),
        "load_max_over_mean": (jnp.max(s["load_e"]) / jnp.maximum(mean_load, 1e-9)).astype(jnp.float32),
        "router_entropy": (s["entropy_sum"] / jnp.maximum(s["tokens"], 1.0)).astype(jnp.float32),
    }


# ---------------------------------------------------------------------------------------------------------------
# permute / unpermute
# ---------------------------------------------------------------------------------------------------------------
def dispatch(x_td, expert_tk, position_tk, keep_tk, n_experts: int, capacity: int):
    """Scatter each kept assignment's token into a zero-padded (E, C, D) buffer (dropped ones go to a dummy row)."""
    T, K = expert_tk.shape
    slot_tk = jnp.where(keep_tk, expert_tk * capacity + position_tk, n_experts * capacity)
    x_tkd = jnp.broadcast_to(x_td[:, None, :], (T, K, x_td.shape[-1]))
    buf = jnp.zeros((n_experts * capacity + 1, x_td.shape[-1]), x_td.dtype)
    buf = buf.at[slot_tk.reshape(-1)].set(x_tkd.reshape(T * K, -1), unique_indices=False)
    return buf[:-1].reshape(n_experts, capacity, -1)


def combine(y_ecd, expert_tk, position_tk, keep_tk, weight_tk):
    """Gather each assignment's expert output, weight it, sum over the k choices: (T, D) in float32."""
    E, C, D = y_ecd.shape
    slot_tk = jnp.where(keep_tk, expert_tk * C + position_tk, E * C)
    flat = jnp.concatenate([y_ecd.reshape(E * C, D), jnp.zeros((1, D), y_ecd.dtype)], axis=0)
    y_tkd = flat[slot_tk].astype(jnp.float32)
    w_tk = jnp.where(keep_tk, weight_tk, 0.0).astype(jnp.float32)
    return jnp.einsum("tkd,tk->td", y_tkd, w_tk)


def sort_by_expert(expert_tk, n_experts: int):
    """Dropless permutation: assignments sorted by expert (stable). Returns (order, token_of_row, group_sizes_e)."""
    T, K = expert_tk.shape
    flat = expert_tk.reshape(T * K)
    order = jnp.argsort(flat, stable=True)  # row r of the sorted layout is assignment order[r]
    group_sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    return order, order // K, group_sizes


def unsort_combine(y_rd, order, weight_tk):
    """Inverse of `sort_by_expert` followed by the weighted sum over k: (T, D) float32."""
    T, K = weight_tk.shape
    y_assign = jnp.zeros_like(y_rd).at[order].set(y_rd).reshape(T, K, -1).astype(jnp.float32)
    return jnp.einsum("tkd,tk->td", y_assign, weight_tk.astype(jnp.float32))


# ---------------------------------------------------------------------------------------------------------------
# expert compute
# ---------------------------------------------------------------------------------------------------------------
def _act(mlp: str, h, g=None):
    if mlp == "gelu":
        return jax.nn.gelu(h)
    return jax.nn.silu(g) * h  # swiglu


def experts_dense(params: dict, x_ecd, mlp: str, dot) -> jax.Array:
    """Expert FFN on a padded buffer (E, C, D) -> (E, C, D) through the policy's einsum `dot`."""
    h = dot("ecd,edf->ecf", x_ecd, params["w_in_edf"])
    if "b_in_ef" in params:
        h = h + params["b_in_ef"][:, None, :].astype(h.dtype)
    g = dot("ecd,edf->ecf", x_ecd, params["w_gate_edf"]) if mlp == "swiglu" else None
    y = dot("ecf,efd->ecd", _act(mlp, h, g), params["w_out_efd"])
    return y


def experts_scan(params: dict, x_ecd, mlp: str, dot, gather=None) -> jax.Array:
    """The padded-buffer expert FFN one expert at a time: a lax.scan over experts whose checkpointed step gathers
    that expert's weights (fsdp: `gather(name, slice)` all-gathers the slice in the compute dtype) and runs up, gate,
    activation and down on its (C, D) rows. Only one expert's (C, F) hidden and (D, F) weights are alive at once,
    forward and backward (the backward recomputes the step); flops are those of `experts_dense`."""
    names = [k for k in ("w_in_edf", "w_gate_edf", "w_out_efd", "b_in_ef") if k in params]
    gather = gather or (lambda k, v: v)

    def step(carry, inp):
        x_cd, ws = inp
        w = {k: gather(k, v) for k, v in ws.items()}
        h = dot("cd,df->cf", x_cd, w["w_in_edf"])
        if "b_in_ef" in w:
            h = h + w["b_in_ef"][None, :].astype(h.dtype)
        g = dot("cd,df->cf", x_cd, w["w_gate_edf"]) if mlp == "swiglu" else None
        return carry, dot("cf,fd->cd", _act(mlp, h, g), w["w_out_efd"])

    _, y_ecd = jax.lax.scan(jax.checkpoint(step), None, (x_ecd, {k: params[k] for k in names}))
    return y_ecd


def experts_ragged_chunked(params: dict, x_rd, group_sizes, expert_r, mlp: str, compute_dtype, impl: str,
                           chunks: int) -> jax.Array:
    """`experts_ragged` over `chunks` equal slices of the sorted rows (a checkpointed lax.scan): each slice's group
    sizes are the groups clipped to it, so the grouped matmul of a slice computes exactly its rows. The (R, F)
    hidden of the whole layer never exists; one slice's does, forward and backward."""
    if chunks <= 1:
        return experts_ragged(params, x_rd, group_sizes, expert_r, mlp, compute_dtype, impl)
    R, D = x_rd.shape
    rc = R // chunks
    ends = jnp.cumsum(group_sizes).astype(jnp.int32)
    starts = ends - group_sizes.astype(jnp.int32)

    def step(carry, inp):
        x_c, lo, e_c = inp
        gs_c = (jnp.clip(ends, lo, lo + rc) - jnp.clip(starts, lo, lo + rc)).astype(jnp.int32)
        return carry, experts_ragged(params, x_c, gs_c, e_c, mlp, compute_dtype, impl)

    los = jnp.arange(chunks, dtype=jnp.int32) * rc
    _, y = jax.lax.scan(jax.checkpoint(step), None, (x_rd.reshape(chunks, rc, D), los, expert_r.reshape(chunks, rc)))
    return y.reshape(R, -1)


def ragged_dot(x_rd, w_edf, group_sizes, compute_dtype):
    """Grouped matmul with the policy's compute dtype and float32 accumulation, forward and backward (the policy has
    no ragged op; models.precision.ragged_dot_f32)."""
    return ragged_dot_f32(x_rd, w_edf, group_sizes, compute_dtype).astype(compute_dtype)


def experts_ragged(params: dict, x_rd, group_sizes, expert_r, mlp: str, compute_dtype, impl: str = "ragged_dot"
                   ) -> jax.Array:
    """Expert FFN on rows sorted by expert (dropless): a grouped matmul (models.kernels.grouped: ragged_dot, the
    megablox gmm on TPU, or the blocked fallback), group_sizes per expert."""
    def gmm(x, w):
        return grouped_matmul(x, w, group_sizes, compute_dtype, impl).astype(compute_dtype)

    h = gmm(x_rd, params["w_in_edf"])
    if "b_in_ef" in params:
        h = h + params["b_in_ef"][expert_r].astype(h.dtype)
    g = gmm(x_rd, params["w_gate_edf"]) if mlp == "swiglu" else None
    return gmm(_act(mlp, h, g), params["w_out_efd"])


# ---------------------------------------------------------------------------------------------------------------
# one token group, local experts
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MoEOptions:
    """The static routing choices (hashable; read from ModelConfig by `options_from_config`)."""

    n_experts: int
    top_k: int
    capacity_factor: float | None = None
    router: str = "token-choice"
    score: str = "softmax"
    mlp: str = "gelu"
    renormalize: bool | None = None  # None: k > 1
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    skip_experts: bool = False  # cost attribution only: experts replaced by the identity (routing + permute remain)
    # expert hidden activations above this many bytes per array are computed in chunks (experts_scan over experts
    # for the padded buffer, experts_ragged_chunked over row slices for dropless): memory at pod scale
    chunk_bytes: int = MOE_CHUNK_BYTES
    gmm: str = "auto"  # dropless grouped matmul: auto | ragged_dot | gmm | blocked (models.kernels.grouped)


def options_from_config(cfg) -> MoEOptions:
    return MoEOptions(
        n_experts=cfg.n_experts, top_k=cfg.top_k, capacity_factor=cfg.capacity_factor,
        router=getattr(cfg, "router", "token-choice"), score=getattr(cfg, "router_score", "softmax"),
        mlp=getattr(cfg, "mlp", "gelu"), renormalize=getattr(cfg, "router_renormalize", None),
        aux_loss_coef=float(getattr(cfg, "aux_loss_coef", 0.0)), z_loss_coef=float(getattr(cfg, "z_loss_coef", 0.0)),
        gmm=getattr(cfg, "moe_gmm", "auto") or "auto",
        chunk_bytes=int(getattr(cfg, "moe_chunk_bytes", MOE_CHUNK_BYTES) or MOE_CHUNK_BYTES))


def platform_of(mesh=None) -> str:
    """The platform the program is compiled for: the concrete mesh's devices (TPU targets compiled from a CPU host),
    else the partitioning context's mesh, else JAX's default device."""
    for m in (mesh, (current() or (None,))[0]):
        if isinstance(m, jax.sharding.Mesh):
            return m.devices.flat[0].platform
    return jax.devices()[0].platform


def route_group(logits_te, opt: MoEOptions, capacity: int | None, bias_e=None):
    """Routing of one token group, no expert compute. Returns a dict of arrays used by the permute steps and the
    additive statistics. Used by the block, the EP path and `workbench moe route`."""
    E = opt.n_experts
    if opt.router == "expert-choice":
        token_ec, gate_ec, probs_te = expert_choice_route(logits_te, capacity)
        T = logits_te.shape[0]
        chosen_t = jnp.zeros((T,), jnp.int32).at[token_ec.reshape(-1)].add(1)
        # an expert-choice "assignment" is a token and dropped = tokens no expert took; every expert takes C tokens,
        # so the load is uniform by construction (scaled so that f_e sums to 1 as for token-choice)
        load_e = jnp.full((E,), T / E, jnp.float32)
        sums = routing_sums(logits_te, probs_te, load_e, T, jnp.sum(chosen_t == 0))
        return {"token_ec": token_ec, "gate_ec": gate_ec}, sums
    r = top_k_route(logits_te, opt.top_k, opt.score, renormalize=opt.renormalize, bias_e=bias_e)
    position_tk, keep_tk = assign_slots(r.expert_tk, E, capacity)
    load_e = jnp.sum(jax.nn.one_hot(r.expert_tk, E, dtype=jnp.float32), axis=(0, 1))
    T, K = r.expert_tk.shape
    sums = routing_sums(logits_te, r.probs_te, load_e, T * K, jnp.sum(~keep_tk))
    return {"expert_tk": r.expert_tk, "weight_tk": r.weight_tk, "position_tk": position_tk, "keep_tk": keep_tk}, sums


def moe_group(params: dict, x_td, logits_te, opt: MoEOptions, dot, compute_dtype, bias_e=None, platform=None):
    """MoE of one token group with all experts local. Returns (y_td float32, sums).
    Tokens are permuted in the policy's compute dtype (what the expert matmuls read anyway)."""
    T = x_td.shape[0]
    E = opt.n_experts
    x_td = x_td.astype(compute_dtype)
    if opt.capacity_factor is None and opt.router == "token-choice":  # dropless: sort + ragged_dot
        route, sums = route_group(logits_te, opt, None, bias_e)
        order, token_r, group_sizes = sort_by_expert(route["expert_tk"], E)
        expert_r = route["expert_tk"].reshape(-1)[order]
        x_rd = x_td[token_r]
        if opt.skip_experts:
            y_rd = x_rd
        else:
            impl = choose_impl(opt.gmm, platform or platform_of())
            n = row_chunks(x_rd.shape[0], opt_ff(params), jnp.dtype(compute_dtype).itemsize, opt.chunk_bytes)
            y_rd = experts_ragged_chunked(params, x_rd, group_sizes, expert_r, opt.mlp, compute_dtype, impl, n)
            y_rd = _add_out_bias(params, y_rd, expert_r)
        return unsort_combine(y_rd, order, route["weight_tk"]), sums
    C = expert_capacity(T, E, opt.top_k, opt.capacity_factor)
    route, sums = route_group(logits_te, opt, C, bias_e)
    if opt.router == "expert-choice":
        x_ecd = x_td[route["token_ec"]]
        y_ecd = _experts_or_identity(params, x_ecd, opt, dot)
        y_td = jnp.zeros((T, x_td.shape[-1]), jnp.float32).at[route["token_ec"].reshape(-1)].add(
            (route["gate_ec"][..., None] * y_ecd.astype(jnp.float32)).reshape(E * C, -1))
        return y_td, sums
    x_ecd = dispatch(x_td, route["expert_tk"], route["position_tk"], route["keep_tk"], E, C)
    y_ecd = _experts_or_identity(params, x_ecd, opt, dot)
    return combine(y_ecd, route["expert_tk"], route["position_tk"], route["keep_tk"], route["weight_tk"]), sums


def opt_ff(params) -> int:
    """d_ff of the (local) experts, from the up projection's shape."""
    return int(params["w_in_edf"].shape[-1])


def _experts_padded(params, x_ecd, opt: MoEOptions, dot, gather=None):
    """The (E, C, D) expert FFN: one einsum over all experts, or `experts_scan` when the (E, C, F) hidden would be
    above opt.chunk_bytes (and the policy's dot is the plain einsum, which a scan may call)."""
    E, C, _ = x_ecd.shape
    big = E * C * opt_ff(params) * jnp.dtype(x_ecd.dtype).itemsize > opt.chunk_bytes
    if big and isinstance(dot, Einsum):
        return experts_scan(params, x_ecd, opt.mlp, dot, gather)
    if gather is not None:
        params = {k: gather(k, v, whole=True) for k, v in params.items()}
    return experts_dense(params, x_ecd, opt.mlp, dot)


def _experts_or_identity(params, x_ecd, opt: MoEOptions, dot):
    if opt.skip_experts:
        return x_ecd
    return _add_out_bias_ecd(params, _experts_padded(params, x_ecd, opt, dot))


def _add_out_bias(params, y_rd, expert_r):
    if "b_out_ed" in params:
        return y_rd + params["b_out_ed"][expert_r].astype(y_rd.dtype)
    return y_rd


def _add_out_bias_ecd(params, y_ecd):
    if "b_out_ed" in params:
        return y_ecd + params["b_out_ed"][:, None, :].astype(y_ecd.dtype)
    return y_ecd


def router_logits(x_td, w_router_de):
    """Router logits in float32 whatever the policy (Switch Transformer's selective precision)."""
    return jnp.einsum("td,de->te", x_td.astype(jnp.float32), w_router_de.astype(jnp.float32))


def moe_local(params: dict, x_td, opt: MoEOptions, dot, compute_dtype, groups: int = 1, bias_e=None,
              jitter_td=None, platform=None):
    """All experts on this device; tokens split into `groups` equal groups with their own capacity (GShard groups;
    the EP path routes one group per device, so `groups` = token shards reproduces it exactly)."""
    T, D = x_td.shape
    if T % groups:
        raise WorkbenchError(f"{T} tokens cannot be split into {groups} equal routing groups")
    xr = x_td if jitter_td is None else x_td * jitter_td
    logits_te = router_logits(xr, params["w_router_de"])
    if groups == 1:
        return moe_group(params, x_td, logits_te, opt, dot, compute_dtype, bias_e, platform)
    x_gtd = x_td.reshape(groups, T // groups, D)
    l_gte = logits_te.reshape(groups, T // groups, -1)
    ys, sums = [], []
    for g in range(groups):  # a Python loop keeps `dot` (an nnx module) out of vmap; groups are few
        y, s = moe_group(params, x_gtd[g], l_gte[g], opt, dot, compute_dtype, bias_e, platform)
        ys.append(y)
        sums.append(s)
    total = jax.tree.map(lambda *a: sum(a), *sums)
    return jnp.concatenate(ys, axis=0), total


# ---------------------------------------------------------------------------------------------------------------
# expert parallelism
# ---------------------------------------------------------------------------------------------------------------
def current_mesh():
    """The mesh in context (jax.set_mesh / nnx), or None."""
    m = compat.get_abstract_mesh()
    if m is None or m.empty:
        return None
    return m


def ep_axes(mesh, expert_axis: str = EXPERT_AXIS):
    """(token axes, tensor axis or None) for the EP layout on `mesh`."""
    names = tuple(mesh.axis_names)
    tensor = TENSOR_AXIS if TENSOR_AXIS in names and mesh.shape[TENSOR_AXIS] > 1 else None
    token_axes = tuple(a for a in names if a != tensor)
    return token_axes, tensor


def choose_a2a(mode: str, opt: MoEOptions, platform: str) -> str:
    """'padded' or 'ragged'/'ragged-emulated' for an EP exchange. The ragged exchange needs dropless token-choice
    (capacity routing fills fixed (E, C) buffers by definition). 'auto': ragged where the backend implements
    ragged-all-to-all (TPU, GPU; on CPU only if this jaxlib compiles it: compat.ragged_all_to_all_supported, which
    XLA:CPU in jax 0.10.2 and 0.12.0.1 does not), padded otherwise."""
    if mode not in A2A_MODES:
        raise WorkbenchError(f"unknown all-to-all mode {mode!r}; choose one of {', '.join(A2A_MODES)}")
    raggable = opt.capacity_factor is None and opt.router == "token-choice"
    if mode == "auto":
        return "ragged" if (raggable and compat.ragged_all_to_all_supported(platform)) else "padded"
    if mode != "padded" and not raggable:
        raise WorkbenchError(f"the {mode} all-to-all needs dropless token-choice routing (capacity_factor=None); "
                             "capacity routing exchanges fixed (E, C) buffers: use a2a='padded'")
    return mode


@dataclasses.dataclass(frozen=True)
class _EPLayout:
    """How ep_forward lays one MoE layer over the mesh: expert-parallel degree and axis, token and tensor axes, the
    per-device token count, the capacity per expert, the exchange mode and the grouped-matmul kernel."""

    ep: int
    ex: str | None  # the expert axis when it splits the experts (ep > 1), else None
    expert_axis: str
    token_axes: tuple
    tensor: str | None
    T_loc: int
    D: int
    E: int
    C: int
    mode: str
    impl: str


def _ep_layout(mesh, x_td, opt: MoEOptions, expert_axis: str, tensor_axis: str | None, a2a: str) -> _EPLayout:
    """The layout of ep_forward (see its docstring); one-line errors for what does not divide."""
    # no expert axis: ep = 1, every device holds all experts and routes its own tokens (no all-to-all)
    has_ep_axis = expert_axis in mesh.axis_names and mesh.shape[expert_axis] > 1
    ep = mesh.shape[expert_axis] if has_ep_axis else 1
    ex = expert_axis if has_ep_axis else None
    E = opt.n_experts
    check_routing_args(E, opt.top_k, opt.capacity_factor, opt.router, opt.score, ep)
    token_axes, tensor = ep_axes(mesh, expert_axis)
    if tensor_axis != "auto":
        tensor = tensor_axis
        token_axes = tuple(a for a in mesh.axis_names if a != tensor)
    n_tok_shards = int(np.prod([mesh.shape[a] for a in token_axes]))
    T, D = x_td.shape
    if T % n_tok_shards:
        raise WorkbenchError(f"{T} tokens are not divisible by the {n_tok_shards} token shards of mesh axes "
                             f"{token_axes}; change the batch size or sequence length")
    T_loc = T // n_tok_shards
    platform = mesh.devices.flat[0].platform if isinstance(mesh, jax.sharding.Mesh) else jax.devices()[0].platform
    mode = choose_a2a(a2a, opt, platform)
    if ep == 1 and opt.capacity_factor is None and opt.router == "token-choice":
        mode = "ragged"  # no exchange at all: sort + ragged_dot on the device's own rows
    # one routing group per device; dropless (None) gives C = T_loc: nothing can be dropped, padding pays for it
    C = expert_capacity(T_loc, E, opt.top_k, opt.capacity_factor)
    return _EPLayout(ep, ex, expert_axis, token_axes, tensor, T_loc, D, E, C, mode, choose_impl(opt.gmm, platform))


def _gather_param(k, v, gathers: dict, compute_dtype, whole: bool = True):
    """FSDP: a parameter (whole, or one expert's slice) gathered over the non-expert, non-tensor axes it is
    sharded on, in the dtype its consumer reads (router: float32; experts: the compute dtype)."""
    v = v.astype(jnp.float32 if k == "w_router_de" else compute_dtype)
    for dim, axes in gathers[k]:
        v = jax.lax.all_gather(v, axes, axis=dim if whole else dim - 1, tiled=True)
    return v


def _padded_exchange(p, x_loc, logits, bias, lay: _EPLayout, opt: MoEOptions, dot, gather_one):
    """The capacity path on one device: route into (E, C) slots, all-to-all to the experts' devices, the experts,
    all-to-all back, combine. Returns (y_td float32, this device's routing sums)."""
    E, C, ep, expert_axis, tensor = lay.E, lay.C, lay.ep, lay.expert_axis, lay.tensor
    route, sums = route_group(logits, opt, C, bias)
    if opt.router == "expert-choice":
        x_ecd = x_loc[route["token_ec"]]
    else:
        x_ecd = dispatch(x_loc, route["expert_tk"], route["position_tk"], route["keep_tk"], E, C)
    # (E, C, D) -> (E_loc, ep·C, D): rows for expert e go to the device holding e
    x_recv = x_ecd if ep == 1 else jax.lax.all_to_all(x_ecd, expert_axis, split_axis=0, concat_axis=1, tiled=True)
    if opt.skip_experts:
        y_recv = x_recv
    else:
        pl = {k: v for k, v in p.items() if k != "b_out_ed"}
        y_recv = _experts_padded(pl, x_recv, opt, dot, lambda k, v, whole=False: gather_one(k, v, whole))
        if tensor is not None:
            y_recv = jax.lax.psum(y_recv, tensor)
        if "b_out_ed" in p:
            y_recv = y_recv + p["b_out_ed"][:, None, :].astype(y_recv.dtype)
    y_ecd = y_recv if ep == 1 else jax.lax.all_to_all(y_recv, expert_axis, split_axis=1, concat_axis=0, tiled=True)
    if opt.router == "expert-choice":
        y = jnp.zeros((lay.T_loc, lay.D), jnp.float32).at[route["token_ec"].reshape(-1)].add(
            (route["gate_ec"][..., None] * y_ecd.astype(jnp.float32)).reshape(E * C, lay.D))
    else:
        y = combine(y_ecd, route["expert_tk"], route["position_tk"], route["keep_tk"], route["weight_tk"])
    return y, sums


def _ep_local(p, x_loc, bias, jit_loc, *, lay: _EPLayout, opt: MoEOptions, dot, compute_dtype, gathers: dict):
    """One device's share of ep_forward inside the shard_map: its tokens routed, exchanged and combined."""
    gather_one = lambda k, v, whole=True: _gather_param(k, v, gathers, compute_dtype, whole)
    lazy = {k: v for k, v in p.items() if k in ("w_in_edf", "w_gate_edf", "w_out_efd", "b_in_ef")}
    p = {k: (v if k in lazy else gather_one(k, v)) for k, v in p.items()}
    p_full = lambda: {**p, **{k: gather_one(k, v) for k, v in lazy.items()}}
    logits = router_logits(x_loc if jit_loc is None else x_loc * jit_loc, p["w_router_de"])
    x_loc = x_loc.astype(compute_dtype)  # what crosses the all-to-all: the compute dtype, not the residual's
    if lay.mode != "padded":
        route, sums = route_group(logits, opt, None, bias)
        y = _ragged_exchange(p_full(), x_loc, route, opt, lay.ep, lay.expert_axis, lay.tensor, lay.mode,
                             compute_dtype, lay.impl)
        return y, jax.tree.map(lambda a: jax.lax.psum(a, lay.token_axes), sums)
    y, sums = _padded_exchange(p, x_loc, logits, bias, lay, opt, dot, gather_one)
    sums = jax.tree.map(lambda a: jax.lax.psum(a, lay.token_axes), sums)
    return y, sums


def ep_forward(params: dict, x_td, opt: MoEOptions, dot, compute_dtype, mesh=None, expert_axis: str = EXPERT_AXIS,
               bias_e=None, tensor_axis: str | None = "auto", a2a: str = "auto", jitter_td=None, weight_specs=None,
               check_vma: bool | None = None):
    """Expert-parallel MoE: see the module docstring. Returns (y_td float32, global sums).

    Tokens are split over every mesh axis but `tensor_axis` ("auto": the tensor-parallel axis `model` when present with size > 1;
    None: no tensor parallelism inside the experts). `a2a`: see `choose_a2a`.

    `weight_specs` (name -> PartitionSpec, from the strategy's rules: `weight_specs_for`): the parameters enter the
    shard_map as the strategy stores them, and each device all-gathers, in the compute dtype, the dimensions sharded
    over axes other than the expert and tensor axes (fsdp's `embed` over `data`); the gather's transpose is a
    reduce-scatter, so the gradients leave sharded like the parameters (ZeRO-3), not as full per-device copies.
    None: experts over the expert axis, d_ff over the tensor axis, the rest replicated at the boundary.

    `check_vma` (jax.shard_map's varying-manual-axes check): None = on, except around the megablox kernel, whose
    pallas_call declares its output without manual axes (JAX refuses it under the check)."""
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        raise WorkbenchError("the sharded MoE path needs a mesh in context (use --strategy ep or pass mesh=)")
    lay = _ep_layout(mesh, x_td, opt, expert_axis, tensor_axis, a2a)
    ex, tensor = lay.ex, lay.tensor
    tok_spec = P(lay.token_axes, None)
    w_specs = {
        "w_router_de": P(None, None),
        "w_in_edf": P(ex, None, tensor), "w_gate_edf": P(ex, None, tensor),
        "w_out_efd": P(ex, tensor, None),
        "b_in_ef": P(ex, tensor), "b_out_ed": P(ex, None),
    }
    if weight_specs is not None:
        w_specs = {**w_specs, **weight_specs}
    p_specs = {k: w_specs[k] for k in params}
    gathers = {k: _gather_dims(p_specs[k], (ex, tensor)) for k in params}

    def local(p, x_loc, bias, jit_loc):
        return _ep_local(p, x_loc, bias, jit_loc, lay=lay, opt=opt, dot=dot, compute_dtype=compute_dtype,
                         gathers=gathers)

    bias = jnp.zeros((lay.E,), jnp.float32) if bias_e is None else bias_e
    sums_spec = {k: P() for k in STAT_KEYS}
    if check_vma is None:
        check_vma = not (lay.impl == "gmm" and lay.mode != "padded")
    if jitter_td is None:
        fn = compat.shard_map(lambda p, x, b: local(p, x, b, None), mesh=mesh, in_specs=(p_specs, tok_spec, P()),
                              out_specs=(tok_spec, sums_spec), check_vma=check_vma)
        return fn(params, x_td, bias)
    fn = compat.shard_map(local, mesh=mesh, in_specs=(p_specs, tok_spec, P(), tok_spec), out_specs=(tok_spec, sums_spec),
                          check_vma=check_vma)
    return fn(params, x_td, bias, jitter_td)


def _gather_dims(spec, keep) -> list[tuple[int, tuple[str, ...]]]:
    """(dimension, mesh axes) of a PartitionSpec sharded over axes outside `keep` (the expert and tensor axes)."""
    out = []
    for dim, names in enumerate(spec):
        if names is None:
            continue
        names = names if isinstance(names, tuple) else (names,)
        extra = tuple(a for a in names if a not in keep)
        if extra:
            if len(extra) != len(names):
                raise WorkbenchError(f"parameter dimension {dim} is sharded over {names}: mixing the expert/tensor "
                                     "axes with other axes in one dimension is not supported by the MoE layer")
            out.append((dim, extra if len(extra) > 1 else extra[0]))
    return out


# logical axes of the block's parameters (models/params.param metadata; the strategies' rules shard them)
PARAM_AXES = {"w_router_de": ("embed", None), "w_in_edf": ("experts", "embed", "mlp"),
              "w_gate_edf": ("experts", "embed", "mlp"), "w_out_efd": ("experts", "mlp", "embed"),
              "b_in_ef": ("experts", "mlp"), "b_out_ed": ("experts", "embed")}


def weight_specs_for(params: dict, mesh, rules) -> dict:
    """The PartitionSpec each MoE parameter has under a rule table (what the shard_map receives)."""
    return {k: spec_for(PARAM_AXES[k], v.shape, mesh, rules, what=f"MoE parameter {k}") for k, v in params.items()}


def _excl_cumsum(a, axis=-1):
    return jnp.cumsum(a, axis=axis) - a


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """jax.lax.ragged_all_to_all's documented semantics built from all_gather (for backends without the op, e.g.
    XLA:CPU, so the ragged EP path can be tested there). Moves ep× the bytes of the real op: a test device only."""
    ep = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    n = input_offsets.shape[0]
    spd = n // ep
    ops = jax.lax.all_gather(operand, axis_name)  # (ep, N, ...)
    in_off = jax.lax.all_gather(input_offsets, axis_name)  # (ep, n) per source
    sizes = jax.lax.all_gather(send_sizes, axis_name)
    out_off = jax.lax.all_gather(output_offsets, axis_name)
    rows = jnp.arange(output.shape[0])
    result = output
    for src in range(ep):
        for j in range(spd):
            # slice (me·spd + j) of source `src` is the one addressed to me
            i = me * spd + j
            start, size, o = out_off[src, i], sizes[src, i], in_off[src, i]
            hit = (rows >= start) & (rows < start + size)
            idx = jnp.clip(o + rows - start, 0, operand.shape[0] - 1)
            vals = ops[src][idx]
            result = jnp.where(hit.reshape((-1,) + (1,) * (operand.ndim - 1)), vals, result)
    del recv_sizes  # implied by the senders' sizes; kept in the signature to match the real op
    return result


def _local_experts(p, x_rows, group_sizes, expert_r, opt, compute_dtype, tensor, impl="ragged_dot"):
    """Rows grouped by (local) expert through the experts (dropless, ragged_dot); partial sums over the tensor axis
    reduced; the output bias added. With opt.skip_experts the rows pass through (flop attribution)."""
    if opt.skip_experts:
        return x_rows
    pl = {k: v for k, v in p.items() if k != "b_out_ed"}
    n = row_chunks(x_rows.shape[0], opt_ff(pl), jnp.dtype(compute_dtype).itemsize, opt.chunk_bytes)
    y = experts_ragged_chunked(pl, x_rows, group_sizes, expert_r, opt.mlp, compute_dtype, impl, n)
    if tensor is not None:
        y = jax.lax.psum(y, tensor)
    return _add_out_bias(p, y, expert_r)


def _ragged_exchange(p, x_loc, route, opt: MoEOptions, ep: int, axis: str, tensor, mode: str, compute_dtype,
                     impl: str = "ragged_dot"):
    """Dropless EP with ragged all-to-all: send each expert exactly its rows, compute with ragged_dot, send back.

    Sender: assignments sorted by global expert; slice e (rows for expert e) goes to device e // E_loc.
    Receiver layout: rows grouped by local expert, then by source device, so ragged_dot runs on them directly.
    Buffer on the receiver: ep · T_loc · min(k, E_loc) rows (the most that can arrive), of which only the
    received ones are computed on backends with a grouped matmul.
    """
    E = opt.n_experts
    E_loc = E // ep
    T_loc, D = x_loc.shape
    K = opt.top_k
    rag = jax.lax.ragged_all_to_all if mode == "ragged" else ragged_all_to_all_emulated
    order, token_r, group_sizes = sort_by_expert(route["expert_tk"], E)
    x_sorted = x_loc[token_r]  # (T_loc·K, D), rows sorted by global expert
    if ep == 1:  # all experts here: no exchange
        expert_r = route["expert_tk"].reshape(-1)[order]
        y_sorted = _local_experts(p, x_sorted, group_sizes, expert_r, opt, compute_dtype, tensor, impl)
        return unsort_combine(y_sorted, order, route["weight_tk"])
    in_off = _excl_cumsum(group_sizes).astype(jnp.int32)  # (E,) slice e starts here
    # per source s and local expert l: how many rows arrive  (ep·E_loc,) indexed s·E_loc + l
    recv_sizes = jax.lax.all_to_all(group_sizes, axis, 0, 0, tiled=True).astype(jnp.int32)
    recv_se = recv_sizes.reshape(ep, E_loc)
    gs_local = jnp.sum(recv_se, axis=0).astype(jnp.int32)  # rows per local expert
    # receiver offsets: local expert major, source minor
    recv_off_se = (_excl_cumsum(gs_local)[None, :] + _excl_cumsum(recv_se, axis=0)).astype(jnp.int32)
    recv_off = recv_off_se.reshape(ep * E_loc)
    out_off = jax.lax.all_to_all(recv_off, axis, 0, 0, tiled=True).astype(jnp.int32)  # where my slices land
    M = ep * T_loc * min(K, E_loc)
    buf = jnp.zeros((M, D), x_sorted.dtype)
    x_recv = rag(x_sorted, buf, in_off, group_sizes, out_off, recv_sizes, axis_name=axis)
    # local expert of each received row (rows past the last group are padding: computed as zeros, never sent back)
    expert_r = jnp.clip(jnp.searchsorted(jnp.cumsum(gs_local), jnp.arange(M), side="right"), 0, E_loc - 1)
    y_recv = _local_experts(p, x_recv, gs_local, expert_r, opt, compute_dtype, tensor, impl)
    # back: slice s·E_loc + l returns to source s, landing where that source's slice for expert (me·E_loc + l) began
    back_off = jax.lax.all_to_all(in_off, axis, 0, 0, tiled=True).astype(jnp.int32)
    y_sorted = rag(y_recv.astype(x_sorted.dtype), jnp.zeros_like(x_sorted), recv_off, recv_sizes, back_off,
                   group_sizes.astype(jnp.int32), axis_name=axis)
    return unsort_combine(y_sorted, order, route["weight_tk"])


# ---------------------------------------------------------------------------------------------------------------
# the Flax NNX block
# ---------------------------------------------------------------------------------------------------------------
class ExpertBias(nnx.Variable):
    """Loss-free balancing bias (not a parameter: updated by a rule, not by the optimizer)."""


class MoEBlock(nnx.Module):
    """Mixture-of-experts FFN. `__call__(x_btd) -> (y_btd, aux)`; aux holds float32 scalars:
    loss (aux_loss_coef·lb_loss + z_loss_coef·z_loss, add it to the training loss), lb_loss, z_loss,
    dropped_fraction, load_max_over_mean, router_entropy.

    Expert parallelism (see `_use_ep`): under strategy 'ep' rules with an `expert` mesh axis of size > 1, or, with
    no rules in context, when the mesh in context (or `mesh=`) has one; `expert_parallel=False` forces the local
    path. Optional config fields (getattr, default off): router_jitter (ε), router_bias_rate (loss-free balancing
    step), router_renormalize, moe_groups, moe_a2a.
    """

    def __init__(self, cfg, policy, *, rngs: nnx.Rngs, mesh=None, expert_parallel: bool | None = None):
        self.opt = options_from_config(cfg)
        check_routing_args(self.opt.n_experts, self.opt.top_k, self.opt.capacity_factor, self.opt.router,
                           self.opt.score)
        if self.opt.mlp not in MLPS:
            raise WorkbenchError(f"unknown mlp {self.opt.mlp!r}; choose one of {', '.join(MLPS)}")
        E, D, F = cfg.n_experts, cfg.d_model, cfg.d_ff
        self.compute_dtype = policy.compute_dtype
        pd = policy.param_dtype
        # the same initialisation as the dense MLP in models/layers.py, so MoE and dense start alike
        std, out_std = 0.02, 0.02 / math.sqrt(2 * getattr(cfg, "n_layers", 1))
        ax = PARAM_AXES
        self.w_router_de = param(rngs, normal(std), (D, E), ax["w_router_de"], pd)
        self.w_in_edf = param(rngs, normal(std), (E, D, F), ax["w_in_edf"], pd)
        if self.opt.mlp == "swiglu":
            self.w_gate_edf = param(rngs, normal(std), (E, D, F), ax["w_gate_edf"], pd)
        self.w_out_efd = param(rngs, normal(out_std), (E, F, D), ax["w_out_efd"], pd)
        if getattr(cfg, "bias", False):
            self.b_in_ef = param(rngs, zeros, (E, F), ax["b_in_ef"], pd)
            self.b_out_ed = param(rngs, zeros, (E, D), ax["b_out_ed"], pd)
        # shared experts (DeepSeekMoE): one dense SwiGLU/GELU MLP of n_shared·d_ff every token passes through
        self.n_shared = int(getattr(cfg, "n_shared_experts", 0) or 0)
        if self.n_shared:
            fs = F * self.n_shared
            self.w_sh_in_df = param(rngs, normal(std), (D, fs), ("embed", "mlp"), pd)
            if self.opt.mlp == "swiglu":
                self.w_sh_gate_df = param(rngs, normal(std), (D, fs), ("embed", "mlp"), pd)
            self.w_sh_out_fd = param(rngs, normal(out_std), (fs, D), ("mlp", "embed"), pd)
        self.dot = policy.einsum_module(rngs=rngs)
        self.jitter = float(getattr(cfg, "router_jitter", 0.0) or 0.0)
        self.bias_rate = float(getattr(cfg, "router_bias_rate", 0.0) or 0.0)
        if self.bias_rate:
            self.expert_bias = ExpertBias(jnp.zeros((E,), jnp.float32))
        self.rngs = nnx.data(rngs if self.jitter else None)  # jitter noise stream ('dropout')
        self.groups = int(getattr(cfg, "moe_groups", 1) or 1)
        self.a2a = getattr(cfg, "moe_a2a", "auto") or "auto"
        self.mesh = mesh
        self.expert_parallel = expert_parallel
        self.deterministic = False  # training by default; set True (e.g. via nnx.Module.eval()) for evaluation

    def param_dict(self) -> dict:
        names = ("w_router_de", "w_in_edf", "w_gate_edf", "w_out_efd", "b_in_ef", "b_out_ed")
        return {n: getattr(self, n)[...] for n in names if hasattr(self, n)}

    def _use_ep(self):
        """(mesh, tensor axis) for expert parallelism, or None for the local path.

        Under partitioning.shard.activation_sharding(mesh, rules) EP is on when the rules map the logical 'experts'
        axis onto a mesh axis of size > 1 (strategy 'ep'); the rules' 'mlp' axis, if any, is the tensor axis.
        Without rules: EP when the mesh in context has an 'expert' axis of size > 1.
        """
        if self.expert_parallel is False:
            return None
        ctx = current()
        mesh, tensor = self.mesh, None
        if ctx is not None:
            mesh = mesh if mesh is not None else ctx[0]
            rules = ctx[1]
            on = EXPERT_AXIS in rules.mesh_axes_for("experts")
            tensor = next((a for a in rules.mesh_axes_for("mlp") if a in mesh.axis_names and mesh.shape[a] > 1), None)
            token_devices = mesh.size // (mesh.shape[tensor] if tensor else 1)
            if not (on and EXPERT_AXIS in mesh.axis_names and mesh.shape[EXPERT_AXIS] > 1) and token_devices > 1:
                # tokens sharded but experts not: route per device in shard_map (ep = 1). Left to XLA's
                # propagation, the global-capacity dispatch is replicated: every device computes every expert row.
                return mesh, tensor
        else:
            mesh = mesh if mesh is not None else current_mesh()
            on = True
            tensor = None if mesh is None else ep_axes(mesh)[1]
        if on and mesh is not None and EXPERT_AXIS in mesh.axis_names and mesh.shape[EXPERT_AXIS] > 1:
            return mesh, tensor
        if self.expert_parallel:
            raise WorkbenchError("expert_parallel=True needs a mesh with an 'expert' axis of size > 1 in context "
                                 "(strategy 'ep')")
        return None

    def __call__(self, x_btd):
        B, S, D = x_btd.shape
        x_td = x_btd.reshape(B * S, D)
        params = self.param_dict()
        bias_e = self.expert_bias[...] if self.bias_rate else None
        jitter_td = None
        if self.jitter and not self.deterministic:
            jitter_td = jax.random.uniform(self.rngs.dropout(), (B * S, D), jnp.float32,
                                           1.0 - self.jitter, 1.0 + self.jitter)
        ep = self._use_ep()
        if ep is not None:
            ctx = current()
            wspecs = weight_specs_for(params, ep[0], ctx[1]) if ctx is not None else None
            y_td, sums = ep_forward(params, x_td, self.opt, self.dot, self.compute_dtype, mesh=ep[0], bias_e=bias_e,
                                    tensor_axis=ep[1], a2a=self.a2a, jitter_td=jitter_td, weight_specs=wspecs)
        else:
            y_td, sums = moe_local(params, x_td, self.opt, self.dot, self.compute_dtype, self.groups, bias_e,
                                   jitter_td, platform=platform_of(self.mesh))
        if self.bias_rate and not self.deterministic:
            load_e = sums["load_e"]
            self.expert_bias[...] = bias_e + self.bias_rate * jnp.sign(jnp.mean(load_e) - load_e)
        aux = finalize_stats(sums, self.opt.aux_loss_coef, self.opt.z_loss_coef)
        y_btd = y_td.astype(self.compute_dtype).reshape(B, S, D)
        if self.n_shared:
            y_btd = y_btd + self.shared(x_btd).astype(self.compute_dtype)
        return y_btd, aux

    def shared(self, x_btd):
        """The shared experts: a dense MLP on every token (sharded by the strategy like models.layers.MLP)."""
        h = self.dot("btd,df->btf", x_btd, self.w_sh_in_df[...])
        g = self.dot("btd,df->btf", x_btd, self.w_sh_gate_df[...]) if self.opt.mlp == "swiglu" else None
        a = constrain(_act(self.opt.mlp, h, g), ("batch", "seq", "mlp"), "shared-expert hidden")
        return self.dot("btf,fd->btd", a, self.w_sh_out_fd[...])
