#!/usr/bin/env python3
"""GPU host check: run as it is on a GPU host (installs nothing), from the source tree's root (`-m` puts it on the path).

    python -m benchmarks.gpu_check [OUT_DIR] [--budget-s 500] [--work DIR] [--sections a,b]  # OUT_DIR: $OUT, then
                                                                            # ./gpu-check-out; default: every section
    python -m benchmarks.gpu_check --sections programs --programs llama,moe --no-trace   # some programs, untraced
    python -m benchmarks.gpu_check --tiny OUT_DIR                 # a CPU smoke run with tiny sizes (the test suite)

Each section runs in a process of its own (a crash or a hang loses that section only, and each process gives its
device memory back when it ends), in this order, each within its share of the time budget:
1. calibrate: `workbench calibrate --json` as a user runs it on the GPU: matmul per dtype and against size, the
   device stream, the kernel launch cost (workbench.measure.device); cached, so later sections price with it;
2. ops: the built-in op suite measured, each predicted against the catalogue chip and against the calibration;
3. programs: whole programs compiled on the device, predicted (a) from that compile (catalogue and calibrated) and
   (b) by the CPU host's stored prediction for the same spec, and measured (benchmarks/gpu_programs.py);
4. run: `workbench run --preset gpt2-small --batch 16 --steps 12 --json` as a user runs it (the GPU found and used,
   its MFU and prediction in the record);
5. peer: the same gpt2-small step in PyTorch (eager and torch.compile, bf16 autocast, scaled_dot_product_attention,
   fused AdamW) alternating with the workbench's (benchmarks/peer.py);
6. precision and tiling: bf16 vs fp8 matmuls, the shape sawtooth and Pallas blocks vs cuBLAS (when time is left).
Writes summary.json, table.md (both rewritten after each section) and artifacts.tar.gz (the device's HLO of every
program, the records, each section's output) under OUT_DIR; intermediate files under --work (default OUT_DIR).
Works on jax 0.10 to 0.12.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
import traceback

from benchmarks import gpu_programs
from workbench.hardware.devices import select_platform
from workbench.measure.calibrate import get_spec
from workbench.measure.device import calibrate_device, calibrated_spec, chip_for, load_or_calibrate_device
from workbench.programs.demo import run_suite
from workbench.results.store import Store

GPU_SUITE = [
    ("matmul", {"m": 4096, "n": 4096, "k": 4096}, "bfloat16"),
    ("matmul", {"m": 8192, "n": 8192, "k": 8192}, "bfloat16"),
    ("matmul", {"m": 8192, "n": 8192, "k": 8192}, "float32"),
    ("elementwise", {"n": 1 << 28}, "float32"),
    ("softmax", {"rows": 32768, "cols": 4096}, "bfloat16"),
    ("layernorm", {"rows": 32768, "cols": 4096}, "bfloat16"),
    ("attention", {"batch": 8, "heads": 16, "seq": 2048, "head_dim": 128}, "bfloat16"),
]
TINY_SUITE = [("matmul", {"m": 128, "n": 128, "k": 128}, "float32"), ("elementwise", {"n": 1 << 16}, "float32"),
              ("softmax", {"rows": 64, "cols": 128}, "float32"),
              ("attention", {"batch": 1, "heads": 2, "seq": 64, "head_dim": 32}, "float32")]
# (section, seconds it may take at most on an H200; the budget left caps it too)
# on an H200 (2026-12-04): calibrate 37 s, ops 11 s, the gpt2-small program 143 s with its traces; `workbench run` of
# gpt2-small (a training and an evaluation step compiled) and the peer (torch.compile) did not finish in 70 and 140 s
SECTIONS = [("calibrate", 70), ("ops", 55), ("programs", 300), ("run", 150), ("peer", 240), ("precision", 60),
            ("tiling", 60)]
EXTRA = {"precision": "benchmarks.gpu_precision", "tiling": "benchmarks.gpu_tiling"}


# ------------------------------------------------------------------------------------------------ one section
def _platform(tiny: bool):
    return select_platform("cpu" if tiny else "auto", quiet=True)


def _specs(tiny: bool):
    """(the catalogue chip, the chip with this device's calibration laid over it, the calibration)."""
    import jax

    dev = jax.devices()[0]
    if dev.platform == "cpu":  # the tiny smoke run: the host stands in for the chip
        spec = get_spec("host")
        cal = calibrate_device(quick=True, quiet=True)
    else:
        spec = chip_for(dev.device_kind)
        if spec is None:
            raise SystemExit(f"gpu_check: device kind {dev.device_kind!r} is in no catalogue entry")
        cal = load_or_calibrate_device(quiet=True)
    return spec, calibrated_spec(spec, cal), cal


def section_ops(out_dir: str, tiny: bool) -> dict:
    spec, cal_spec, _ = _specs(tiny)
    rows = []
    for name, sizes, dt in (TINY_SUITE if tiny else GPU_SUITE):
        try:
            r = run_suite([(name, sizes)], dtype=dt, target=spec, repeats=10, progress=False, kind="gpu-check-op",
                          also_predict=(cal_spec,))[0]
            rec = Store().records()[-1]
            p2 = rec["extra"]["predictions"][cal_spec.name]["predicted_s"]
            r.update(dtype=dt, predicted_calibrated_s=p2,
                     error_calibrated=abs(p2 - r["measured_s"]) / r["measured_s"] if r["measured_s"] else None,
                     flops_counted=rec["costs"]["flops"],
                     unpriced_custom_calls=rec["costs"].get("unpriced_custom_calls"))
            rows.append(r)
            print(f"  {name} {sizes} {dt}: measured {r['measured_s']:.3g}s, predicted {r['predicted_s']:.3g}s "
                  f"(catalogue) / {p2:.3g}s (calibrated), bound {r['bound']}", flush=True)
        except Exception as e:  # noqa: BLE001 - one op's failure is reported, the rest still run
            rows.append({"op": name, "sizes": str(sizes), "dtype": dt, "failed": f"{type(e).__name__}: {e}"[:300]})
            print(f"  {name} failed: {e}", flush=True)
    return {"catalogue_chip": spec.name, "ops": rows}


def section_programs(out_dir: str, tiny: bool, deadline: float) -> dict:
    spec, cal_spec, _ = _specs(tiny)
    path = os.path.join(out_dir, "sections", "programs.json")
    return gpu_programs.run(out_dir, spec=spec, tiny=tiny, cal_spec=cal_spec, deadline=deadline,
                            on_row=lambda res: _write(path, res))  # a section cut short keeps what it measured


def section_extra(name: str, out_dir: str, tiny: bool) -> dict:
    import importlib

    spec, _, _ = _specs(tiny)
    return importlib.import_module(EXTRA[name]).run(out_dir=out_dir, spec=spec, tiny=tiny)


def run_section(name: str, out_dir: str, tiny: bool, deadline: float) -> int:
    """One section in this process; its result goes to OUT_DIR/sections/NAME.json."""
    os.environ["WORKBENCH_RESULTS"] = os.path.join(out_dir, "results.jsonl")
    _platform(tiny)
    t0 = time.time()
    try:
        if name == "ops":
            res = section_ops(out_dir, tiny)
        elif name == "programs":
            res = section_programs(out_dir, tiny, deadline)
        else:
            res = section_extra(name, out_dir, tiny)
    except Exception as e:  # noqa: BLE001 - the section's failure, in its own file
        res = {"failed": f"{type(e).__name__}: {e}"[:400], "traceback": traceback.format_exc()[-2000:]}
    res["wall_s"] = time.time() - t0
    _write(os.path.join(out_dir, "sections", f"{name}.json"), res)
    return 0


# ------------------------------------------------------------------------------------------------ the orchestrator
def _write(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2, default=str)
    os.replace(path + ".tmp", path)


def _child(cmd: list[str], timeout: float, log) -> tuple[int | None, str]:
    """Run a section's process; (exit code or None on timeout, its stdout). Its stderr goes to the log."""
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # take device memory as needed, give it back on exit
    env.setdefault("PYTHONUNBUFFERED", "1")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 5), env=env)
        log.write(p.stderr)
        sys.stdout.write(p.stdout if len(p.stdout) < 20000 else p.stdout[-20000:])
        return p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        log.write((e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")) + "\n[timed out]\n")
        sys.stdout.write(out[-5000:])
        return None, out


def _json_tail(text: str):
    """The JSON document a command printed on stdout (its last top-level object)."""
    i = text.find("{")
    while i >= 0:
        try:
            return json.loads(text[i:])
        except ValueError:
            i = text.find("{", i + 1)
    return None


def orchestrate(out_dir: str, tiny: bool, budget_s: float, work: str | None = None,
                only: list[str] | None = None) -> dict:
    """Run the sections one after the other within `budget_s`; the summary (out_dir/summary.json) is rewritten after
    each. Intermediate files go to `work` (default out_dir)."""
    final, out_dir = out_dir, work or out_dir
    t_start = time.time()
    end = t_start + budget_s
    py = sys.executable
    summary: dict = {"tiny": tiny, "budget_s": budget_s, "sections": {}}
    log = open(os.path.join(out_dir, "sections.log"), "a")
    plat = ["--platform", "cpu"] if tiny else []
    for name, cap in SECTIONS:
        if only and name not in only:
            continue
        left = end - time.time()
        if left < 15:
            summary["sections"][name] = {"skipped": f"out of time ({budget_s:.0f} s budget)"}
            continue
        limit = min(cap * (0.5 if tiny else 1.0) + (60 if tiny else 0), left)
        t0 = time.time()
        print(f"gpu_check: {name} (up to {limit:.0f} s)", flush=True)
        if name == "calibrate":
            rc, out = _child([py, "-m", "workbench", "calibrate", "--json", *(["--quick"] if tiny else []), *plat],
                             limit, log)
            res = _json_tail(out) or {"failed": f"exit {rc}"}
        elif name == "run":
            args = (["--preset", "tiny", "--steps", "2"] if tiny else
                    ["--preset", "gpt2-small", "--batch", "16", "--seq", "1024", "--steps", "12"])
            rc, out = _child([py, "-m", "workbench", "run", *args, "--json", *plat], limit, log)
            res = _json_tail(out) or {"failed": f"exit {rc}"}
        elif name == "peer":
            args = ["--tiny", "--device", "cpu"] if tiny else [
                "--preset", "gpt2-small", "--batch", "16", "--precision", "bf16", "--torch", "eager,compile",
                "--rounds", "3", "--steps", "5", "--total-steps", "100"]
            rc, out = _child([py, "-m", "benchmarks.peer", *args, "--out", os.path.join(out_dir, "peer.json")],
                             limit, log)
            try:
                with open(os.path.join(out_dir, "peer.json")) as f:
                    res = json.load(f)
            except (OSError, ValueError):  # exit 0 and no result: PyTorch is not installed (the peer says so)
                res = ({"skipped": "no result (is PyTorch installed?)"} if rc == 0 else
                       {"failed": f"exit {rc}" if rc is not None else "timed out", "stdout": out[-1500:]})
        else:
            rc, _ = _child([py, "-m", "benchmarks.gpu_check", "--section", name, out_dir,
                            "--deadline", str(time.time() + limit - 20), *(["--tiny"] if tiny else [])], limit, log)
            try:
                with open(os.path.join(out_dir, "sections", f"{name}.json")) as f:
                    res = json.load(f)
            except (OSError, ValueError):
                res = {"failed": f"exit {rc}" if rc is not None else f"timed out after {limit:.0f} s"}
        if rc is None:
            res.setdefault("timed_out", True)
        res["section_wall_s"] = time.time() - t0
        summary["sections"][name] = res
        summary["wall_s"] = time.time() - t_start
        _write(os.path.join(final, "summary.json"), summary)  # what is done survives whatever comes next
        with open(os.path.join(final, "table.md"), "w") as f:
            f.write(table(summary))
    log.close()
    summary["wall_s"] = time.time() - t_start
    return summary


def table(summary: dict) -> str:
    s = summary["sections"]
    cal = s.get("calibrate") or {}
    key = cal.get("key") or {}
    lines = [f"# GPU check: {key.get('device_kind', '?')} ({key.get('platform_version') or key.get('platform', '?')}), "
             f"jax {key.get('jax', '?')}", ""]
    if cal.get("matmul"):
        vs = cal.get("vs_catalogue") or {}
        lines.append("calibration: " + ", ".join(
            f"{dt} {v['flops_per_s'] / 1e12:.0f} TFLOP/s ({vs.get(dt, 0):.0%})" for dt, v in cal["matmul"].items())
            + f"; stream {cal['stream']['bytes_per_s'] / 1e12:.2f} TB/s ({vs.get('stream', 0):.0%}); launch "
            f"{cal['kernel_launch']['per_kernel_s'] * 1e6:.1f} µs/kernel (percent of the catalogue)")
    lines += ["", "| op | sizes | dtype | bound | predicted (catalogue) | predicted (calibrated) | measured | error cat. | "
              "error cal. |", "|---|---|---|---|---|---|---|---|---|"]
    for r in (s.get("ops") or {}).get("ops", []):
        if "failed" in r:
            lines.append(f"| {r['op']} | {r['sizes']} | {r['dtype']} | failed: {r['failed'][:80]} |||||")
            continue
        lines.append(f"| {r['op']} | {r['sizes']} | {r['dtype']} | {r['bound']} | {r['predicted_s']:.3g} | "
                     f"{r['predicted_calibrated_s']:.3g} | {r['measured_s']:.3g} | {r['error']:.1%} | "
                     f"{r['error_calibrated']:.1%} |")
    progs = (s.get("programs") or {}).get("programs", [])
    if progs:
        lines += ["", "| program | measured ms | (a) catalogue ms | err | (a) calibrated ms | err | (b) CPU host ms | err "
                  "| MFU | compile s |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in progs:
            if "measured_s" not in r:
                lines.append(f"| {r['program']} | {r.get('failed') or r.get('skipped')} |||||||||")
                continue
            lines.append(f"| {r['program']} | {r['measured_s'] * 1e3:.2f} | {_ms(r.get('predicted_s'))} | "
                         f"{_pct(r.get('error'))} | {_ms(r.get('predicted_calibrated_s'))} | "
                         f"{_pct(r.get('error_calibrated'))} | {_ms(r.get('predicted_host_s'))} | "
                         f"{_pct(r.get('error_host'))} | {_pct(r.get('mfu'))} | {r['compile_s']:.0f} |")
        for k, v in ((s.get("programs") or {}).get("summary") or {}).items():
            lines.append(f"\n{k}: median |error| {v['median']:.1%}, max {v['max']:.1%} over {v['n']} programs")
    run = s.get("run") or {}
    if run.get("step_s"):
        lines += ["", f"workbench run gpt2-small: platform {run.get('platform')} ({run.get('device_kind')}), step "
                  f"{run['step_s'] * 1e3:.1f} ms, {run.get('tokens_per_s', 0):.0f} tokens/s, MFU {_pct(run.get('mfu'))}, "
                  f"predicted {_ms(run.get('predicted_step_s'))} / calibrated {_ms(run.get('predicted_step_s_calibrated'))}"]
    peer = (s.get("peer") or {}).get("precisions") or {}
    for p, v in peer.items():
        lines += ["", f"peer {p}: workbench {v['workbench']['step_s'] * 1e3:.1f} ms/step; " + ", ".join(
            f"{side} {v[side]['step_s'] * 1e3:.1f} ms (workbench/{side} tokens/s {r:.2f}×)"
            for side, r in v["ratios_tokens_per_s"].items())]
    for name in ("precision", "tiling"):
        if s.get(name):
            lines += ["", f"## {name}", "", "```", json.dumps(s[name], indent=1, default=str)[:2500], "```"]
    return "\n".join(lines) + "\n"


def _ms(x):
    return f"{x * 1e3:.2f}" if x else "—"


def _pct(x):
    return f"{x:+.1%}" if x is not None else "—"


def pack(out_dir: str, work: str, limit_bytes: int = 15 * 2**20) -> str:
    """Everything but the summary and table in one archive (the device tool brings back at most 8 files of at most
    16 MiB each); over `limit_bytes`, packed again without the kernel traces."""
    path = os.path.join(out_dir, "artifacts.tar.gz")
    for with_traces in (True, False):
        with tarfile.open(path, "w:gz") as tar:
            for name in ("hlo", "sections", "results.jsonl", "sections.log", "peer.json", "peer.png"):
                p = os.path.join(work, name)
                if os.path.exists(p):
                    tar.add(p, arcname=name,
                            filter=lambda ti: ti if with_traces or not ti.name.endswith(".trace.json.gz") else None)
        if os.path.getsize(path) <= limit_bytes:
            break
    return path


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    tiny = "--tiny" in argv
    if "--no-trace" in argv:  # the first program is not traced (the trace costs a few seconds of device time)
        os.environ["WORKBENCH_GPU_TRACE"] = "0"
    argv = [a for a in argv if a not in ("--tiny", "--no-trace")]
    opts = {}
    for flag in ("--section", "--deadline", "--budget-s", "--work", "--sections", "--programs"):
        if flag in argv:
            i = argv.index(flag)
            opts[flag] = argv[i + 1]
            del argv[i:i + 2]
    if "--programs" in opts:  # only the programs whose names contain one of these words (sections run in children)
        os.environ["WORKBENCH_GPU_PROGRAMS"] = opts["--programs"]
    out_dir = os.path.abspath(argv[0] if argv else os.environ.get("OUT") or "gpu-check-out")
    os.makedirs(out_dir, exist_ok=True)
    if "--section" in opts:
        return run_section(opts["--section"], out_dir, tiny, float(opts.get("--deadline", time.time() + 600)))
    work = os.path.abspath(opts.get("--work", out_dir))
    os.makedirs(work, exist_ok=True)
    os.environ["WORKBENCH_RESULTS"] = os.path.join(work, "results.jsonl")
    only = [x for x in opts.get("--sections", "").split(",") if x]
    bad = [x for x in only if x not in dict(SECTIONS)]
    if bad:
        print(f"gpu_check: error: unknown section {bad[0]!r}; choose from {', '.join(dict(SECTIONS))}", file=sys.stderr)
        return 2
    summary = orchestrate(out_dir, tiny, float(opts.get("--budget-s", 900 if tiny else 500)), work, only)
    _write(os.path.join(out_dir, "summary.json"), summary)
    text = table(summary)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"gpu_check: done in {summary['wall_s']:.0f}s; results under {out_dir} ({pack(out_dir, work)})")
    return 0


if __name__ == "__main__":
    from workbench.hardware.hostmem import reexec_with_hugepages

    # before JAX starts, in the orchestrator and in each section's process: the allocator the CLI runs with, so the
    # tiny run's sections price with the calibration `workbench calibrate` made (one host fingerprint, not two)
    reexec_with_hugepages()
    sys.exit(main())
