"""`workbench serve` as a user runs it: measured and predicted on the host, predicted for a TPU slice."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _serve(tmp_path, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", WORKBENCH_RESULTS=str(tmp_path), WORKBENCH_HUGEPAGES="0")
    r = subprocess.run([sys.executable, "-m", "workbench", "serve", *args, "--json"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_serve_on_the_host_measures_and_predicts_each_batch(tmp_path):
    r = _serve(tmp_path, "--preset", "tiny", "--batch", "1,4", "--prompt-len", "16", "--gen-len", "8",
               "--draft", "tiny", "--draft-tokens", "2", "--requests", "synthetic")
    assert [b["batch"] for b in r["batches"]] == [1, 4]
    for b in r["batches"]:
        assert b["ttft_s"] > 0 and b["tpot_s"] > 0 and b["predicted_tpot_s"] > 0 and b["fits"]
        assert b["tokens_per_s"] == pytest.approx(b["batch"] / b["tpot_s"])
        assert b["decode"]["intensity"] < b["prefill"]["intensity"]  # one token per weight read vs a prompt
    assert "why" in r["knee"]
    s = r["speculative"]
    assert s["same_tokens_as_greedy"] and s["measured_speedup"] > 0 and s["predicted_speedup"] > 0
    c = r["continuous_batching"]
    assert c["requests"] == 16 and c["tokens"] > 0 and c["mean_slots_busy"] <= 4
    store = [json.loads(x) for x in open(tmp_path / "records.jsonl")]
    assert sorted({(x["spec"]["batch"], x["spec"]["phase"]) for x in store if x["kind"] == "serve"}) == \
        [(1, "decode"), (1, "prefill"), (4, "decode"), (4, "prefill")]


@pytest.mark.compile_heavy
def test_serve_predicts_a_tpu_slice_and_int8_weights_read_fewer_bytes(tmp_path):
    base = ("--preset", "tiny", "--target", "tpu-v5e:2x2", "--batch", "4,16", "--prompt-len", "32", "--gen-len", "16")
    r = _serve(tmp_path, *base)
    q = _serve(tmp_path, *base, "--quant", "int8")
    assert all(b["predicted_tpot_s"] > 0 and b["fits"] for b in r["batches"])
    assert r["knee"]["batch"] is not None or "never" in r["knee"]["why"]
    assert q["batches"][0]["decode"]["bytes"] < r["batches"][0]["decode"]["bytes"]
    # the paged decode by JAX's Pallas kernel needs a head_dim of 128 lanes: a one-line error, then with it
    bad = subprocess.run([sys.executable, "-m", "workbench", "serve", *base, "--paged"], cwd=ROOT, capture_output=True,
                         text=True, env=dict(os.environ, JAX_PLATFORMS="cpu", WORKBENCH_RESULTS=str(tmp_path)))
    assert bad.returncode == 2 and "head_dim" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr[-500:]
    p = _serve(tmp_path, *base, "--paged", "--set", "head_dim=128")
    assert all(b["predicted_tpot_s"] > 0 and b["fits"] for b in p["batches"])


def test_serve_a_trained_checkpoint_quantized_and_paged(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", WORKBENCH_RESULTS=str(tmp_path), WORKBENCH_HUGEPAGES="0")
    ck = tmp_path / "ck"
    r = subprocess.run([sys.executable, "-m", "workbench", "run", "--preset", "tiny", "--steps", "2",
                        "--checkpoint-dir", str(ck)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    again = subprocess.run([sys.executable, "-m", "workbench", "run", "--preset", "tiny", "--steps", "2",
                            "--checkpoint-dir", str(ck), "--resume"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0 and "nothing left to train" in again.stderr, again.stderr[-500:]  # a re-queued job
    out = _serve(tmp_path, "--preset", "tiny", "--checkpoint", str(ck), "--batch", "2", "--prompt-len", "16",
                 "--gen-len", "8", "--quant", "int8", "--kv-dtype", "int8", "--paged", "--page-size", "4",
                 "--requests", "synthetic", "--plot", str(tmp_path / "serve.png"))
    assert out["weights"].startswith("checkpoint") and "step 2" in out["weights"]
    q = out["quality"]
    assert q["perplexity"] > 1 and abs(q["perplexity"] / q["perplexity_unquantized"] - 1) < 0.05
    assert out["continuous_batching"]["paged_cache"]["paged_positions_peak"] <= \
        out["continuous_batching"]["paged_cache"]["contiguous_positions"]
    assert os.path.getsize(out["plot"]) > 0
