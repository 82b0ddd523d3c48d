"""The training step, built once for every strategy and mesh: what `workbench run` trains, `predict` compiles for a
target, and the fusion explorer and the benchmarks lower.

    prog = build_train_step(cfg, policy=..., mesh=mesh, strategy='fsdp+tp', batch_size=8, seq_len=64)
    step, state, batch = prog                   # jitted step, sharded (or abstract) state, sharded (or abstract) batch
    compiled = step.lower(state, batch).compile()
    state, metrics = step(state, batch)         # state is donated

State: {'params': nnx.State (float32 master weights; with master_weights='optimizer' in the compute dtype and the
float32 master under opt['master']), 'gmeta': nnx.State (fp8 gradient-scaling state, differentiated:
its "gradient" is its new value; empty for other policies), 'rest': nnx.State (other variables, e.g. fp8 forward
scales, router biases), 'opt': optax state (AdamW moments sharded like their parameters; with
optimizer_sharding='data' also split over the data-parallel replicas, ZeRO-1), 'step': int32}.
Optimizer: optax AdamW (b1 0.9, b2 0.95, weight decay on matrices only) after global-norm clipping, warm-up + cosine.
Activations are pinned through partitioning.shard.activation_sharding while the step is traced; the mesh is also
in context as an abstract mesh (jax.sharding.get_abstract_mesh) for layers that shard_map (models/moe.py).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from models import pipeline as pp
from models import quant
from models.analytics import analytics
from models.config import ModelConfig, resolve_attention
from models.precision import get_policy
from models.transformer import Transformer
from partitioning.rules import get_rules
from partitioning.shard import activation_sharding, constrain, replica_shardings, spec_for, state_shardings
from workbench import compat
from workbench.errors import WorkbenchError


# ------------------------------------------------------------------------------------------------- optimizer
def make_optimizer(learning_rate: float = 1e-3, total_steps: int = 1000, warmup_steps: int | None = None,
                   weight_decay: float = 0.1, clip_norm: float = 1.0) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW (decay on rank >= 2 parameters only), linear warm-up then cosine to 10%."""
    total_steps = max(int(total_steps), 1)
    warmup = min(100, max(total_steps // 10, 1)) if warmup_steps is None else max(int(warmup_steps), 1)
    schedule = optax.warmup_cosine_decay_schedule(learning_rate / (warmup + 1), learning_rate, warmup, max(total_steps, warmup + 1),
                                                  end_value=0.1 * learning_rate)
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
    return optax.chain(optax.clip_by_global_norm(clip_norm),
                       optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=weight_decay, mask=decay_mask))


def default_learning_rate(cfg: ModelConfig) -> float:
    """3e-3 for models under ~1M parameters, 1e-3 up to ~100M, 3e-4 above (the usual nanoGPT-scale choices)."""
    n = analytics(cfg)["params_total"]
    return 3e-3 if n < 1e6 else (1e-3 if n < 1e8 else 3e-4)


def default_precision() -> str:
    """float32 on a CPU host (XLA:CPU computes bf16 matmuls in float32: no faster path), bf16 on accelerators."""
    return "float32" if jax.devices()[0].platform == "cpu" else "bf16"


# ------------------------------------------------------------------------------------------------- the step
class _NoVariable(nnx.Variable):
    """Matches nothing: the gradient-meta filter for policies without differentiated scaling state."""


def _grad_meta_filter(policy):
    """Variables differentiated alongside the parameters whose 'gradient' is their new value (fp8 delayed scaling
    of gradients, models/quant.py's Fp8GradMeta); a filter that matches nothing otherwise."""
    wrt = quant.grad_wrt(policy)
    return quant.Fp8GradMeta if (wrt is not nnx.Param and hasattr(quant, "Fp8GradMeta")) else _NoVariable


def _label_mask(targets_bt, vocab: int):
    """targets == iota over the vocabulary: the one-hot of each target as a compare XLA fuses into its consumer (no
    gather over the vocabulary, which a model-sharded vocabulary inside the 1F1B head's shard_map cannot take)."""
    iota = jax.lax.broadcasted_iota(jnp.int32, (1,) * targets_bt.ndim + (vocab,), targets_bt.ndim)
    return targets_bt[..., None] == iota


def _token_losses(logits_btv, targets_bt):
    """(logsumexp over the vocabulary, the target's logit), each (b, t) in float32."""
    lf = logits_btv.astype(jnp.float32)
    picked = jnp.sum(jnp.where(_label_mask(targets_bt, lf.shape[-1]), lf, 0.0), axis=-1)
    return jax.nn.logsumexp(lf, axis=-1), picked


@jax.custom_vjp
def cross_entropy(logits_btv, targets_bt):
    """Mean next-token cross-entropy in float32 (nats): logsumexp − the target's logit, as
    optax.softmax_cross_entropy_with_integer_labels computes it (tests/programs/test_loss.py).

    Its own derivative, so that the backward pass keeps only the logits in their own dtype and one float32 logsumexp
    per token, and recomputes softmax − one_hot from them, returned in the logits' dtype. Differentiated by JAX,
    the float32 logsumexp keeps exp(logits − max) for the backward: a float32 copy of the logits, 21 GB per chip
    for a 128256-word vocabulary at 5 × 8192 tokens per chip (MaxText's Llama 3.1 70B recipe on v6e-256 needed
    38.2 GB of temporaries with it and 25.0 GB without, on a 31.25 GB chip). The logits' gradient is rounded to
    their dtype once here; the head's dot rounds its cotangent to the compute dtype anyway (models/precision.py)."""
    lse, picked = _token_losses(logits_btv, targets_bt)
    return jnp.mean(lse - picked)


def _cross_entropy_fwd(logits_btv, targets_bt):
    lse, picked = _token_losses(logits_btv, targets_bt)
    return jnp.mean(lse - picked), (logits_btv, targets_bt, lse)


def _cross_entropy_bwd(res, g):
    logits_btv, targets_bt, lse = res
    p = jnp.exp(logits_btv.astype(jnp.float32) - lse[..., None])
    one_hot = _label_mask(targets_bt, logits_btv.shape[-1]).astype(jnp.float32)
    d = ((p - one_hot) * (g / lse.size)).astype(logits_btv.dtype)
    return d, np.zeros(targets_bt.shape, jax.dtypes.float0)


cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def check_schedule_policy(pipe: pp.PipelineSpec | None, policy) -> None:
    """One line for the precision policies the 1F1B schedule cannot carry: its backward runs inside the loss's
    custom_vjp forward rule, where fp16 loss scaling would not reach (the scale would multiply gradients computed
    unscaled, which is what it exists to prevent) and fp8 delayed scaling's gradient state (differentiated to its new
    value) cannot come out."""
    if pipe is None or pipe.schedule != "1f1b":
        return
    policy = get_policy(policy)
    if policy.loss_scaling is not None:
        raise WorkbenchError(f"1F1B does not apply {policy.name}'s loss scaling inside its backward pass; use "
                             "--pipeline-schedule gpipe or a bf16/float32 policy")
    if _grad_meta_filter(policy) is not _NoVariable:
        raise WorkbenchError(f"1F1B cannot carry {policy.name}'s delayed-scaling gradient state through its backward "
                             "pass; use --pipeline-schedule gpipe or fp8-current")


def pipeline_for(cfg: ModelConfig, strategy, stages: int, microbatches: int, repeats: int, schedule: str,
                 batch_size: int, policy) -> tuple[pp.PipelineSpec | None, ModelConfig]:
    """The pipeline a strategy runs (None for the unpipelined ones, which refuse the pipeline options) and the config
    it runs (layers stacked: the stacked axis is what is sharded over `stage`). Every check is a one-line error; the
    training step and `predict` both ask here."""
    rules = get_rules(strategy)
    if pp.STAGE_AXIS not in rules.mesh_axes_for("layers"):  # not pp, pp+fsdp, pp+tp, pp+fsdp+tp
        if repeats != 1:
            raise WorkbenchError(f"--pipeline-repeats applies to the pipelined strategies (pp, pp+fsdp, ...), not "
                                 f"{rules.name}")
        if schedule != "gpipe":
            raise WorkbenchError(f"--pipeline-schedule applies to the pipelined strategies (pp, pp+fsdp, ...), not "
                                 f"{rules.name}")
        return None, cfg
    if repeats < 1:
        raise WorkbenchError(f"--pipeline-repeats must be >= 1, got {repeats}")
    pipe = pp.PipelineSpec(stages, microbatches, repeats, pp.check_schedule_name(schedule))
    pipe.check(cfg.n_layers, batch_size)
    if cfg.is_moe:
        raise WorkbenchError("pipeline parallelism is not implemented for mixture-of-experts models; use ep")
    check_schedule_policy(pipe, policy)
    return pipe, (cfg if cfg.scan_layers else cfg.replace(scan_layers=True))


@dataclasses.dataclass
class TrainProgram:
    """What build_train_step returns; unpacks as (step, state, batch)."""

    step: Any  # jitted (state, batch) -> (state, metrics), state donated
    state: Any  # sharded state (abstract ShapeDtypeStructs with shardings when abstract=True)
    batch: Any  # {'inputs', 'targets'}: (B, T) int32, sharded over the data axis
    eval_step: Any  # jitted (params, gmeta, rest, batch) -> mean loss
    grads: Any  # jitted (params, gmeta, rest, batch) -> (loss, grads): the step's loss and gradients (no update;
    #            scaled by the loss scale for fp16 policies)
    init: Any  # jitted () -> state (sharded)
    state_shardings: Any
    batch_sharding: Any
    mesh: Any
    rules: Any
    policy: Any
    cfg: ModelConfig
    graphdef: Any
    optimizer: Any
    batch_size: int
    seq_len: int
    microbatches: int
    pipeline: pp.PipelineSpec | None = None  # pp strategies: the schedule (models/pipeline.py); params stage-ordered

    def __iter__(self):
        return iter((self.step, self.state, self.batch))

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


def abstract_with(tree, shardings):
    """ShapeDtypeStructs of `tree` carrying `shardings` (a compile-only stand-in for a sharded state)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


@dataclasses.dataclass(frozen=True, eq=False)
class _StepFunctions:
    """The functions a training step is built from, over one model, policy, mesh and strategy; each is traced under
    jit (the names are the compiled programs' names: jit_train_step, jit_eval_step, jit_grads_only, jit_init_fn)."""

    cfg: ModelConfig
    policy: Any
    mesh: Any
    rules: Any
    pipe: pp.PipelineSpec | None
    tx: Any
    seed: int
    gm: Any  # fp8 gradient-scaling state: differentiated, its "gradient" is its new value
    graphdef: Any
    microbatches: int
    accumulate: int  # gradient-accumulation steps (1 for pipelines: their microbatches are the schedule's)
    mb_size: int
    seq_len: int
    grad_shardings: Any = None  # ZeRO-1: each rank's slice of the gradients (optimizer_sharding='data')

    def init_fn(self):
        model = Transformer(self.cfg, self.policy, nnx.Rngs(self.seed))
        if self.pipe is not None:  # the same parameters, the stacked layer axis in stage order
            nnx.update(model.blocks, pp.to_stage_order(nnx.state(model.blocks), self.pipe, self.cfg.n_layers))
        _, params, gmeta, rest = nnx.split(model, nnx.Param, self.gm, ...)
        opt = self.tx.init(params)
        if self.master_in_optimizer:  # the float32 values become the master copy; the parameters narrow
            opt = {"master": params, "tx": opt}
            params = jax.tree.map(lambda x: x.astype(self.policy.compute_dtype), params)
        state = {"params": params, "gmeta": gmeta, "rest": rest, "opt": opt, "step": jnp.zeros((), jnp.int32)}
        if self.policy.loss_scaling is not None:
            state["loss_scale"] = self.policy.loss_scaling.init()
        return state

    @property
    def master_in_optimizer(self) -> bool:
        return self.cfg.master_weights == "optimizer"

    def update(self, params, opt, grads):
        """-> (new params, new optimizer state): AdamW on float32 values (`grads` widened by the caller). With the
        master weights in the optimizer the gradients (reduced, or reduce-scattered, in the compute dtype before
        they widened) update the master copy, and the parameters are the master rounded to the compute dtype."""
        if not self.master_in_optimizer:
            updates, opt = self.tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), opt
        updates, inner = self.tx.update(grads, opt["tx"], opt["master"])
        master = optax.apply_updates(opt["master"], updates)
        params = jax.tree.map(lambda m, p: m.astype(p.dtype), master, params)
        return params, {"master": master, "tx": inner}

    def apply_model(self, model, tokens_bt):
        return model(tokens_bt) if self.pipe is None else pp.forward(model, tokens_bt, self.pipe, self.mesh)

    def forward_loss(self, params, gmeta, rest, batch, ls_state):
        model = nnx.merge(self.graphdef, params, gmeta, rest)
        if self.pipe is not None and self.pipe.schedule == "1f1b":  # head and loss per microbatch on the last stage
            loss = pp.pipelined_loss(model, batch["inputs"], batch["targets"], self.pipe, self.mesh,
                                     cross_entropy)
            aux = {}
        else:
            logits_btv, aux = self.apply_model(model, batch["inputs"])
            loss = cross_entropy(logits_btv, batch["targets"])
        total = loss + aux.get("loss", 0.0)
        new_rest = nnx.split(model, nnx.Param, self.gm, ...)[3]
        if self.policy.loss_scaling is not None:
            total = self.policy.loss_scaling.scale(total, ls_state)
        return total, (loss, aux, new_rest)

    def loss_and_grads(self, params, gmeta, rest, batch, ls_state):
        """-> (loss, aux, new rest, parameter grads, new gmeta); microbatches accumulate (mean) in a scan."""
        grad_fn = jax.value_and_grad(self.forward_loss, argnums=(0, 1), has_aux=True)
        if self.accumulate == 1:
            (_, (loss, aux, rest)), (grads, gmeta) = grad_fn(params, gmeta, rest, batch, ls_state)
            return loss, aux, rest, grads, gmeta
        microbatches = self.microbatches
        mbs = {k: constrain(v.reshape(microbatches, self.mb_size, self.seq_len), (None, "batch", "seq"),
                            f"microbatched {k}")
               for k, v in batch.items()}

        def body(carry, mb):
            g_acc, m_acc, l_acc, a_acc, rest = carry
            (_, (loss, aux, rest)), (g, m) = grad_fn(params, gmeta, rest, mb, ls_state)
            g_acc = jax.tree.map(jnp.add, g_acc, g)
            m_acc = jax.tree.map(jnp.add, m_acc, m)
            a_acc = {k: a_acc[k] + aux[k] for k in a_acc}
            return (g_acc, m_acc, l_acc + loss, a_acc, rest), None

        first = jax.tree.map(lambda x: x[0], mbs)
        aux_shape = jax.eval_shape(lambda: grad_fn(params, gmeta, rest, first, ls_state))[0][1][1]
        zeros = lambda t: jax.tree.map(jnp.zeros_like, t)
        carry = (zeros(params), zeros(gmeta), jnp.zeros((), jnp.float32),
                 {k: jnp.zeros((), jnp.float32) for k in aux_shape}, rest)
        (g, m, l, a, rest), _ = jax.lax.scan(body, carry, mbs)
        mean = lambda t: jax.tree.map(lambda x: x / microbatches, t)
        return l / microbatches, mean(a), rest, mean(g), mean(m)

    def train_step(self, state, batch):
        loss_scaling = self.policy.loss_scaling
        with activation_sharding(self.mesh, self.rules), compat.use_abstract_mesh(self.mesh.abstract_mesh):
            ls_state = state.get("loss_scale")
            loss, aux, rest, grads, gmeta = self.loss_and_grads(state["params"], state["gmeta"], state["rest"], batch,
                                                                ls_state)
            new_state = dict(state)
            finite = None
            if loss_scaling is not None:
                grads, new_state["loss_scale"], finite = loss_scaling.unscale_and_check(grads, ls_state)
            if self.grad_shardings is not None:  # reduce-scattered to the optimizer state's slices
                grads = jax.lax.with_sharding_constraint(grads, self.grad_shardings)
            # float32 from here (a no-op for float32 parameters): the update and the norm read the same values
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            params, opt = self.update(state["params"], state["opt"], grads)
            if finite is not None:  # fp16 overflow: skip the update, keep the old state
                keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
                params, opt = keep(params, state["params"]), keep(opt, state["opt"])
            new_state.update(params=params, gmeta=gmeta, rest=rest, opt=opt, step=state["step"] + 1)
            metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **{f"aux_{k}": v for k, v in aux.items()}}
            return new_state, metrics

    def eval_step(self, params, gmeta, rest, batch):
        with activation_sharding(self.mesh, self.rules), compat.use_abstract_mesh(self.mesh.abstract_mesh):
            model = nnx.merge(self.graphdef, params, gmeta, rest)
            logits_btv, _ = self.apply_model(model, batch["inputs"])
            return cross_entropy(logits_btv, batch["targets"])

    def grads_only(self, params, gmeta, rest, batch):
        loss_scaling = self.policy.loss_scaling
        with activation_sharding(self.mesh, self.rules), compat.use_abstract_mesh(self.mesh.abstract_mesh):
            ls_state = loss_scaling.init() if loss_scaling is not None else None
            loss, _, _, grads, _ = self.loss_and_grads(params, gmeta, rest, batch, ls_state)
            return loss, grads


def build_train_step(cfg: ModelConfig, *, policy="float32", mesh, strategy, batch_size: int, seq_len: int | None = None,
                     microbatches: int = 1, abstract: bool = False, seed: int = 0, learning_rate: float | None = None,
                     total_steps: int = 1000, weight_decay: float = 0.1, clip_norm: float = 1.0,
                     pipeline_repeats: int = 1, pipeline_schedule: str = "gpipe") -> TrainProgram:
    """The sharded training step of `cfg` under `strategy` on `mesh` (see the module docstring).

    abstract=True builds no arrays (ShapeDtypeStructs carrying their shardings): for AOT compiles on topologies.
    Pipelined strategies (pp, pp+fsdp, pp+tp, pp+fsdp+tp): `microbatches` are the pipeline's microbatches (not
    gradient accumulation), `pipeline_repeats` > 1 the circular schedule's virtual stages per device,
    `pipeline_schedule` 'gpipe' (circular when repeats > 1) or '1f1b' (the loss computed by
    models.pipeline.pipelined_loss, whose backward is interleaved with its forward); the layers are stacked
    (scan_layers=true) and stored in stage order (models/pipeline.py).
    """
    policy = get_policy(policy)
    if cfg.master_weights == "optimizer" and jnp.dtype(policy.compute_dtype).itemsize >= 4:
        raise WorkbenchError(f"master_weights=optimizer keeps the parameters in the policy's compute dtype, and "
                             f"policy {policy.name} computes in {jnp.dtype(policy.compute_dtype).name}: choose a "
                             "bf16 or fp8 policy (--policy bf16), or master_weights=params")
    rules = get_rules(strategy)
    pipe, cfg = pipeline_for(cfg, rules, int(dict(mesh.shape).get(pp.STAGE_AXIS, 1)), microbatches, pipeline_repeats,
                             pipeline_schedule, batch_size, policy)
    cfg = resolve_attention(cfg, mesh.devices.flat[0].platform, policy.compute_dtype)  # auto: per platform
    seq_len = cfg.seq_len if seq_len is None else int(seq_len)
    if cfg.pos == "learned" and seq_len > cfg.seq_len:
        raise WorkbenchError(f"seq_len={seq_len} exceeds the model's learned positions ({cfg.seq_len}); "
                             f"lower --seq or set seq_len={seq_len} in the model config")
    if batch_size < 1 or microbatches < 1 or batch_size % microbatches:
        raise WorkbenchError(f"batch size {batch_size} must be a positive multiple of microbatches={microbatches}")
    mb_size = batch_size // microbatches
    # batch sharding (errors name 'batch' and the mesh axis when the batch does not divide)
    batch_spec = spec_for(("batch", "seq"), (mb_size, seq_len), mesh, rules, what="batch (per microbatch)")
    batch_sharding = NamedSharding(mesh, batch_spec)
    tx = make_optimizer(learning_rate or default_learning_rate(cfg), total_steps, weight_decay=weight_decay,
                        clip_norm=clip_norm)
    gm = _grad_meta_filter(policy)
    abs_model = nnx.eval_shape(lambda: Transformer(cfg, policy, nnx.Rngs(seed)))
    graphdef = nnx.split(abs_model, nnx.Param, gm, ...)[0]
    fns = _StepFunctions(cfg, policy, mesh, rules, pipe, tx, seed, gm, graphdef, microbatches,
                         1 if pipe is not None else microbatches, mb_size, seq_len)
    abs_state = jax.eval_shape(fns.init_fn)
    state_shardings(abs_state["params"], mesh, rules)  # first, so divisibility errors name the parameter path
    zero1 = cfg.optimizer_sharding == "data"
    shardings = state_shardings(abs_state, mesh, rules, shard_optimizer=zero1)
    if zero1:
        fns = dataclasses.replace(fns, grad_shardings=replica_shardings(abs_state["params"], mesh, rules))
    step = jax.jit(fns.train_step, in_shardings=(shardings, batch_sharding), out_shardings=(shardings, None),
                   donate_argnums=0)
    init = jax.jit(fns.init_fn, out_shardings=shardings)
    evaluate = jax.jit(fns.eval_step, in_shardings=(shardings["params"], shardings["gmeta"], shardings["rest"],
                                                     batch_sharding))
    grads = jax.jit(fns.grads_only, in_shardings=(shardings["params"], shardings["gmeta"], shardings["rest"],
                                                  batch_sharding),
                    out_shardings=(None, shardings["params"]))
    if abstract:
        state = abstract_with(abs_state, shardings)
        batch = {k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=batch_sharding)
                 for k in ("inputs", "targets")}
    else:
        state = init()
        batch = {k: jax.device_put(np.zeros((batch_size, seq_len), np.int32), batch_sharding)
                 for k in ("inputs", "targets")}
    return TrainProgram(step, state, batch, evaluate, grads, init, shardings, batch_sharding, mesh, rules, policy, cfg,
                        graphdef, tx, batch_size, seq_len, microbatches, pipe)


def prog_batch_ways(rules, shape: dict) -> int:
    """Mesh ways the batch is split under these rules."""
    return math.prod(shape.get(a, 1) for a in rules.mesh_axes_for("batch"))


def prog_tensor_ways(rules, shape: dict) -> int:
    """Mesh ways the layers' matmuls are split (the tensor-parallel axes of `mlp`)."""
    return math.prod(shape.get(a, 1) for a in rules.mesh_axes_for("mlp"))

