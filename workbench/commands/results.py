"""`workbench results list|show|path`: the results store."""
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

    @res.command("path")
    def path_cmd():
        """Where records are written ($WORKBENCH_RESULTS, default ./results)."""

        print(Store().path)
