"""`workbench moe ...`: routing statistics on synthetic router logits (and, later, measured MoE layers).

    workbench moe route --tokens 4096 --experts 8 --top-k 2 --capacity-factor 1.0 --router token-choice --json

Synthetic logits: logits_te = N(0, 1) - skew · ln(e + 1), i.e. expert popularity follows a Zipf law of exponent
`skew` on top of unit Gaussian noise (skew 0: balanced in expectation). Nothing is timed here: every number is a count
computed by the same routing functions the model uses (models/moe.py).
"""
from __future__ import annotations

from typing import Optional

import typer

from workbench.commands._common import emit_json, print_table
from workbench.errors import WorkbenchError, positive_int


def synthetic_logits(tokens: int, experts: int, skew: float, seed: int):
    """(T, E) float32 logits: unit Gaussian noise minus skew·ln(e+1) (Zipf-like popularity of the experts)."""
    import jax
    import jax.numpy as jnp

    noise = jax.random.normal(jax.random.key(seed), (tokens, experts), jnp.float32)
    return noise - skew * jnp.log1p(jnp.arange(experts, dtype=jnp.float32))[None, :]


def route_stats(tokens: int, experts: int, top_k: int, capacity_factor: float | None, router: str,
                score: str = "softmax", skew: float = 0.0, seed: int = 0, ep: int = 1) -> dict:
    """Route synthetic logits and return the statistics (a dict of plain numbers). Tokens are split into `ep` routing
    groups, one per expert-parallel device, each with its own capacity, exactly as models.moe.ep_forward routes."""
    import jax
    import jax.numpy as jnp

    from models import moe

    moe.check_routing_args(experts, top_k, capacity_factor, router, score, ep)
    if tokens % ep:
        raise WorkbenchError(f"--tokens {tokens} is not divisible by --ep {ep} (one routing group per device)")
    opt = moe.MoEOptions(n_experts=experts, top_k=top_k, capacity_factor=capacity_factor, router=router, score=score)
    t_loc = tokens // ep
    cap = moe.expert_capacity(t_loc, experts, top_k, capacity_factor)
    logits = synthetic_logits(tokens, experts, skew, seed).reshape(ep, t_loc, experts)

    @jax.jit
    def run(logits_gte):
        def one(l_te):
            route, sums = moe.route_group(l_te, opt, None if (capacity_factor is None and router == "token-choice")
                                          else cap)
            return sums

        sums = jax.vmap(one)(logits_gte)
        sums = jax.tree.map(lambda a: jnp.sum(a, axis=0), sums)
        return sums, moe.finalize_stats(sums, 1.0, 1.0)

    sums, stats = run(logits)
    assignments = int(sums["assignments"])
    dropped = int(sums["dropped"])
    return {
        "tokens": tokens, "experts": experts, "top_k": top_k, "capacity_factor": capacity_factor,
        "router": router, "score": score, "skew": skew, "seed": seed, "ep": ep,
        "capacity_per_expert": cap if capacity_factor is not None else None,
        "assignments": assignments, "dispatched": assignments - dropped, "dropped": dropped,
        "dropped_fraction": float(stats["dropped_fraction"]),
        "load_per_expert": [float(v) for v in sums["load_e"]],
        "load_max_over_mean": float(stats["load_max_over_mean"]),
        "lb_loss": float(stats["lb_loss"]), "z_loss": float(stats["z_loss"]),
        "router_entropy_nats": float(stats["router_entropy"]),
        "conventions": ("lb_loss: Switch E*sum_e f_e*P_e (uniform = 1); z_loss: mean logsumexp^2; "
                        "expert-choice: assignments = tokens, dropped = tokens no expert took"),
    }


def register(app: typer.Typer) -> None:
    moe_app = typer.Typer(help="Mixture-of-experts routing statistics.", no_args_is_help=True)

    @moe_app.command("route")
    def route(
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
        from workbench.devices import default_platform

        positive_int("--tokens", tokens)
        positive_int("--experts", experts)
        positive_int("--ep", ep)
        if skew < 0:
            raise WorkbenchError(f"--skew must be >= 0, got {skew}")
        default_platform()
        out = route_stats(tokens, experts, top_k, capacity_factor, router, score, skew, seed, ep)
        if as_json:
            emit_json(out)
            return
        rows = [{"quantity": k, "value": v} for k, v in out.items() if k not in ("load_per_expert", "conventions")]
        print_table(rows, title="MoE routing on synthetic logits")
        print("load per expert:", " ".join(f"{v:.0f}" for v in out["load_per_expert"]))
        print(out["conventions"])

    app.add_typer(moe_app, name="moe")
