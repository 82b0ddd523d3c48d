"""Measurement harness and results store."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from workbench.errors import RecompileError, WorkbenchError
from workbench.measure.harness import measure, measure_steps, random_inputs, summarize
from workbench.results.store import Store, make_record


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


def test_wide_spread_flagged():
    m = summarize([1.0, 1.0, 2.0, 3.0, 1.0], warmup=1, calls=1, compile_s=None)
    assert m.wide_spread and any("wide spread" in n for n in m.notes)
    assert not summarize([1.0, 1.01, 0.99, 1.0], warmup=1, calls=1, compile_s=None).wide_spread


def test_random_inputs_never_zero():
    a = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    (x,) = random_inputs((a,))
    assert x.dtype == jnp.bfloat16 and float(jnp.abs(x).sum()) > 0 and float(x.std()) > 0.5


def test_store_roundtrip_and_dataframe(tmp_path):
    st = Store(str(tmp_path))
    r = st.append(make_record("t", {"op": "x"}, extra={"v": float("nan")}, seed=3))
    st.append(make_record("u", {"op": "y"}))
    assert [x["id"] for x in st.records()][0] == r["id"]
    assert r["extra"]["v"] is None and r["provenance"]["seed"] == 3 and r["provenance"]["jax"] == jax.__version__
    df = st.load()
    assert len(df) == 2 and "spec.op" in df.columns
    assert len(st.records("u")) == 1


def test_corrupt_and_incomplete_files(tmp_path):
    st = Store(str(tmp_path))
    st.append(make_record("t", {}))
    before = open(st.path).read()
    with open(st.path, "a") as f:
        f.write('{"half": ')  # a torn write from outside
    with pytest.raises(WorkbenchError, match="incomplete record"):
        st.append(make_record("t", {}))
    assert open(st.path).read() == before + '{"half": ', "nothing appended to a damaged file"
    with pytest.raises(WorkbenchError, match=r"records.jsonl:2"):
        st.records()
    assert json.loads(before)["kind"] == "t"
    os.remove(st.path)
    assert st.records() == []


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
    assert prof["matmul_rate"] and prof["matmul_rate"] > 0


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
    assert 0 < fl["rate"] < 1e14


def test_mfu_chart_writes_a_png(tmp_path):
    from workbench.results.figures import mfu_chart

    rows = [{"devices": d, "strategy": "dp", "mesh": f"data={d}", "batch": 8, "mfu": m,
             "mfu_bound": b,
             "kernel_profile": {"kernel_ms": 10.0, "classes": {"matmul": {"ms": 7.0}, "collective": {"ms": 3.0}}}}
            for d, m, b in ((1, 0.5, 0.85), (8, 0.4, None))]
    path = mfu_chart(rows, str(tmp_path / "mfu.png"), targets={1: 0.8, 8: 0.65})
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
