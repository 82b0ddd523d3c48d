"""The training loss: the value and gradient of optax's cross-entropy, without a float32 copy of the logits kept for
the backward pass."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from partitioning import topology as topo
from workbench.programs import predict as wp
from workbench.programs import step
from workbench.programs.step import cross_entropy
from workbench.testing import assert_close


def _reference(logits, targets):
    """optax's loss in float64 on the same logits (widened), and its gradient."""
    with jax.enable_x64():
        x = jnp.asarray(np.asarray(logits, np.float64))
        f = lambda x: optax.softmax_cross_entropy_with_integer_labels(x, jnp.asarray(targets)).mean()  # noqa: E731
        return float(f(x)), np.asarray(jax.grad(f)(x))


def _case(dtype, shape=(2, 7, 33), seed=0):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=shape).astype(np.float32) * 4, dtype)
    targets = jnp.asarray(rng.integers(0, shape[-1], size=shape[:-1]), jnp.int32)
    return logits, targets


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_value_and_gradient_are_optax_s(dtype):
    logits, targets = _case(dtype)
    want_loss, want_grad = _reference(logits, targets)
    loss, grad = jax.jit(jax.value_and_grad(cross_entropy))(logits, targets)
    assert loss.dtype == jnp.float32 and grad.dtype == logits.dtype
    # the loss is computed in float32 either way; the gradient is rounded once to the logits' dtype
    assert_close(loss, want_loss, "float32", scale=10)
    assert_close(grad, want_grad, dtype, scale=max(1.0, float(np.abs(want_grad).max()) / 1e-3))


def test_gradient_scales_with_the_incoming_cotangent_and_ignores_integer_targets():
    logits, targets = _case("float32", shape=(3, 17))
    g1 = jax.grad(lambda x: 2.5 * cross_entropy(x, targets))(logits)
    g0 = jax.grad(cross_entropy)(logits, targets)
    assert_close(g1, 2.5 * np.asarray(g0), "float32")
    # each row of softmax − one_hot sums to zero
    assert_close(np.asarray(g0).sum(-1), np.zeros(3), "float32")


@pytest.mark.compile_heavy
@pytest.mark.skipif(not topo.libtpu_available(), reason="libtpu not installed (pip install -e .[tpu])")
def test_a_compiled_training_step_keeps_no_float32_copy_of_the_logits(monkeypatch):
    """A vocabulary-heavy training step compiled by libtpu for v5e:2x2: its temporaries stay under one float32 copy
    of each device's logits (4 × 512 × 32768: 256 MiB). Differentiated by JAX, optax's loss keeps
    exp(logits − max) in float32 for the backward pass and the step needs more than that copy (391 MiB)."""
    spec = wp.PredictSpec("tiny", "tpu-v5e:2x2", "fsdp", batch=16, seq=512, remat="full",
                          overrides="n_layers=2,d_model=256,n_heads=4,d_ff=1024,vocab_size=32768,seq_len=512,"
                                    "scan_layers=true")
    f32_logits = 4 * 512 * 32768 * 4

    def temps():
        return wp.lower(spec, precheck=False).lowered.compile().memory_analysis().temp_size_in_bytes

    ours = temps()
    monkeypatch.setattr(step, "cross_entropy", lambda x, t: optax.softmax_cross_entropy_with_integer_labels(
        x.astype(jnp.float32), t).mean())
    jax_derived = temps()
    assert ours < f32_logits <= jax_derived, (ours, f32_logits, jax_derived)
