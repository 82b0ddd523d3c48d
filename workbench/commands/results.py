"""`workbench results list|show|path|compare`: the results store."""
from __future__ import annotations

from typing import Optional

import typer

from workbench.errors import WorkbenchError
from workbench.results.console import emit_json, print_table
from workbench.results.store import Store


def register(app: typer.Typer) -> None:
    res = typer.Typer(help="The results store (append-only JSON Lines).", no_args_is_help=True)
    app.add_typer(res, name="results")

    @res.command("list")
    def list_cmd(kind: Optional[str] = typer.Option(None, help="only records of this kind"),
                 last: int = typer.Option(20, help="show the last N"),
                 json_out: bool = typer.Option(False, "--json")):
        """The latest records, one line each."""
        recs = Store().records(kind)[-last:]
        rows = [{"id": r["id"], "kind": r["kind"], "time": r["provenance"]["time"],
                 "spec": ", ".join(f"{k}={v}" for k, v in r["spec"].items() if k != "description")[:70],
                 "predicted_s": (r.get("prediction") or {}).get("predicted_s"),
                 "measured_s": (r.get("measurement") or {}).get("median_s")} for r in recs]
        emit_json(rows) if json_out else print_table(rows)

    @res.command("show")
    def show_cmd(record_id: str):
        """One record, whole, as JSON."""
        for r in Store().records():
            if r["id"].startswith(record_id):
                emit_json(r)
                return
        raise WorkbenchError(f"no record {record_id!r} in {Store().path}; `workbench results list` shows the ids")

    @res.command("compare")
    def compare_cmd(experiment: Optional[str] = typer.Option(None, "--experiment",
                                                             help="a record id (prefix) or experiment key"),
                    kind: Optional[str] = typer.Option(None, help="only records of this kind"),
                    metric: Optional[list[str]] = typer.Option(None, "--metric",
                                                               help="dotted path into a record (repeatable), e.g. "
                                                                    "measurement.median_s"),
                    every: bool = typer.Option(False, "--all", help="also experiments seen under one version set"),
                    json_out: bool = typer.Option(False, "--json")):
        """The same experiment (kind + spec) across jax/jaxlib/libtpu/flax versions: medians per version set."""
        from workbench.results.console import emit_json, print_table
        from workbench.results.store import Store

        comps = Store().compare(experiment=experiment, kind=kind, metrics=tuple(metric) if metric else None,
                                every=every)
        if json_out:
            emit_json([c.to_record() for c in comps])
            return
        if not comps:
            print("no experiment was recorded under more than one version set (--all lists every experiment)")
        for c in comps:
            spec = ", ".join(f"{k}={v}" for k, v in c.spec.items() if k != "description")[:90]
            rows = [{"jax": r.versions.get("jax"), "jaxlib": r.versions.get("jaxlib"),
                     "libtpu": r.versions.get("libtpu"), "flax": r.versions.get("flax"), "n": r.n, **r.metrics}
                    for r in c.rows]
            print_table(rows, title=f"{c.kind} {c.experiment}: {spec}")

    @res.command("path")
    def path_cmd():
        """Where records are written ($WORKBENCH_RESULTS, default ./results)."""
        print(Store().path)
