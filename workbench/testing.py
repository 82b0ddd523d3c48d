"""One tolerance table keyed by dtype, used by every test that compares against a higher-precision reference."""
import numpy as np

# relative tolerances (rtol, atol) for results computed in `dtype` against a float64/float32 reference
TOLERANCES = {
    "float64": (1e-12, 1e-12),
    "float32": (1e-5, 1e-6),
    "float16": (2e-3, 1e-4),
    "bfloat16": (1e-2, 1e-3),
    "float8_e4m3fn": (7e-2, 1e-2),
    "float8_e5m2": (1.3e-1, 2e-2),
}


def tol(dtype) -> tuple[float, float]:
    return TOLERANCES[np.dtype(dtype).name]


def assert_close(actual, expected, dtype, scale: float = 1.0):
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                               rtol=rtol * scale, atol=atol * scale)
