"""8 simulated CPU devices, set before JAX starts (tests mirror a small mesh on a laptop)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WORKBENCH_RESULTS", os.path.join(os.path.dirname(__file__), "..", ".cache", "test-results"))
# a missing host calibration is measured at the quick sizes (seconds, not minutes); subprocesses inherit it
os.environ.setdefault("WORKBENCH_CALIBRATION", "quick")
# JAX's persistent compilation cache: the suite compiles the same programs again in its subprocesses (a
# multi-process run beside its one-process reference, a resumed run) and across tests; subprocesses inherit the
# directory. A fresh clone starts it empty.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "jax-compile"))
# every program, however quick to compile: the suite's tests build the same tiny programs again and again (the same
# training step in a test, its CLI run and its resumed run); the cached executable is the one XLA compiled. Compiles
# whose XLA dump is read afterwards skip the cache (workbench.compat.no_persistent_cache).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
assert len(jax.devices()) == 8, "tests need 8 simulated CPU devices"

import pytest  # noqa: E402


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    """A fresh results store per test."""
    d = tmp_path / "results"
    monkeypatch.setenv("WORKBENCH_RESULTS", str(d))
    return d
