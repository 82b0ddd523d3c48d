"""`workbench moe ...`: routing statistics on synthetic router logits, and the costs of one MoE layer on a mesh.

    workbench moe route --tokens 4096 --experts 8 --top-k 2 --capacity-factor 1.0 --router token-choice --json
    workbench --devices 8 moe layer --mesh data=2,expert=4 --strategy ep --experts 8 --top-k 2 --capacity-factor 1.25

The programs (synthetic logits, routing statistics, the layer's compiled costs) are in workbench/programs/moe.py.
"""
from __future__ import annotations

from typing import Optional

import typer

from workbench.errors import finite_number, positive_int
from workbench.hardware.devices import default_platform, request_devices
from workbench.results.console import emit_json, print_table
from workbench.results.store import Store, make_record


def route_cmd(
    tokens: int = typer.Option(4096, "--tokens", help="tokens routed (batch x sequence)"),
    experts: int = typer.Option(8, "--experts", help="number of experts"),
    top_k: int = typer.Option(2, "--top-k", help="experts per token (token-choice); average for expert-choice"),
    capacity_factor: Optional[float] = typer.Option(
        None, "--capacity-factor", help="slots per expert = ceil(C*T*k/E); omit for dropless"),
    router: str = typer.Option("token-choice", "--router", help="token-choice | expert-choice"),
    score: str = typer.Option("softmax", "--score", help="softmax | sigmoid (token-choice)"),
    skew: float = typer.Option(0.0, "--skew", help="Zipf exponent of expert popularity (0: balanced)"),
    seed: int = typer.Option(0, "--seed"),
    ep: int = typer.Option(1, "--ep", help="expert-parallel degree: tokens routed in this many groups"),
    as_json: bool = typer.Option(False, "--json", help="JSON to stdout"),
):
    """Route synthetic logits; print dropped fraction, per-expert load, aux losses, entropy."""
    from workbench.programs.moe import route_stats

    positive_int("--tokens", tokens)
    positive_int("--experts", experts)
    positive_int("--ep", ep)
    finite_number("--skew", skew, minimum=0)
    default_platform()
    out = route_stats(tokens, experts, top_k, capacity_factor, router, score, skew, seed, ep)
    if as_json:
        emit_json(out)
        return
    rows = [{"quantity": k, "value": v} for k, v in out.items() if k not in ("load_per_expert", "conventions")]
    print_table(rows, title="MoE routing on synthetic logits")
    print("load per expert:", " ".join(f"{v:.0f}" for v in out["load_per_expert"]))
    print(out["conventions"])


def layer_cmd(
    tokens: int = typer.Option(4096, "--tokens", help="tokens per step (batch x seq)"),
    seq: int = typer.Option(64, "--seq"),
    d_model: int = typer.Option(256, "--d-model"),
    d_ff: int = typer.Option(512, "--d-ff", help="hidden size of each expert"),
    experts: int = typer.Option(8, "--experts"),
    top_k: int = typer.Option(2, "--top-k"),
    capacity_factor: Optional[float] = typer.Option(
        1.25, "--capacity-factor", help="slots per expert = ceil(C*T*k/E) per routing group"),
    dropless: bool = typer.Option(False, "--dropless", help="no capacity: sort + ragged_dot"),
    router: str = typer.Option("token-choice", "--router"),
    score: str = typer.Option("softmax", "--score"),
    mlp: str = typer.Option("swiglu", "--mlp"),
    mesh: str = typer.Option("expert=8", "--mesh", help="e.g. data=2,expert=4 (axes: data, model, expert, seq)"),
    strategy: str = typer.Option("ep", "--strategy"),
    backward: bool = typer.Option(False, "--backward", help="compile forward+backward"),
    targets: str = typer.Option("tpu-v5e,h100-sxm", "--targets", help="chips to predict on"),
    devices: int = typer.Option(8, "--devices", help="simulated CPU devices (must match the mesh)"),
    do_measure: bool = typer.Option(False, "--measure", help="also time it here (quiet machine only)"),
    record: bool = typer.Option(True, "--record/--no-record", help="append a record to the results store"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Compile one MoE layer on a mesh: flops of routing/dispatch vs experts, all-to-all bytes, predictions."""
    from workbench.programs.moe import layer_costs

    for name, v in (("--tokens", tokens), ("--seq", seq), ("--d-model", d_model), ("--d-ff", d_ff),
                    ("--experts", experts), ("--top-k", top_k)):
        positive_int(name, v)
    if capacity_factor is not None and not dropless:
        finite_number("--capacity-factor", capacity_factor, minimum=0, strictly_above=True)
    request_devices(positive_int("--devices", devices))
    cf = None if dropless else capacity_factor
    out, cost = layer_costs(tokens=tokens, seq=seq, d_model=d_model, d_ff=d_ff, experts=experts, top_k=top_k,
                            capacity_factor=cf, router=router, score=score, mlp=mlp, mesh_spec=mesh,
                            strategy=strategy, backward=backward,
                            targets=[t for t in targets.split(",") if t], measure=do_measure)
    if record:
        spec = {k: out[k] for k in ("tokens", "seq", "d_model", "d_ff", "experts", "top_k", "capacity_factor",
                                    "router", "score", "mlp", "mesh", "strategy", "program")}
        rec = Store().append(make_record("moe_layer", spec, cost, None, None, extra=out))
        out["record_id"] = rec["id"] if isinstance(rec, dict) else None
    if as_json:
        emit_json(out)
        return
    rows = [{"quantity": k, "value": v} for k, v in out.items()
            if not isinstance(v, dict) and k not in ("prediction_note",)]
    print_table(rows, title="MoE layer (per device)")
    for name, p in out["predictions"].items():
        print(f"{name}: predicted {p['predicted_s']:.3g}s ({p['bound']}-bound; comm {p['comm_s']:.3g}s)")
    print(out["prediction_note"])


def gmm_cmd(
    rows: int = typer.Option(4096, "--rows", help="rows (token-expert assignments) sorted by expert"),
    d_model: int = typer.Option(1024, "--d-model"),
    d_ff: int = typer.Option(2048, "--d-ff"),
    experts: int = typer.Option(8, "--experts"),
    targets: str = typer.Option("cpu,tpu-v5p:2x2x1,tpu-v6e:2x2", "--targets",
                                help="cpu and/or TPU slices (one device of each is compiled for)"),
    forward_only: bool = typer.Option(False, "--forward-only", help="compile the forward product only"),
    policy: str = typer.Option("bf16", "--policy", help="precision policy of the operands"),
    record: bool = typer.Option(True, "--record/--no-record", help="append a record to the results store"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Grouped matmul per backend: ragged_dot, megablox gmm (TPU), the blocked fallback; flops vs useful."""
    from workbench.programs.moe import gmm_costs

    for name, v in (("--rows", rows), ("--d-model", d_model), ("--d-ff", d_ff), ("--experts", experts)):
        positive_int(name, v)
    default_platform()
    out = gmm_costs(rows=rows, d_model=d_model, d_ff=d_ff, experts=experts,
                    targets=[t for t in targets.split(",") if t], backward=not forward_only, compute=policy)
    if record:
        spec = {k: out[k] for k in ("rows", "d_model", "d_ff", "experts", "backward", "compute_dtype")}
        rec = Store().append(make_record("moe_gmm", spec, None, None, None, extra=out))
        out["record_id"] = rec["id"] if isinstance(rec, dict) else None
    if as_json:
        emit_json(out)
        return
    table = []
    for target, b in out["backends"].items():
        for impl, f in b["forms"].items():
            table.append({"backend": target, "form": impl, "compiled": f["compiled"],
                          "flops/useful": f.get("flops_over_useful"), "bytes": f.get("bytes"),
                          "temp_bytes": f.get("temp_bytes"), "best": impl == b["best"],
                          "auto": impl == b["auto"], "why": f.get("why", "")})
    print_table(table, title=f"grouped matmul, {rows} rows x {d_model} x {d_ff}, {experts} experts "
                             f"(useful {out['useful_flops']:.4g} flops)")


def register(app: typer.Typer) -> None:
    moe_app = typer.Typer(help="Mixture-of-experts routing statistics.", no_args_is_help=True)
    moe_app.command("route")(route_cmd)
    moe_app.command("layer")(layer_cmd)
    moe_app.command("gmm")(gmm_cmd)
    app.add_typer(moe_app, name="moe")
