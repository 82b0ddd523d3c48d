"""Predictions for published large-scale training runs, compiled for their targets from this host.

    python -m benchmarks.published_validation [--only NAME[,NAME]] [--json] [--table PATH]
                                              [--workers N | --ray auto|ADDRESS]

Each row of benchmarks/data/published_runs.csv (MaxText on TPU v5e and v5p, torchtitan and NeMo on H100; facts
with their sources) becomes a `workbench predict` spec (workbench.programs.validation.PublishedRun.spec: the
model's shape, the slice, the parallelism and mesh, the global batch and microbatches, the remat policy it used)
and is compiled through workbench.programs.predict for its target: libtpu for TPU slices, the GPU path for H100 nodes.
Reported per run: predicted vs published step time and MFU, the error, and for rows that do not fit the compiler's
reason. The median |step-time error| overall and per chip family lands in reports/published_validation.json and in
the results store (kind `published_validation`), where `workbench plan` reads the error it prints beside its
predictions. Each row also times itself: the program's build and lower, its compile and the whole prediction, so
that reports/predict_overhead.md gives, per row, how much longer a prediction takes than the bare compile of the
same program (`predict_over_compile`).

These compiles are pod-scale (up to 256 chips, 7B-128B models): they run one at a time (or one per worker with
`--workers N` / `--ray`: workbench.programs.executor; each worker sets up its devices before its JAX starts, and the
rows come back here to be written), never in tests, with progress on stderr. A GPU row needs as many simulated CPU
devices as GPUs (when the CUDA plugin is absent); they are requested once, before JAX starts, for the largest GPU row
selected.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from partitioning.topology import gpu_compiler_for, parse_target
from workbench.errors import WorkbenchError
from workbench.hardware.devices import default_platform, request_devices
from workbench.hardware.hostmem import reexec_with_hugepages
from workbench.programs import predict as wp
from workbench.programs.executor import Task, make_executor
from workbench.programs.plan import candidate_memory
from workbench.programs.validation import load_runs, summarize_errors
from workbench.results.store import Store, make_record


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def validate(run) -> dict:
    """Compile one published run for its target and compare."""
    spec = run.spec()
    row = {"name": run.name, "chip": run.chip, "target": run.row["target"], "slice": run.row["target"],
           "framework": run.row["framework"],
           "strategy": spec.strategy, "mesh": spec.mesh, "batch": spec.batch, "seq": spec.seq,
           "microbatches": spec.microbatches, "remat_published": run.row["remat"], "remat": spec.remat,
           "shard_activations": spec.shard_activations, "block": run.block,
           "policy": spec.policy, "source": run.row["source"], "commit": run.row["commit"] or None}
    t0 = time.perf_counter()
    try:
        body = wp.predict_once(spec, price_unfit=True)  # a row that does not fit names its largest buffers
    except WorkbenchError as e:
        row.update(fits=False, compiled=False, reason=str(e), step_error=None, mfu_error=None,
                   wall_s=time.perf_counter() - t0)
        return row
    except Exception as e:  # noqa: BLE001 - a compiler failure on one run must not end the validation
        row.update(fits=False, compiled=False, reason=f"compile failed: {type(e).__name__}: "
                                                      f"{' '.join(str(e).split())[:300]}",
                   step_error=None, mfu_error=None, wall_s=time.perf_counter() - t0)
        return row
    pub_step, how = run.published_step(body["model_flops_per_step"])
    pub_mfu = float(run.row["mfu"]) if run.row.get("mfu") else None
    pred_step, pred_mfu = body.get("predicted_step_s"), body.get("predicted_mfu")
    fits = bool(body.get("fits"))
    row.update(
        fits=fits, compiled=bool(body.get("compiled")), reason=body.get("reason"),
        memory_per_device_bytes=body.get("memory_per_device_bytes"), hbm_bytes=body.get("hbm_bytes"),
        predicted_step_s=pred_step, published_step_s=pub_step, published_step_how=how,
        step_error=(pred_step / pub_step - 1) if (fits and pred_step and pub_step) else None,
        predicted_mfu=pred_mfu, published_mfu=pub_mfu,
        mfu_error=(pred_mfu / pub_mfu - 1) if (fits and pred_mfu and pub_mfu) else None,
        bound=body.get("bound"), compute_s=body.get("compute_s"), memory_s=body.get("memory_s"),
        comm_s=body.get("comm_s"), host_s=body.get("host_s"),
        host_bytes_out_per_device=body.get("host_bytes_out_per_device"), analytic_floor_s=body.get("analytic_floor_s"),
        flop_counts=body.get("flop_counts"), compiler=body.get("compiler"), notes=body.get("notes", [])[:6])
    row.update(_timing(body, time.perf_counter() - t0))
    return row


def _timing(body: dict, wall_s: float) -> dict:
    """The prediction's wall time against the bare compile of the same program, both measured in this call: the
    program's build and `jit(...).lower(...)` (build_and_lower_s) plus its `.compile()` (compile_s) are what a bare
    compile costs; the rest of wall_s is the workbench's own work (reading the optimized HLO, pricing, the analytic
    counts). A program compiled twice would show a ratio near 2."""
    lower_s, compile_s = body.get("build_and_lower_s"), body.get("compile_s")
    bare = (lower_s or 0.0) + (compile_s or 0.0)
    return {"build_and_lower_s": lower_s, "compile_s": compile_s, "wall_s": wall_s,
            "predict_over_compile": wall_s / bare if lower_s is not None and compile_s else None}


_DEVICES_SET: list[int | None] = []


def _setup_devices(n_sim: int | None) -> None:
    """The devices the rows compile for, once per process and before its JAX starts: `n_sim` simulated CPU devices
    (GPU rows without the CUDA plugin), else the default platform."""
    if not _DEVICES_SET:
        request_devices(n_sim) if n_sim else default_platform()
        _DEVICES_SET.append(n_sim)


def validate_on_worker(run, n_sim: int | None) -> dict:
    """One row on a fan-out worker (workbench.programs.executor): its devices, then validate."""
    _setup_devices(n_sim)
    return validate(run)


def _compiled_as(r: dict) -> str:
    mesh = r.get("mesh") or ""
    parts = [f"{r.get('strategy')} {mesh}".strip(), str(r.get("remat"))]
    if r.get("block") == "parallel":
        parts.append("parallel block")
    if r.get("shard_activations"):
        parts.append("sharded activations")
    if r.get("policy") and r.get("policy") != "bf16":
        parts.append(str(r["policy"]))
    return ", ".join(parts)


def _result_cell(r: dict) -> str:
    if r.get("step_error") is None:
        why = " ".join(str(r.get("reason") or "not compared").split()).replace("|", "/")
        oom = re.search(r"HLO temporaries \(([\d.]+G)\) exceeds available HBM \(([\d.]+G)\)", why)
        if oom:
            largest = re.search(r"; largest allocations: (.*)$", why)
            why = f"the TPU compiler needs {oom.group(1)} of temporaries > {oom.group(2)} HBM" + (
                f"; largest: {largest.group(1)}" if largest else "")
        if why.startswith(("compile failed", "worker failed")):
            return why[:160]
        room = f"; priced from its optimized HLO: {r['predicted_step_s']:.3g} s" if r.get("predicted_step_s") else ""
        return f"does not fit: {why[:260]}{room}"
    terms = ", ".join(f"{k} {r[k + '_s']:.3g} s" for k in ("compute", "memory", "comm", "host") if r.get(k + "_s"))
    return f"{r['predicted_step_s']:.3g} s ({r.get('bound')}-bound; {terms})"


def markdown_table(rows: list[dict], summary: dict) -> str:
    """The validation as one Markdown table: each run as compiled, its predicted and published step, the error."""
    lines = ["| run | target | compiled here as | predicted step | published step | step error | "
             "MFU predicted / published |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        err = f"{r['step_error']:+.1%}" if r.get("step_error") is not None else "—"
        pm = f"{r['predicted_mfu']:.1%}" if r.get("predicted_mfu") and r.get("step_error") is not None else "—"
        bm = f"{r['published_mfu']:.1%}" if r.get("published_mfu") else "—"
        pub = f"{r['published_step_s']:.3g} s" if r.get("published_step_s") else "—"
        lines.append(f"| {r['name']} | {r['target']} | {_compiled_as(r)} | {_result_cell(r)} | {pub} | {err} | "
                     f"{pm} / {bm} |")
    lines.append("")
    med = summary.get("median_error")
    by_chip = ", ".join(f"{c} {v:.1%} over {summary['n_by_chip'][c]}"
                        for c, v in sorted((summary.get("median_error_by_chip") or {}).items()))
    lines.append(f"Median |step error| over the {summary.get('n_compared')} runs that fit: "
                 f"{'—' if med is None else f'{med:.1%}'}" + (f" ({by_chip})." if by_chip else "."))
    return "\n".join(lines)


def timing_table(rows: list[dict], total_wall_s: float, executor: str) -> str:
    """Per row: the program's build and lower, its compile, the whole prediction, and prediction / (build + lower +
    compile), the figure a prediction is held to (≤ 1.2)."""
    lines = ["| run | build + lower | compile | predict (whole) | predict / compile |", "|---|---|---|---|---|"]
    ratios = []
    for r in rows:
        q = r.get("predict_over_compile")
        if q is not None:
            ratios.append(q)
        cells = [f"{r[k]:.1f} s" if r.get(k) is not None else "—" for k in ("build_and_lower_s", "compile_s", "wall_s")]
        lines.append(f"| {r['name']} | {' | '.join(cells)} | {'—' if q is None else f'{q:.3f}'} |")
    lines.append("")
    lines.append(f"{len(rows)} rows in {total_wall_s / 60:.1f} min ({executor}); predict / compile "
                 + (f"from {min(ratios):.3f} to {max(ratios):.3f}." if ratios else "not measured (nothing compiled)."))
    return "\n".join(lines)


def _expected_seconds(report: str, runs, targets) -> list[float]:
    """Each row's expected wall time: its wall_s in the last report at `report` when it has one, else its chip count
    (a pod-scale program compiles for longer) scaled by the median seconds per chip of the rows the report has."""
    try:
        with open(report, encoding="utf-8") as f:
            last = {r["name"]: r["wall_s"] for r in json.load(f).get("runs", []) if r.get("wall_s")}
    except (OSError, ValueError):
        last = {}
    per_chip = sorted(last[r.name] / t.n_chips for r, t in zip(runs, targets) if r.name in last)
    scale = per_chip[len(per_chip) // 2] if per_chip else 1.0
    return [last.get(r.name, scale * t.n_chips) for r, t in zip(runs, targets)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma list of run names (see benchmarks/data/published_runs.csv)")
    ap.add_argument("--json", action="store_true", help="JSON on stdout")
    ap.add_argument("--table", help="another published-runs CSV")
    ap.add_argument("--out", default=os.path.join("reports", "published_validation.json"))
    ap.add_argument("--workers", type=int, help="compile the rows in N local worker processes")
    ap.add_argument("--ray", help="compile each row as a Ray task: auto, or the cluster head's HOST:6379")
    ap.add_argument("--markdown", action="store_true",
                    help="the results as a Markdown table on stdout (the one docs/accuracy-tpu.md shows)")
    args = ap.parse_args(argv)

    try:
        runs = load_runs(args.table)
        if args.only:
            want = [w.strip() for w in args.only.split(",") if w.strip()]
            unknown = [w for w in want if w not in {r.name for r in runs}]
            if unknown:
                raise WorkbenchError(f"--only {unknown[0]!r} is not a run of the table; choose from "
                                     f"{', '.join(r.name for r in runs)}")
            runs = [r for r in runs if r.name in want]

        targets = [parse_target(r.row["target"]) for r in runs]
        sim = [t.n_chips for t in targets if gpu_compiler_for(t, "auto") == "cpu-sim"]
        n_sim = max(sim) if sim else None
        executor = make_executor(args.workers, args.ray)
        if executor.name == "in-process":
            _setup_devices(n_sim)
    except WorkbenchError as e:
        print(f"published_validation: error: {e}", file=sys.stderr)
        return 2

    tasks = [Task(str(i), run.name, validate_on_worker, (run, n_sim), candidate_memory(t),
                  fresh_process=True) for i, (run, t) in enumerate(zip(runs, targets))]
    if executor.slots() > 1:  # longest first, so that no worker is left with a long row at the end
        cost = _expected_seconds(args.out, runs, targets)
        tasks.sort(key=lambda t: -cost[int(t.key)])
    by_index: dict[int, dict] = {}
    n = len(runs)
    t_start = time.perf_counter()
    with executor:
        for r in executor.run(tasks, on_start=lambda t: _log(f"[{int(t.key) + 1}/{n}] {t.label}: compiling ...")):
            i, run = int(r.task.key), runs[int(r.task.key)]
            row = r.value if r.ok else {
                "name": run.name, "chip": run.chip, "target": run.row["target"], "slice": run.row["target"],
                "framework": run.row["framework"], "fits": False, "compiled": False, "step_error": None,
                "mfu_error": None, "reason": f"worker failed: {r.error}"}
            row["worker"] = r.worker
            by_index[i] = row
            k = f"[{len(by_index)}/{n}] {run.name}"
            if row.get("step_error") is not None:
                _log(f"{k}: predicted {row['predicted_step_s']:.3g}s vs published "
                     f"{row['published_step_s']:.3g}s ({row['step_error']:+.1%}); MFU {row['predicted_mfu']:.3f} vs "
                     f"{row['published_mfu'] if row['published_mfu'] is not None else '-'} ({row['wall_s']:.0f}s, "
                     f"on {r.worker})")
            else:
                _log(f"{k}: does not fit / not compared (on {r.worker or 'a worker that died'}): "
                     f"{str(row.get('reason'))[:200]}")
    rows = [by_index[i] for i in sorted(by_index)]
    summary = summarize_errors(rows)
    total_wall_s = time.perf_counter() - t_start
    ratios = [r["predict_over_compile"] for r in rows if r.get("predict_over_compile") is not None]
    out = {"runs": rows, **summary, "chips": sorted({r["chip"] for r in rows}),
           "executor": executor.describe(), "total_wall_s": total_wall_s,
           "max_predict_over_compile": max(ratios) if ratios else None,
           "error_convention": "step_error = predicted / published step time − 1; median of |step_error| over the "
                               "runs that fit"}
    Store().append(make_record("published_validation", {"only": args.only, "table": args.table}, extra=out))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, default=str)
    timing = os.path.join(os.path.dirname(os.path.abspath(args.out)), "predict_overhead.md")
    with open(timing, "w", encoding="utf-8") as f:
        f.write(timing_table(rows, total_wall_s, executor.describe()) + "\n")
    if args.json:
        print(json.dumps(out, indent=1, default=str))
    elif args.markdown:
        print(markdown_table(rows, summary))
    else:
        for r in rows:
            err = f"{r['step_error']:+.1%}" if r.get("step_error") is not None else "—"
            print(f"{r['name']:28s} {r['target']:16s} pred {r.get('predicted_step_s') or float('nan'):9.3g}s  "
                  f"pub {r.get('published_step_s') or float('nan'):9.3g}s  {err:>8s}  fits={r['fits']}")
        print(f"median |step error| {summary['median_error']} over {summary['n_compared']} runs; wrote {args.out}")
    return 0


if __name__ == "__main__":
    reexec_with_hugepages()
    sys.exit(main())
