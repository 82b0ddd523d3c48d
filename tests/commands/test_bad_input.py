"""Every CLI input is validated where it enters: one line on stderr, exit 2, nothing allocated or compiled first
(issue: architecture). Each case is refused before JAX builds a device or an array."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = [
    (["moe", "route", "--tokens", "1024", "--experts", "8", "--top-k", "2", "--capacity-factor", "inf"],
     "capacity factor must be a finite number"),
    (["moe", "route", "--tokens", "99999999999", "--experts", "8", "--top-k", "2", "--capacity-factor", "1.25"],
     "GiB but this host has"),
    (["moe", "route", "--tokens", "64", "--experts", "8", "--top-k", "2", "--skew", "nan"], "--skew must be a finite"),
    (["moe", "layer", "--tokens", "0"], "--tokens must be a positive whole number"),
    (["model-info", "--preset", "llama3-8b", "--seq", "-5"], "--seq must be a positive whole number"),
    (["model-info", "--preset", "llama3-8b", "--seq", "0"], "--seq must be a positive whole number"),
    (["model-info", "--preset", "tiny-moe", "--set", "capacity_factor=inf"], "capacity_factor must be a finite"),
    (["model-info", "--preset", "small-moe", "--platform", "xpu"], "--platform 'xpu' is not one of cpu, gpu, tpu"),
    (["model-info", "--preset", "tiny", "--set", "norm_eps=nan"], "norm_eps must be a finite"),
    (["predict", "--preset", "tiny", "--target", "tpu-v5e:2x2", "--strategy", "fsdp", "--policy", "fp9"],
     "unknown precision policy 'fp9'"),
    (["predict", "--preset", "tiny", "--target", "tpu-v5e:2x2", "--strategy", "zz"], "unknown strategy"),
    (["plan", "--preset", "tiny", "--target", "tpu-v5e:2x2", "--max-candidates", "0"], "--max-candidates must be"),
    (["run", "--preset", "tiny", "--steps", "1", "--lr", "inf"], "--lr must be a finite number"),
    (["run", "--preset", "tiny", "--steps", "1", "--eval-every", "0"], "--eval-every must be a positive"),
    (["run", "--preset", "tiny", "--steps", "1", "--seq", "-3"], "--seq must be a positive whole number"),
    (["run", "--preset", "small", "--strategy", "pp", "--mesh", "stage=3", "--devices", "3", "--microbatches", "3",
      "--steps", "1"], "does not divide the model's n_layers=4"),
    (["run", "--preset", "small", "--strategy", "pp", "--mesh", "stage=4", "--devices", "4", "--microbatches", "2",
      "--steps", "1"], "fewer than the 4 pipeline stages"),
    (["predict", "--preset", "small", "--target", "tpu-v5e:2x2", "--strategy", "pp", "--mesh", "stage=4",
      "--microbatches", "2"], "fewer than the 4 pipeline stages"),
    (["run", "--preset", "small", "--strategy", "pp", "--mesh", "stage=4", "--devices", "4", "--microbatches", "4",
      "--steps", "1", "--pipeline-schedule", "zb"], "unknown pipeline schedule 'zb'"),
    (["predict", "--preset", "small", "--target", "tpu-v5e:2x2", "--strategy", "pp", "--mesh", "stage=4",
      "--microbatches", "4", "--pipeline-schedule", "1f1b", "--policy", "fp16"], "1F1B does not apply fp16's loss"),
    (["serve", "--preset", "small", "--batch", "0"], "--batch takes positive sizes"),
    (["serve", "--preset", "small", "--batch", "1", "--quant", "int3"], "unknown weight quantization 'int3'"),
    (["serve", "--preset", "small", "--batch", "1", "--kv-dtype", "int2"], "unknown KV-cache dtype 'int2'"),
    (["serve", "--preset", "small", "--prompt-len", "200", "--gen-len", "100"], "exceeds small's learned position"),
    (["serve", "--preset", "llama3-8b", "--target", "h100:8", "--draft", "tiny"], "--draft, --requests and --checkpoint run on"),
    (["serve", "--preset", "llama3-8b", "--target", "h100:8", "--paged"], "Pallas TPU kernel; use a TPU target"),
]


@pytest.mark.parametrize("args,needle", CASES, ids=[" ".join(a[:4]) for a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(args, needle, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", WORKBENCH_RESULTS=str(tmp_path), WORKBENCH_HUGEPAGES="0")
    r = subprocess.run([sys.executable, "-m", "workbench", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr[-500:])
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "records.jsonl")  # nothing recorded
