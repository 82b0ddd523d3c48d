"""Serving predictions against published serving figures, and (with --host) against this host's measurements.

    python -m benchmarks.serving_validation [--json] [--only NAME[,NAME]] [--table PATH] [--host] [--skip-published]

Each row of benchmarks/data/published_serving.csv (TensorRT-LLM on H100, JetStream-PyTorch on TPU v5e, PaLM 540B on
TPU v4 from Pope et al. 2022; each with its source and commit) names a model preset, a target, the strategy and mesh,
the batch, prompt and output lengths, the weight and KV-cache formats, and one published figure. The serving engine's
prefill and/or decode step for that configuration is compiled for the target and predicted
(workbench.programs.serve.target_phase, the programs `workbench serve --target` prices), and the prediction is
converted to the published metric:

  ttft_s                      predicted time to first token (one prefill of `batch` prompts)
  tpot_s                      predicted time per output token (one decode step against a full cache)
  decode_s                    gen_len x tpot (the time to generate gen_len tokens, as Pope et al. report)
  out_tokens_per_s_per_chip   batch x gen_len / (ttft + (gen_len - 1) x tpot) / chips: a static batch, prefilled
                              then decoded (TensorRT-LLM's gptSessionBenchmark)
  out_tokens_per_s_total      batch / tpot: every slot decoding against the full cache (a serving benchmark's
                              steady state; its interleaved prefills and partly filled slots are not modelled)

Reported per row: published, predicted, the signed error (predicted / published - 1, on the published metric),
whether the programs fit the chip's memory; then the median |error| overall and per chip family. A record per row
goes to the results store (kind `serving_validation`), the summary to reports/serving_validation.json.

--host adds the host part: `workbench serve --preset small --target host --batch 1,8,32,64 --prompt-len 128
--gen-len 64` and a wider configuration (d_model 1024), measured with the one harness beside the calibrated host
roofline; the median |error| of predicted against measured time per output token and time to first token. It times
programs, so run it on a quiet machine.

One process compiles every row: TPU slices through libtpu and GPU nodes through deviceless XLA:GPU share it. Without
the JAX CUDA plugin a GPU row compiles for simulated CPU devices, requested once before JAX starts for the largest GPU
row selected. Large models (llama2-70b, PaLM 540B) take minutes per row to compile on a small host.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time

from partitioning.topology import gpu_compiler_for, parse_target
from workbench.errors import WorkbenchError
from workbench.hardware.devices import default_platform, request_devices
from workbench.programs.serve import ServeSpec, serve, target_phase, validate
from workbench.results.store import Store, make_record

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "published_serving.csv")
FIELDS = ("name", "framework", "chip", "target", "model", "overrides", "strategy", "mesh", "batch", "prompt_len",
          "gen_len", "quant", "kv_dtype", "metric", "value", "unit", "source", "commit", "date", "notes")
REQUIRED = tuple(f for f in FIELDS if f not in ("overrides", "mesh", "notes"))
METRICS = {"ttft_s": ("prefill",), "tpot_s": ("decode",), "decode_s": ("decode",),
           "out_tokens_per_s_per_chip": ("prefill", "decode"), "out_tokens_per_s_total": ("decode",)}
HOST_CONFIGS = (("small", None), ("small", "d_model=1024,n_heads=16,d_ff=4096"))
HOST_BATCHES = (1, 8, 32, 64)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_rows(path: str | None = None) -> list[dict]:
    """The published rows, checked: every required field present, a known metric, a positive value and sizes."""
    path = path or TABLE
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise WorkbenchError(f"published serving table {path}: {e.strerror or e}") from None
    for i, r in enumerate(rows, start=2):
        missing = [k for k in REQUIRED if not (r.get(k) or "").strip()]
        if missing:
            raise WorkbenchError(f"{path} line {i} ({r.get('name') or '?'}): missing {', '.join(missing)}")
        if r["metric"] not in METRICS:
            raise WorkbenchError(f"{path} line {i}: unknown metric {r['metric']!r}; one of {', '.join(METRICS)}")
        try:
            ok = float(r["value"]) > 0 and min(int(r[k]) for k in ("batch", "prompt_len", "gen_len")) >= 1
        except ValueError:
            ok = False
        if not ok:
            raise WorkbenchError(f"{path} line {i} ({r['name']}): value, batch, prompt_len and gen_len must be "
                                 "positive numbers")
    names = [r["name"] for r in rows]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise WorkbenchError(f"{path}: duplicate row names {', '.join(dup)}")
    return rows


def spec_of(row: dict):
    """The ServeSpec of a published row (one batch size)."""
    return ServeSpec(row["model"], row["target"], (int(row["batch"]),), int(row["prompt_len"]), int(row["gen_len"]),
                     quant=row["quant"], kv_dtype=row["kv_dtype"], strategy=row["strategy"],
                     mesh=row["mesh"] or None, overrides=row["overrides"] or None)


def convert(metric: str, batch: int, gen_len: int, chips: int, ttft: float | None, tpot: float | None) -> float:
    """The published metric from the predicted time to first token and time per output token (module docstring)."""
    if metric == "ttft_s":
        return ttft
    if metric == "tpot_s":
        return tpot
    if metric == "decode_s":
        return gen_len * tpot
    if metric == "out_tokens_per_s_per_chip":
        return batch * gen_len / (ttft + (gen_len - 1) * tpot) / chips
    if metric == "out_tokens_per_s_total":
        return batch / tpot
    raise WorkbenchError(f"unknown metric {metric!r}")


def validate_row(row: dict) -> dict:
    """Compile the phases a row's metric needs for its target, predict, convert, compare."""
    spec = spec_of(row)
    b, published = int(row["batch"]), float(row["value"])
    out = {"name": row["name"], "framework": row["framework"], "chip": row["chip"], "target": row["target"],
           "model": row["model"], "overrides": row["overrides"] or None, "strategy": row["strategy"],
           "mesh": row["mesh"] or None, "batch": b, "prompt_len": spec.prompt_len, "gen_len": spec.gen_len,
           "quant": spec.quant, "kv_dtype": spec.kv_dtype, "metric": row["metric"], "unit": row["unit"],
           "published": published, "source": row["source"], "commit": row["commit"], "date": row["date"]}
    t0 = time.perf_counter()
    phases: dict[str, dict] = {}
    try:
        validate(spec)
        for mode in METRICS[row["metric"]]:
            phases[mode] = target_phase(spec, b, mode)
    except WorkbenchError as e:
        return dict(out, compiled=False, fits=False, predicted=None, error=None, reason=str(e),
                    wall_s=time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - a compiler failure on one row must not end the validation
        return dict(out, compiled=False, fits=False, predicted=None, error=None,
                    reason=f"compile failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}",
                    wall_s=time.perf_counter() - t0)
    pre, dec = phases.get("prefill"), phases.get("decode")
    ttft = pre["predicted_s"] if pre else None
    tpot = dec["predicted_s"] if dec else None
    chips = (dec or pre)["chips"]
    have = all(p["predicted_s"] for p in phases.values())
    predicted = convert(row["metric"], b, spec.gen_len, chips, ttft, tpot) if have else None
    fits = all(bool(p.get("fits")) for p in phases.values())
    reason = next((p["reason"] for p in phases.values() if p.get("reason")), None)
    return dict(out, compiled=have, fits=fits, chips=chips, predicted=predicted,
                error=(predicted / published - 1) if predicted else None,
                predicted_ttft_s=ttft, predicted_tpot_s=tpot, reason=reason,
                memory_per_device_bytes=max((p.get("peak_memory_bytes") or 0) for p in phases.values()) or None,
                prefill=pre, decode=dec, wall_s=time.perf_counter() - t0)


def summarize(rows: list[dict]) -> dict:
    """Median |error| over the rows with a prediction, overall and per chip family; and over those that fit."""
    errs = [r for r in rows if r.get("error") is not None]
    by_chip: dict[str, list[float]] = {}
    for r in errs:
        by_chip.setdefault(r["chip"], []).append(abs(r["error"]))
    fit = [abs(r["error"]) for r in errs if r.get("fits")]
    return {"median_error": statistics.median([abs(r["error"]) for r in errs]) if errs else None,
            "n_compared": len(errs),
            "median_error_fitting": statistics.median(fit) if fit else None, "n_fitting": len(fit),
            "median_error_by_chip": {c: statistics.median(v) for c, v in sorted(by_chip.items())},
            "n_by_chip": {c: len(v) for c, v in sorted(by_chip.items())}}


def host_part(store) -> dict:
    """Measured against predicted time per output token and time to first token on this host (times programs)."""
    configs, t_errs, f_errs = [], [], []
    for preset, overrides in HOST_CONFIGS:
        spec = ServeSpec(preset, "host", HOST_BATCHES, 128, 64, overrides=overrides)
        _log(f"host: serving {preset} {overrides or ''} at batch {','.join(map(str, HOST_BATCHES))} ...")
        r = serve(spec, say=_log)
        per = []
        for b in r["batches"]:
            te = b["predicted_tpot_s"] / b["tpot_s"] - 1
            fe = b["predicted_ttft_s"] / b["ttft_s"] - 1
            t_errs.append(abs(te))
            f_errs.append(abs(fe))
            per.append({"batch": b["batch"], "tpot_s": b["tpot_s"], "predicted_tpot_s": b["predicted_tpot_s"],
                        "tpot_error": te, "ttft_s": b["ttft_s"], "predicted_ttft_s": b["predicted_ttft_s"],
                        "ttft_error": fe})
        configs.append({"preset": preset, "overrides": overrides, "target": r["target"], "batches": per})
    out = {"configs": configs, "median_tpot_error": statistics.median(t_errs),
           "median_ttft_error": statistics.median(f_errs),
           "median_error": statistics.median(t_errs + f_errs), "n": len(t_errs) + len(f_errs)}

    store.append(make_record("serving_validation", {"part": "host", "prompt_len": 128, "gen_len": 64,
                                                    "batches": list(HOST_BATCHES)}, extra=out))
    return out


def _setup_devices(rows: list[dict]) -> None:
    """The devices the rows compile for, before JAX starts: simulated CPU devices for the largest GPU row that cannot
    compile through XLA:GPU, else the default platform."""
    targets = [parse_target(r["target"]) for r in rows]
    sim = [t.n_chips for t in targets if gpu_compiler_for(t, "auto") == "cpu-sim"]
    request_devices(max(sim)) if sim else default_platform()


def _fmt(x, unit: str) -> str:
    if x is None:
        return "—"
    return f"{x * 1e3:.1f} ms" if unit.startswith("s") else f"{x:,.0f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma list of row names (benchmarks/data/published_serving.csv)")
    ap.add_argument("--json", action="store_true", help="JSON on stdout")
    ap.add_argument("--table", help="another published-serving CSV")
    ap.add_argument("--host", action="store_true", help="also measure serving on this host against its prediction "
                                                        "(times programs: a quiet machine)")
    ap.add_argument("--skip-published", action="store_true", help="only the host part (with --host)")
    ap.add_argument("--out", default=os.path.join("reports", "serving_validation.json"))
    args = ap.parse_args(argv)

    try:
        rows = [] if args.skip_published else load_rows(args.table)
        if args.only:
            want = [w.strip() for w in args.only.split(",") if w.strip()]
            unknown = [w for w in want if w not in {r["name"] for r in rows}]
            if unknown:
                raise WorkbenchError(f"--only {unknown[0]!r} is not a row of the table; choose from "
                                     f"{', '.join(r['name'] for r in rows)}")
            rows = [r for r in rows if r["name"] in want]
        if args.skip_published and not args.host:
            raise WorkbenchError("--skip-published leaves nothing to do without --host")
        _setup_devices(rows)
    except WorkbenchError as e:
        print(f"serving_validation: error: {e}", file=sys.stderr)
        return 2

    store = Store()
    results = []
    for i, row in enumerate(rows, start=1):
        _log(f"[{i}/{len(rows)}] {row['name']}: {row['model']} on {row['target']}, batch {row['batch']} ...")
        r = validate_row(row)
        results.append(r)
        store.append(make_record("serving_validation", {"part": "published", "name": r["name"],
                                                        "table": args.table}, extra=r))
        if r["error"] is not None:
            _log(f"[{i}/{len(rows)}] {r['name']}: predicted {r['predicted']:.4g} vs published {r['published']:.4g} "
                 f"{r['unit']} ({r['error']:+.1%}){'' if r['fits'] else ', does not fit'} ({r['wall_s']:.0f} s)")
        else:
            _log(f"[{i}/{len(rows)}] {r['name']}: not compared: {str(r.get('reason'))[:200]}")
    out = {"rows": results, **summarize(results),
           "error_convention": "error = predicted / published - 1 on the published metric; medians of |error|"}
    if args.host:
        out["host"] = host_part(store)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, default=str)
    if args.json:
        print(json.dumps(out, indent=1, default=str))
        return 0
    for r in results:
        err = f"{r['error']:+.1%}" if r["error"] is not None else "—"
        print(f"{r['name']:40s} {r['target']:13s} {r['metric']:26s} pub {_fmt(r['published'], r['unit']):>10s}  "
              f"pred {_fmt(r['predicted'], r['unit']):>10s}  {err:>8s}  fits={r['fits']}")
    if results:
        med = out["median_error"]
        print(f"median |error| {'—' if med is None else f'{med:.1%}'} over {out['n_compared']} rows; by chip: "
              + ", ".join(f"{c} {v:.1%} ({out['n_by_chip'][c]})" for c, v in out["median_error_by_chip"].items()))
    if args.host:
        h = out["host"]
        print(f"host: median |error| tpot {h['median_tpot_error']:.1%}, ttft {h['median_ttft_error']:.1%} "
              f"over {h['n'] // 2} batches")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    from workbench.hardware.hostmem import reexec_with_hugepages

    reexec_with_hugepages()  # before JAX starts: the allocator `workbench serve` runs with (workbench/hostmem.py)
    sys.exit(main())
