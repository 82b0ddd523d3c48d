"""Benchmark: tokens/s and MFU of the `small` preset per strategy on this host (run in a quiet window).

    python -m benchmarks.mfu                      # 1 device (dp) + 8 simulated devices (dp, fsdp, tp, fsdp+tp)
    python -m benchmarks.mfu --steps 40 --batch 8 --preset small --devices 1,8
    python -m benchmarks.mfu --set scan_layers=true --out reports/mfu_scan.json   # the scanned-layers variant
    python -m benchmarks.mfu --tiny               # a quick check that the script works (tiny preset, 4 steps)

Each device count runs in its own process (the simulated device count is fixed when JAX starts). Every case trains
through workbench.train.train_model — the CostReport, prediction and step times come from the spine — and appends a
record of kind 'mfu' to the results store. MFU = model flops per step (6N + 12·L·n_heads·head_dim·seq per token, the
PaLM convention) / median step time / the calibrated host ceiling (workbench.hardware.get_spec('host'), the XLA
float32 matmul rate): simulated devices share the host, so an 8-device mesh is compared with the same ceiling.

Targets (the issue): 1 device >= 80% of the calibrated XLA matmul ceiling; the best 8-device strategy >= 65%.
The summary lists, per case, the five kernels with the largest roofline time (where the step loses time against
the matmuls) from the CostReport.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))

CASES = {1: [("dp", "data=1")],
         8: [("dp", "data=8"), ("fsdp", "data=8"), ("tp", "data=2,model=4"), ("fsdp+tp", "data=2,model=4"),
             ("tp", "model=8")]}


def _top_kernels(cost: dict, spec, n: int = 5) -> list[dict]:
    """Among the record's kernels (the CostReport's 25 largest by bytes), the n with the largest roofline time
    max(flops/peak, bytes/bw) per device: the memory-bound kernels where a step loses time against the matmuls."""
    out = []
    peak, bw = spec.peak("float32"), spec.hbm_bw
    for k in cost.get("kernels", []):
        nbytes = k["bytes_in"] + k["bytes_out"]
        t = max(k["flops"] / peak, nbytes / bw) * k.get("count", 1)
        out.append({"name": k["name"], "kind": k.get("kind"), "roofline_s": t, "flops": k["flops"], "bytes": nbytes})
    return sorted(out, key=lambda r: -r["roofline_s"])[:n]


def worker(devices: int, preset: str, steps: int, batch: int, precision: str | None, cases=None,
           overrides: str | None = None) -> list[dict]:
    from workbench.devices import request_devices
    from workbench.errors import WorkbenchError

    request_devices(devices)
    from models.presets import get_config
    from partitioning.mesh import make_mesh
    from workbench.hardware import get_spec
    from workbench.results import Store, make_record
    from workbench.train import train_model

    spec = get_spec("host")
    store = Store()
    rows = []
    for strategy, mesh_spec in cases or CASES.get(devices, [("dp", f"data={devices}")]):
        try:
            r = train_model(get_config(preset, overrides), strategy=strategy, mesh=make_mesh(mesh_spec), steps=steps,
                            batch_size=batch, precision=precision, progress=True, eval_every=steps, eval_batches=1)
        except WorkbenchError as e:  # e.g. tiny's 4 heads on a model=8 axis
            print(f"skipped {strategy} on {mesh_spec}: {e}", file=sys.stderr)
            continue
        row = {"preset": preset, "overrides": overrides or "", "devices": devices, "strategy": strategy, "mesh": mesh_spec,
               "precision": r["precision"], "step_s": r["step_s"], "step_s_iqr": r["step_s_iqr"],
               "tokens_per_s": r["tokens_per_s"], "mfu": r["mfu"], "replication": r["replication"],
               "predicted_step_s": (r["prediction"] or {}).get("predicted_s"),
               "host_ceiling_flops": r["mfu_ceiling_flops"], "loss_first": r["losses"][0],
               "loss_last": r["losses"][-1], "top_kernels": _top_kernels(r["cost"], spec),
               "wide_spread": (r["measurement"] or {}).get("wide_spread")}
        rec = make_record("mfu", {"preset": preset, "overrides": overrides or "", "strategy": strategy,
                                  "mesh": mesh_spec, "devices": devices, "steps": steps, "batch": batch, "precision": r["precision"]},
                          r["cost"], r["prediction"], r["measurement"],
                          extra={k: v for k, v in row.items() if k != "top_kernels"} | {"mfu_note": r["mfu_note"]})
        store.append(rec)
        row["record_id"] = rec["id"]
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("devices", "strategy", "mesh", "step_s", "tokens_per_s", "mfu")}),
              file=sys.stderr)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--devices", default="1,8", help="comma-separated device counts, one process each")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--precision", default=None, help="default: float32 on a CPU host")
    ap.add_argument("--set", dest="overrides", default=None, help="model overrides, e.g. scan_layers=true")
    ap.add_argument("--tiny", action="store_true", help="quick self-check: tiny preset, 4 steps")
    ap.add_argument("--out", default="reports/mfu.json")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.tiny:
        a.preset, a.steps = "tiny", 4
    if a.worker is not None:
        rows = worker(a.worker, a.preset, a.steps, a.batch, a.precision, overrides=a.overrides)
        print(json.dumps(rows))
        return rows
    rows = []
    for n in [int(x) for x in a.devices.split(",") if x.strip()]:
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
    print(f"{'devices':>7} {'strategy':>8} {'mesh':>15} {'step_s':>8} {'tokens/s':>9} {'MFU':>6} {'repl':>5}")
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "—"
        print(f"{r['devices']:>7} {r['strategy']:>8} {r['mesh']:>15} {r['step_s']:>8.3f} {r['tokens_per_s']:>9.0f} "
              f"{mfu:>6} {r['replication']:>5.2f}")
    for r in rows:
        print(f"\n{r['devices']} devices {r['strategy']}: top kernels by roofline time (per device)")
        for k in r["top_kernels"]:
            print(f"  {k['name'][:48]:48s} {k['roofline_s'] * 1e3:8.2f} ms  flops {k['flops']:.3g}  bytes "
                  f"{k['bytes']:.3g}")
    one = [r["mfu"] for r in rows if r["devices"] == 1 and r["mfu"] is not None]
    many = [r["mfu"] for r in rows if r["devices"] > 1 and r["mfu"] is not None]
    if one:
        print(f"\n1 device MFU {max(one):.1%} (target >= 80% of the calibrated XLA matmul ceiling)")
    if many:
        print(f"best multi-device MFU {max(many):.1%} (target >= 65%)")
    print(f"wrote {a.out}")
    return rows


if __name__ == "__main__":
    from workbench.hostmem import reexec_with_hugepages

    reexec_with_hugepages()  # before JAX starts: huge pages for XLA:CPU buffers (workbench/hostmem.py)
    main()
