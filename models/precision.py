"""Precision policies: the one object every dense/einsum in the models consults (no precision flags inside layers).

A layer asks its policy for an einsum module once, at construction:

    self.dot = policy.einsum_module(rngs=rngs)      # may carry state (fp8 scales, amax histories)
    y_btf = self.dot("btd,df->btf", x_btd, w_df)     # returns policy.compute_dtype, accumulates in float32

Parameters stay in `policy.param_dtype` (float32 master weights). Softmax, norms, losses and optimizer state stay in
float32 whatever the policy. Policies that need more (fp16 dynamic loss scaling, fp8 scaling, MX block formats)
subclass `PrecisionPolicy` and register themselves in `_REGISTRY` (see models/quant.py where present).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from workbench.compat import varying_axes
from workbench.errors import WorkbenchError

# ------------------------------------------------------------------------------------------------------------------
# dots that accumulate and return float32, forward and backward
# ------------------------------------------------------------------------------------------------------------------
# XLA:CPU runs a bf16 dot 2.3-2.8x faster when it accumulates and returns float32 (preferred_element_type) than when
# it returns bf16 (a Zen 5 host with avx512_bf16: 865-903 vs 321 GFLOP/s at 2048^3; docs/models.md). The backward
# dots JAX derives for a forward dot are not under the model's control: jax 0.10 promotes the bf16 operand to the
# float32 cotangent's dtype (a float32 dot), later versions return the input dtype (a bf16-output dot). The custom
# VJPs below write both backward products themselves: compute-dtype operands, float32 accumulation and result, one
# cast to the primal's dtype. On TPU and GPU this is what the matrix units do anyway (bf16 in, f32 accumulate), so
# the model stays written once; float32 accumulation is also the more accurate form (the weight gradient, a sum
# over batch x positions, reaches the float32 master weight without a bf16 rounding in between).
F32 = jnp.float32


@functools.lru_cache(maxsize=512)
def transposed_equations(eq: str) -> tuple[str, str]:
    """'btd,df->btf' -> ('btf,df->btd', 'btd,btf->df'): the equations of d/dx and d/dw of einsum(eq, x, w).

    Needs an explicit two-operand equation in which every label of one operand also appears in the other or in the
    output (no label summed inside one operand, none repeated in an operand); anything else: ValueError."""
    e = eq.replace(" ", "")
    if "..." in e or "->" not in e or e.count(",") != 1:
        raise ValueError(f"einsum {eq!r}: the float32-accumulating einsum needs an explicit two-operand equation "
                         "such as 'btd,df->btf'")
    ins, out = e.split("->")
    xl, wl = ins.split(",")
    for part in (xl, wl, out):
        if len(set(part)) != len(part):
            raise ValueError(f"einsum {eq!r}: a label is repeated within one operand")
    for a, b in ((xl, wl), (wl, xl)):
        if any(lab not in b and lab not in out for lab in a):
            raise ValueError(f"einsum {eq!r}: a label is summed inside one operand; sum it before the einsum")
    if any(lab not in xl and lab not in wl for lab in out):
        raise ValueError(f"einsum {eq!r}: an output label appears in neither operand")
    return f"{out},{wl}->{xl}", f"{xl},{out}->{wl}"


def _acc32(eq, a, b):
    return jnp.einsum(eq, a, b, preferred_element_type=F32)


def _rounded_on_device(eq, a, b):
    """einsum(eq, a, b) accumulated in float32 and, lowered for a TPU or GPU, returned in the operands' dtype (the
    matrix unit's own rounding; float32 on XLA:CPU, where a float32 result is the fast form). Shown to the
    partitioner as the dot's result, the rounding decides what a contraction split over devices reduces: libtpu
    and XLA:GPU reduce the partial sums in the dot's result dtype, so a bf16 result halves a tensor-parallel
    reduce-scatter, as in the programs MaxText compiles (its dots return bf16)."""
    if a.dtype == F32 and b.dtype == F32:
        return _acc32(eq, a, b)
    return jax.lax.platform_dependent(
        a, b, cpu=functools.partial(_acc32, eq),
        default=lambda a, b: jnp.einsum(eq, a, b, preferred_element_type=a.dtype).astype(F32))


def _product(eq, a, b, rounded: bool):
    return _rounded_on_device(eq, a, b) if rounded else _acc32(eq, a, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _einsum_f32(eq, compute_dtype, rounded, grad_dtype, x, w):
    return _product(eq, x.astype(compute_dtype), w.astype(compute_dtype), rounded)


def _einsum_f32_fwd(eq, compute_dtype, rounded, grad_dtype, x, w):
    xc, wc = x.astype(compute_dtype), w.astype(compute_dtype)
    # residuals in the compute dtype (what the backward products read); zero-size protos carry the primal dtypes
    return _product(eq, xc, wc, rounded), (xc, wc, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _weight_grad(eq_dw: str, xc, gc, out_dtype=F32):
    """einsum(eq_dw, xc, gc) accumulated in float32: on XLA:CPU with the larger operand second (_weight_grad_cpu);
    other backends lay out their own dot operands and get the plain product (on TPU the CPU form, swapped operands
    behind an optimization barrier, made host offloading keep more in HBM: tests/programs/test_tpu_programs.py).
    Chosen when lowering, per platform (jax.lax.platform_dependent), so an ahead-of-time TPU compile from a CPU host
    takes the TPU form. There the product is returned in `out_dtype`, the weight's own: a bf16 weight (master
    weights in the optimizer) gets its gradient rounded by the dot, so the data-parallel reduction that follows
    runs on bf16, as Megatron's grad_sync_dtype=bf16 does (rounded after a float32 result, XLA may drop the
    rounding and reduce float32). The CPU returns float32, cast by the caller."""
    return jax.lax.platform_dependent(
        xc, gc, cpu=functools.partial(_weight_grad_cpu, eq_dw),
        default=lambda a, b: jnp.einsum(eq_dw, a, b, preferred_element_type=out_dtype).astype(F32)
        if out_dtype != F32 else _acc32(eq_dw, a, b))


def _weight_grad_cpu(eq_dw: str, xc, gc):
    """einsum(eq_dw, xc, gc) (the d/dw product: both operands contract the labels they share with the primal input,
    the batch and positions), float32 accumulation, with the larger operand second.

    A dot kernel wants its lhs contracted on its last dimension and its rhs on its first; d/dw contracts the leading
    (batch, positions) dimensions of both, so XLA materializes the lhs transposed. Second is where the larger one
    needs no transpose: only the smaller operand and the (weight-sized) result move. On XLA:CPU the transpose of a
    `small` MLP's (b·t, d_ff) activation, with its GELU recomputed inside the transposing loop, cost 121 ms a step
    against 8 for the transposed (b·t, d_model) cotangent (docs/models.md)."""
    if xc.size <= gc.size:
        return _acc32(eq_dw, xc, gc)
    ins, out = eq_dw.split("->")
    xl, gl = ins.split(",")
    # the result in dot order (the cotangent's free labels, then the input's), transposed to the weight's own
    # order afterwards: written straight to `out`, einsum would put the larger operand first again
    dot_out = "".join(lab for lab in out if lab in gl) + "".join(lab for lab in out if lab not in gl)
    y = _acc32(f"{gl},{xl}->{dot_out}", gc, xc)
    # the barrier keeps XLA from folding the transpose back into the dot (it would swap the operands again)
    return jnp.transpose(jax.lax.optimization_barrier(y), [dot_out.index(lab) for lab in out])


def _match_vma(ct, primal):
    """Inside shard_map: psum a cotangent over the manual mesh axes it varies over and its primal does not (what
    JAX's own transpose of the implicit pvary does; a custom VJP must do it itself). Outside: ct unchanged."""
    extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
    return jax.lax.psum(ct, extra) if extra else ct


def _einsum_f32_bwd(eq, compute_dtype, rounded, grad_dtype, res, g):
    xc, wc, x_proto, w_proto = res
    eq_dx, eq_dw = transposed_equations(eq)
    gc = g.astype(compute_dtype)  # the cotangent as a dot operand: the compute dtype, like the forward operands
    # d/dx rounded on a device as JAX's own derivative of the compute-dtype cast would be (the bf16 cotangent of
    # the bf16 operand): a tensor-parallel layer's input gradient is then summed over the model axis in bf16, as
    # in MaxText's programs. d/dw reaches the float32 master weight in float32, unless the caller asks for
    # `grad_dtype` (MaxText's dots return the compute dtype: its weight gradients are reduced over the data-parallel
    # devices in bf16 and widened after).
    dx = _match_vma(_product(eq_dx, gc, wc, rounded), xc)
    dw_dtype = (w_proto.dtype if grad_dtype is None else grad_dtype) if rounded else F32
    dw = _match_vma(_weight_grad(eq_dw, xc, gc, dw_dtype), wc)
    return dx.astype(x_proto.dtype), dw.astype(w_proto.dtype)


_einsum_f32.defvjp(_einsum_f32_fwd, _einsum_f32_bwd)


def einsum_f32(eq: str, x, w, compute_dtype=F32, rounded: bool = False, grad_dtype=None):
    """einsum(eq, x, w) with both operands cast to `compute_dtype`, accumulated in float32, returned in float32.

    rounded: the caller rounds the result to the compute dtype on a TPU or GPU anyway (finish_dot), so the dot
    itself returns the compute dtype there (_rounded_on_device: the same bits, and what the partitioner reduces
    across a split contraction is then compute-dtype partial sums); d/dx too, as the derivative of the cast to the
    compute dtype would give it. On a CPU nothing changes.

    Differentiable: for a compute dtype narrower than float32 both backward products (d/dx, d/dw) also take
    compute-dtype operands and accumulate and return float32, cast once to the dtype of x and w respectively. A
    float32 compute dtype takes the same custom VJP for its operand order (the weight gradient's larger operand
    second: the `small` float32 step ran 1.51 -> 1.19 s traced, docs/models.md); an equation the VJP cannot
    transpose stays a plain einsum in float32 and raises ValueError in a narrower dtype.

    grad_dtype (with `rounded`): the dtype the weight-gradient dot returns on a TPU or GPU; None: the weight's own
    (model config weight_grad_dtype, models/config.py)."""
    try:
        transposed_equations(eq)  # validate at trace time, with the equation in the message
    except ValueError:
        if np.dtype(compute_dtype) == np.float32:
            return _acc32(eq, x.astype(F32), w.astype(F32))
        raise
    return _einsum_f32(eq, compute_dtype, rounded, None if grad_dtype is None else jnp.dtype(grad_dtype), x, w)


def _ragged_dw_dims():
    # dw[e] = x[rows of e]^T . g[rows of e]: rows (ragged, contracted) of both operands, a group axis in the output
    return jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged_f32(compute_dtype, x_rd, w_edf, group_sizes):
    return jax.lax.ragged_dot(x_rd.astype(compute_dtype), w_edf.astype(compute_dtype), group_sizes,
                              preferred_element_type=F32)


def _ragged_f32_fwd(compute_dtype, x_rd, w_edf, group_sizes):
    xc, wc = x_rd.astype(compute_dtype), w_edf.astype(compute_dtype)
    y = jax.lax.ragged_dot(xc, wc, group_sizes, preferred_element_type=F32)
    return y, (xc, wc, group_sizes, jnp.zeros((0,), x_rd.dtype), jnp.zeros((0,), w_edf.dtype))


def _ragged_f32_bwd(compute_dtype, res, g_rf):
    xc, wc, group_sizes, x_proto, w_proto = res
    gc = g_rf.astype(compute_dtype)
    dx = jax.lax.ragged_dot(gc, jnp.swapaxes(wc, 1, 2), group_sizes, preferred_element_type=F32)
    dw = jax.lax.ragged_dot_general(xc, gc, group_sizes, _ragged_dw_dims(), preferred_element_type=F32)
    return _match_vma(dx, xc).astype(x_proto.dtype), _match_vma(dw, wc).astype(w_proto.dtype), None


_ragged_f32.defvjp(_ragged_f32_fwd, _ragged_f32_bwd)


def ragged_dot_f32(x_rd, w_edf, group_sizes, compute_dtype=F32):
    """jax.lax.ragged_dot (rows sorted by group, one (d, f) matrix per group) with compute-dtype operands and float32
    accumulation and result, forward and backward (as einsum_f32)."""
    if np.dtype(compute_dtype) == np.float32:
        return jax.lax.ragged_dot(x_rd.astype(F32), w_edf.astype(F32), group_sizes, preferred_element_type=F32)
    return _ragged_f32(compute_dtype, x_rd, w_edf, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _f32_on_narrow(fn, out_dtype, xs):
    return fn(*(x.astype(F32) for x in xs)).astype(out_dtype)


def _f32_on_narrow_fwd(fn, out_dtype, xs):
    return _f32_on_narrow(fn, out_dtype, xs), xs


def _f32_on_narrow_bwd(fn, out_dtype, xs, g):
    _, vjp = jax.vjp(fn, *(x.astype(F32) for x in xs))
    return (tuple(_match_vma(c.astype(x.dtype), x) for c, x in zip(vjp(g.astype(F32)), xs)),)


_f32_on_narrow.defvjp(_f32_on_narrow_fwd, _f32_on_narrow_bwd)


def elementwise_f32(fn, out_dtype, compute_dtype, *xs, rounded: int | None = None):
    """fn(*xs) in float32, rounded once to `out_dtype`: the activation between dots (a GELU epilogue, SwiGLU's
    silu(gate) * up).

    On XLA:CPU, or with a float32 compute dtype, plain autodiff (the form the host measurements were taken with).
    Lowered for an accelerator (jax.lax.platform_dependent), the inputs are first rounded to `compute_dtype` (the
    matrix unit's output) and the backward pass keeps only those narrow inputs, recomputing fn's float32 derivative
    from them: autodiff of the float32 form kept float32 copies (SwiGLU's gate, up and silu(gate) in a step without
    remat: three float32 tensors of tokens × d_ff per layer where Megatron's fused SwiGLU keeps its two bf16 inputs).
    `rounded`: how many leading inputs are rounded (default all; a bias after the accumulator stays as it is)."""
    def plain(*a):
        return fn(*(x.astype(F32) for x in a)).astype(out_dtype)

    if compute_dtype is None or np.dtype(compute_dtype).itemsize >= 4:
        return plain(*xs)

    n = len(xs) if rounded is None else rounded

    def narrow(*a):
        return _f32_on_narrow(fn, out_dtype, tuple(x.astype(compute_dtype) if i < n else x for i, x in enumerate(a)))

    return jax.lax.platform_dependent(*xs, cpu=plain, default=narrow)


def finish_dot(y, out_dtype, bias=None, epilogue=None, compute_dtype=None):
    """A dot's epilogue: `y` (its float32 accumulator) plus `bias`, then `epilogue` (an elementwise function, e.g.
    GELU), all in float32, rounded once to `out_dtype`.

    One rounding instead of one per elementwise op: a bf16 chain written op by op (bias add, then the tanh GELU's
    seven ops) rounds to bf16 after every op, and on a CPU without bf16 vector arithmetic each rounding is a
    convert pair that XLA:CPU does not vectorize well (the `small` bf16 step's GELU fusions ran at 4-8 GB/s,
    docs/models.md). float32 epilogues are what the matrix units of TPUs and GPUs do too, and what PyTorch's bf16
    kernels do per op (compute in float32, round the result).

    With a narrow `compute_dtype`, that form is the CPU's. Lowered for an accelerator (jax.lax.platform_dependent,
    so an ahead-of-time TPU compile from a CPU host takes it), the accumulator is rounded to the compute dtype
    first and the epilogue runs in float32 on that. A remat policy that saves dot outputs (`minimal`, `dots`) then
    saves them in the compute dtype, as MaxText's do. Saved in float32, the outputs of a `minimal` step
    doubled: MaxText's 32B recipe on v5p-128 needed 137 GB of temporaries (96 GB per chip) and fits with bf16
    outputs."""
    def once(y):
        if bias is not None or epilogue is not None:
            y = y.astype(F32)
            if bias is not None:
                y = y + bias.astype(F32)
            if epilogue is not None:
                y = epilogue(y)
        return y.astype(out_dtype)

    if compute_dtype is None or np.dtype(compute_dtype) == np.float32:
        return once(y)
    if epilogue is not None:  # its backward keeps the rounded accumulator, not a float32 copy (elementwise_f32)
        if bias is None:
            return elementwise_f32(epilogue, out_dtype, compute_dtype, y)
        return elementwise_f32(lambda y, b: epilogue(y + b), out_dtype, compute_dtype, y, bias, rounded=1)
    return jax.lax.platform_dependent(y, cpu=once, default=lambda y: once(y.astype(compute_dtype)))


class Einsum(nnx.Module):
    """Plain einsum: cast both operands to the compute dtype, accumulate in float32 (forward and backward: einsum_f32),
    return `out_dtype` (default: the compute dtype; float32 keeps the elementwise work between dots in float32).

    A call may add a `bias` and apply an elementwise `epilogue` to the float32 accumulator before the one rounding
    (finish_dot), and ask for its own `out_dtype` (float32 where the consumer works in float32: the residual stream,
    the softmax, the loss)."""

    def __init__(self, compute_dtype, out_dtype=None, grad_dtype=None):
        self.compute_dtype = compute_dtype
        self.out_dtype = compute_dtype if out_dtype is None else out_dtype
        self.grad_dtype = grad_dtype  # the weight gradient's dtype out of its dot on a TPU or GPU (einsum_f32)

    def __call__(self, eq: str, x, w, *, bias=None, epilogue=None, out_dtype=None):
        # finish_dot rounds the accumulator to the compute dtype on a TPU or GPU: the dot may return it there
        return finish_dot(einsum_f32(eq, x, w, self.compute_dtype, rounded=True, grad_dtype=self.grad_dtype),
                          self.out_dtype if out_dtype is None else out_dtype, bias, epilogue, self.compute_dtype)


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    name: str
    compute_dtype: object = jnp.float32
    param_dtype: object = jnp.float32
    description: str = ""
    activation_dtype: object = None  # what the einsums return; None: compute_dtype
    weight_grad_dtype: object = None  # what a weight-gradient dot returns on a TPU or GPU; None: the weight's dtype

    def einsum_module(self, rngs: nnx.Rngs | None = None) -> nnx.Module:
        return Einsum(self.compute_dtype, self.activation_dtype, self.weight_grad_dtype)

    def with_weight_grads_in_compute_dtype(self) -> PrecisionPolicy:
        """This policy with each weight-gradient dot returning the compute dtype on a TPU or GPU (model config
        weight_grad_dtype=compute, MaxText's program); a float32 policy is unchanged."""
        return dataclasses.replace(self, weight_grad_dtype=jnp.dtype(self.compute_dtype))

    @property
    def loss_scaling(self):
        """None, or an object with init()/scale(loss)/unscale_and_check(grads, state) for fp16 dynamic scaling."""
        return None


_REGISTRY: dict[str, Callable[..., PrecisionPolicy]] = {
    "float32": lambda **kw: PrecisionPolicy("float32", jnp.float32, description="float32 everywhere"),
    "bf16": lambda **kw: PrecisionPolicy(
        "bf16", jnp.bfloat16,
        description="float32 master parameters, bfloat16 compute, float32 accumulation/softmax/norms/optimizer"),
    # bf16 dot operands only: every dot returns its float32 accumulator and the elementwise work between dots (biases,
    # GELU, the attention scale and transposes) stays in float32, so a CPU without bf16 vector arithmetic converts
    # only the dot operands (docs/models.md, bf16 on CPU hosts)
    "bf16-f32act": lambda **kw: PrecisionPolicy(
        "bf16-f32act", jnp.bfloat16, activation_dtype=jnp.float32,
        description="as bf16, but the dots return float32: elementwise work between dots in float32, bf16 only as "
                    "dot operands"),
}
_EXTENSIONS = ["models.quant"]  # modules that add policies to _REGISTRY when imported


def register(name: str, factory: Callable[..., PrecisionPolicy]) -> None:
    _REGISTRY[name] = factory


def available() -> list[str]:
    _load_extensions()
    return sorted(_REGISTRY)


def _load_extensions():
    import importlib

    for m in _EXTENSIONS:
        try:
            importlib.import_module(m)
        except ModuleNotFoundError as e:
            if e.name != m:
                raise


def get_policy(name: str, **options) -> PrecisionPolicy:
    """Policy by name ('float32', 'bf16', ...). Unknown or ambiguous names raise a one-line WorkbenchError."""
    _load_extensions()
    if isinstance(name, PrecisionPolicy):
        return name
    if name not in _REGISTRY:
        hint = ""
        if name == "fp8":
            hint = " ('fp8' is ambiguous: choose a scaling recipe, fp8-current or fp8-delayed)"
        raise WorkbenchError(f"unknown precision policy {name!r}{hint}; choose one of {', '.join(available())}")
    return _REGISTRY[name](**options)
