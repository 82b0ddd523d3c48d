"""The fusion explorer (workbench.programs.fusion, `workbench fusion`): kernel counts a program's structure fixes,
barriers, the unfused program's bytes against a plain count over its jaxpr, TPU against XLA:CPU, bad input."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from workbench.cli import main
from workbench.errors import WorkbenchError
from workbench.programs import fusion as fx

N = 1 << 16
X = jax.ShapeDtypeStruct((N,), jnp.float32)


def chain(x, y):
    """Four elementwise ops on whole arrays (no constants for XLA to broadcast or fold): one loop fusion."""
    a = x * y
    b = a + x
    c = b * y
    return c - x


def chain_with_barrier(x, y):
    b = jax.lax.optimization_barrier(x * y + x)
    return b * y - x


def compute_kernels(v):
    return [k for k in v.kernels if k.xla_kind != "opt-barrier"]


def test_chain_fuses_into_one_kernel(results_dir):
    r = fx.explore(fx.function_program(chain, X, X), no_fusion=False, measure_it=False)
    (k,) = r.default.kernels
    assert k.kind == "loop" and k.ops == {"multiply": 2, "add": 1, "subtract": 1}
    assert k.bytes == 3 * N * 4  # reads x and y, writes the result: once each
    assert k.predicted_s > 0 and k.measured_s is None


def test_barrier_gives_two_kernels_once_xla_cpu_keeps_it(results_dir):
    """XLA:CPU drops optimization barriers (the default compile fuses through it); the explorer finds the pass that
    does so in the compiler's dump and switches it off for the barrier variant, which then has two kernels."""
    r = fx.explore(fx.function_program(chain_with_barrier, X, X), no_fusion=False, barriers_in_program=True,
                   measure_it=False)
    if len(r.default.kernels) == 2:  # this XLA:CPU keeps the barrier (jax 0.12): the default splits there already
        assert len(compute_kernels(r.default)) == 2
        return
    assert len(r.default.kernels) == 1  # the barrier was dropped (jax 0.10)
    assert r.barrier_pass  # the pass that drops it, read from the dump (cse_barrier_expander in jax 0.10)
    (name,) = [n for n in r.variants if n.startswith("barriers")]
    assert len(compute_kernels(r.variants[name])) == 2
    assert r.variants[name].notes and r.barrier_pass in r.variants[name].notes[0]


def test_barrier_rewrite_at_a_chosen_point(results_dir):
    """The program rewritten with a barrier after its second equation (the add): two kernels, same values."""
    r = fx.explore(fx.function_program(chain, X, X), no_fusion=False, barrier_after=lambda i, e: i == 1,
                   measure_it=False)
    v = r.variants["barriers(predicate)"]
    assert v.barriers == 1 and len(compute_kernels(v)) == 2
    fn, n, prims = fx.with_barriers(chain, (X, X), lambda i, e: i == 1)
    x, y = jnp.arange(8.0), jnp.full((8,), 1.5)
    np.testing.assert_array_equal(jax.jit(fn)(x, y), chain(x, y))
    assert n == 1 and {"mul", "add", "sub"} <= prims


def test_unfused_bytes_are_the_ops_operands_and_results(results_dir):
    """With every fusing pass off, the bytes moved equal a plain sum over the program's jaxpr equations of their
    operands' and results' sizes (each op reads its inputs from memory and writes its output)."""
    r = fx.explore(fx.function_program(chain, X, X), measure_it=False)
    jaxpr = jax.make_jaxpr(chain)(X, X).jaxpr
    expected = 0
    for eqn in jaxpr.eqns:
        for v in list(eqn.invars) + list(eqn.outvars):
            expected += int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize
    un = r.variants["no-fusion"]
    assert "fusion" in r.fusion_passes
    assert len(compute_kernels(un)) == len(jaxpr.eqns) == 4
    assert un.bytes == expected
    assert r.saved_bytes == expected - 3 * N * 4
    d = r.diffs["no-fusion"]
    assert d["n_split"] == 1 and len(d["split"][0]["into"]) == 4  # the one fusion split into its four ops
    assert r.speedup["predicted"] > 1


@pytest.mark.compile_heavy
def test_tpu_and_cpu_kernel_lists_differ_for_dot_bias_activation(results_dir):
    """XLA:CPU hands the dot to YNNPACK and fuses bias + GELU in a loop fusion after it; the TPU compiler fuses
    all three into the dot's output fusion."""
    def layer(x, w, b):
        return jax.nn.gelu(x @ w + b)

    args = (jax.ShapeDtypeStruct((256, 512), jnp.float32), jax.ShapeDtypeStruct((512, 512), jnp.float32),
            jax.ShapeDtypeStruct((512,), jnp.float32))
    r = fx.explore(fx.function_program(layer, *args, target="tpu-v5e:1x1"), no_fusion=False)
    tpu = [k for k in r.default.kernels if k.flops > 0]
    host = [k for k in r.host_compare["host_kernel_list"] if k["flops"] > 0]
    assert r.default.predicted_s > 0 and r.default.measured_s is None
    with_all = [k for k in tpu if {"tanh", "add"} <= set(k.ops) and ({"dot", "convolution"} & set(k.ops))]
    assert len(with_all) == 1 and with_all[0].kind == "dot/convolution"
    assert not [k for k in host if "tanh" in k["ops"] and ({"dot", "convolution"} & set(k["ops"]))]
    assert len(host) > len(tpu)
    assert r.host_compare["target_fuses_host_does_not"]


def test_bad_input_one_line_errors(results_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(WorkbenchError, match="comma"):
        fx.parse_pass_list("fusion dce")
    with pytest.raises(WorkbenchError, match="not an XLA flag"):
        fx.parse_xla_flags("fast-math")
    with pytest.raises(SystemExit) as e:
        main(["fusion", "--op", "softmax", "--rows", "64", "--cols", "32", "--disable-passes", "NONSENSE"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) - sum(1 for line in err if line.startswith("fusion:")) == 1
    assert "NONSENSE" in err[-1] and "comma-separated" in err[-1]
    with pytest.raises(WorkbenchError, match="XLA rejected .*xla_no_such_flag"):
        fx.explore(fx.function_program(chain, X, X), xla_flags=["--xla_no_such_flag=1"], measure_it=False)


def test_cli_json_keys_and_measured_kernels(results_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main(["fusion", "--op", "elementwise", "--n", "65536", "--repeats", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert list(out["variants"])[:2] == ["default", "no-fusion"]
    for name, v in out["variants"].items():
        assert {"kernels", "bytes", "flops", "predicted_s", "measured_s"} <= set(v)
        assert v["kernels"] == len(out["kernels"][name]) and v["measured_s"] > 0
    assert out["variants"]["no-fusion"]["bytes"] >= 5 * out["variants"]["default"]["bytes"]
    assert out["saved_bytes"] > 0 and set(out["speedup"]) == {"measured", "predicted"}
    assert any(k["measured_s"] for k in out["kernels"]["default"])  # from the trace
    assert "loop" in out["prediction_error_by_kind"]["default"]
    assert (tmp_path / out["chart"]).exists()
    recs = [json.loads(line) for line in open(results_dir / "records.jsonl")]
    assert {r["spec"]["variant"] for r in recs if r["kind"] == "fusion"} == set(out["variants"])
