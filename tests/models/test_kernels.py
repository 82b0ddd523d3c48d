"""Pallas kernels (models/kernels): blocked matmul, the fused bias + activation epilogue and causal attention against a float64
reference in interpret mode (odd and tile-multiple shapes, masked K edges, bf16 and f32, both backends' forms);
the cost they state; one compile for a TPU from this host."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.kernels.matmul import Block, kernel_cost, matmul, reference
from partitioning import topology as topo
from workbench.testing import assert_close

CASES = [
    # (m, n, k), block, activation, backend
    ((128, 256, 384), (64, 128, 128), "none", "tpu"),     # every dimension a multiple of its block
    ((100, 200, 300), (64, 128, 128), "gelu", "tpu"),     # odd: M, N and K edges; K masked (300 = 2·128 + 44)
    ((37, 130, 129), (16, 128, 128), "relu", "tpu"),      # one column past a block in N and in K
    ((100, 200, 300), (64, 128, 128), "gelu", "gpu"),     # the Triton form (operands padded to whole blocks)
    ((128, 128, 256), (64, 64, 64), "none", "gpu"),
]


def _inputs(m, n, k, dtype, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    # round to the operand dtype first, so the reference sees exactly the kernel's inputs
    return (jnp.asarray(a, dtype), jnp.asarray(b, dtype), jnp.asarray(bias, dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape,block,activation,backend", CASES)
def test_matmul_matches_float64_in_interpret_mode(shape, block, activation, backend, dtype):
    m, n, k = shape
    a, b, bias = _inputs(m, n, k, dtype)
    use_bias = activation != "none"
    out = matmul(a, b, bias if use_bias else None, block=block, activation=activation, backend=backend,
                 interpret=True)
    assert out.shape == (m, n) and out.dtype == jnp.dtype(dtype)
    ref = reference(np.asarray(a, np.float64), np.asarray(b, np.float64),
                    np.asarray(bias, np.float64) if use_bias else None, activation)
    assert np.isfinite(np.asarray(out, np.float32)).all(), "an unmasked edge leaked padding into the result"
    # float32: the accumulation of k products rounds k times, growing like sqrt(k) (the table's tolerance is per
    # operation); bfloat16: the output's own rounding dominates (the reference sees the same bf16 inputs)
    assert_close(np.asarray(out, np.float32), ref, dtype, scale=math.sqrt(k) if dtype == "float32" else 1.0)


def test_k_edge_mask_is_what_keeps_padding_out():
    """Without the K mask the interpreter's NaN padding of the last block reaches every output element."""
    import models.kernels.matmul as km

    a, b, _ = _inputs(40, 128, 200, "float32")
    good = matmul(a, b, block=(16, 128, 128), interpret=True)
    assert np.isfinite(np.asarray(good)).all()
    orig = km._tpu_kernel
    try:
        km._tpu_kernel = lambda *r, **kw: orig(*r, **dict(kw, k_rem=0))
        bad = km.matmul(a, b, block=(16, 128, 128), interpret=True)
    finally:
        km._tpu_kernel = orig
    assert np.isnan(np.asarray(bad)).all()


def test_kernel_cost_is_the_blocked_schedule():
    """Hand count: M=N=K=1024 in 256x512x128 blocks, bf16: a read N/bn=2 times, b read M/bm=4 times, out once."""
    c = kernel_cost(1024, 1024, 1024, Block(256, 512, 128), 2, 2)
    assert c.grid == (4, 2, 8)
    assert c.flops == 2 * 1024**3
    assert c.bytes_accessed == 2 * 1024 * 1024 * 2 + 4 * 1024 * 1024 * 2 + 1024 * 1024 * 2
    g = kernel_cost(1000, 1000, 1000, Block(128, 128, 128), 4, 4, bias=True, activation="gelu")
    assert g.transcendentals == 1000 * 1000
    assert g.grid == (8, 8, 8)


def test_bad_shapes_are_one_line_errors():
    from workbench.errors import WorkbenchError

    a = jnp.ones((8, 16))
    with pytest.raises(WorkbenchError, match="matmul needs"):
        matmul(a, jnp.ones((8, 16)), interpret=True)
    with pytest.raises(WorkbenchError, match="activation"):
        matmul(a, jnp.ones((16, 8)), activation="swish", interpret=True)


@pytest.mark.compile_heavy
@pytest.mark.skipif(not topo.libtpu_available(), reason="libtpu not installed (pip install -e .[tpu])")
def test_pallas_matmul_compiles_for_tpu_v5e_and_states_its_cost():
    """Mosaic compiles the kernel for a compile-only v5e from this CPU host; XLA reads the kernel's own cost."""
    from jax.sharding import SingleDeviceSharding

    dev = topo.tpu_devices("tpu-v5e:1x1")[0]
    s = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=SingleDeviceSharding(dev))
    bias = jax.ShapeDtypeStruct((256,), jnp.bfloat16, sharding=SingleDeviceSharding(dev))
    c = jax.jit(lambda x, y, z: matmul(x, y, z, block=(128, 128, 128), activation="gelu")).lower(s, s, bias).compile()
    assert "tpu_custom_call" in c.as_text()
    ca = c.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    want = kernel_cost(256, 256, 256, Block(128, 128, 128), 2, 2, bias=True, activation="gelu")
    assert ca["flops"] == pytest.approx(want.flops)
    # the HLO reader takes the same declared cost from the kernel's backend config: programs with loops are counted
    # from the HLO kernels, so a Pallas kernel inside a scanned layer (megablox gmm in the MoE block) is not 0 flops
    from workbench.cost.hlo import parse_kernels

    kernels = parse_kernels(c.as_text())
    assert sum(k.flops * k.count for k in kernels) == pytest.approx(want.flops, rel=0.01)
    assert sum(k.transcendentals * k.count for k in kernels) == pytest.approx(want.transcendentals, rel=0.01)


@pytest.mark.skipif(not any(d.platform == "gpu" for d in jax.devices()) if jax.default_backend() != "cpu" else True,
                    reason="the Pallas GPU (Triton) compiler needs a GPU attached; this host has none")
def test_pallas_matmul_runs_on_gpu():  # pragma: no cover - GPU hosts only
    a, b, bias = _inputs(300, 200, 500, "bfloat16")
    out = matmul(a, b, bias, block=(64, 64, 64), activation="gelu", backend="gpu")
    assert_close(np.asarray(out, np.float32), reference(a, b, bias, "gelu"), "bfloat16")


# ---------------------------------------------------------------------------------------------- causal attention

ATTN_CASES = [
    ((2, 256, 64), (128, 128), True),    # blocks divide S; the diagonal blocks are partly masked, the rest skipped
    ((3, 200, 64), (64, 128), True),     # S = 200: the last key block runs past S (masked scores, zeroed values)
    ((2, 200, 32), (128, 64), False),    # no causal mask: every block visited
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape,blocks,causal", ATTN_CASES)
def test_causal_attention_matches_float64_in_interpret_mode(shape, blocks, causal, dtype):
    from models.kernels.attention import causal_attention
    from models.kernels.attention import reference as attn_reference

    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype) for _ in range(3))
    out = causal_attention(q, k, v, block_q=blocks[0], block_k=blocks[1], causal=causal, interpret=True)
    assert out.shape == shape and out.dtype == jnp.dtype(dtype)
    ref = attn_reference(*(np.asarray(x, np.float64) for x in (q, k, v)), causal=causal)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    # float32: scores contract over D, the output over S keys: rounding grows like sqrt(D + S). bfloat16: the
    # probabilities are rounded to bf16 before p·v (as flash kernels do), so the output carries S roundings of p
    # on top of its own: 4x the one-rounding tolerance
    assert_close(np.asarray(out, np.float32), ref, dtype,
                 scale=math.sqrt(shape[1] + shape[2]) if dtype == "float32" else 4.0)


def test_attention_cost_counts_the_visited_blocks():
    from models.kernels.attention import attention_cost, visited_fraction

    assert visited_fraction(256, 128, 128, True) == 0.75       # of the 2x2 block pairs, the upper one is skipped
    assert visited_fraction(256, 128, 128, False) == 1.0
    c = attention_cost(4, 256, 64, 128, 128, 2, causal=True)
    assert c.flops == 4 * 4 * 256 * 256 * 64 * 0.75
    assert c.bytes_accessed == 4 * 256 * 64 * 2 * 2 + 4 * 256 * 64 * 2 * 2 * 2 * 0.75


@pytest.mark.compile_heavy
@pytest.mark.skipif(not topo.libtpu_available(), reason="libtpu not installed (pip install -e .[tpu])")
def test_causal_attention_compiles_for_tpu_v5e():
    from jax.sharding import SingleDeviceSharding

    from models.kernels.attention import attention_cost, causal_attention

    dev = topo.tpu_devices("tpu-v5e:1x1")[0]
    s = jax.ShapeDtypeStruct((2, 512, 128), jnp.bfloat16, sharding=SingleDeviceSharding(dev))
    c = jax.jit(lambda q, k, v: causal_attention(q, k, v)).lower(s, s, s).compile()
    assert "tpu_custom_call" in c.as_text()
    ca = c.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    assert ca["flops"] == pytest.approx(attention_cost(2, 512, 128, 128, 128, 2).flops)
