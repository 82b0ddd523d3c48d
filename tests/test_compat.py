"""The version layer (workbench.compat) on whichever jax this venv has, provenance, and the cross-version compare."""
import jax
import jax.numpy as jnp
import pytest

from workbench import compat
from workbench.results.store import Store, experiment_key, make_record, versions


def test_versions_name_the_jax_stack():
    v = versions()
    assert v["jax"] == jax.__version__ and v["jaxlib"] and v["python"].count(".") == 2
    for k in ("libtpu", "flax", "optax", "orbax_checkpoint"):
        assert k in v  # None when not installed, but always recorded
    assert compat.JAX_VERSION[:2] >= (0, 10)


def test_mesh_axes_are_auto_and_shard_map_is_jax_own():
    m = compat.jax_mesh((2, 4), ("data", "model"))
    assert m.shape == {"data": 2, "model": 4} and all(t == jax.sharding.AxisType.Auto for t in m.axis_types)
    assert compat.shard_map is jax.shard_map
    f = compat.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=m, in_specs=jax.sharding.PartitionSpec("data"),
                         out_specs=jax.sharding.PartitionSpec())
    x = jnp.arange(2.0 * 3).reshape(2, 3)
    assert jnp.allclose(jax.jit(f)(x), x.sum(0, keepdims=True))


def test_varying_axes_inside_and_outside_shard_map():
    """The manual axes a value varies over: the sharded axis for a sharded input, none for a replicated one or a
    psum's result, and none outside shard_map (whichever spelling the jax version has)."""
    m = compat.jax_mesh((2, 4), ("data", "model"))
    P = jax.sharding.PartitionSpec
    seen = {}

    def body(x, w):
        seen["x"], seen["w"] = compat.varying_axes(x), compat.varying_axes(w)
        seen["sum"] = compat.varying_axes(jax.lax.psum(x, "data"))
        return x

    jax.jit(compat.shard_map(body, mesh=m, in_specs=(P("data"), P()), out_specs=P("data")))(
        jnp.ones((4, 3)), jnp.ones((3,)))
    assert seen == {"x": frozenset({"data"}), "w": frozenset(), "sum": frozenset()}
    assert compat.varying_axes(jnp.ones(3)) == frozenset()


class _C:
    def __init__(self, ca=None, exc=None):
        self.ca, self.exc = ca, exc

    def cost_analysis(self):
        if self.exc:
            raise self.exc
        return self.ca

    def memory_analysis(self):
        if self.exc:
            raise self.exc
        return None


@pytest.mark.parametrize("ca,want,note", [
    ({"flops": 3.0}, {"flops": 3.0}, None),
    ([{"flops": 3.0}], {"flops": 3.0}, None),
    ([{"flops": 3.0}, {"flops": 4.0, "bytes accessed": 1.0}], {"flops": 7.0, "bytes accessed": 1.0}, "2 entries"),
    (None, {}, "returned nothing"),
])
def test_cost_analysis_shapes_are_one_dict(ca, want, note):
    d, notes = compat.cost_analysis(_C(ca))
    assert d == want
    assert (note is None and not notes) or any(note in n for n in notes)


def test_cost_and_memory_analysis_of_a_real_compile():
    c = jax.jit(lambda a, b: a @ b).lower(jax.ShapeDtypeStruct((64, 32), jnp.float32),
                                         jax.ShapeDtypeStruct((32, 16), jnp.float32)).compile()
    d, notes = compat.cost_analysis(c)
    assert d["flops"] == pytest.approx(2 * 64 * 32 * 16) and not notes
    mem, notes = compat.memory_analysis(c)
    assert set(mem) == set(compat.MEMORY_FIELDS) and mem["argument"] == (64 * 32 + 32 * 16) * 4
    assert mem["output"] == 64 * 16 * 4
    d, notes = compat.cost_analysis(_C(exc=NotImplementedError()))
    assert d == {} and "unavailable: NotImplementedError" in notes[0]


def test_ragged_all_to_all_support_is_probed_not_assumed():
    assert compat.ragged_all_to_all_supported("tpu") and compat.ragged_all_to_all_supported("cuda")
    got = compat.ragged_all_to_all_supported("cpu")  # compiles a probe on XLA:CPU
    try:  # the answer must match what XLA:CPU actually does with the op
        mesh = compat.jax_mesh((1,), ("x",), devices=jax.devices()[:1])
        P = jax.sharding.PartitionSpec
        f = jax.jit(compat.shard_map(lambda *a: jax.lax.ragged_all_to_all(*a, axis_name="x"), mesh=mesh,
                                     in_specs=(P("x"),) * 6, out_specs=P("x")))
        i = jnp.array([0], jnp.int32)
        f(jnp.ones((2, 1)), jnp.zeros((2, 1)), i, jnp.array([2], jnp.int32), i, jnp.array([2], jnp.int32))
        works = True
    except Exception:  # noqa: BLE001
        works = False
    assert got == works


def _rec(jax_v, step, kind="predict", spec=None):
    r = make_record(kind, spec or {"preset": "tiny", "target": "tpu-v5e:2x2"}, extra={"predicted_step_s": step})
    r["provenance"].update(jax=jax_v, jaxlib=jax_v, libtpu="0.0.42.1" if jax_v.startswith("0.10") else "0.0.52")
    return r


def test_provenance_carries_the_versions(results_dir):
    r = make_record("x", {"a": 1})
    for k in ("jax", "jaxlib", "libtpu", "flax", "optax", "python"):
        assert k in r["provenance"]
    assert r["provenance"]["jax"] == jax.__version__


def test_store_compares_one_experiment_across_versions(results_dir):
    s = Store()
    for rec in (_rec("0.12.0.1", 2.0), _rec("0.10.2", 3.0), _rec("0.10.2", 5.0), _rec("0.12.0.1", 4.0),
                _rec("0.12.0.1", 9.0, spec={"preset": "small", "target": "tpu-v5e:2x2"})):
        s.append(rec)
    comps = s.compare()
    assert len(comps) == 1  # the 'small' experiment ran under one version set only
    c = comps[0]
    assert [r.versions["jax"] for r in c.rows] == ["0.10.2", "0.12.0.1"]  # oldest first
    assert [r.n for r in c.rows] == [2, 2]
    assert [r.metrics["extra.predicted_step_s"] for r in c.rows] == [4.0, 3.0]  # medians
    assert c.ratios()["extra.predicted_step_s"] == pytest.approx(0.75)
    assert c.to_record()["newest_over_oldest"]["extra.predicted_step_s"] == pytest.approx(0.75)
    one = s.compare(experiment=c.rows[0].record_ids[0][:6])
    assert len(one) == 1 and one[0].experiment == c.experiment == experiment_key(s.records()[0])
    assert len(s.compare(every=True)) == 2


def test_compare_cli(results_dir, capsys):
    import json

    from workbench.cli import main

    s = Store()
    for rec in (_rec("0.10.2", 3.0), _rec("0.12.0.1", 2.0)):
        s.append(rec)
    assert main(["results", "compare", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[0]["rows"][0]["versions"]["jax"] == "0.10.2" and out[0]["rows"][1]["n"] == 1
    with pytest.raises(SystemExit) as e:
        main(["results", "compare", "--experiment", "nosuchid"])
    assert e.value.code == 2 and "no record or experiment" in capsys.readouterr().err


def test_a_dumped_compile_skips_the_persistent_cache(tmp_path):
    """The suite runs with JAX's persistent cache on (tests/conftest.py): a program compiled (and cached) once comes
    back from the cache on the next compile without running the compiler's passes, so a per-pass XLA dump asked of
    it stays empty; no_persistent_cache's options make the compiler run its passes."""
    if not jax.config.jax_compilation_cache_dir:
        pytest.skip("no persistent compilation cache in this run")
    lowered = jax.jit(lambda x: jnp.tanh(x) * 3.0 + 1.25).lower(jnp.ones((7, 5)))
    lowered.compile()  # cached (the suite caches every program)

    def passes_dumped(name, **options):
        d = tmp_path / name
        lowered.compile(compiler_options=dict(options, xla_dump_to=str(d), xla_dump_hlo_pass_re=".*"))
        return len(list(d.glob("*.[0-9][0-9][0-9][0-9].*.txt")))  # module_N.name.PASS#.pass.after_..before_...txt

    with compat.no_persistent_cache() as options:
        assert passes_dumped("uncached", **options) > 5, "the compiler did not run its passes"
    if jax.config.jax_persistent_cache_min_compile_time_secs == 0:  # every program is cached: the cache answered
        assert passes_dumped("cached") == 0, "a cached compile ran the passes: is the cache in use?"
