"""`workbench calibrate [--json] [--force]`: the host's measured and physical ceilings."""
from __future__ import annotations

import typer

from workbench.commands.options import platform_option
from workbench.hardware.devices import request_devices
from workbench.measure.calibrate import load_or_calibrate, write_allocates
from workbench.results.console import emit_json


def _print_memory_start(cal: dict) -> None:
    ms = cal.get("memory_start") or {}
    if ms.get("per_kernel_s") is not None:
        lo, hi = ms.get("per_kernel_s_range") or (None, None)
        print(f"  memory start       {ms['per_kernel_s'] * 1e6:8.2f} µs before a kernel's stream from memory runs "
              "at its rate" + (f" (rounds {lo * 1e6:.0f} to {hi * 1e6:.0f})" if lo is not None else ""))


def _print_row_product(cal: dict) -> None:
    rp = cal.get("row_product") or {}
    if rp.get("read_ratio"):
        print(f"  one-row product    {rp['bytes_per_s'] / 1e9:8.2f} GB/s weight reads from memory "
              f"({rp['read_ratio']:.2f}x a sum over the same {rp['weight'][0] * rp['weight'][1] * 4 / 2**20:.0f} MiB)")


def register(app: typer.Typer) -> None:
    @app.command("calibrate")
    def calibrate_cmd(force: bool = typer.Option(False, "--force", help="re-measure even if cached"),
                      quick: bool = typer.Option(False, "--quick", help="small sizes (seconds; for tests)"),
                      platform: str = platform_option(),
                      json_out: bool = typer.Option(False, "--json")):
        """Measure the ceilings of the devices programs run on. On a CPU host: XLA's matmul FLOP/s (float32, bfloat16,
        float16, fp8; each in its fastest result form), streaming bandwidth and special-function throughput, beside
        the physical peaks derived from its CPU features (cached per host fingerprint). On a GPU or TPU: matmul per
        dtype and against size, the device stream and the kernel launch cost (cached per device kind, driver and
        jax version)."""
        request_devices(None, platform)
        import jax

        if jax.devices()[0].platform != "cpu":  # an accelerator: its own ceilings, never the host's
            _device(force, quick, json_out)
            return
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
        if s.get("spread") is not None and band and (s["spread"] > 0.15 or s.get("stable") is False):
            print(f"  warning: the memory stream is noisy: samples {band[0] / 1e9:.1f}–{band[1] / 1e9:.1f} GB/s "
                  f"(spread {s['spread']:.0%} of the median, {len(s.get('samples') or [])} samples"
                  + ("" if s.get("stable", True) else ", the last three never agreed within 15 %")
                  + "); memory-bound predictions carry that band: calibrate again on a quieter machine")
        for lv in cal.get("cache_levels") or []:
            rate = (f"{lv['bytes_per_s'] / 1e9:8.2f} GB/s stream, reads ×{lv.get('read_ratio') or 1:.2f} "
                    f"(spread {lv.get('spread', 0):.0%}{'' if lv.get('stable', True) else ', did not settle'})"
                    if lv.get("bytes_per_s") else f"{'':8s} {lv.get('note', 'not timed')}")
            print(f"  L{lv['level']} {lv['type'][:7]:7s} {lv['capacity_bytes'] / 2**20:9.2f} MiB "
                  f"({lv['instances']} × {lv['size_bytes'] / 2**10:.0f} KiB) {rate}")
            full = lv.get("full")
            if full and lv.get("bytes_per_s"):
                print(f"     over all {full['working_set_bytes'] / 2**20:.0f} MiB: {full['bytes_per_s'] / 1e9:.2f} GB/s, "
                      f"{full['hit_share']:.0%} from the cache: priced as {lv['effective_bytes'] / 2**20:.1f} MiB")
        if cal.get("stream_inplace"):
            wa = write_allocates(cal)
            print(f"  in-place stream    {cal['stream_inplace']['bytes_per_s'] / 1e9:8.2f} GB/s (output over its input; "
                  + ("the caches write-allocate: a kernel from memory moves bytes_in + 2·bytes_out)" if wa else
                     "reads and writes priced alike)"))
        if cal.get("cache_stream"):
            print(f"  in-cache stream    {cal['cache_stream']['bytes_per_s'] / 1e9:8.2f} GB/s "
                  f"({cal['cache_stream']['buffer_bytes'] / 2**20:.0f} MiB buffers)")
        rd = cal.get("reduce") or {}
        if rd.get("from_memory") and rd.get("in_cache"):
            print(f"  reduction          {rd['in_cache']['per_s'] / 1e9:8.2f} G elements/s in cache, "
                  f"{rd['from_memory']['per_s'] / 1e9:.2f} from memory")
        _print_row_product(cal)
        if (cal.get("convert") or {}).get("per_s"):
            print(f"  f32<->bf16 convert {cal['convert']['per_s'] / 1e9:8.2f} G/s (inside fused kernels)")
        tr = cal.get("transpose") or {}
        if tr.get("in_cache") and tr.get("from_memory"):
            print(f"  strided transpose  {tr['in_cache']['per_s'] / 1e9:8.2f} G elements/s in cache "
                  f"({tr['in_cache']['n']}²), {tr['from_memory']['per_s'] / 1e9:.2f} from memory ({tr['from_memory']['n']}²)")
        indep = cal.get("transcendentals_throughput") or {}
        for k, v in cal["transcendentals"].items():
            extra = f" (independent: {indep[k]['per_s'] / 1e9:.2f})" if k in indep else ""
            print(f"  {k:5s} chain          {v['per_s'] / 1e9:8.2f} G/s{extra}")
        if (cal.get("transcendentals_library") or {}).get("per_s"):
            tl = cal["transcendentals_library"]
            print(f"  exp in a library fusion {tl['per_s'] / 1e9:.2f} G/s"
                  + (f" ({tl['per_s_beyond_pass'] / 1e9:.2f} beyond its operand's pass)"
                     if tl.get("per_s_beyond_pass") else ""))
        libf = cal.get("library_fusion") or {}
        if (libf.get("pass") or {}).get("per_s") and (libf.get("ops") or {}).get("per_s"):
            print(f"  library fusion     {libf['ops']['per_s'] / 1e9:8.2f} G elementwise flops/s; a reduced operand's "
                  f"pass {libf['pass']['per_s'] / 1e9:.2f} G elements/s")
        if (cal.get("kernel_launch") or {}).get("per_kernel_s"):
            print(f"  kernel launch      {cal['kernel_launch']['per_kernel_s'] * 1e6:8.2f} µs per kernel in a program")
        _print_memory_start(cal)
        rv = cal.get("rendezvous") or {}
        if rv.get("by_group"):
            per = ", ".join(f"groups of {g}: {v['per_collective_s'] * 1e6:.0f}" for g, v in
                            sorted(rv["by_group"].items(), key=lambda kv: int(kv[0])))
            print(f"  rendezvous         µs per collective on {rv['n_devices']} simulated devices ({per})")
        for k, v in cal["physical"]["derivation"].items():
            if k in ("float32", "bfloat16", "fma_pipes_why", "clock_source"):
                print(f"  physical {k}: {v}")
        for f in cal.get("findings", []):
            print(f"  finding: {f}")


def _device(force: bool, quick: bool, json_out: bool) -> None:
    from workbench.measure.device import load_or_calibrate_device

    cal = load_or_calibrate_device(force=force, quick=quick)
    if json_out:
        emit_json(cal)
        return
    k = cal["key"]
    print(f"device: {k['device_kind']} x {k['device_count']} ({k['platform']}, {k.get('platform_version') or '-'}), "
          f"jax {k['jax']}, calibrated {cal['time']}" + (" [cached]" if cal.get("cached") else ""))
    vs = cal.get("vs_catalogue") or {}
    for dt, v in cal["matmul"].items():
        share = f"  ({vs[dt]:.0%} of {cal['catalogue_chip']}'s catalogue peak)" if dt in vs else ""
        print(f"  matmul {dt:14s} {v['flops_per_s'] / 1e12:8.1f} TFLOP/s at {v['n']}³, {v['result_dtype']} result{share}")
    print("  bfloat16 by size   " + ", ".join(f"{int(n)}³ {r / 1e12:.0f}" for n, r in cal["matmul_curve_bfloat16"])
          + " TFLOP/s")
    s = cal["stream"]
    share = f"  ({vs['stream']:.0%} of the catalogue's HBM bandwidth)" if "stream" in vs else ""
    print(f"  device stream      {s['bytes_per_s'] / 1e12:8.2f} TB/s over {s['bytes'] / 2**30:.1f} GiB, read + write{share}")
    print(f"  kernel launch      {cal['kernel_launch']['per_kernel_s'] * 1e6:8.2f} µs per kernel in a program")
    for f in cal.get("findings", []):
        print(f"  finding: {f}")
    print(f"  ({cal['wall_s']:.0f} s)")
