"""Pipeline parallelism: the transformer's stacked layers cut into stages over the `stage` mesh axis.

The model is not rewritten: `Transformer(cfg)` with scan_layers=True keeps its blocks as one vmapped `Block` whose
parameters are stacked on a leading layer axis (logical name 'layers', which the pp rule tables map to `stage`).
`forward(model, tokens, pipe, mesh)` runs the model's own `embed`, then the stacked blocks as a pipeline, then the
model's own `head`; the per-layer function is the model's `block_call()` (same remat policy as the plain forward).

Schedules (one loop, `PipelineSpec`):
  gpipe     repeats=1. Stage s holds layers [s·L/p, (s+1)·L/p). Microbatch i is on stage s at tick i + s; m + p − 1
            ticks. Bubble (p − 1)/(m + p − 1).
  circular  repeats=v > 1 (interleaved / virtual stages, MaxText's circular pipeline). The layers are cut into v·p
            chunks; chunk c lives on stage c mod p, so each device holds v non-adjacent chunks. Microbatches go round
            the ring v times in groups of p: microbatch i = g·p + j runs chunk r·p + s on stage s at tick
            g·v·p + r·p + j + s (no two on one stage at one tick). v·m + p − 1 ticks, bubble (p − 1)/(v·m + p − 1);
            needs m % p == 0.
  1f1b      repeats=1, `pipelined_loss` / `one_f_one_b`. The layers as gpipe; the head and the loss run per microbatch
            on the last stage inside the loop, and each microbatch's backward starts as soon as it leaves the last
            stage: m + 2p − 2 ticks of one forward slot and one backward slot, idle slots skipped (lax.cond), so the
            step is (m + p − 1)(F + B), GPipe's bubble. A stage stashes at most min(m, 2p − 1) stage inputs and
            recomputes its stage in the backward. A jax.custom_vjp: the train step's jax.value_and_grad is unchanged.
For gpipe and circular the backward pass is jax.grad of the forward loop: the reverse schedule with reverse permutes.
It holds every microbatch's saved activations until the backward starts (GPipe's memory profile).

Mechanics: `shard_map` manual over `stage` only (data/model stay automatic, so pp composes with fsdp and tp); each tick
every stage applies its current chunk to the activation it holds, then `lax.ppermute` shifts the activations one
stage on (stage p−1 wraps to stage 0, which the circular schedule uses). Under gpipe and circular every stage
computes every tick, so the bubble is visible in the compiled program as work on ticks whose result is discarded:
per-device flops of the pipelined layers are (v·m + p − 1)/(v·m) of the useful ones. 1f1b branches around idle
slots instead (its bubble is idle time, not discarded work).

Parameter layout: stacked layers are stored stage-major (`stage_order`): the v chunks of stage s are contiguous, so
the 'layers' axis sharded over `stage` puts exactly a stage's chunks on its device and no parameter moves in the step.
For gpipe that order is the model's own; for circular it is a fixed permutation applied once at init
(`to_stage_order`; `from_stage_order` undoes it, e.g. to compare gradients with an unpipelined run).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.analytics import attention_params, mlp_params
from partitioning.shard import activation_sharding, constrain, current
from workbench import compat
from workbench.errors import WorkbenchError

STAGE_AXIS = "stage"
SCHEDULES = ("gpipe", "1f1b", "circular")


def check_schedule_name(name: str) -> str:
    """A schedule name as given on the command line: one line for a bad one."""
    if name not in SCHEDULES:
        raise WorkbenchError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)} (circular is "
                             "gpipe with --pipeline-repeats > 1)")
    return name


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """p stages, m microbatches, v repeats (virtual stages per device), the schedule.

    schedule: 'gpipe' (the default; with repeats > 1 it is the circular schedule and reads 'circular'), '1f1b'
    (repeats 1), or 'circular' (repeats > 1)."""

    stages: int
    microbatches: int
    repeats: int = 1
    schedule: str = "gpipe"

    def __post_init__(self):
        if self.schedule == "gpipe" and isinstance(self.repeats, int) and self.repeats > 1:
            object.__setattr__(self, "schedule", "circular")  # GPipe over v virtual stages per device

    @property
    def ticks(self) -> int:
        """Ticks of the compiled loop: v·m + p − 1 forward ticks (gpipe, circular; the backward is their transpose);
        m + 2p − 2 ticks of one F slot and one B slot each (1f1b)."""
        if self.schedule == "1f1b":
            return self.microbatches + 2 * self.stages - 2
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def step_ticks(self) -> int:
        """The step in units of one chunk's forward + backward on one microbatch: v·m + p − 1 for every schedule
        (1f1b: (p − 1) ticks of F alone, m of F + B, p − 1 of B alone, since an idle slot does no work)."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """(p − 1)/(v·m + p − 1): the share of the step a stage spends on no useful work (1f1b: v = 1)."""
        return (self.stages - 1) / self.step_ticks

    @property
    def work_ratio(self) -> float:
        """Layer work a device computes / the useful: (v·m + p − 1)/(v·m) for gpipe and circular (every stage computes
        every tick); 1 for 1f1b (idle slots are skipped; its backward's recompute of the stage forward not counted)."""
        if self.schedule == "1f1b":
            return 1.0
        return self.ticks / (self.repeats * self.microbatches)

    @property
    def held_microbatches(self) -> int:
        """Microbatches whose activations stage 0 holds at once for the backward: all m (gpipe, circular: every
        tick's saved layer activations until the backward starts); min(m, 2p − 1) stage inputs (1f1b's stash)."""
        if self.schedule == "1f1b":
            return min(self.microbatches, 2 * self.stages - 1)
        return self.microbatches

    def check(self, n_layers: int, batch_size: int | None = None) -> None:
        p, m, v = self.stages, self.microbatches, self.repeats
        for name, x in (("stages", p), ("microbatches", m), ("pipeline repeats", v)):
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise WorkbenchError(f"pipeline {name} must be a positive whole number, got {x!r}")
        check_schedule_name(self.schedule)
        if self.schedule == "1f1b" and v > 1:
            raise WorkbenchError(f"1F1B with --pipeline-repeats {v} (interleaved 1F1B) is not implemented; use "
                                 "--pipeline-repeats 1, or --pipeline-schedule gpipe for the circular schedule")
        if self.schedule == "circular" and v == 1:
            raise WorkbenchError("the circular schedule needs --pipeline-repeats > 1 (with 1 it is gpipe)")
        if n_layers % (p * v):
            what = f"stage={p}" + (f" × pipeline repeats {v}" if v > 1 else "")
            raise WorkbenchError(f"mesh {what} does not divide the model's n_layers={n_layers}; use a stage size "
                                 f"(× repeats) that divides {n_layers}")
        if m < p:
            raise WorkbenchError(f"--microbatches {m} is fewer than the {p} pipeline stages; use --microbatches >= {p}")
        if v > 1 and m % p:
            raise WorkbenchError(f"the circular schedule (pipeline repeats {v}) needs --microbatches a multiple of "
                                 f"the {p} stages, got {m}")
        if batch_size is not None and batch_size % m:
            raise WorkbenchError(f"batch size {batch_size} must be a multiple of --microbatches {m}")

    def to_record(self) -> dict:
        formula = ("(p - 1) / (m + p - 1)  (1F1B: GPipe's bubble; the backward recomputes each stage's forward from "
                   "its stashed input)" if self.schedule == "1f1b" else
                   "(p - 1) / (v*m + p - 1)  (GPipe: v = 1; circular: v repeats per device)")
        return {"schedule": self.schedule, "stages": self.stages, "microbatches": self.microbatches,
                "repeats": self.repeats, "ticks": self.ticks, "step_ticks": self.step_ticks,
                "bubble_fraction": self.bubble_fraction, "work_ratio": self.work_ratio,
                "held_microbatches": self.held_microbatches,
                "held_what": ("stage inputs, stashed: the backward recomputes the stage" if self.schedule == "1f1b"
                              else "every tick's saved layer activations, until the backward starts"),
                "bubble_formula": formula}


def stage_order(n_layers: int, stages: int, repeats: int = 1) -> np.ndarray:
    """perm with stored[i] = layer perm[i]: stage-major (stage s: its chunks r = 0..v-1, each Lc layers in order)."""
    lc = n_layers // (stages * repeats)
    return np.array([(r * stages + s) * lc + k for s in range(stages) for r in range(repeats) for k in range(lc)])


def _permute_layers(tree, perm: np.ndarray):
    """Every leaf's leading (layer) axis reordered by perm; the tree itself when perm is the identity."""
    if (perm == np.arange(perm.size)).all():
        return tree
    return jax.tree.map(lambda a: a[perm], tree)


def to_stage_order(tree, pipe: PipelineSpec, n_layers: int):
    """Permute the leading (layer) axis of every leaf of a stacked-blocks tree into stage order."""
    return _permute_layers(tree, stage_order(n_layers, pipe.stages, pipe.repeats))


def from_stage_order(tree, pipe: PipelineSpec, n_layers: int):
    """The inverse of to_stage_order: back to the model's layer order."""
    return _permute_layers(tree, np.argsort(stage_order(n_layers, pipe.stages, pipe.repeats)))


def _spmd_stages(mesh) -> int:
    return int(dict(mesh.shape).get(STAGE_AXIS, 1))


def carry_dtype(mesh, residual_dtype):
    """The dtype activations travel between stages in: the residual stream's, except float32 on XLA:CPU (which
    also compiles the GPU targets), whose AllReducePromotion pass aborts on the bf16 program ("Invalid binary
    instruction opcode copy", jaxlib 0.12). bf16 -> float32 is exact: the numerics are the model's either way."""
    platform = mesh.devices.flat[0].platform if hasattr(mesh, "devices") else "cpu"
    return jnp.dtype(jnp.float32) if platform == "cpu" else jnp.dtype(residual_dtype)


def _apply_chunk(layer_fn, chunk_state, x, pos, residual_dtype, cd):
    """One stage's chunk of layers (a lax.scan over the chunk's stacked layer states) on one microbatch; each layer's
    output rounded to residual_dtype as in the model's own layer loop; the result in the carry dtype cd."""
    def one(x, layer_state):
        y, _ = layer_fn(layer_state, x, pos)
        return y.astype(residual_dtype), None

    return jax.lax.scan(one, x.astype(residual_dtype), chunk_state)[0].astype(cd)


def run_layers(layer_fn, stacked, x_mbtd, pos_bt, pipe: PipelineSpec, mesh, residual_dtype):
    """The pipelined layers: stacked block state (L, ...) in stage order, microbatched input (m, mb, t, d) ->
    output (m, mb, t, d). layer_fn(layer_state, x, positions) -> (x, aux); each layer's output is rounded to
    residual_dtype as in the model's own layer loop."""
    p, m, v = pipe.stages, pipe.microbatches, pipe.repeats
    if _spmd_stages(mesh) != p:
        raise WorkbenchError(f"pipeline of {p} stages on a mesh whose stage axis is {_spmd_stages(mesh)}; make them "
                             "equal")
    n_layers = jax.tree.leaves(stacked)[0].shape[0]
    lc = n_layers // (p * v)
    # (L, ...) -> (p, v, Lc, ...): stage-major storage makes this a local reshape of the stage-sharded axis
    staged = jax.tree.map(lambda a: a.reshape((p, v, lc) + a.shape[1:]), stacked)
    ctx = current()
    rules = ctx[1] if ctx is not None else None
    cd = carry_dtype(mesh, residual_dtype)

    def body(params, x_mb, pos):
        params = jax.tree.map(lambda a: a[0], params)  # this stage's (v, Lc, ...)
        s = jax.lax.axis_index(STAGE_AXIS)

        def chunk(r, x):
            if v == 1:
                cp = jax.tree.map(lambda a: a[0], params)
            else:
                cp = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False), params)
            return _apply_chunk(layer_fn, cp, x, pos, residual_dtype, cd)

        def tick(carry, t):
            buf, outs = carry
            u = t - s
            valid = (u >= 0) & (u < v * m)
            uc = jnp.clip(u, 0, v * m - 1)
            g, r, j = uc // (v * p), (uc // p) % v, uc % p
            i = g * p + j  # the microbatch this stage works on at this tick
            fresh = jax.lax.dynamic_index_in_dim(x_mb, i, 0, keepdims=False)
            inp = jnp.where((s == 0) & (r == 0), fresh, buf)
            y = chunk(r, inp)
            done = valid & (s == p - 1) & (r == v - 1)
            prev = jax.lax.dynamic_index_in_dim(outs, i, 0, keepdims=False)
            outs = jax.lax.dynamic_update_index_in_dim(outs, jnp.where(done, y, prev), i, 0)
            buf = jax.lax.ppermute(y, STAGE_AXIS, perm=[(k, (k + 1) % p) for k in range(p)])
            return (buf, outs), None

        vary = lambda a: jax.lax.pcast(a, STAGE_AXIS, to="varying")
        carry = (vary(jnp.zeros(x_mb.shape[1:], cd)), vary(jnp.zeros(x_mb.shape, cd)))
        # the block's own activation constraints, on the mesh as seen inside shard_map
        with (activation_sharding(compat.get_abstract_mesh(), rules) if rules is not None
              else contextlib.nullcontext()):
            (_, outs), _ = jax.lax.scan(tick, carry, jnp.arange(pipe.step_ticks))  # v·m + p − 1; also 1f1b's forward-only
        return outs[None]

    fn = compat.shard_map(body, mesh=mesh, in_specs=(P(STAGE_AXIS), P(), P()), out_specs=P(STAGE_AXIS),
                          axis_names=frozenset({STAGE_AXIS}))
    return fn(staged, x_mbtd.astype(cd), pos_bt)[p - 1].astype(residual_dtype)


def forward(model, tokens_bt, pipe: PipelineSpec, mesh):
    """The model's logits with its blocks run as a pipeline (embed and head as the model has them). -> (logits, {})."""
    cfg = model.cfg
    if not cfg.scan_layers:
        raise WorkbenchError("pipeline parallelism needs stacked layers: --set scan_layers=true")
    if cfg.is_moe:
        raise WorkbenchError("pipeline parallelism is not implemented for mixture-of-experts models; use ep")
    b, t = tokens_bt.shape
    m = pipe.microbatches
    if b % m:
        raise WorkbenchError(f"batch {b} is not a multiple of --microbatches {m}")
    mb = b // m
    positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    rd = model.residual_dtype
    x_btd = model.embed(tokens_bt, positions_bt).astype(rd)
    x_mbtd = constrain(x_btd.reshape(m, mb, t, x_btd.shape[-1]), (None, "batch", "seq", "embed"),
                       "microbatched embedding")
    gd, stacked = nnx.split(model.blocks)
    call = model.block_call()
    layer_fn = lambda st, x, pos: call(nnx.merge(gd, st), x, pos)
    y_mbtd = run_layers(layer_fn, stacked, x_mbtd, positions_bt[:mb], pipe, mesh, rd)
    y_btd = constrain(y_mbtd.reshape(b, t, -1), ("batch", "seq", "embed"), "pipeline output")
    return model.head(y_btd), {}


def _vary(a):
    return jax.lax.pcast(a, STAGE_AXIS, to="varying")


@dataclasses.dataclass(frozen=True, eq=False)
class _Schedule1F1B:
    """One stage's part of one_f_one_b's schedule, run inside the shard_map over `stage` (`body`).

    The schedule (lockstep SPMD over the `stage` axis; p stages, m microbatches, ticks t = 0 .. m + 2p − 3):
      F  stage s runs microbatch f = t − s (when 0 ≤ f < m): input x_mb[f] on stage 0, else what stage s − 1 sent
         last tick; the input is stashed in slot f mod K (K = min(m, 2p − 1)); the last stage also runs the head and
         the loss of f and takes dy = d(loss_f / m)/dy (jax.vjp), accumulating the head's gradients.
      B  stage s runs microbatch b = t − (2p − 2 − s) (when 0 ≤ b < m): cotangent dy (last stage, the same tick,
         after F) or what stage s + 1 sent last tick; it recomputes the stage from the stash
         (jax.vjp(chunk, stage params, stash[b mod K])), accumulates the stage's parameter gradients and sends dx
         back; stage 0 keeps dx as the cotangent of x_mb[b].
      then one ppermute s → s + 1 of y and one s → s − 1 of dx (outside any branch).
    F and B sit in lax.cond on per-device predicates, so a stage with no microbatch in a slot does no work there:
    the step is (m + p − 1)(F + B) ticks' worth of time, GPipe's bubble (p − 1)/(m + p − 1).

    The stash bound (no overwrite before the read): stage s writes microbatch f at tick f + s and reads it at tick
    f + 2p − 2 − s; the next write to slot f mod K is microbatch f + K at tick f + K + s. Within a tick F (the write)
    comes before B (the read), so the read must be at an earlier tick than that write: f + 2p − 2 − s < f + K + s,
    i.e. K > 2(p − 1 − s), which K = 2p − 1 satisfies on every stage (the tightest is stage 0); when m < 2p − 1,
    K = m slots hold every microbatch and no slot is written twice. Stage s holds at most 2(p − 1 − s) + 1
    microbatches' stage inputs at once, independent of m (Megatron's non-lockstep 1F1B holds p − s: there a hop
    costs one F or one B, here every hop costs a whole F + B tick; docs/pipeline.md).
    """

    layer_fn: Any
    head_loss: Any
    p: int
    m: int
    k_slots: int
    ticks: int
    rules: Any  # the activation rules in context when the schedule was built (None: none)
    cd: Any  # the carry dtype
    residual_dtype: Any

    def forward(self, t, s, last, params, head_state, chunk, x_mb, tg_mb, recv_f, stash, g_head, loss):
        """F of tick t on stage s (and the head's loss and dy on the last stage) -> (y, dy, stash, g_head, loss)."""
        m, k_slots, cd, residual_dtype = self.m, self.k_slots, self.cd, self.residual_dtype
        f = t - s
        do_f = (f >= 0) & (f < m)
        fc = jnp.clip(f, 0, m - 1)
        x_in = jnp.where(s == 0, jax.lax.dynamic_index_in_dim(x_mb, fc, 0, keepdims=False), recv_f)
        slot = fc % k_slots
        kept = jax.lax.dynamic_index_in_dim(stash, slot, 0, keepdims=False)
        stash = jax.lax.dynamic_update_index_in_dim(stash, jnp.where(do_f, x_in, kept), slot, 0)
        # each cond is written (idle, skip, work): the work is branch 0, the one a counter that follows a single
        # branch (workbench.cost.analytic) counts, as the HLO counter counts every branch each tick
        y = jax.lax.cond(~do_f, lambda x: jnp.zeros_like(x), lambda x: chunk(params, x), x_in)

        def head_step(ops):
            y, g_head, loss = ops
            tg = jax.lax.dynamic_index_in_dim(tg_mb, fc, 0, keepdims=False)
            l_f, vjp = jax.vjp(lambda hs, yy: self.head_loss(hs, yy.astype(residual_dtype), tg) / m, head_state, y)
            dhs, dy = vjp(jnp.ones_like(l_f))
            return dy.astype(cd), jax.tree.map(jnp.add, g_head, dhs), loss + l_f.astype(jnp.float32)

        dy, g_head, loss = jax.lax.cond(~(do_f & last), lambda ops: (jnp.zeros_like(ops[0]),) + ops[1:],
                                        head_step, (y, g_head, loss))
        return y, dy, stash, g_head, loss

    def backward(self, t, s, last, params, chunk, dy, recv_b, stash, g_par, dx_mb):
        """B of tick t on stage s -> (g_par, dx, dx_mb)."""
        p, m = self.p, self.m
        b = t - (2 * p - 2 - s)
        do_b = (b >= 0) & (b < m)
        bc = jnp.clip(b, 0, m - 1)
        cot = jnp.where(last, dy, recv_b)
        x_saved = jax.lax.dynamic_index_in_dim(stash, bc % self.k_slots, 0, keepdims=False)

        def back(ops):
            g_par, x_saved, cot = ops
            _, vjp = jax.vjp(chunk, params, x_saved)
            dp, dx = vjp(cot)
            return jax.tree.map(jnp.add, g_par, dp), dx.astype(self.cd)

        g_par, dx = jax.lax.cond(~do_b, lambda ops: (ops[0], jnp.zeros_like(ops[1])), back, (g_par, x_saved, cot))
        prev = jax.lax.dynamic_index_in_dim(dx_mb, bc, 0, keepdims=False)
        dx_mb = jax.lax.dynamic_update_index_in_dim(dx_mb, jnp.where(do_b & (s == 0), dx, prev), bc, 0)
        return g_par, dx, dx_mb

    def body(self, stage_ids, params, head_state, x_mb, tg_mb, pos):
        """One stage: every tick's F and B, then the loss, the stage's gradients, the head's and x's."""
        p, cd = self.p, self.cd
        fwd_perm = [(k, k + 1) for k in range(p - 1)]
        bwd_perm = [(k + 1, k) for k in range(p - 1)]
        params = jax.tree.map(lambda a: a[0], params)  # this stage's (Lc, ...)
        # this stage's index, from a stage-sharded iota: as axis_index, without the analytic counter's (jax's
        # roofline) warning that it has no rule for axis_index
        s = stage_ids[0]
        last = s == p - 1
        # varying before any vjp: the transpose of an implicit invariant -> varying cast is a psum over `stage`,
        # which must not sit inside a branch that only some stages take
        head_state = jax.tree.map(_vary, head_state)
        chunk = lambda cp, x: _apply_chunk(self.layer_fn, cp, x, pos, self.residual_dtype, cd)
        zeros_x = jnp.zeros(x_mb.shape[1:], cd)

        def tick(carry, t):
            recv_f, recv_b, stash, g_par, g_head, loss, dx_mb = carry
            y, dy, stash, g_head, loss = self.forward(t, s, last, params, head_state, chunk, x_mb, tg_mb, recv_f,
                                                      stash, g_head, loss)
            g_par, dx, dx_mb = self.backward(t, s, last, params, chunk, dy, recv_b, stash, g_par, dx_mb)
            # ---- the two permutes, outside the branches
            recv_f = jax.lax.ppermute(y, STAGE_AXIS, perm=fwd_perm)
            recv_b = jax.lax.ppermute(dx, STAGE_AXIS, perm=bwd_perm)
            return (recv_f, recv_b, stash, g_par, g_head, loss, dx_mb), None

        zeros = lambda tree: jax.tree.map(lambda a: _vary(jnp.zeros(a.shape, a.dtype)), tree)
        carry = (_vary(zeros_x), _vary(zeros_x), _vary(jnp.zeros((self.k_slots,) + x_mb.shape[1:], cd)),
                 zeros(params), zeros(head_state), _vary(jnp.zeros((), jnp.float32)), _vary(jnp.zeros(x_mb.shape, cd)))
        with (activation_sharding(compat.get_abstract_mesh(), self.rules) if self.rules is not None
              else contextlib.nullcontext()):
            (_, _, _, g_par, g_head, loss, dx_mb), _ = jax.lax.scan(tick, carry, jnp.arange(self.ticks))
        psum = lambda a: jax.lax.psum(a, STAGE_AXIS)  # the loss and head grads live on the last stage, dx on stage 0
        return psum(loss), jax.tree.map(lambda a: a[None], g_par), jax.tree.map(psum, g_head), psum(dx_mb)


def one_f_one_b(layer_fn, head_loss, pipe: PipelineSpec, mesh, residual_dtype):
    """The pipelined part's loss under the 1F1B schedule, as a function with its own backward pass:

        loss = f(stacked, head_state, x_mbtd, targets_mbt, pos_bt)

    stacked: the block states (L, ...) in stage order; head_state: what `head_loss(head_state, y_btd, targets_bt)`
    differentiates (the final norm and the unembedding); x_mbtd: the microbatched embedding (m, mb, t, d);
    targets_mbt (m, mb, t); pos_bt (mb, t). loss = the mean over microbatches of head_loss (equal-size microbatches:
    the mean over all tokens of the global batch when head_loss is each microbatch's mean cross-entropy).

    f is a jax.custom_vjp: its forward rule runs the whole schedule, forward and backward interleaved, and returns
    the gradients w.r.t. stacked, head_state and x_mbtd as residuals; its backward rule scales them by the incoming
    cotangent. So jax.value_and_grad around f (and around the embedding before it) works unchanged.

    The schedule, its cost (GPipe's bubble) and the bound on the stash it keeps: _Schedule1F1B.
    """
    p, m = pipe.stages, pipe.microbatches
    if pipe.repeats != 1:
        raise WorkbenchError(f"1F1B with pipeline repeats {pipe.repeats} (interleaved 1F1B) is not implemented; use "
                             "--pipeline-repeats 1 or --pipeline-schedule gpipe for the circular schedule")
    if _spmd_stages(mesh) != p:
        raise WorkbenchError(f"pipeline of {p} stages on a mesh whose stage axis is {_spmd_stages(mesh)}; make them "
                             "equal")
    ctx = current()
    cd = carry_dtype(mesh, residual_dtype)
    sched = _Schedule1F1B(layer_fn, head_loss, p, m, pipe.held_microbatches, pipe.ticks,
                          ctx[1] if ctx is not None else None, cd, residual_dtype)
    sm = compat.shard_map(sched.body, mesh=mesh, in_specs=(P(STAGE_AXIS), P(STAGE_AXIS), P(), P(), P(), P()),
                          out_specs=(P(), P(STAGE_AXIS), P(), P()), axis_names=frozenset({STAGE_AXIS}))

    def run(stacked, head_state, x_mbtd, targets_mbt, pos_bt):
        n_layers = jax.tree.leaves(stacked)[0].shape[0]
        staged = jax.tree.map(lambda a: a.reshape((p, n_layers // p) + a.shape[1:]), stacked)
        loss, g_staged, g_head, dx = sm(jnp.arange(p, dtype=jnp.int32), staged, head_state, x_mbtd.astype(cd),
                                        targets_mbt, pos_bt)
        g_stacked = jax.tree.map(lambda g, a: g.reshape(a.shape).astype(a.dtype), g_staged, stacked)
        g_head = jax.tree.map(lambda g, a: g.astype(a.dtype), g_head, head_state)
        return loss, (g_stacked, g_head, dx.astype(x_mbtd.dtype))

    @jax.custom_vjp
    def loss_fn(stacked, head_state, x_mbtd, targets_mbt, pos_bt):
        return run(stacked, head_state, x_mbtd, targets_mbt, pos_bt)[0]

    def loss_fwd(stacked, head_state, x_mbtd, targets_mbt, pos_bt):
        return run(stacked, head_state, x_mbtd, targets_mbt, pos_bt)

    def loss_bwd(grads, g):
        scaled = jax.tree.map(lambda a: (a * g).astype(a.dtype), grads)
        return (*scaled, None, None)

    loss_fn.defvjp(loss_fwd, loss_bwd)
    return loss_fn


def pipelined_loss(model, tokens_bt, targets_bt, pipe: PipelineSpec, mesh, loss_fn):
    """The model's training loss with its blocks and head run as a 1F1B pipeline (one_f_one_b): the model's own
    embed outside, then the stacked blocks, the model's own head and `loss_fn(logits_btv, targets_bt)` (a mean over
    the microbatch's tokens) per microbatch on the last stage. -> the mean over microbatches (equal sizes: the mean
    over all tokens of the batch, the same quantity as loss_fn over the whole batch's logits)."""
    cfg = model.cfg
    if not cfg.scan_layers:
        raise WorkbenchError("pipeline parallelism needs stacked layers: --set scan_layers=true")
    if cfg.is_moe:
        raise WorkbenchError("pipeline parallelism is not implemented for mixture-of-experts models; use ep")
    b, t = tokens_bt.shape
    m = pipe.microbatches
    if b % m:
        raise WorkbenchError(f"batch {b} is not a multiple of --microbatches {m}")
    mb = b // m
    positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    rd = model.residual_dtype
    x_btd = model.embed(tokens_bt, positions_bt).astype(rd)
    x_mbtd = constrain(x_btd.reshape(m, mb, t, x_btd.shape[-1]), (None, "batch", "seq", "embed"),
                       "microbatched embedding")
    targets_mbt = constrain(targets_bt.reshape(m, mb, t), (None, "batch", "seq"), "microbatched targets")
    gd_blocks, stacked = nnx.split(model.blocks)
    call = model.block_call()
    layer_fn = lambda st, x, pos: call(nnx.merge(gd_blocks, st), x, pos)
    # the head's state: everything but the blocks (the final norm, the unembedding or the tied embedding table)
    gd, blocks_state, head_state = nnx.split(model, nnx.PathContains("blocks"), ...)
    no_blocks = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), blocks_state)
    head_loss = lambda hs, y_btd, tg_bt: loss_fn(nnx.merge(gd, no_blocks, hs).head(y_btd), tg_bt)
    f = one_f_one_b(layer_fn, head_loss, pipe, mesh, rd)
    return f(stacked, head_state, x_mbtd, targets_mbt, positions_bt[:mb])


def bubble_terms(pipe: PipelineSpec, cfg, batch: int, seq: int, batch_ways: int, tensor_ways: int,
                 peak_flops: float | None) -> dict:
    """The bubble in seconds on one device, analytically: (p − 1) ticks × one tick's layer FLOPs at peak.

    One tick = one chunk (L/(p·v) layers) forward and backward on one microbatch's tokens on this device
    (batch/(m·batch_ways)·seq, the layers' share of train_flops_per_token: 6·N_layers + attention, the head left
    out), divided over the tensor-parallel ways. In the SPMD program every stage computes every tick, so the
    compiled per-device program already runs these (p − 1) ticks: its roofline is the critical path, and this term
    is the part of it that is bubble."""
    aw, _ = attention_params(cfg)
    mw, _ = mlp_params(cfg)
    layer_flops_per_token = 6 * (aw + mw) + 12 * cfg.n_heads * cfg.head_dim * seq  # one layer, fwd + bwd
    tokens_tick = batch / (pipe.microbatches * batch_ways) * seq
    lc = cfg.n_layers / (pipe.stages * pipe.repeats)
    tick_flops = layer_flops_per_token * lc * tokens_tick / max(tensor_ways, 1)
    out = {**pipe.to_record(), "tick_flops_per_device": tick_flops,
           "bubble_flops_per_device": (pipe.stages - 1) * tick_flops,
           "layer_flops_per_device": pipe.step_ticks * tick_flops,
           "tick_how": f"6*(attention+mlp matmul params) + 12*n_heads*head_dim*seq per token per layer x {lc:g} "
                       f"layers x {tokens_tick:g} tokens / {tensor_ways} tensor ways"}
    if peak_flops:
        out["tick_s"] = tick_flops / peak_flops
        out["bubble_s"] = (pipe.stages - 1) * tick_flops / peak_flops
    return out
