"""Per-kernel truth on a GPU: a trace jax.profiler took of the gpt2-small bf16 training step on an H200 (jax 0.11.2,
CUDA 13; benchmarks.gpu_check, 2026-12-04), joined with the HLO the device compiled (tests/data/gpu_h200/)."""
import gzip
import json
import os

import pytest

from workbench.hardware.spec import catalogue
from workbench.measure.kernels import LIBRARY_ROW, KernelTrace, events_from_trace, join

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "gpu_h200")
WALLS = (0.07326, 0.07337)  # the two traced steps' wall clock, as gpu_check timed them


@pytest.fixture(scope="module")
def table():
    with gzip.open(os.path.join(DATA, "gpt2_small_train_bf16.hlo.gz"), "rt") as f:
        hlo = f.read()
    with gzip.open(os.path.join(DATA, "gpt2_small_train_bf16.trace.json.gz"), "rt") as f:
        raw = json.load(f)
    trace = KernelTrace(tuple(events_from_trace(raw)), WALLS)
    return raw, trace, join(trace, hlo, catalogue()["h200"], dtype="bfloat16")


def test_device_kernels_are_read_from_the_gpu_track_by_kernel_name(table):
    """On a GPU the events that count are the device's (process '/device:GPU:0'), named for the kernel; their
    `hlo_op` names the CUDA graph that launched them, which is no kernel."""
    raw, trace, _ = table
    on_gpu = [e for e in raw if e.get("ph") == "X" and e.get("pid") == 1 and "hlo_op" in (e.get("args") or {})]
    assert len(trace.events) == len(on_gpu) > 4000
    assert not any(e.name.startswith("command_buffer") for e in trace.events)


def test_every_kernel_second_lands_in_a_row_and_a_class(table):
    """The join accounts for the device's busy time: kernel names resolve to HLO instructions ('_' for '.'), call
    sites sharing one kernel (deduplicated_name) are one row, cuBLAS kernels (nvjet_*) go to the library row; only
    the runtime's memsets are left over."""
    raw, trace, t = table
    per_step = sum(e.dur_s for e in trace.events) / trace.steps
    memsets = sum(e.dur_s for e in trace.events if e.name.startswith("Memset")) / trace.steps
    assert t.unmatched_events == sum(1 for e in trace.events if e.name.startswith("Memset"))
    assert sum(c.measured_s for c in t.classes) == pytest.approx(t.busy_s, rel=0.02)
    assert t.busy_s == pytest.approx(per_step - memsets, rel=0.05)  # one stream: shares are durations
    lib = next(r for r in t.rows if r.name == LIBRARY_ROW)
    assert lib.kernel_class == "dot" and lib.executions == 180 and lib.measured_s > 0.005
    grouped = next(r for r in t.rows if r.name == "gemm_fusion_dot.603")  # one kernel, 12 layers' call sites
    assert grouped.executions == 12 and grouped.predicted_s > 10 * 2 * 16384 * 3072 * 768 / 989.5e12


def test_the_step_on_the_h200_is_its_kernels(table):
    """What the trace says of this step: the GPU is busy for ~90 % of the wall clock, dots take half the kernel
    time, and the catalogue's roofline prices the dots at well under their time (the vocabulary-sized gemms ran at
    230-450 TFLOP/s, not at the 989.5 TFLOP/s peak)."""
    _, _, t = table
    assert 0.85 < t.busy_s / t.wall_s <= 1.0
    c = t.by_class()
    assert 0.4 < c["dot"].measured_s / t.busy_s < 0.6
    assert c["dot"].predicted_s < 0.7 * c["dot"].measured_s
