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
The backward pass is jax.grad of the forward loop: the reverse schedule with reverse permutes. It holds every
microbatch's saved activations until the backward starts (GPipe's memory profile; a 1F1B schedule would hold at most
p microbatches: not implemented here, see docs/pipeline.md).

Mechanics: `shard_map` manual over `stage` only (data/model stay automatic, so pp composes with fsdp and tp); each tick
every stage applies its current chunk to the activation it holds, then `lax.ppermute` shifts the activations one
stage on (stage p−1 wraps to stage 0, which the circular schedule uses). Every stage computes every tick, so the
bubble is visible in the compiled program as work on ticks whose result is discarded: per-device flops of the
pipelined layers are (v·m + p − 1)/(v·m) of the useful ones.

Parameter layout: stacked layers are stored stage-major (`stage_order`): the v chunks of stage s are contiguous, so
the 'layers' axis sharded over `stage` puts exactly a stage's chunks on its device and no parameter moves in the step.
For gpipe that order is the model's own; for circular it is a fixed permutation applied once at init
(`to_stage_order`; `from_stage_order` undoes it, e.g. to compare gradients with an unpipelined run).
"""
from __future__ import annotations

import contextlib
import dataclasses

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
SCHEDULES = ("gpipe", "circular")


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """p stages, m microbatches, v repeats (virtual stages per device)."""

    stages: int
    microbatches: int
    repeats: int = 1

    @property
    def schedule(self) -> str:
        return "gpipe" if self.repeats == 1 else "circular"

    @property
    def ticks(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """(p − 1)/(v·m + p − 1): the share of ticks a stage spends on no useful work."""
        return (self.stages - 1) / self.ticks

    @property
    def work_ratio(self) -> float:
        """Ticks computed / useful ticks = (v·m + p − 1)/(v·m): per-device layer work relative to the ideal."""
        return self.ticks / (self.repeats * self.microbatches)

    def check(self, n_layers: int, batch_size: int | None = None) -> None:
        p, m, v = self.stages, self.microbatches, self.repeats
        for name, x in (("stages", p), ("microbatches", m), ("pipeline repeats", v)):
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise WorkbenchError(f"pipeline {name} must be a positive whole number, got {x!r}")
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
        return {"schedule": self.schedule, "stages": self.stages, "microbatches": self.microbatches,
                "repeats": self.repeats, "ticks": self.ticks, "bubble_fraction": self.bubble_fraction,
                "work_ratio": self.work_ratio,
                "bubble_formula": "(p - 1) / (v*m + p - 1)  (GPipe: v = 1; circular: v repeats per device)"}


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

            def one(x, layer_state):
                y, _ = layer_fn(layer_state, x, pos)
                return y.astype(residual_dtype), None

            return jax.lax.scan(one, x.astype(residual_dtype), cp)[0].astype(cd)

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
            (_, outs), _ = jax.lax.scan(tick, carry, jnp.arange(pipe.ticks))
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
           "layer_flops_per_device": pipe.ticks * tick_flops,
           "tick_how": f"6*(attention+mlp matmul params) + 12*n_heads*head_dim*seq per token per layer x {lc:g} "
                       f"layers x {tokens_tick:g} tokens / {tensor_ways} tensor ways"}
    if peak_flops:
        out["tick_s"] = tick_flops / peak_flops
        out["bubble_s"] = (pipe.stages - 1) * tick_flops / peak_flops
    return out
