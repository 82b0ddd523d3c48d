"""Benchmark: tokens/s and MFU of the `small` preset per strategy on this host (run in a quiet window).

    python -m benchmarks.mfu                      # 1 device (dp) + 8 simulated devices (dp, fsdp, tp, fsdp+tp)
    python -m benchmarks.mfu --steps 40 --batch 8,32 --preset small --devices 1,8
    python -m benchmarks.mfu --set scan_layers=false --out reports/mfu_unrolled.json   # the unrolled-layers variant
    python -m benchmarks.mfu --tiny               # a quick check that the script works (tiny preset, 4 steps)

Each device count runs in its own process (the simulated device count is fixed when JAX starts). Every case trains
through workbench.programs.train.train_model — the CostReport, prediction and step times come from the spine — and appends a
record of kind 'mfu' to the results store. MFU = model flops per step (6N + 12·L·n_heads·head_dim·seq per token, the
PaLM convention) / median step time / the calibrated host ceiling (workbench.measure.calibrate.get_spec('host'), the XLA
float32 matmul rate): simulated devices share the host, so an 8-device mesh is compared with the same ceiling.

Targets (the issue): 1 device >= 80% of the calibrated XLA matmul ceiling; the best 8-device strategy >= 65%.
The summary lists, per case, the floor its dots set (each dot of the compiled step timed alone, without layout copies
or any other kernel: workbench.measure.harness.dot_floor) and the MFU bound that floor implies, then where the step's time
goes as measured: two extra steps traced with jax.profiler, each
kernel joined with its flops and bytes from the compiled HLO (workbench.measure.harness.profile_kernels), summed by class
(matmul, copy/transpose, dynamic-(update-)slice, broadcast, elementwise/reduce) with the six longest kernels.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from models.presets import get_config
from partitioning.mesh import make_mesh
from workbench.errors import WorkbenchError
from workbench.hardware.devices import request_devices
from workbench.programs.train import train_model
from workbench.results.figures import mfu_chart
from workbench.results.store import Store, make_record

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = {1: [("dp", "data=1")],
         8: [("dp", "data=8"), ("fsdp", "data=8"), ("tp", "data=2,model=4"), ("fsdp+tp", "data=2,model=4"),
             ("tp", "model=8")]}


def steps_for(batch: int, steps: int) -> int:
    """Fewer steps for larger batches (about the same tokens), never under 10 (9 timed)."""
    return max(10, steps * 8 // batch) if batch > 8 else steps


def worker(devices: int, preset: str, steps: int, batches: list[int], precision: str | None, cases=None,
           overrides: str | None = None) -> list[dict]:
    request_devices(devices)

    store = Store()
    rows = []
    todo = [(b, s, m) for b in batches for s, m in (cases or CASES.get(devices, [("dp", f"data={devices}")]))]
    for batch, strategy, mesh_spec in todo:
        n_steps = steps_for(batch, steps)
        try:
            r = train_model(get_config(preset, overrides), strategy=strategy, mesh=make_mesh(mesh_spec), steps=n_steps,
                            batch_size=batch, precision=precision, progress=True, eval_every=n_steps, eval_batches=1,
                            profile_steps=2).to_record()
        except WorkbenchError as e:  # e.g. tiny's 4 heads on a model=8 axis
            print(f"skipped {strategy} on {mesh_spec}: {e}", file=sys.stderr)
            continue
        row = {"preset": preset, "overrides": overrides or "", "devices": devices, "strategy": strategy, "mesh": mesh_spec,
               "batch": batch, "steps": n_steps,
               "precision": r["precision"], "step_s": r["step_s"], "step_s_iqr": r["step_s_iqr"],
               "tokens_per_s": r["tokens_per_s"], "mfu": r["mfu"], "replication": r["replication"],
               "predicted_step_s": (r["prediction"] or {}).get("predicted_s"),
               "host_ceiling_flops": r["mfu_ceiling_flops"], "loss_first": r["losses"][0],
               "loss_last": r["losses"][-1], "kernel_profile": r["kernel_profile"],
               "dot_floor_s": r["kernel_profile"]["dot_floor"]["step_floor_s"],
               "mfu_bound": r["kernel_profile"]["dot_floor"]["mfu_bound"],
               "wide_spread": (r["measurement"] or {}).get("wide_spread")}
        rec = make_record("mfu", {"preset": preset, "overrides": overrides or "", "strategy": strategy,
                                  "mesh": mesh_spec, "devices": devices, "steps": n_steps, "batch": batch, "precision": r["precision"]},
                          r["cost"], r["prediction"], r["measurement"],
                          extra=row | {"mfu_note": r["mfu_note"]})
        store.append(rec)
        row["record_id"] = rec["id"]
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("devices", "strategy", "mesh", "batch", "step_s", "tokens_per_s", "mfu",
                                              "mfu_bound")}),
              file=sys.stderr)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--devices", default="1,8", help="comma-separated device counts, one process each")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", default="8,32", help="comma-separated global batch sizes (sequences of 256 tokens); "
                    "batches above 8 run fewer steps (steps*8/batch, at least 10)")
    ap.add_argument("--precision", default=None, help="default: float32 on a CPU host")
    ap.add_argument("--set", dest="overrides", default=None, help="model overrides, e.g. scan_layers=false")
    ap.add_argument("--tiny", action="store_true", help="quick self-check: tiny preset, 4 steps")
    ap.add_argument("--out", default="reports/mfu.json")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.tiny:
        a.preset, a.steps, a.batch = "tiny", 4, "8"

    def ints(flag: str, text: str) -> list[int]:  # checked here, before any worker starts
        try:
            vals = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            vals = []
        if not vals or min(vals) < 1:
            ap.error(f"{flag} takes comma-separated positive integers, got {text!r}")
        return vals

    batches, device_counts = ints("--batch", a.batch), ints("--devices", a.devices)
    if a.worker is not None:
        rows = worker(a.worker, a.preset, a.steps, batches, a.precision, overrides=a.overrides)
        print(json.dumps(rows))
        return rows
    rows = []
    for n in device_counts:
        cmd = [sys.executable, "-m", "benchmarks.mfu", "--worker", str(n), "--preset", a.preset,
               "--steps", str(a.steps), "--batch", str(a.batch)] + (["--precision", a.precision] if a.precision else []) \
            + (["--set", a.overrides] if a.overrides else [])
        env = dict(os.environ)
        env.setdefault("JAX_PLATFORMS", "cpu")
        p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=os.path.dirname(HERE))
        if p.returncode != 0:
            print(f"worker for {n} devices failed (exit {p.returncode})", file=sys.stderr)
            continue
        rows.extend(json.loads(p.stdout.strip().splitlines()[-1]))
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=2)
    if rows:

        png = mfu_chart(rows, os.path.splitext(a.out)[0] + ".png", targets={1: 0.80, 8: 0.65},
                        title=f"{a.preset}: MFU on this host (dashed: the issue's targets)")
        print(f"chart {png}")
    print(f"{'devices':>7} {'strategy':>8} {'mesh':>15} {'batch':>5} {'step_s':>8} {'tokens/s':>9} {'MFU':>6} {'repl':>5} "
          f"{'dots_s':>7} {'bound':>6}")
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "—"
        bound = f"{r['mfu_bound']:.1%}" if r.get("mfu_bound") is not None else "—"
        print(f"{r['devices']:>7} {r['strategy']:>8} {r['mesh']:>15} {r['batch']:>5} {r['step_s']:>8.3f} {r['tokens_per_s']:>9.0f} "
              f"{mfu:>6} {r['replication']:>5.2f} {r['dot_floor_s']:>7.3f} {bound:>6}")
    print("dots_s: the step's dots timed alone (workbench.measure.harness.dot_floor; simulated devices' dots add up on the "
          "shared host); bound: the MFU of a step that took only that long")
    for r in rows:
        kp = r["kernel_profile"]
        rate = f"{kp['matmul_rate'] / 1e9:.0f}" if kp["matmul_rate"] else "—"
        print(f"\n{r['devices']} devices {r['strategy']} ({r['mesh']}, batch {r['batch']}): measured kernel time per step "
              f"{kp['kernel_ms']:.0f} ms (summed over devices), matmuls at {rate} GFLOP/s "
              f"(ceiling {r['host_ceiling_flops'] / 1e9:.0f})")
        for name, c in kp["classes"].items():
            print(f"  {name:22s} {c['ms']:8.1f} ms {c['ms'] / kp['kernel_ms']:6.1%}  {c['kernels']:4d} kernels  "
                  f"{c['gflop']:7.2f} GFLOP")
        for k in kp["kernels"][:6]:
            what = k["dot"] or k["op"]
            print(f"    {k['name'][:30]:30s} {k['ms']:7.1f} ms x{k['calls']:<5g} {k['gflop_per_s']:6.0f} GFLOP/s "
                  f"{k['gb_per_s']:6.1f} GB/s  {what[:60]}")
        fl = kp["dot_floor"]
        print(f"  its dots timed alone: {fl['step_floor_s']:.3f} s per step at {(fl['rate'] or 0) / 1e9:.0f} GFLOP/s, "
              f"MFU bound {fl['mfu_bound']:.1%}; the step spends {r['step_s'] - fl['step_floor_s']:.3f} s "
              f"({(r['step_s'] - fl['step_floor_s']) / fl['step_floor_s']:.0%} of that floor) beyond it")
    for label, sel, target in (("1 device", lambda r: r["devices"] == 1, "80% of the calibrated XLA matmul ceiling"),
                               ("best multi-device", lambda r: r["devices"] > 1, "65%")):
        best = {}
        for r in rows:
            if sel(r) and r["mfu"] is not None and r["mfu"] > best.get(r["batch"], (-1,))[0]:
                best[r["batch"]] = (r["mfu"], r["strategy"], r["mesh"])
        for b, (m, st, me) in sorted(best.items()):
            print(f"{label} MFU {m:.1%} at batch {b} ({st} {me}; target >= {target})")
    print(f"wrote {a.out}")
    return rows


if __name__ == "__main__":
    from workbench.hardware.hostmem import reexec_with_hugepages

    reexec_with_hugepages()  # before JAX starts: huge pages for XLA:CPU buffers (workbench/hostmem.py)
    main()
