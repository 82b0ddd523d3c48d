"""8 simulated CPU devices, set before JAX starts (tests mirror a small mesh on a laptop)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WORKBENCH_RESULTS", os.path.join(os.path.dirname(__file__), "..", ".cache", "test-results"))
# a missing host calibration is measured at the quick sizes (seconds, not minutes); subprocesses inherit it
os.environ.setdefault("WORKBENCH_CALIBRATION", "quick")
# JAX's persistent compilation cache (programs that took over a second to compile): the suite compiles the same
# programs again in its subprocesses (a multi-process run beside its one-process reference, a resumed run) and
# across tests; subprocesses inherit the directory. A fresh clone starts it empty.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "jax-compile"))

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
