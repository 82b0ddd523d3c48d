"""Pinned host predictions: a few ops priced from the stored calibrations of tests/data/hosts, to the last digit.

The host roofline's structure (workbench/roofline/host.py composing HardwareSpec.measured) may be rearranged; what it
predicts may not, unless a change means to: then these figures move with it, in the same commit, and the replay
tests (tests/measure/test_host_replay.py) say whether the new figures still hold against the measurements.
Each figure exercises a different refinement: the matmul rate curve, the memory levels with write-allocate, a
reduction's rate, a softmax's dependent passes, a layernorm's library transcendentals.
"""
import os

import pytest

from workbench.programs.replay import HOSTS_DIR, predict_op, stored_spec

# (host folder, op builder, sizes, dtype, predicted seconds per call)
PINS = [
    ("xeon-amx-2026-12-05", "matmul", {"m": 1000, "k": 3000, "n": 777}, "float32", 0.016753596986653328),
    ("xeon-amx-2026-12-05", "elementwise", {"n": 67108864}, "float32", 0.03019476485121442),
    ("xeon-amx-2026-12-05", "reduce_short", {"rows": 262144, "cols": 32}, "float32", 0.0008125569323815695),
    ("xeon-amx-2026-12-05", "softmax", {"rows": 65536, "cols": 96}, "float32", 0.0023375253311210997),
    ("xeon-amx-2026-12-05", "layernorm", {"rows": 4096, "cols": 1024}, "float32", 0.0015602151287716927),
    ("zen5-2026-12-04", "matmul", {"m": 1000, "k": 3000, "n": 777}, "float32", 0.010186139875555571),
    ("zen5-2026-12-04", "elementwise", {"n": 67108864}, "float32", 0.013663031018885611),
    ("zen5-2026-12-04", "softmax", {"rows": 65536, "cols": 96}, "float32", 0.0014674549735240999),
    ("zen5-2026-12-04", "layernorm", {"rows": 4096, "cols": 1024}, "float32", 0.0006859039371513015),
]


@pytest.mark.parametrize("host,builder,sizes,dtype,seconds", PINS,
                         ids=[f"{p[0].split('-')[0]}-{p[1]}" for p in PINS])
def test_stored_calibration_prices_the_op_as_pinned(host, builder, sizes, dtype, seconds):
    spec = stored_spec(os.path.join(HOSTS_DIR, host))
    assert predict_op(builder, sizes, dtype, spec) == pytest.approx(seconds, rel=1e-9)
