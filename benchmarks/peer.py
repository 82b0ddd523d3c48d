"""Benchmark: the `small` training step in PyTorch and in the workbench, alternating; tokens/s ratio per precision.

    pip install -e .[peer]                     # PyTorch, an optional extra (never needed by `make test`)
    python -m benchmarks.peer                  # float32 and bf16, 5 rounds of 4 timed steps per side
    python -m benchmarks.peer --precision float32 --rounds 8 --steps 4 --compile    # torch.compile'd PyTorch step
    python -m benchmarks.peer --tiny           # quick self-check (tiny preset, 2 rounds of 2 steps)

The same model on both sides: the workbench's preset (for `small`: GPT-2 style, pre-LayerNorm, biases, learned
positions, tanh GELU, tied embeddings, 4 layers of d_model 512, 8 heads, d_ff 2048, 256 byte tokens, 256 positions)
with the workbench's initialisation (normal 0.02; residual output projections 0.02/sqrt(2L); positions 0.01; zero
biases), the same optimizer (global-norm clipping at 1.0, then AdamW b1 0.9, b2 0.95, eps 1e-8, weight decay 0.1 on
matrices only, linear warm-up then cosine to 10 %: workbench.programs.step.make_optimizer) and the same batches of
the stdlib corpus (workbench.programs.data.Batches). PyTorch's bf16 is torch.autocast('cpu', torch.bfloat16) over
float32 master weights, the counterpart of the workbench's bf16 policy; its attention is
F.scaled_dot_product_attention(is_causal=True), what a PyTorch user writes.

Each (framework, precision) runs in its own worker process (JAX's and PyTorch's thread pools never share a process;
a waiting worker blocks on a pipe and uses no CPU). The parent alternates the workers round by round, the order
rotating, so every side sees the same minutes of the machine; each round's steps are timed by the one harness
(workbench.measure.harness.measure_steps). The machine's load average before and after is recorded: a run whose
load exceeded the core count is flagged `contended` (its figures are void for reporting; the ratios of one run
still compare sides that shared the same minutes).

Writes reports/peer.json (per precision: each side's step time, tokens/s, first/last loss, parameter count; the
tokens/s ratio workbench / PyTorch; bf16 / float32 step-time ratios per side), reports/peer.png, and one record of
kind 'peer' per precision in the results store. Without torch installed it prints how to install it and exits 0.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import jax
import numpy as np

from models.analytics import analytics
from models.precision import get_policy
from models.presets import get_config
from models.quant import matmul_format
from models.transformer import Transformer, count_params
from partitioning.mesh import make_mesh
from workbench.errors import WorkbenchError
from workbench.measure.calibrate import bf16_isa, cpu_features, get_spec
from workbench.measure.device import chip_for
from workbench.measure.harness import measure_steps
from workbench.programs.data import Batches, shard_batch
from workbench.programs.step import build_train_step, default_learning_rate
from workbench.results.figures import peer_chart
from workbench.results.store import Store, make_record

try:  # optional: `pip install -e .[peer]`
    import torch
    import torch.nn.functional as F
    from torch import nn
except ModuleNotFoundError:
    torch = None

HERE = os.path.dirname(os.path.abspath(__file__))
PRECISIONS = ("float32", "bf16")
SIDES = ("workbench", "torch", "torch-compile")  # torch: eager PyTorch; torch-compile: torch.compile'd model
WEIGHT_DECAY, CLIP_NORM, BETAS, EPS = 0.1, 1.0, (0.9, 0.95), 1e-8  # as workbench.programs.step.make_optimizer


def torch_missing_message() -> str:
    return ("benchmarks.peer needs PyTorch, which is not installed: `pip install -e .[peer]` (or `pip install torch`) "
            "and run it again; skipped")


# --------------------------------------------------------------------------------------------- the schedule
def lr_schedule(learning_rate: float, total_steps: int) -> np.ndarray:
    """The learning rate of every step of workbench.programs.step.make_optimizer's schedule (optax
    warmup_cosine_decay_schedule: linear from lr/(warmup+1) to lr over `warmup` steps, cosine to 0.1·lr at
    total_steps), as a plain array for the PyTorch side (which must not start JAX)."""
    total = max(int(total_steps), 1)
    warmup = min(100, max(total // 10, 1))
    decay = max(total, warmup + 1) - warmup
    init, end = learning_rate / (warmup + 1), 0.1 * learning_rate
    s = np.arange(total + 1, dtype=np.float64)
    ramp = init + (learning_rate - init) * np.minimum(s, warmup) / warmup
    frac = np.clip(s - warmup, 0, decay) / decay
    cos = end + (learning_rate - end) * 0.5 * (1 + np.cos(np.pi * frac))
    return np.where(s < warmup, ramp, cos)


# --------------------------------------------------------------------------------------------- the PyTorch model
if torch is not None:
    class TorchBlock(nn.Module):
        """Pre-LayerNorm block: x + proj(attn(ln1(x))), then x + out(gelu(fc(ln2(x))))."""

        def __init__(self, d: int, n_heads: int, d_ff: int, eps: float):
            super().__init__()
            self.n_heads = n_heads
            self.ln1, self.ln2 = nn.LayerNorm(d, eps=eps), nn.LayerNorm(d, eps=eps)
            self.qkv = nn.Linear(d, 3 * d)  # q, k, v projections (the workbench's w_dnh, w_dkh_k, w_dkh_v + biases)
            self.proj = nn.Linear(d, d)
            self.fc = nn.Linear(d, d_ff)
            self.out = nn.Linear(d_ff, d)

        def forward(self, x_btd):
            b, t, d = x_btd.shape
            q, k, v = self.qkv(self.ln1(x_btd)).split(d, dim=2)
            q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))  # (b,n,t,h)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x_btd = x_btd + self.proj(o.transpose(1, 2).reshape(b, t, d))
            return x_btd + self.out(F.gelu(self.fc(self.ln2(x_btd)), approximate="tanh"))

    class TorchGPT(nn.Module):
        """The workbench's GPT-2 style config (mlp gelu, layernorm, learned positions, biases, tied embeddings) in
        PyTorch, initialised with the workbench's scales."""

        def __init__(self, cfg):
            super().__init__()
            if (cfg.mlp, cfg.norm, cfg.pos, cfg.bias, cfg.tie_embeddings) != ("gelu", "layernorm", "learned", True, True) \
                    or cfg.n_kv_heads != cfg.n_heads or cfg.head_dim * cfg.n_heads != cfg.d_model or cfg.is_moe:
                raise ValueError("the PyTorch peer is the GPT-2 style dense config only (gelu, layernorm, learned "
                                 "positions, biases, tied embeddings, multi-head attention)")
            d = cfg.d_model
            self.wte = nn.Embedding(cfg.vocab_size, d)
            self.wpe = nn.Embedding(cfg.seq_len, d)
            self.blocks = nn.ModuleList(TorchBlock(d, cfg.n_heads, cfg.d_ff, cfg.norm_eps) for _ in range(cfg.n_layers))
            self.ln_f = nn.LayerNorm(d, eps=cfg.norm_eps)
            out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
            for name, p in self.named_parameters():
                if name.endswith("bias") and "ln" not in name:
                    nn.init.zeros_(p)
                elif name.endswith(("proj.weight", "out.weight")):
                    nn.init.normal_(p, std=out_std)
                elif name.endswith(("qkv.weight", "fc.weight", "wte.weight")):
                    nn.init.normal_(p, std=0.02)
            nn.init.normal_(self.wpe.weight, std=0.01)

        def forward(self, tokens_bt):
            t = tokens_bt.shape[1]
            x = self.wte(tokens_bt) + self.wpe(torch.arange(t, device=tokens_bt.device))
            for blk in self.blocks:
                x = blk(x)
            return F.linear(self.ln_f(x), self.wte.weight)  # tied head

    def torch_param_count(model) -> int:
        return sum(p.numel() for p in model.parameters())  # a tied parameter is counted once


# --------------------------------------------------------------------------------------------- workers
class TorchSide:
    def __init__(self, cfg, precision: str, batch: int, total_steps: int, learning_rate: float, compile_: bool,
                 seed: int = 0, device: str = "cpu"):
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.model = TorchGPT(cfg).to(self.device)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        fused = {"fused": True} if self.device.type == "cuda" else {}  # one kernel per step for the whole update
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=learning_rate, betas=BETAS,
                                     eps=EPS, **fused)
        self.lrs = lr_schedule(learning_rate, total_steps)
        self.bf16 = precision == "bf16"
        self.fwd = torch.compile(self.model) if compile_ else self.model
        self.batches = Batches(batch, cfg.seq_len, seed)
        self.i = 0
        self.params = torch_param_count(self.model)

    def step(self, _=None) -> float:
        b = self.batches.train(self.i)
        x = torch.from_numpy(b["inputs"]).long().to(self.device, non_blocking=True)
        y = torch.from_numpy(b["targets"]).long().to(self.device, non_blocking=True)
        for g in self.opt.param_groups:
            g["lr"] = float(self.lrs[min(self.i, len(self.lrs) - 1)])
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            logits = self.fwd(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP_NORM)
        self.opt.step()
        self.i += 1
        return float(loss.detach())


class WorkbenchSide:
    def __init__(self, cfg, precision: str, batch: int, total_steps: int, learning_rate: float, seed: int = 0):
        self.prog = build_train_step(cfg, policy=precision, mesh=make_mesh("data=1"), strategy="dp", batch_size=batch,
                                     total_steps=total_steps, learning_rate=learning_rate, seed=seed)
        self.params = count_params(jax.eval_shape(lambda: Transformer(cfg, precision)))
        self.state = self.prog.state
        self.batches = Batches(batch, cfg.seq_len, seed)
        self.i = 0

    def step(self, _=None):
        self.state, m = self.prog.step(self.state, shard_batch(self.batches.train(self.i), self.prog.batch_sharding))
        self.i += 1
        return m["loss"]


def worker(side: str, preset: str, precision: str, batch: int, total_steps: int, device: str) -> None:
    """Line protocol on stdin/stdout: prints a ready line, then answers `run K` with K timed steps, `quit` ends."""
    cfg = get_config(preset)
    lr = default_learning_rate(cfg)
    t0 = time.perf_counter()
    s = (TorchSide(cfg, precision, batch, total_steps, lr, side == "torch-compile", device=device)
         if side.startswith("torch") else WorkbenchSide(cfg, precision, batch, total_steps, lr))
    first = float(s.step())  # compiles (workbench) / warms the allocator (torch); untimed
    print(json.dumps({"ready": True, "params": s.params, "setup_s": time.perf_counter() - t0, "loss_first": first}),
          flush=True)
    guard = s.prog.step if side == "workbench" else None
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        losses = []
        m = measure_steps(lambda i: losses.append(s.step()) or losses[-1], warmup=1, repeats=int(cmd[1]), guard=guard)
        print(json.dumps({"times_s": list(m.times_s), "loss_last": float(losses[-1])}), flush=True)


def _start(side, a, precision):
    cmd = [sys.executable, "-m", "benchmarks.peer", "--worker", side, "--preset", a.preset, "--precision", precision,
           "--batch", str(a.batch), "--total-steps", str(a.total_steps), "--device", a.device]
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cuda" if a.device == "cuda" else "cpu")
    if a.device == "cuda":  # the sides share one GPU, one at a time: JAX takes what it needs, not 75 % up front
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                            cwd=os.path.dirname(HERE))


def _ask(p, line=None) -> dict:
    if line is not None:
        p.stdin.write(line + "\n")
        p.stdin.flush()
    out = p.stdout.readline()
    if not out:
        raise RuntimeError(f"a peer worker exited (code {p.wait()})")
    return json.loads(out)


def mfu_ceilings(precisions, device: str = "cpu", gpu: str | None = None) -> dict[str, dict[str, float | None]]:
    """Per precision: on a CPU, the host's measured XLA ceiling (`workbench calibrate`, the faster dot form) and its
    physical peak (cores x FLOP/cycle x clock, from the CPU's features); on a GPU, the catalogue chip's dense peak
    (as 'physical') for the dtype the precision's dots run in."""
    dts = {p: matmul_format(get_policy(p))["peak_dtype"] for p in precisions}
    if device == "cuda":
        chip = chip_for(gpu or "")
        return {p: {"physical": chip.peak(dt)} for p, dt in dts.items()} if chip is not None else {}
    try:
        spec = get_spec("host")
    except WorkbenchError as e:  # no calibration and none could be made: MFU is left out, not guessed
        print(f"peer: no host calibration ({e}); MFU left out", file=sys.stderr)
        return {}
    return {p: {"measured": spec.peak(dt), "physical": spec.physical_peak(dt)} for p, dt in dts.items()}


def summarize_side(times: list[float], tokens: int, ready: dict, loss_last: float) -> dict:
    t = np.asarray(times)
    return {"step_s": float(np.median(t)), "step_s_min": float(t.min()),
            "step_s_iqr": float(np.percentile(t, 75) - np.percentile(t, 25)), "steps_timed": int(t.size),
            "tokens_per_s": tokens / float(np.median(t)), "params": ready["params"], "setup_s": ready["setup_s"],
            "loss_first": ready["loss_first"], "loss_last": loss_last}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--precision", default=",".join(PRECISIONS), help="comma-separated: float32, bf16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per side per round")
    ap.add_argument("--total-steps", type=int, default=1000, help="the schedule's length (both sides)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the PyTorch model (same as --torch compile)")
    ap.add_argument("--torch", default=None, help="PyTorch sides, comma-separated: eager, compile (default eager)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="where both sides run: auto (cuda when PyTorch sees a GPU), cpu, cuda")
    ap.add_argument("--tiny", action="store_true", help="quick self-check: tiny preset, 2 rounds of 2 steps")
    ap.add_argument("--out", default="reports/peer.json")
    ap.add_argument("--worker", choices=SIDES, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.tiny:
        a.preset, a.rounds, a.steps = "tiny", 2, 2
    precisions = [p.strip() for p in a.precision.split(",") if p.strip()]
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad or not precisions:
        ap.error(f"--precision takes a comma-separated list of {', '.join(PRECISIONS)}, got {a.precision!r}")
    if min(a.batch, a.rounds, a.steps, a.total_steps) < 1:
        ap.error("--batch, --rounds, --steps and --total-steps must be positive")
    if torch is None:
        print(torch_missing_message(), file=sys.stderr)
        return None
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.worker:
        return worker(a.worker, a.preset, a.precision, a.batch, a.total_steps, a.device)
    modes = [m.strip() for m in (a.torch or ("compile" if a.compile else "eager")).split(",") if m.strip()]
    if not modes or set(modes) - {"eager", "compile"}:
        ap.error(f"--torch takes eager, compile or both, got {a.torch!r}")
    sides = ("workbench",) + tuple("torch" if m == "eager" else "torch-compile" for m in modes)

    cfg = get_config(a.preset)
    TorchGPT(cfg)  # a config the PyTorch peer cannot build fails here, before any worker starts
    cores = os.cpu_count() or 1
    load_before = os.getloadavg()
    keys = [(p, s) for p in precisions for s in sides]
    procs = {k: _start(k[1], a, k[0]) for k in keys}
    try:
        ready = {}
        for k in keys:  # workers compile one at a time would be fairer to the others, but they only wait here
            ready[k] = _ask(procs[k])
            print(f"peer: {k[1]} {k[0]} ready ({ready[k]['setup_s']:.1f} s, {ready[k]['params']} parameters)",
                  file=sys.stderr)
        times = {k: [] for k in keys}
        last = {}
        for r in range(a.rounds):
            order = keys[r % len(keys):] + keys[:r % len(keys)]  # rotate who goes first
            for k in order:
                res = _ask(procs[k], f"run {a.steps}")
                times[k] += res["times_s"]
                last[k] = res["loss_last"]
            print(f"peer: round {r + 1}/{a.rounds}: " + ", ".join(
                f"{k[1]} {k[0]} {np.median(times[k]):.3f} s" for k in keys), file=sys.stderr)
    finally:
        for p in procs.values():
            try:
                p.stdin.write("quit\n")
                p.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
            p.wait(timeout=60)
    load_after = os.getloadavg()
    tokens = a.batch * cfg.seq_len
    feat = cpu_features()
    out = {"preset": a.preset, "batch": a.batch, "seq_len": cfg.seq_len, "tokens_per_step": tokens,
           "rounds": a.rounds, "steps_per_round": a.steps, "torch_compile": "compile" in modes, "sides": list(sides),
           "device": a.device, "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else None,
           "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "cpu": feat["model"], "cores": feat["cores"], "bf16_isa": bf16_isa(feat["flags"]),
           "load_average_before": load_before, "load_average_after": load_after,
           "contended": max(load_before[0], load_after[0]) > cores,
           "precisions": {}}
    model_flops = analytics(cfg, cfg.seq_len)["train_flops_per_token"] * tokens
    out["model_flops_per_step"] = model_flops
    ceilings = mfu_ceilings(precisions, a.device, out["gpu"])
    for p in precisions:
        res = {s: summarize_side(times[(p, s)], tokens, ready[(p, s)], last[(p, s)]) for s in sides}
        for s in sides:  # the same model on every side: one flop count, each side's own step time
            for kind, peak in ceilings.get(p, {}).items():
                res[s][f"mfu_{kind}"] = model_flops / res[s]["step_s"] / peak if peak else None
        res["ratios_tokens_per_s"] = {s: res["workbench"]["tokens_per_s"] / res[s]["tokens_per_s"] for s in sides[1:]}
        best = max(sides[1:], key=lambda s: res[s]["tokens_per_s"])  # the faster PyTorch side is the bar to meet
        res["ratio_tokens_per_s"], res["ratio_against"] = res["ratios_tokens_per_s"][best], best
        res["ceilings_flops_per_s"] = ceilings.get(p, {})
        out["precisions"][p] = res
    if "float32" in out["precisions"] and "bf16" in out["precisions"]:
        out["bf16_step_over_float32"] = {s: out["precisions"]["bf16"][s]["step_s"] /
                                         out["precisions"]["float32"][s]["step_s"] for s in sides}
    store = Store()
    for p, v in out["precisions"].items():
        store.append(make_record("peer", {"preset": a.preset, "batch": a.batch, "precision": p,
                                          "torch_compile": "compile" in modes, "device": a.device},
                                 extra={k: v for k, v in out.items() if k != "precisions"} | {"result": v}))
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    png = peer_chart(out, os.path.splitext(a.out)[0] + ".png")
    print(f"{'precision':>9} {'workbench s/step':>16} {'PyTorch s/step':>14} {'tokens/s ratio':>14} "
          f"{'MFU measured (wb / pt)':>22} {'MFU physical (wb / pt)':>22}")

    def pair(v, key, side):
        a, b = v["workbench"].get(key), v[side].get(key)
        return f"{a:.0%} / {b:.0%}" if a is not None and b is not None else "—"

    for p, v in out["precisions"].items():
        for side in sides[1:]:
            print(f"{p:>9} {v['workbench']['step_s']:>16.4f} {v[side]['step_s']:>14.4f} "
                  f"{v['ratios_tokens_per_s'][side]:>13.2f}× {pair(v, 'mfu_measured', side):>22} "
                  f"{pair(v, 'mfu_physical', side):>22}  ({side})")
    if "bf16_step_over_float32" in out:
        print("bf16 step / float32 step: " + ", ".join(f"{s} {r:.2f}" for s, r in out["bf16_step_over_float32"].items()))
    if out["contended"]:
        print(f"note: load average {max(load_before[0], load_after[0]):.1f} on {cores} cores: contended, figures void "
              "for reporting (ratios compare sides that shared the same minutes)")
    print(f"wrote {a.out}, {png}")
    return out


if __name__ == "__main__":
    from workbench.hardware.hostmem import reexec_with_hugepages

    reexec_with_hugepages()  # before JAX starts (the workbench workers inherit the allocator setting)
    main()
