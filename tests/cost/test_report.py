"""CostReport: compiler and analytic counts against formulas; guards on cost_analysis; costs add."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

from workbench.cost.compile import compile_program
from workbench.cost.report import CostReport, costs_from_compiled


def test_matmul_flops_from_compiler_and_analytic():
    m, n, k = 128, 64, 256
    a = jax.ShapeDtypeStruct((m, k), jnp.float32)
    b = jax.ShapeDtypeStruct((k, n), jnp.float32)
    c = compile_program(lambda x, y: x @ y, a, b)
    assert c.cost.flops == 2 * m * n * k
    assert c.cost.analytic.flops == 2 * m * n * k
    assert c.cost.hlo_flops == 2 * m * n * k
    assert c.cost.argument_bytes == 4 * (m * k + k * n)
    assert c.cost.output_bytes == 4 * m * n
    assert c.cost.peak_memory_bytes >= 4 * (m * k + k * n + m * n)


def test_scan_loop_scaled_by_trip_count():
    def f(x, ws):
        def body(h, w):
            return jnp.tanh(h @ w), None

        return jax.lax.scan(body, x, ws)[0]

    L, d = 6, 64
    c = compile_program(f, jax.ShapeDtypeStruct((32, d), jnp.float32), jax.ShapeDtypeStruct((L, d, d), jnp.float32))
    want = L * 2 * 32 * d * d
    assert abs(c.cost.hlo_flops - want) / want < 0.05
    assert abs(c.cost.analytic.flops - want) / want < 0.05


class _Fake:
    def __init__(self, ca):
        self._ca = ca

    def cost_analysis(self):
        return self._ca

    def memory_analysis(self):
        return None

    def as_text(self):
        return "HloModule m\n\nENTRY %main (x: f32[4]) -> f32[4] {\n  ROOT %x = f32[4]{0} parameter(0)\n}\n"


@pytest.mark.parametrize("raw,flops,note", [
    ([{"flops": 10.0, "bytes accessed": 4.0}], 10.0, None),
    ({"bytes accessed": 4.0}, 0.0, "no 'flops'"),
    ({"flops": -3.0, "bytes accessed": 4.0}, 0.0, "invalid"),
    (None, 0.0, "returned nothing"),
])
def test_cost_analysis_guards(raw, flops, note):
    rep = costs_from_compiled(_Fake(raw), n_devices=1)
    assert rep.flops == flops
    if note:
        assert any(note in n for n in rep.notes)


def test_costs_add():
    a = CostReport(flops=1.0, transcendentals=2.0, bytes_accessed=3.0, temp_bytes=10.0, n_devices=2)
    b = dataclasses.replace(a, flops=5.0, temp_bytes=4.0)
    s = a + b
    assert s.flops == 6.0 and s.bytes_accessed == 6.0 and s.temp_bytes == 10.0
    assert sum([a, b]).flops == 6.0
    with pytest.raises(ValueError):
        a + dataclasses.replace(b, n_devices=4)


def test_largest_allocations_read_the_compiler_memory_report(tmp_path):
    """The device-memory section of libtpu's memory-usage report (its format, lines abridged): sizes in their units,
    the largest value of each allocation named with its repeat count; other memory spaces and tuples ignored."""
    from workbench.cost.compile import largest_allocations
    (tmp_path / "module_0000.jit_train_step.after_optimizations-memory-usage-report.txt").write_text(
        "Memory Space: default (color=0)\n"
        "Total bytes: 34255156576 (31.90GiB)\n"
        "  cumulative_size;       size;       offset; used_by_n_values; shapes_list\n"
        "  ------------------------------------------------------------\n"
        "   20.00GiB( 45%);   20.00GiB;    286785536;                9; bf16[256,4,4096,32], bf16[4,4096,8192], "
        "f32[8192], 5×bf16[80,4,4096,8192]\n"
        "   22.98GiB( 52%); 1000.00MiB;  22296395776;                3; bf16[8192,32000], 2×f32[8192,32000]\n"
        "   23.00GiB( 52%);       512B;      3997696;                1; (f32[16], f32[16], u32[])\n"
        "Memory Space: vmem (color=1)\n"
        "   90.00GiB(100%);   90.00GiB;            0;                1; f32[999999,99999]\n")
    got = largest_allocations(str(tmp_path))
    assert got == [{"bytes": 20 * 2**30, "shape": "bf16[80,4,4096,8192]", "repeats": 5, "values": 9},
                   {"bytes": 1000 * 2**20, "shape": "f32[8192,32000]", "repeats": 2, "values": 3}]
    assert largest_allocations(str(tmp_path / "none")) == []
