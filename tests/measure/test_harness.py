"""The measurement harness: statistics, recompile guard, random inputs, per-kernel profiles and the dot floor."""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from workbench.errors import RecompileError
from workbench.measure.calibrate import cpu_features
from workbench.measure.harness import measure, measure_interleaved, measure_steps, random_inputs, summarize


def test_measure_stats_and_batching():
    f = jax.jit(lambda x: x * 2.0)
    x = jnp.ones((1000,))
    m = measure(f, x, warmup=1, repeats=5)
    assert m.repeats == 5 and m.min_s <= m.median_s and m.calls_per_repeat > 1
    assert m.iqr_s >= 0


def test_recompile_during_timing_is_an_error():
    f = jax.jit(lambda x: x + 1)

    def step(i):
        return f(jnp.ones((2 + i,)))  # a new shape every call → recompiles

    with pytest.raises(RecompileError):
        measure_steps(step, warmup=1, repeats=3, guard=f)


def test_steps_are_timed_until_they_add_up_to_the_floor():
    """measure_steps times at least `repeats` steps, then more until their sum reaches min_total_s, never past
    max_repeats; without a floor, exactly `repeats`."""
    seen = []

    def step(i):
        seen.append(i)
        time.sleep(0.002)
        return jnp.zeros(())

    m = measure_steps(step, warmup=1, repeats=3, min_total_s=0.05, max_repeats=500)
    assert 0.05 <= sum(m.times_s) < 0.05 + 5 * max(m.times_s) and m.repeats == len(m.times_s) > 3
    assert seen == list(range(1 + m.repeats))  # warm-up step 0, then the timed steps in order
    assert measure_steps(step, warmup=1, repeats=3).repeats == 3
    assert measure_steps(step, warmup=1, repeats=3, min_total_s=10.0, max_repeats=6).repeats == 6


def test_measure_times_until_the_batches_add_up_to_the_floor():
    """measure takes at least `repeats` timings (each a batch of calls), then more until the batches add up to
    min_total_s, never past max_repeats; without a floor, exactly `repeats`."""
    def slow(x):
        time.sleep(0.002)
        return x

    m = measure(slow, 1.0, warmup=1, repeats=3, min_batch_s=0.0, min_total_s=0.05, max_repeats=500)
    assert m.calls_per_repeat == 1 and m.repeats == len(m.times_s) > 3
    assert 0.05 <= sum(m.times_s) < 0.05 + 5 * max(m.times_s)
    assert measure(slow, 1.0, warmup=1, repeats=3, min_batch_s=0.0).repeats == 3
    assert measure(slow, 1.0, warmup=1, repeats=3, min_batch_s=0.0, min_total_s=10.0, max_repeats=6).repeats == 6


def test_interleaved_rounds_time_every_program_once_per_round():
    calls = {"a": 0, "b": 0}

    def counted(name, fn):
        def call(x):
            calls[name] += 1
            return fn(x)
        return call

    small, big = jnp.ones((8,)), jnp.ones((512, 512))
    f = jax.jit(lambda x: x + 1)
    g = jax.jit(lambda x: (x @ x) @ x)
    meas, per_round = measure_interleaved({"a": (counted("a", f), small), "b": (counted("b", g), big)},
                                          warmup=1, rounds=4)
    assert calls == {"a": 5, "b": 5}  # one warm-up + one call per round each
    assert len(per_round["a"]) == len(per_round["b"]) == 4 and meas["a"].repeats == 4
    assert np.median(np.array(per_round["a"]) / np.array(per_round["b"])) < 1  # two 512^3 matmuls > an add


def test_wide_spread_flagged():
    m = summarize([1.0, 1.0, 2.0, 3.0, 1.0], warmup=1, calls=1, compile_s=None)
    assert m.wide_spread and any("wide spread" in n for n in m.notes)
    assert not summarize([1.0, 1.01, 0.99, 1.0], warmup=1, calls=1, compile_s=None).wide_spread


def test_random_inputs_never_zero():
    a = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    (x,) = random_inputs((a,))
    assert x.dtype == jnp.bfloat16 and float(jnp.abs(x).sum()) > 0 and float(x.std()) > 0.5


def _host_float32_ceiling() -> float:
    """An upper bound no float32 matmul here can beat: every core this process may use × float32 lanes of its widest
    vector unit (from the CPU flags) × 2 FMA pipes (the most any x86 core has) × 2 FLOP per FMA × 6 GHz (above
    any shipping server clock, boost included)."""
    feat = cpu_features()
    flags = set(feat["flags"])
    lanes = 16 if "avx512f" in flags else 8 if "avx" in flags or "avx2" in flags else 4
    return feat["cores"] * lanes * 2 * 2 * 6e9


def test_profile_kernels_joins_trace_times_with_hlo_costs():
    """A traced matmul + elementwise program: the dot is found, classed as a matmul, its flops are 2mnk per call,
    every kernel has a positive time, and the classes add up to the kernel total."""
    from workbench.measure.harness import profile_kernels

    m, k, n = 256, 512, 384
    f = jax.jit(lambda a, b: jnp.tanh(a @ b) * 2.0)
    a = jax.random.normal(jax.random.key(0), (m, k))
    b = jax.random.normal(jax.random.key(1), (k, n))
    compiled = f.lower(a, b).compile()
    prof = profile_kernels(lambda i: compiled(a, b), compiled.as_text(), steps=3)
    dots = [r for r in prof["kernels"] if r["class"] == "matmul"]
    assert len(dots) == 1, prof["kernels"]
    assert dots[0]["calls"] == 1 and dots[0]["ms"] > 0
    np.testing.assert_allclose(dots[0]["gflop"], 2 * m * k * n / 1e9, rtol=1e-6)
    assert dots[0]["dot"].startswith(f"f32[{m},{n}]")
    assert all(r["ms"] > 0 for r in prof["kernels"])
    np.testing.assert_allclose(sum(c["ms"] for c in prof["classes"].values()), prof["kernel_ms"], rtol=1e-9)
    # the matmul rate is the dots' flops over their traced time, and no faster than this host can physically go
    dot_s = sum(r["ms"] for r in dots) / 1e3
    assert prof["matmul_rate"] == pytest.approx(sum(r["gflop"] for r in dots) * 1e9 / dot_s, rel=1e-9)
    assert prof["matmul_rate"] <= _host_float32_ceiling()


def test_dot_floor_times_each_distinct_dot_once_and_counts_its_runs():
    """Two dots of the same sizes (one with a transposed operand) and a different one: the floor times two sizes,
    counts two runs of the shared one, adds their flops exactly, and every timing comes from the trace."""
    from workbench.measure.harness import dot_floor

    m, k, n = 192, 256, 128

    def f(a, b, at, c):
        return a @ b, jax.lax.dot_general(at, b, (((0,), (0,)), ((), ()))), b.T @ c

    args = (jnp.ones((m, k)), jnp.ones((k, n)), jnp.ones((k, m)), jnp.ones((k, 64)))
    fl = dot_floor(jax.jit(f).lower(*args).compile().as_text(), steps=2, warmup=1)
    rows = {r["dot"]: r for r in fl["dots"]}
    assert set(rows) == {f"({m}×{k})·({k}×{n}) f32", f"({n}×{k})·({k}×64) f32"}, rows
    assert rows[f"({m}×{k})·({k}×{n}) f32"]["count"] == 2
    np.testing.assert_allclose(fl["gflop"], (2 * 2 * m * k * n + 2 * n * k * 64) / 1e9, rtol=1e-9)
    assert all(r["timed_by"] == "trace" and r["ms_each"] > 0 for r in rows.values())
    np.testing.assert_allclose(fl["dot_s"] * 1e3, sum(r["ms_total"] for r in rows.values()), rtol=1e-9)
    assert fl["rate"] == pytest.approx(fl["gflop"] * 1e9 / fl["dot_s"], rel=1e-9)
    assert fl["rate"] <= _host_float32_ceiling()


