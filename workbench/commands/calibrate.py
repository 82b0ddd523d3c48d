"""`workbench calibrate [--json] [--force]`: the host's measured and physical ceilings."""
from __future__ import annotations

import typer

from workbench.hardware.devices import request_devices
from workbench.measure.calibrate import load_or_calibrate
from workbench.results.console import emit_json


def register(app: typer.Typer) -> None:
    @app.command("calibrate")
    def calibrate_cmd(force: bool = typer.Option(False, "--force", help="re-measure even if cached"),
                      quick: bool = typer.Option(False, "--quick", help="small sizes (seconds; for tests)"),
                      json_out: bool = typer.Option(False, "--json")):
        """Measure XLA's matmul FLOP/s (float32, bfloat16, float16, fp8; each in its fastest result form), streaming
        bandwidth and special-function throughput on this host, beside the physical peaks derived from its CPU
        features. Cached per host fingerprint."""
        request_devices(None)
        cal = load_or_calibrate(force=force, quick=quick)
        if json_out:
            emit_json(cal)
            return
        phys = cal["physical"]["peak_flops"]
        print(f"host: {cal['cpu']['model']} ({cal['cpu']['cores']} cores), calibrated {cal['time']}"
              + (" [cached]" if cal.get("cached") else ""))
        for dt, v in cal["matmul"].items():
            peak = f"   physical peak {phys[dt] / 1e9:8.1f} GFLOP/s" if dt in phys else ""
            print(f"  XLA matmul {dt:13s} {v['flops_per_s'] / 1e9:8.1f} GFLOP/s (IQR {v['flops_per_s_iqr'] / 1e9:.1f}, "
                  f"n={v['n']}, {v.get('result_dtype', dt)} result){peak}")
        lv = cal.get("matmul_level")
        if lv:
            lo, hi = lv["range_flops_per_s"]
            print(f"  matmul level       float32 {lv['n']}³ sampled {lo / 1e9:.0f}–{hi / 1e9:.0f} GFLOP/s at the start, "
                  f"middle and end; the figures above are the median sample's level (×{lv['factor']:.2f} the matmul "
                  "phase)")
        s = cal["stream"]
        band = s.get("range_bytes_per_s")
        print(f"  stream bandwidth   {s['bytes_per_s'] / 1e9:8.2f} GB/s (IQR {s['bytes_per_s_iqr'] / 1e9:.2f}; "
              + (f"samples {band[0] / 1e9:.2f}–{band[1] / 1e9:.2f}; " if band else "")
              + f"{s['buffer_bytes'] / 2**20:.0f} MiB buffers, read + write, out of place)")
        if cal.get("stream_inplace"):
            print(f"  in-place stream    {cal['stream_inplace']['bytes_per_s'] / 1e9:8.2f} GB/s (output over its input; "
                  "not used for pricing)")
        for k, v in cal["transcendentals"].items():
            print(f"  {k:5s} throughput     {v['per_s'] / 1e9:8.2f} G/s")
        for k, v in cal["physical"]["derivation"].items():
            if k in ("float32", "bfloat16", "fma_pipes_why", "clock_source"):
                print(f"  physical {k}: {v}")
        for f in cal.get("findings", []):
            print(f"  finding: {f}")
