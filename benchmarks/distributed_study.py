"""Benchmark: what going beyond one process costs on this host (run it in a quiet window).

    python -m benchmarks.distributed_study                 # small, fsdp on data=8: 1, 2 and 4 processes; checkpoints
    python -m benchmarks.distributed_study --preset tiny --steps 20 --processes 1,2 --every 5
    python -m benchmarks.distributed_study --tiny          # a quick check that the script works

Two studies, every figure measured by the spine (workbench.programs.train.train_model: step times from the harness,
workbench.measure.harness; saves timed by its `timed`) and appended to the results store as records of kind
'distributed':
1. processes: the same global mesh (`--devices 8 --mesh data=8`, fsdp) as 1, 2, 4 processes
   (`workbench run --processes N`): median step time and its spread, and the largest relative loss difference from
   the 1-process run (the runs must agree to float32 tolerance).
2. checkpoints (one process): no checkpoint, asynchronous orbax saves every K steps, synchronous saves every K
   steps. Per run: the time a save holds the loop (`save_blocking_s`: for a synchronous save, the whole save; the
   first save apart from the later ones, since it includes orbax's start-up),
   the median step with a save and without, the wait for the last background write, the restore time of a
   resumed run.
Each row carries the host's load average when it ran: a figure taken while other work ran is marked contended.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from models.presets import get_config
from partitioning.mesh import make_mesh
from workbench.hardware.devices import request_devices
from workbench.programs.checkpoint import CheckpointSpec
from workbench.programs.train import train_model
from workbench.results.store import Store, make_record

CONTENDED_LOAD = 0.5  # load average per core above which a row is marked contended


def _load() -> dict:
    one, five, _ = os.getloadavg()
    cores = os.cpu_count() or 1
    return {"loadavg_1m": one, "cores": cores, "contended": one / cores > CONTENDED_LOAD}


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) if y else abs(x) for x, y in zip(a, b))


def process_cases(preset: str, steps: int, counts: list[int], devices: int) -> list[dict]:
    rows, ref = [], None
    for n in counts:
        load = _load()
        cmd = [sys.executable, "-m", "workbench", "run", "--preset", preset, "--strategy", "fsdp", "--mesh",
               f"data={devices}", "--devices", str(devices), "--processes", str(n), "--steps", str(steps), "--json"]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        if p.returncode != 0:
            print(f"{n} processes: exit {p.returncode}", file=sys.stderr)
            continue
        r = json.loads(p.stdout)
        ref = ref if ref is not None else r["losses"]
        rows.append({"study": "processes", "preset": preset, "processes": r["processes"], "hosts": r["hosts"],
                     "devices": devices, "mesh": f"data={devices}", "strategy": "fsdp", "steps": steps,
                     "step_s": r["step_s"], "tokens_per_s": r["tokens_per_s"], "mfu": r["mfu"],
                     "loss_rel_diff_vs_1_process": _rel(r["losses"], ref), "record_id": r["record_id"],
                     **{k: v for k, v in load.items()}, "contended": load["contended"] or _load()["contended"]})
    return rows


def checkpoint_worker(preset: str, steps: int, every: int, devices: int) -> list[dict]:
    request_devices(devices)  # before JAX starts: this worker is its own process
    cfg, rows = get_config(preset), []
    root = tempfile.mkdtemp(prefix="workbench-ckpt-study-")
    try:
        for mode in ("none", "async", "sync", "resume"):
            load = _load()
            d = os.path.join(root, mode if mode != "resume" else "async")
            spec = None
            if mode in ("async", "sync"):
                spec = CheckpointSpec(d, every=every, asynchronous=mode == "async")
            elif mode == "resume":  # continue the async run from its step just before the end
                last = max(int(x) for x in os.listdir(d) if x.isdigit())
                shutil.rmtree(os.path.join(d, str(last)))
                spec = CheckpointSpec(d, every=every, resume=True)
            r = train_model(cfg, strategy="fsdp", mesh=make_mesh(f"data={devices}"), steps=steps, progress=False,
                            checkpoint=spec)
            c = r.checkpoint.to_record() if r.checkpoint else {}
            blocking = c.get("save_blocking_s") or []  # the first save includes orbax's start-up: shown apart
            r = r.to_record()
            rows.append({"study": "checkpoint", "mode": mode, "preset": preset, "devices": devices, "steps": steps,
                         "every": every if spec else None, "step_s": r["step_s"],
                         "step_s_iqr": r["step_s_iqr"], "save_blocking_s_median": c.get("save_blocking_s_median"),
                         "save_waiting_s_median": c.get("save_waiting_s_median"),
                         "save_blocking_s": c.get("save_blocking_s"),
                         "first_save_blocking_s": (blocking or [None])[0],
                         "later_saves_blocking_s_median": float(np.median(blocking[1:])) if len(blocking) > 1 else None,
                         "step_s_with_save": c.get("step_s_with_save"),
                         "step_s_without_save": c.get("step_s_without_save"),
                         "save_overhead_s": c.get("save_overhead_s"), "final_wait_s": c.get("final_wait_s"),
                         "restore_s": c.get("restore_s"), "first_step": r["first_step"],
                         "state_bytes": r["cost"]["memory"].get("argument_bytes"),
                         **load, "contended": load["contended"] or _load()["contended"]})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--processes", default="1,2,4", help="comma-separated process counts (each divides --devices)")
    ap.add_argument("--devices", type=int, default=8, help="global simulated devices (the mesh is data=N)")
    ap.add_argument("--every", type=int, default=5, help="checkpoint interval in steps")
    ap.add_argument("--tiny", action="store_true", help="quick self-check: tiny preset, 10 steps, 1 and 2 processes")
    ap.add_argument("--out", default="reports/distributed.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.tiny:
        a.preset, a.steps, a.processes, a.every = "tiny", 10, "1,2", 5
    try:
        counts = [int(x) for x in a.processes.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or any(a.devices % n for n in counts):
        ap.error(f"--processes takes comma-separated counts that divide --devices {a.devices}, got {a.processes!r}")
    if a.steps < 2 * a.every or a.every < 1:
        ap.error(f"--steps {a.steps} must cover at least two checkpoint intervals of --every {a.every}")
    if a.worker:
        print(json.dumps(checkpoint_worker(a.preset, a.steps, a.every, a.devices)))
        return None
    rows = process_cases(a.preset, a.steps, counts, a.devices)
    cmd = [sys.executable, "-m", "benchmarks.distributed_study", "--worker", "--preset", a.preset, "--steps",
           str(a.steps), "--every", str(a.every), "--devices", str(a.devices)]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    if p.returncode == 0:
        rows += json.loads(p.stdout.strip().splitlines()[-1])
    else:
        print(f"checkpoint worker failed (exit {p.returncode})", file=sys.stderr)

    store = Store()
    for r in rows:
        spec = {k: r.get(k) for k in ("study", "preset", "processes", "mode", "devices", "steps", "every")}
        r["study_record_id"] = store.append(make_record("distributed", spec, extra=r))["id"]
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=2)
    f3 = lambda v: "—" if v is None else f"{v:.4f}"
    print(f"{'processes':>9} {'step_s':>8} {'tokens/s':>9} {'loss diff':>9} {'load/core':>9}")
    for r in (r for r in rows if r["study"] == "processes"):
        print(f"{r['processes']:>9} {f3(r['step_s']):>8} {r['tokens_per_s'] or 0:>9.0f} "
              f"{r['loss_rel_diff_vs_1_process']:>9.1e} {r['loadavg_1m'] / r['cores']:>9.2f}"
              + ("  contended" if r["contended"] else ""))
    print(f"\n{'checkpoint':>10} {'step_s':>8} {'1st save':>8} {'later':>8} {'of it wait':>10} {'with save':>9} "
          f"{'without':>8} {'last wait':>9} {'restore':>8}")
    for r in (r for r in rows if r["study"] == "checkpoint"):
        print(f"{r['mode']:>10} {f3(r['step_s']):>8} {f3(r['first_save_blocking_s']):>8} "
              f"{f3(r['later_saves_blocking_s_median']):>8} "
              f"{f3(r['save_waiting_s_median']):>10} "
              f"{f3(r['step_s_with_save']):>9} {f3(r['step_s_without_save']):>8} {f3(r['final_wait_s']):>9} "
              f"{f3(r['restore_s']):>8}" + ("  contended" if r["contended"] else ""))
    print(f"wrote {a.out}")
    return rows


if __name__ == "__main__":
    from workbench.hardware.hostmem import reexec_with_hugepages

    reexec_with_hugepages()  # before JAX starts: huge pages for XLA:CPU buffers (workbench/hostmem.py)
    main()
