"""Low-precision number formats, scaling recipes and the precision policies built on them.

Registered into models/precision.py's registry on import (`get_policy(name, **options)`):

| policy        | matmul operands (forward)           | gradients (backward GEMMs)         | scaling                          |
|---------------|-------------------------------------|------------------------------------|----------------------------------|
| `fp16`        | float16                             | float16, loss scaled               | dynamic loss scaling             |
| `fp8-current` | E4M3, per tensor                    | E5M2, per tensor                   | this step's amax                 |
| `fp8-delayed` | E4M3, per tensor                    | E5M2, per tensor                   | amax history (length, margin)    |
| `mxfp8`       | E4M3, 32-element blocks, E8M0 scale | E5M2 MX blocks (operands E4M3 MX)  | per block, power of two          |
| `mxfp4`       | E2M1, 32-element blocks, E8M0 scale | E5M2 MX blocks (operands E4M3 MX)  | per block, power of two          |

Every quantizer saturates: values beyond the format's largest finite number become that number (the plain casts turn
them into NaN for E4M3 and inf for E5M2). Scales never become zero or non-finite: a zero or non-finite amax keeps the
previous scale. Accumulation is float32 everywhere. On hardware without these units (this CPU) the formats are
emulated exactly: operands are rounded to the format's values and the products are accumulated in float32.

The train-step protocol (docs/precision.md):
    ls = policy.loss_scaling                    # None, or DynamicLossScale (fp16)
    wrt = grad_wrt(policy)                      # what nnx.grad differentiates: nnx.Param (+ Fp8GradMeta for fp8-delayed)
    grads = commit_grads(policy, model, grads)  # writes the fp8 gradient-scaling state, returns parameter grads only
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import fp8_ops as _flax_fp8

from models import precision as _precision
from models.precision import Einsum, PrecisionPolicy, finish_dot
from workbench.errors import WorkbenchError

F32 = jnp.float32


# ---------------------------------------------------------------------------------------------------------------
# formats
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Format:
    """An element format: its JAX dtype, largest finite value, and the exponent of that value (emax, OCP MX spec)."""

    name: str
    dtype: Any
    max: float
    emax: int
    bits: int

    @property
    def min_normal(self) -> float:
        return float(jnp.finfo(self.dtype).tiny) if self.dtype != F32 else float(np.finfo(np.float32).tiny)


def _fmt(name, dtype, bits):
    fmax = float(jnp.finfo(dtype).max)
    return Format(name, dtype, fmax, int(math.floor(math.log2(fmax))), bits)


E4M3 = _fmt("e4m3", jnp.float8_e4m3fn, 8)     # max 448 = 1.75 * 2^8
E5M2 = _fmt("e5m2", jnp.float8_e5m2, 8)       # max 57344 = 1.75 * 2^15
E2M1 = _fmt("e2m1", jnp.float4_e2m1fn, 4)     # max 6 = 1.5 * 2^2
# identity "format" for testing the scaled-op plumbing with check_grads: exact for |x / scale| <= 2^64, and emax 0 so
# an MX block scale is 2^floor(log2 amax) (elements in [1, 2))
FLOAT32 = Format("float32", jnp.float32, 2.0 ** 64, 0, 32)
FORMATS = {f.name: f for f in (E4M3, E5M2, E2M1, FLOAT32)}
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127        # E8M0 scale range (the all-ones pattern is NaN)
# XLA:CPU flushes float32 subnormals, so 2^-127 would read as 0: the emulation clips the scale exponent at -126 (only
# blocks whose amax is below 2^-118 notice; recorded here, not hidden).
_EMU_MIN_EXP = -126


def get_format(name) -> Format:
    if isinstance(name, Format):
        return name
    if name not in FORMATS:
        raise WorkbenchError(f"unknown number format {name!r}; choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


def saturating_cast(x, fmt: Format):
    """Round `x` to `fmt`, clamping finite values beyond the largest finite number to +-max (NaN stays NaN)."""
    fmt = get_format(fmt)
    x = jnp.asarray(x)
    if fmt.dtype == F32:
        return x.astype(F32)
    m = jnp.asarray(fmt.max, x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else F32)
    return jnp.clip(x, -m, m).astype(fmt.dtype)


def quantize(x, fmt: Format, scale):
    """Per-tensor quantization: x / scale rounded (saturating) to `fmt`. `scale` is the dequantization factor."""
    return saturating_cast(x.astype(F32) / scale, fmt)


def dequantize(q, scale, dtype=F32):
    return (q.astype(F32) * scale).astype(dtype)


def qdq(x, fmt: Format, scale):
    """Quantize then dequantize (fake quantization), float32 result."""
    return dequantize(quantize(x, fmt, scale), scale)


def amax(x):
    """max |x| over the whole tensor, float32 (under sharding XLA reduces across devices: a global amax)."""
    return jnp.max(jnp.abs(x.astype(F32)))


def compute_scale(amax_value, prev_scale, fmt: Format, margin: float = 0.0):
    """Dequantization scale that maps `amax_value` to the format's max, backed off by 2^margin.

    flax.linen.fp8_ops.compute_scale's formula (the Transformer Engine recipe: scale = amax * 2^margin / fmt_max). A
    zero or non-finite amax keeps `prev_scale` exactly; so does an amax so small that the scale would underflow to
    zero (a guard Flax's version lacks: its scale becomes 0 and the next quantization divides by it).
    """
    fmt = get_format(fmt)
    amax_value = jnp.asarray(amax_value, F32)
    prev_scale = jnp.asarray(prev_scale, F32)
    new = _flax_fp8.compute_scale(amax_value, prev_scale, jnp.float32(fmt.max), margin)
    ok = jnp.isfinite(amax_value) & (amax_value > 0) & jnp.isfinite(new) & (new > 0)
    return jnp.where(ok, new, prev_scale)


def delayed_scaling_update(amax_now, prev_scale, history, fmt: Format, margin: float = 0.0):
    """One step of delayed scaling. Returns (scale to use this step, new history).

    The scale comes from the history of *previous* steps (max over the window); this step's amax is then recorded
    with flax.linen.fp8_ops.compute_amax_history (a ring: the newest at index 0, the oldest dropped). An empty
    (all-zero) history - the first step - uses this step's amax instead of the Transformer Engine / Flax default of
    scale 1 (which flushes small gradients to zero in E5M2). Non-finite amaxes are recorded as 0, so one overflow step
    does not freeze the window.
    """
    history = jnp.asarray(history, F32)
    amax_now = jnp.asarray(amax_now, F32)
    a_hist = jnp.max(history)
    a = jnp.where(a_hist > 0, a_hist, amax_now)
    scale = compute_scale(a, prev_scale, fmt, margin)
    record = jnp.where(jnp.isfinite(amax_now), amax_now, 0.0)
    return scale, _flax_fp8.compute_amax_history(record, history)


# ---------------------------------------------------------------------------------------------------------------
# MX block formats (OCP Microscaling spec v1.0): k=32 elements share one E8M0 (power-of-two) scale
# ---------------------------------------------------------------------------------------------------------------
def mx_shared_exponent(block_amax, fmt: Format):
    """floor(log2(amax)) - emax(fmt), clipped to the E8M0 range; 0 for zero or non-finite blocks (OCP MX 6.3)."""
    mant, exp = jnp.frexp(block_amax)          # amax = mant * 2^exp, mant in [0.5, 1): floor(log2 amax) = exp - 1
    e = exp - 1 - fmt.emax
    ok = jnp.isfinite(block_amax) & (block_amax > 0)
    return jnp.where(ok, jnp.clip(e, _EMU_MIN_EXP, E8M0_MAX_EXP), 0).astype(jnp.int32)


def mx_quantize(x, fmt: Format, block_size: int = 32):
    """Quantize along the last axis in blocks. Returns (elements in fmt.dtype, scales as float8_e8m0fnu, shape
    x.shape[:-1] + (n_blocks,)). The last axis must be a multiple of block_size."""
    fmt = get_format(fmt)
    k = x.shape[-1]
    if k % block_size:
        raise WorkbenchError(f"MX block size {block_size} does not divide the last dimension {k}; "
                             f"use a size that is a multiple of {block_size}")
    xb = x.astype(F32).reshape(*x.shape[:-1], k // block_size, block_size)
    e = mx_shared_exponent(jnp.max(jnp.abs(xb), axis=-1), fmt)
    scale = jnp.ldexp(jnp.float32(1.0), e)
    q = saturating_cast(xb / scale[..., None], fmt).reshape(x.shape)
    return q, scale.astype(jnp.float8_e8m0fnu)


def mx_dequantize(q, scales, block_size: int = 32):
    qb = q.astype(F32).reshape(*q.shape[:-1], q.shape[-1] // block_size, block_size)
    return (qb * scales.astype(F32)[..., None]).reshape(q.shape)


def mx_qdq(x, axes: tuple[int, ...], fmt: Format, block_size: int, *, allow_pad: bool, what: str = "operand"):
    """Block-quantize then dequantize `x` along `axes` (flattened in that order into one contracting dimension K,
    blocks of `block_size` along K). Returns float32 with x's shape.

    Zero padding completes a ragged last block (zeros change no block's amax, so this equals a shorter last block, as
    the microxcaling reference library does). Forward GEMMs allow it only when K is smaller than one block (e.g. a
    head_dim of 16: one short block); a K above the block size that it does not divide is an error unless `allow_pad`
    (backward GEMMs, whose K is batch x sequence)."""
    fmt = get_format(fmt)
    axes = tuple(axes)
    others = [i for i in range(x.ndim) if i not in axes]
    perm = others + list(axes)
    xt = jnp.transpose(x.astype(F32), perm)
    lead = xt.shape[:len(others)]
    k = int(np.prod(xt.shape[len(others):], dtype=np.int64)) if axes else 1
    xt = xt.reshape(lead + (k,))
    pad = (-k) % block_size
    if pad:
        if not allow_pad and k > block_size:
            raise WorkbenchError(
                f"MX block size {block_size} does not divide the contracting dimension {k} of the {what}; "
                f"use sizes that are multiples of {block_size} (or pass block_size= to the policy)")
        xt = jnp.pad(xt, [(0, 0)] * len(lead) + [(0, pad)])
    q, s = mx_quantize(xt, fmt, block_size)
    y = mx_dequantize(q, s, block_size)[..., :k]
    y = y.reshape(tuple(xt.shape[:len(others)]) + tuple(x.shape[a] for a in axes))
    return jnp.transpose(y, np.argsort(perm))


# ---------------------------------------------------------------------------------------------------------------
# einsum equations: the contracting labels and the two backward GEMMs
# ---------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def parse_einsum(eq: str) -> tuple[str, str, str, str, str, str]:
    """'btd,df->btf' -> (x_labels, w_labels, out_labels, contracting labels, dx equation, dw equation)."""
    eq_ = eq.replace(" ", "")
    if "..." in eq_ or "->" not in eq_ or eq_.count(",") != 1:
        raise WorkbenchError(f"quantized einsum needs an explicit two-operand equation like 'btd,df->btf', got {eq!r}")
    ins, out = eq_.split("->")
    xl, wl = ins.split(",")
    for part in (xl, wl, out):
        if len(set(part)) != len(part) or not part.isalpha():
            raise WorkbenchError(f"quantized einsum equation {eq!r}: labels must be letters, none repeated in an operand")
    for lab in xl:
        if lab not in wl and lab not in out:
            raise WorkbenchError(f"quantized einsum equation {eq!r}: label {lab!r} is summed inside one operand; "
                                 "sum it before the einsum")
    for lab in wl:
        if lab not in xl and lab not in out:
            raise WorkbenchError(f"quantized einsum equation {eq!r}: label {lab!r} is summed inside one operand; "
                                 "sum it before the einsum")
    contract = "".join(lab for lab in xl if lab in wl and lab not in out)
    return xl, wl, out, contract, f"{out},{wl}->{xl}", f"{xl},{out}->{wl}"


def _contract_axes(eq: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    xl, wl, out, contract, _, _ = parse_einsum(eq)
    return tuple(xl.index(c) for c in contract), tuple(wl.index(c) for c in contract)


def _dot32(eq, a, b):
    return jnp.einsum(eq, a, b, preferred_element_type=F32, precision=jax.lax.Precision.HIGHEST)


# ---------------------------------------------------------------------------------------------------------------
# per-tensor fp8 einsum with a custom VJP: E4M3 operands forward, E5M2 gradient backward
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Fp8Spec:
    recipe: str = "delayed"       # current | delayed (for the gradient; operands are scaled by the module)
    fwd: str = "e4m3"
    grad: str = "e5m2"
    margin: float = 0.0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def fp8_einsum(eq: str, spec: Fp8Spec, x, w, x_scale, w_scale, g_scale, g_history):
    """einsum(eq, x, w) with x, w quantized per tensor to spec.fwd under the given scales; float32 result.

    Backward: the incoming gradient is quantized to spec.grad (current scaling, or delayed from g_history), both
    backward GEMMs use the saved quantized operands. The cotangents returned for (g_scale, g_history) are their NEW
    values (the "overwrite with gradient" protocol of flax.linen.fp8_ops): commit_grads() writes them back.
    """
    return _fp8_fwd(eq, spec, x, w, x_scale, w_scale, g_scale, g_history)[0]


def _fp8_fwd(eq, spec, x, w, x_scale, w_scale, g_scale, g_history):
    parse_einsum(eq)
    fmt = get_format(spec.fwd)
    qx, qw = quantize(x, fmt, x_scale), quantize(w, fmt, w_scale)
    # fp8 operands straight into the dot (XLA:GPU lowers this to an fp8 GEMM; XLA:CPU upcasts exactly), f32 accumulate
    y = jnp.einsum(eq, qx, qw, preferred_element_type=F32) * (x_scale * w_scale)
    res = (qx, qw, x_scale, w_scale, g_scale, g_history, jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))
    return y, res


def _fp8_bwd(eq, spec, res, g):
    qx, qw, x_scale, w_scale, g_scale, g_history, x_proto, w_proto = res
    _, _, _, _, eq_dx, eq_dw = parse_einsum(eq)
    gfmt = get_format(spec.grad)
    g_amax = amax(g)
    if spec.recipe == "delayed":
        new_gs, new_gh = delayed_scaling_update(g_amax, g_scale, g_history, gfmt, spec.margin)
    else:
        new_gs, new_gh = compute_scale(g_amax, jnp.ones((), F32), gfmt, spec.margin), g_history
    qg = quantize(g, gfmt, new_gs)
    dx = _dot32(eq_dx, qg.astype(F32), qw.astype(F32)) * (new_gs * w_scale)
    dw = _dot32(eq_dw, qx.astype(F32), qg.astype(F32)) * (x_scale * new_gs)
    if spec.recipe == "delayed":
        meta = (new_gs.astype(g_scale.dtype), new_gh.astype(g_history.dtype))
    else:
        meta = (jnp.zeros_like(g_scale), jnp.zeros_like(g_history))
    return (dx.astype(x_proto.dtype), dw.astype(w_proto.dtype), jnp.zeros_like(x_scale), jnp.zeros_like(w_scale),
            *meta)


fp8_einsum.defvjp(_fp8_fwd, _fp8_bwd)


# ---------------------------------------------------------------------------------------------------------------
# MX einsum with a custom VJP: every GEMM (forward, dgrad, wgrad) block-quantized along its own contracting labels
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MxSpec:
    fwd: str = "e4m3"            # elements of x and w in the forward GEMM
    grad: str = "e5m2"           # elements of the gradient in the backward GEMMs
    bwd_operand: str = "e4m3"    # elements of x and w re-quantized (along the backward contracting dims) for dgrad/wgrad
    block_size: int = 32


def _mx_gemm(eq, a, b, fa, fb, block, allow_pad, what):
    ax, bx = _contract_axes(eq)
    aq = mx_qdq(a, ax, fa, block, allow_pad=allow_pad, what=f"left operand of {what} {eq!r}")
    bq = mx_qdq(b, bx, fb, block, allow_pad=allow_pad, what=f"right operand of {what} {eq!r}")
    return _dot32(eq, aq, bq)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def mx_einsum(eq: str, spec: MxSpec, x, w):
    """einsum(eq, x, w) with both operands in MX blocks along the contracting labels; float32 result."""
    return _mx_gemm(eq, x, w, spec.fwd, spec.fwd, spec.block_size, False, "einsum")


def _mx_fwd(eq, spec, x, w):
    return mx_einsum(eq, spec, x, w), (x, w)


def _mx_bwd(eq, spec, res, g):
    x, w = res
    _, _, _, _, eq_dx, eq_dw = parse_einsum(eq)
    # re-quantize from the saved high-precision operands along the backward GEMMs' contracting labels (the MX
    # training recipe: a block runs along the reduction dimension of the GEMM that consumes it); ragged K is padded.
    dx = _mx_gemm(eq_dx, g, w, spec.grad, spec.bwd_operand, spec.block_size, True, "dgrad")
    dw = _mx_gemm(eq_dw, x, g, spec.bwd_operand, spec.grad, spec.block_size, True, "wgrad")
    return dx.astype(x.dtype), dw.astype(w.dtype)


mx_einsum.defvjp(_mx_fwd, _mx_bwd)


# ---------------------------------------------------------------------------------------------------------------
# modules and their state
# ---------------------------------------------------------------------------------------------------------------
class Fp8Meta(nnx.Variable):
    """Forward fp8 scaling state (a scale or an amax history), replicated; updated by the module's forward pass."""


class Fp8GradMeta(nnx.Variable):
    """Gradient fp8 scaling state, replicated; its "gradient" is its new value (commit_grads writes it back)."""


class Fp8Einsum(nnx.Module):
    """Per-tensor fp8 einsum. `current`: scales from this call's amax. `delayed`: scales from an amax history of
    `history` steps with `margin` (state in Fp8Meta / Fp8GradMeta variables: scalars and vectors, replicated)."""

    def __init__(self, recipe: str = "delayed", history: int = 16, margin: float = 0.0, compute_dtype=jnp.bfloat16):
        if recipe not in ("current", "delayed"):
            raise WorkbenchError(f"fp8 recipe must be 'current' or 'delayed', got {recipe!r}")
        self.spec = Fp8Spec(recipe=recipe, margin=float(margin))
        self.compute_dtype = compute_dtype
        self.out_dtype = compute_dtype
        self.fmt = get_format(self.spec.fwd)
        n = int(history) if recipe == "delayed" else 1
        if recipe == "delayed":
            self.x_scale = Fp8Meta(jnp.ones((), F32))
            self.x_amax_history = Fp8Meta(jnp.zeros((n,), F32))
            self.w_scale = Fp8Meta(jnp.ones((), F32))
            self.w_amax_history = Fp8Meta(jnp.zeros((n,), F32))
            self.g_scale = Fp8GradMeta(jnp.ones((), F32))
            self.g_amax_history = Fp8GradMeta(jnp.zeros((n,), F32))

    def scales(self, x, w):
        """The (x_scale, w_scale) this call uses; delayed scaling also advances the histories."""
        m = self.spec.margin
        ax, aw = jax.lax.stop_gradient(amax(x)), jax.lax.stop_gradient(amax(w))
        if self.spec.recipe == "current":
            one = jnp.ones((), F32)
            return compute_scale(ax, one, self.fmt, m), compute_scale(aw, one, self.fmt, m)
        sx, hx = delayed_scaling_update(ax, self.x_scale[...], self.x_amax_history[...], self.fmt, m)
        sw, hw = delayed_scaling_update(aw, self.w_scale[...], self.w_amax_history[...], self.fmt, m)
        for name, v in (("x_scale", sx), ("x_amax_history", hx), ("w_scale", sw), ("w_amax_history", hw)):
            # a fresh Variable, not `var[...] = v`: in-place mutation raises TraceContextError when the model is
            # nnx.merge'd inside a plain jax.value_and_grad (the train step's pattern); replacing works in both
            setattr(self, name, Fp8Meta(v))
        return sx, sw

    def __call__(self, eq: str, x, w, *, bias=None, epilogue=None, out_dtype=None):
        sx, sw = self.scales(x, w)
        if self.spec.recipe == "delayed":
            gs, gh = self.g_scale[...], self.g_amax_history[...]
        else:
            gs, gh = jnp.ones((), F32), jnp.zeros((1,), F32)
        y = fp8_einsum(eq, self.spec, x, w, sx, sw, gs, gh)
        return finish_dot(y, self.compute_dtype if out_dtype is None else out_dtype, bias, epilogue, self.compute_dtype)


class MxEinsum(nnx.Module):
    """Block-scaled (OCP MX) einsum, emulated: stateless."""

    def __init__(self, spec: MxSpec, compute_dtype=jnp.bfloat16):
        self.spec = spec
        self.compute_dtype = compute_dtype
        self.out_dtype = compute_dtype

    def __call__(self, eq: str, x, w, *, bias=None, epilogue=None, out_dtype=None):
        return finish_dot(mx_einsum(eq, self.spec, x, w), self.compute_dtype if out_dtype is None else out_dtype, bias,
                          epilogue, self.compute_dtype)


# ---------------------------------------------------------------------------------------------------------------
# fp16 dynamic loss scaling
# ---------------------------------------------------------------------------------------------------------------
class LossScaleState(NamedTuple):
    scale: jax.Array        # float32 scalar: the factor the loss is multiplied by
    good_steps: jax.Array   # int32 scalar: consecutive steps with finite gradients since the last change


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scaling (Micikevicius et al. 2018; the torch.cuda.amp.GradScaler rules).

    Multiply the loss by `scale` before differentiating; divide the gradients by it; when any gradient is non-finite
    skip the update and halve the scale (not below min_scale); after `growth_interval` finite steps in a row double it
    (not above max_scale). All functions are pure and jit-safe; the state is a pytree of two scalars (replicate it).
    """

    init_scale: float = 2.0 ** 15
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 200
    min_scale: float = 1.0
    max_scale: float = 2.0 ** 24

    def init(self) -> LossScaleState:
        return LossScaleState(jnp.asarray(self.init_scale, F32), jnp.zeros((), jnp.int32))

    def scale(self, loss, state: LossScaleState):
        """The loss to differentiate (float32 * scale)."""
        return loss.astype(F32) * state.scale

    def unscale(self, grads, state: LossScaleState):
        inv = 1.0 / state.scale
        return jax.tree.map(lambda g: (g.astype(F32) * inv).astype(g.dtype), grads)

    @staticmethod
    def all_finite(tree) -> jax.Array:
        leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
        return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)

    def update(self, state: LossScaleState, finite) -> LossScaleState:
        grow = finite & (state.good_steps + 1 >= self.growth_interval)
        scale = jnp.where(finite, jnp.where(grow, state.scale * self.growth_factor, state.scale),
                          state.scale * self.backoff_factor)
        scale = jnp.clip(scale, self.min_scale, self.max_scale)
        good = jnp.where(finite & ~grow, state.good_steps + 1, 0).astype(jnp.int32)
        return LossScaleState(scale.astype(F32), good)

    def unscale_and_check(self, grads, state: LossScaleState):
        """-> (unscaled grads, new state, finite: bool scalar). Apply the optimizer update only where finite."""
        g = self.unscale(grads, state)
        finite = self.all_finite(g)
        return g, self.update(state, finite), finite

    @staticmethod
    def select(finite, new_tree, old_tree):
        """Keep `old_tree` (parameters, optimizer state) when the step's gradients were not finite."""
        return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_tree, old_tree)


# ---------------------------------------------------------------------------------------------------------------
# policies
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Fp16Policy(PrecisionPolicy):
    loss_scale: DynamicLossScale = DynamicLossScale()

    def einsum_module(self, rngs=None):
        return Einsum(self.compute_dtype, grad_dtype=self.weight_grad_dtype)

    @property
    def loss_scaling(self):
        return self.loss_scale


@dataclasses.dataclass(frozen=True)
class Fp8Policy(PrecisionPolicy):
    recipe: str = "delayed"
    history: int = 16
    margin: float = 0.0

    def with_weight_grads_in_compute_dtype(self):
        raise WorkbenchError(f"weight_grad_dtype=compute applies to the float32, bf16 and fp16 policies, not "
                             f"{self.name} (its dots keep their own gradient formats); use weight_grad_dtype=float32")

    def einsum_module(self, rngs=None):
        return Fp8Einsum(self.recipe, self.history, self.margin, self.compute_dtype)


@dataclasses.dataclass(frozen=True)
class MxPolicy(PrecisionPolicy):
    spec: MxSpec = MxSpec()

    def with_weight_grads_in_compute_dtype(self):
        raise WorkbenchError(f"weight_grad_dtype=compute applies to the float32, bf16 and fp16 policies, not "
                             f"{self.name} (its dots keep their own gradient formats); use weight_grad_dtype=float32")

    def einsum_module(self, rngs=None):
        return MxEinsum(self.spec, self.compute_dtype)


def matmul_format(policy: PrecisionPolicy) -> dict:
    """What the matmul operands are stored and multiplied in: dtype name for hardware peaks, bits per element
    (including shared-scale overhead), and whether a CPU runs it natively or emulated."""
    if isinstance(policy, MxPolicy):
        f = get_format(policy.spec.fwd)
        peak = "float8_e4m3fn" if f is E4M3 else "float4_e2m1fn"
        return {"peak_dtype": peak, "bits": f.bits + 8 / policy.spec.block_size, "element": f.name,
                "scale": f"e8m0 per {policy.spec.block_size}", "emulated_on_cpu": True}
    if isinstance(policy, Fp8Policy):
        return {"peak_dtype": "float8_e4m3fn", "bits": 8, "element": "e4m3", "scale": "f32 per tensor",
                "emulated_on_cpu": True}
    name = np.dtype(policy.compute_dtype).name
    return {"peak_dtype": name, "bits": np.dtype(policy.compute_dtype).itemsize * 8, "element": name, "scale": None,
            "emulated_on_cpu": name != "float32"}


def grad_wrt(policy):
    """The nnx filter a train step differentiates with: parameters, plus fp8 gradient-scaling state when present."""
    if isinstance(policy, Fp8Policy) and policy.recipe == "delayed":
        return nnx.Any(nnx.Param, Fp8GradMeta)
    return nnx.Param


def commit_grads(policy, model, grads):
    """Write the new fp8 gradient-scaling state (returned as its "gradient") into `model`; return parameter grads.

    Identity for policies without such state. Call inside the jitted step, before the optimizer update.
    """
    if not (isinstance(policy, Fp8Policy) and policy.recipe == "delayed"):
        return grads
    meta, params = nnx.split_state(grads, Fp8GradMeta, ...)
    nnx.update(model, meta)
    return params


def split_grad_meta(rest):
    """For train steps that differentiate split states with jax.value_and_grad (workbench/train.py's pattern):
    rest -> (gradient-scaling state to differentiate, everything else). Merge both back with the parameters."""
    return nnx.split_state(rest, Fp8GradMeta, ...)


def merge_grad_meta(rest, grad_meta_cotangent):
    """rest (after the forward pass) with the gradient-scaling state replaced by its cotangent, which is its new
    value. With gradient accumulation pass the last microbatch's cotangent, not the sum."""
    return nnx.merge_state(rest, grad_meta_cotangent)


# factories: options are validated here so bad input is one line
def _check_options(name, given: dict, allowed: set):
    extra = set(given) - allowed
    if extra:
        raise WorkbenchError(f"precision policy {name!r} has no option(s) {', '.join(sorted(extra))}; "
                             f"it takes {', '.join(sorted(allowed)) or 'none'}")


def _fp16(**kw):
    _check_options("fp16", kw, {"init_scale", "growth_interval"})
    init = float(kw.get("init_scale", 2.0 ** 15))
    interval = kw.get("growth_interval", 200)
    if not init > 0 or not math.isfinite(init):
        raise WorkbenchError(f"fp16 init_scale must be a positive finite number, got {init}")
    if int(interval) < 1:
        raise WorkbenchError(f"fp16 growth_interval must be >= 1, got {interval}")
    return Fp16Policy("fp16", jnp.float16, description=(
        "float32 master parameters, float16 compute, float32 accumulation/softmax/norms/optimizer, "
        "dynamic loss scaling"), loss_scale=DynamicLossScale(init_scale=init, growth_interval=int(interval)))


def _margin(name, kw):
    m = kw.get("margin", 0.0)
    try:
        m = float(m)
    except (TypeError, ValueError):
        raise WorkbenchError(f"{name} margin must be a number >= 0, got {m!r}") from None
    if m < 0 or not math.isfinite(m):
        raise WorkbenchError(f"{name} margin must be >= 0 (a power-of-two back-off of the scale), got {m}")
    return m


def _fp8_current(**kw):
    _check_options("fp8-current", kw, {"margin"})
    return Fp8Policy("fp8-current", jnp.bfloat16, recipe="current", history=1, margin=_margin("fp8-current", kw),
                     description="E4M3 operands / E5M2 gradients, per-tensor scale from this step's amax; "
                                 "bfloat16 elsewhere, float32 accumulation")


def _fp8_delayed(**kw):
    _check_options("fp8-delayed", kw, {"history", "margin"})
    h = kw.get("history", 16)
    if isinstance(h, bool) or not isinstance(h, (int, np.integer)) and not (isinstance(h, str) and h.isdigit()):
        raise WorkbenchError(f"fp8-delayed history must be a whole number >= 1, got {h!r}")
    h = int(h)
    if h < 1:
        raise WorkbenchError(f"fp8-delayed amax history length must be >= 1, got {h}")
    return Fp8Policy("fp8-delayed", jnp.bfloat16, recipe="delayed", history=h, margin=_margin("fp8-delayed", kw),
                     description=f"E4M3 operands / E5M2 gradients, per-tensor scale from an amax history of {h} "
                                 "steps; bfloat16 elsewhere, float32 accumulation")


def _mx(name, elem):
    def factory(**kw):
        _check_options(name, kw, {"block_size"})
        b = kw.get("block_size", 32)
        if isinstance(b, bool) or int(b) != b or int(b) < 1:
            raise WorkbenchError(f"{name} block_size must be a whole number >= 1, got {b!r}")
        spec = MxSpec(fwd=elem, grad="e5m2", bwd_operand="e4m3", block_size=int(b))
        return MxPolicy(name, jnp.bfloat16, spec=spec, description=(
            f"OCP MX: {elem.upper()} elements, {int(b)}-element blocks with power-of-two (E8M0) scales in every "
            "forward GEMM; backward GEMMs MX with E5M2 gradients; emulated where the hardware lacks MX units"))
    return factory


for _name, _f in {"fp16": _fp16, "fp8-current": _fp8_current, "fp8-delayed": _fp8_delayed,
                  "mxfp8": _mx("mxfp8", "e4m3"), "mxfp4": _mx("mxfp4", "e2m1")}.items():
    _precision.register(_name, _f)

POLICY_ORDER = ["float32", "bf16", "fp16", "fp8-current", "fp8-delayed", "mxfp8", "mxfp4"]
