"""`workbench tiling shape|search`: JSON keys the issue names, one-line errors."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args, timeout=600):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "workbench", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_shape_json_and_errors(results_dir):
    r = _cli("tiling", "shape", "--m", "1000", "--n", "1000", "--k", "1000", "--target", "tpu-v6e", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for key in ("padded", "utilization", "wasted_flops", "predicted_s", "suggestions"):
        assert key in d
    assert d["utilization"] < 1 and d["padded"]["k"] == 1024
    bad = _cli("tiling", "shape", "--m", "0", "--n", "8", "--k", "8", "--target", "tpu-v6e")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "m must be >= 1" in bad.stderr
    bad = _cli("tiling", "shape", "--m", "8", "--n", "8", "--k", "8", "--target", "host")
    assert bad.returncode == 2 and "no matrix-unit tile model" in bad.stderr
    bad = _cli("tiling", "search", "--m", "8", "--n", "8", "--k", "8", "--target", "tpu-v5e", "--kernel", "conv")
    assert bad.returncode == 2 and "unknown --kernel" in bad.stderr
