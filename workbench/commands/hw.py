"""`workbench hw list|show NAME [--json]`: the hardware catalogue, every figure with its source."""
from __future__ import annotations

import typer

from workbench.errors import WorkbenchError
from workbench.hardware.devices import default_platform
from workbench.hardware.spec import catalogue
from workbench.hardware.tiles import tile_model
from workbench.measure.calibrate import get_spec
from workbench.results.console import emit_json, print_table


def register(app: typer.Typer) -> None:
    hw = typer.Typer(help="Hardware catalogue: chips and the calibrated host.", no_args_is_help=True)
    app.add_typer(hw, name="hw")

    @hw.command("list")
    def hw_list(json_out: bool = typer.Option(False, "--json")):
        """All chips with their headline figures (host: from the cached calibration, if any)."""
        default_platform()
        rows = []
        for spec in catalogue().values():
            rows.append(_row(spec))
        try:
            rows.append(_row(get_spec("host", calibrate_if_missing=False)))
        except WorkbenchError:
            rows.append({"name": "host", "kind": "cpu", "vendor": "", "peak_flops": {}, "hbm_bytes": None,
                         "hbm_bw": None, "note": "not calibrated yet: run `workbench calibrate`"})
        if json_out:
            emit_json(rows)
        else:
            print_table([{"name": r["name"], "kind": r["kind"],
                          "bf16 TFLOP/s": (r["peak_flops"].get("bfloat16") or 0) / 1e12 or None,
                          "f32 TFLOP/s": (r["peak_flops"].get("float32") or 0) / 1e12 or None,
                          "fp8 TFLOP/s": (r["peak_flops"].get("float8_e4m3fn")
                                          or r["peak_flops"].get("float8_e4m3fnuz") or 0) / 1e12 or None,
                          "HBM GB": (r["hbm_bytes"] or 0) / 1e9 or None,
                          "HBM TB/s": (r["hbm_bw"] or 0) / 1e12 or None} for r in rows],
                        title="Hardware catalogue (dense peaks per chip; `workbench hw show NAME` for sources)")

    @hw.command("show")
    def hw_show(name: str, json_out: bool = typer.Option(False, "--json")):
        """One chip, every figure with its source and the date it was read."""
        default_platform()
        spec = get_spec(name)
        d = spec.to_dict()
        tm = _tile_model(spec.name)
        if tm is not None:
            d["tiles"] = tm.to_record()
        if json_out:
            emit_json(d)
            return
        print(f"{spec.name} ({spec.vendor}, {spec.kind})")
        for dt, v in spec.peak_flops.items():
            src = spec.sources.get(f"peak_flops.{dt}") or spec.sources.get("peak_flops")
            print(f"  peak {dt:16s} {v / 1e12:10.3f} TFLOP/s   [{src.source if src else '?'}, {src.date if src else ''}]")
        if spec.measured.physical_peak_flops:
            for dt, v in spec.measured.physical_peak_flops.items():
                print(f"  physical {dt:12s} {v / 1e12:10.3f} TFLOP/s   [{spec.sources['physical_peak_flops'].source}]")
        for key, unit, scale in (("hbm_bytes", "GB", 1e9), ("hbm_bw", "GB/s", 1e9), ("onchip_bytes", "MB", 1e6),
                                 ("host_link_bw", "GB/s", 1e9), ("transcendentals_per_s", "G/s", 1e9)):
            v = getattr(spec, key)
            src = spec.sources.get(key)
            if v is not None:
                print(f"  {key:21s} {v / scale:10.3f} {unit:6s} [{src.source if src else '?'}, {src.date if src else ''}]")
        ic = spec.interconnect
        print(f"  interconnect          {ic.kind}: {ic.links} links × {ic.link_bw / 1e9:.1f} GB/s one-way"
              + (f", scale-out {ic.scale_out_bw / 1e9:.1f} GB/s" if ic.scale_out_bw else ""))
        if spec.matrix_unit:
            print(f"  matrix unit           {'×'.join(map(str, spec.matrix_unit))}")
        if spec.cores_per_chip:
            src = spec.sources.get("cores_per_chip")
            print(f"  cores per chip        {spec.cores_per_chip}   [{src.source if src else '?'}, {src.date if src else ''}]")
        for dt in spec.peak_flops:
            print(f"  ridge {dt:15s} {spec.ridge(dt):10.1f} FLOP/byte")
        for n in spec.notes:
            print("  note:", n)
        if tm is not None:
            print(f"  tile model            {tm.matrix_units.value} x {'x'.join(map(str, tm.matrix_unit.value))} "
                  f"{'MXU' if tm.kind == 'tpu' else 'MMA (m, n, k)'} per core, {tm.onchip_bytes.value / 2**20:.3g} MiB "
                  f"{'VMEM' if tm.kind == 'tpu' else 'shared memory'} per core [{tm.onchip_bytes.source[:60]}...]"
                  "  (`workbench tiling shape` uses it)")


def _tile_model(name: str):
    """The chip's tile model (workbench/hardware/tiles.py), or None (the host, or a chip without one)."""
    try:
        return tile_model(name)
    except WorkbenchError:
        return None


def _row(spec) -> dict:
    return {"name": spec.name, "kind": spec.kind, "vendor": spec.vendor, "peak_flops": spec.peak_flops,
            "hbm_bytes": spec.hbm_bytes, "hbm_bw": spec.hbm_bw, "aliases": list(spec.aliases)}
