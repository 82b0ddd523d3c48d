"""MoE programs: routing statistics on synthetic router logits, and the compiled costs of one MoE layer on a mesh
(behind `workbench moe ...` and benchmarks.moe_study).

Synthetic logits: logits_te = N(0, 1) - skew · ln(e + 1), i.e. expert popularity follows a Zipf law of exponent
`skew` on top of unit Gaussian noise (skew 0: balanced in expectation). Routing numbers are counts computed by the
same routing functions the model uses (models/moe.py).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding

from models import moe
from models.config import ModelConfig
from models.kernels import grouped
from models.precision import get_policy
from partitioning import topology as topo
from partitioning.mesh import make_mesh
from partitioning.rules import get_rules
from partitioning.shard import activation_sharding, spec_for, state_shardings
from workbench import compat
from workbench.cost.compile import compile_program
from workbench.errors import WorkbenchError
from workbench.hardware.hostmem import check_fits
from workbench.measure.calibrate import get_spec
from workbench.measure.harness import measure as _measure
from workbench.roofline.prediction import predict


def synthetic_logits(tokens: int, experts: int, skew: float, seed: int):
    """(T, E) float32 logits: unit Gaussian noise minus skew·ln(e+1) (Zipf-like popularity of the experts)."""
    noise = jax.random.normal(jax.random.key(seed), (tokens, experts), jnp.float32)
    return noise - skew * jnp.log1p(jnp.arange(experts, dtype=jnp.float32))[None, :]


def route_stats(tokens: int, experts: int, top_k: int, capacity_factor: float | None, router: str,
                score: str = "softmax", skew: float = 0.0, seed: int = 0, ep: int = 1) -> dict:
    """Route synthetic logits and return the statistics (a dict of plain numbers). Tokens are split into `ep` routing
    groups, one per expert-parallel device, each with its own capacity, exactly as models.moe.ep_forward routes."""
    moe.check_routing_args(experts, top_k, capacity_factor, router, score, ep)
    if tokens % ep:
        raise WorkbenchError(f"--tokens {tokens} is not divisible by --ep {ep} (one routing group per device)")
    opt = moe.MoEOptions(n_experts=experts, top_k=top_k, capacity_factor=capacity_factor, router=router, score=score)
    t_loc = tokens // ep
    cap = moe.expert_capacity(t_loc, experts, top_k, capacity_factor)
    # refuse what cannot fit before allocating: the (T, E) float32 logits and the router's probabilities alone
    check_fits(2 * 4.0 * tokens * experts, f"routing {tokens} tokens over {experts} experts",
               "route fewer --tokens")

    def run(logits_gte):
        def one(l_te):
            route, sums = moe.route_group(l_te, opt, None if (capacity_factor is None and router == "token-choice")
                                          else cap)
            return sums

        sums = jax.vmap(one)(logits_gte)
        sums = jax.tree.map(lambda a: jnp.sum(a, axis=0), sums)
        return sums, moe.finalize_stats(sums, 1.0, 1.0)

    # the compiler's own count of what the routing program holds, checked before anything is allocated
    compiled = jax.jit(run).lower(jax.ShapeDtypeStruct((ep, t_loc, experts), jnp.float32)).compile()
    ma, _ = compat.memory_analysis(compiled)
    if ma:
        need = sum(ma[k] for k in ("argument", "output", "temp"))
        check_fits(need, f"routing {tokens} tokens over {experts} experts", "route fewer --tokens")
    logits = synthetic_logits(tokens, experts, skew, seed).reshape(ep, t_loc, experts)
    sums, stats = compiled(logits)
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


def _expert_mats(mlp: str) -> int:
    return 3 if mlp == "swiglu" else 2


def _layer_program(cfg: ModelConfig, policy, mesh, rules, x_sh, shape: tuple[int, int, int], seed: int,
                   backward: bool, skip: bool):
    """(make, jitted fn, abstract args, state shardings) of one MoE block; skip: experts replaced by the identity."""
    def make():
        blk = moe.MoEBlock(cfg, policy, rngs=nnx.Rngs(seed))
        if skip:
            blk.opt = dataclasses.replace(blk.opt, skip_experts=True)
        return blk

    abs_blk = nnx.eval_shape(make)
    graphdef, abs_state = nnx.split(abs_blk)
    shardings = state_shardings(abs_state, mesh, rules)

    def fwd(state, x):
        with activation_sharding(mesh, rules), compat.use_abstract_mesh(mesh.abstract_mesh):
            blk = nnx.merge(graphdef, state)
            y, aux = blk(x)
            return y, aux

    def fwd_bwd(state, x):
        def loss(state):
            y, aux = fwd(state, x)
            return jnp.mean(y.astype(jnp.float32) ** 2) + aux["loss"], aux
        (_, aux), g = jax.value_and_grad(loss, has_aux=True)(state)
        return g, aux

    fn = jax.jit(fwd_bwd if backward else fwd, in_shardings=(shardings, x_sh))
    abs_args = (jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abs_state,
                             shardings), jax.ShapeDtypeStruct(shape, jnp.float32, sharding=x_sh))
    return make, fn, abs_args, shardings


def _useful_expert_flops(*, tokens: int, d_model: int, d_ff: int, experts: int, top_k: int,
                         capacity_factor: float | None, router: str, mlp: str, backward: bool, mesh, ep: int) -> float:
    """What a perfect grouped matmul does per device: 2·T·k·D·F·(2 or 3 matrices), x3 with the backward."""
    mult = 3 if backward else 1  # backward of a matmul: two matmuls of the same size
    useful = mult * 2.0 * tokens * top_k * d_model * d_ff * _expert_mats(mlp) / mesh.size
    if router == "expert-choice":  # every slot holds a real token: E·C rows per routing group
        groups = int(np.prod([mesh.shape[a] for a in mesh.axis_names if a != "model"])) if ep > 1 else 1
        c = moe.expert_capacity(tokens // groups, experts, top_k, capacity_factor)
        useful = mult * 2.0 * groups * experts * c * d_model * d_ff * _expert_mats(mlp) / mesh.size
    return useful


def _chip_predictions(cost, targets) -> dict:
    """{chip name: predicted time, its parts and bound} of the compiled costs in bfloat16 on each target."""
    preds = {}
    for t in targets:
        spec = get_spec(t)
        p = predict(cost, spec, dtype="bfloat16")
        preds[spec.name] = {"predicted_s": p.predicted_s, "compute_s": p.compute_s, "memory_s": p.memory_s,
                            "comm_s": p.comm_s, "bound": p.bound, "comm_by_kind_s": p.comm_by_kind_s}
    return preds


def _flops_fields(f_total: float, f_route: float, useful: float) -> dict:
    """The per-device flops of the layer, its routing/dispatch part, its experts and their efficiency."""
    return {
        "flops_total_per_device": f_total,
        "flops_routing_dispatch_per_device": f_route,
        "flops_experts_per_device": f_total - f_route,
        "flops_experts_useful_per_device": useful,
        "expert_flops_efficiency": useful / (f_total - f_route) if f_total > f_route else None,
        "expert_flops_over_useful": (f_total - f_route) / useful if useful else None,
    }


def layer_costs(*, tokens: int = 4096, seq: int = 64, d_model: int = 256, d_ff: int = 512, experts: int = 8,
                top_k: int = 2, capacity_factor: float | None = 1.25, router: str = "token-choice",
                score: str = "softmax", mlp: str = "swiglu", mesh_spec: str = "expert=8", strategy: str = "ep",
                backward: bool = False, targets=("tpu-v5e", "h100-sxm"), seed: int = 0, measure: bool = False) -> dict:
    """Compile one MoE layer (forward, or forward+backward) on a mesh of the local devices and attribute its costs.

    Everything per device. flops_total: the compiled layer (XLA cost_analysis). flops_routing_dispatch: the same layer
    compiled with the experts replaced by the identity (router, top-k, slot assignment, scatter/gather, all-to-all,
    combine). flops_experts = total - routing_dispatch. flops_experts_useful: 2·T·k·D·F·(2 or 3 matrices) / devices
    (what a perfect grouped matmul does; capacity padding and XLA:CPU's dense lowering of ragged_dot show up as the
    excess). all_to_all_bytes: payload of the compiled program's all-to-all ops. Routing statistics come from one
    execution on random inputs (counts, not timings). Predictions: workbench.roofline.prediction.predict of the compiled costs
    on each target chip (collectives over the chip's interconnect).
    """
    if tokens % seq:
        raise WorkbenchError(f"--tokens {tokens} must be a multiple of --seq {seq}")
    mesh = make_mesh(mesh_spec)
    rules = get_rules(strategy)
    ep = mesh.shape.get("expert", 1) if "experts" in rules.mapping and "expert" in rules.mesh_axes_for("experts") \
        else 1
    moe.check_routing_args(experts, top_k, capacity_factor, router, score, ep)
    cfg = ModelConfig(n_layers=1, d_model=d_model, n_heads=1, d_ff=d_ff, n_experts=experts, top_k=top_k,
                      capacity_factor=capacity_factor, router=router, router_score=score, mlp=mlp, bias=False,
                      aux_loss_coef=0.01, z_loss_coef=1e-3)
    policy = get_policy("float32")
    batch = tokens // seq
    x_sh = NamedSharding(mesh, spec_for(("batch", "seq", "embed"), (batch, seq, d_model), mesh, rules, "activations"))
    shape = (batch, seq, d_model)
    make, fn, abs_args, shardings = _layer_program(cfg, policy, mesh, rules, x_sh, shape, seed, backward, False)
    comp = compile_program(fn, *abs_args, mesh=mesh, analytic=False)
    _, fn_r, abs_args_r, _ = _layer_program(cfg, policy, mesh, rules, x_sh, shape, seed, backward, True)
    comp_route = compile_program(fn_r, *abs_args_r, mesh=mesh, analytic=False)
    cost = comp.cost
    useful = _useful_expert_flops(tokens=tokens, d_model=d_model, d_ff=d_ff, experts=experts, top_k=top_k,
                                  capacity_factor=capacity_factor, router=router, mlp=mlp, backward=backward,
                                  mesh=mesh, ep=ep)
    # routing statistics from one execution (not timed)
    state = jax.device_put(nnx.state(make()), shardings)
    x = jax.device_put(jax.random.normal(jax.random.key(seed + 1), shape, jnp.float32), x_sh)
    aux = {k: float(v) for k, v in comp.compiled(state, x)[1].items()}
    a2a = cost.collectives_by_kind().get("all-to-all", {"count": 0, "bytes": 0.0})
    result = {
        "tokens": tokens, "seq": seq, "d_model": d_model, "d_ff": d_ff, "experts": experts, "top_k": top_k,
        "capacity_factor": capacity_factor, "router": router, "score": score, "mlp": mlp,
        "mesh": dict(mesh.shape), "strategy": strategy, "expert_parallel_degree": ep,
        "program": "forward+backward" if backward else "forward", "n_devices": mesh.size,
        **_flops_fields(cost.counted_flops, comp_route.cost.counted_flops, useful),
        "grouped_matmul": (grouped.choose_impl(cfg.moe_gmm, mesh.devices.flat[0].platform)
                           if capacity_factor is None and router == "token-choice" else "dense (E, C) einsum"),
        "flops_source": "CostReport.counted_flops (kernel sums x trip counts for programs with loops, else "
                        "cost_analysis)",
        "all_to_all_bytes_per_device": a2a["bytes"], "all_to_all_count": a2a["count"],
        "collectives_per_device": cost.collectives_by_kind_and_axis(),
        "peak_memory_bytes_per_device": cost.peak_memory_bytes,
        "predictions": _chip_predictions(cost, targets),
        "prediction_note": ("costs compiled by XLA:CPU for simulated devices, priced on each chip. Dropless layers "
                            "use the grouped matmul models.kernels.grouped picks per backend (XLA:CPU lowers "
                            "ragged_dot to a dense matmul over all experts, E/k too many flops: the blocked form "
                            "is used here; `workbench moe gmm` compares them)"),
        **{k: aux[k] for k in ("dropped_fraction", "load_max_over_mean", "router_entropy", "lb_loss", "z_loss")},
        "compile_s": comp.compile_s,
    }
    if measure:
        m = _measure(comp.compiled, state, x, warmup=2, repeats=10, compile_s=comp.compile_s)
        result["measured"] = m.to_dict()
    return result, cost


def gmm_costs(*, rows: int = 4096, d_model: int = 1024, d_ff: int = 2048, experts: int = 8,
              targets=("cpu", "tpu-v5p:2x2x1", "tpu-v6e:2x2"), impls=("ragged_dot", "gmm", "blocked"),
              backward: bool = True, compute: str = "bf16") -> dict:
    """Compile each grouped-matmul form (models.kernels.grouped) for one device of each backend and compare its
    compiled flops and bytes with the useful work 2·rows·d_model·d_ff (×3 with the backward pass).

    Per form: counted flops and bytes (workbench.cost.report.CostReport.counted_*: kernel sums × trip counts for
    programs with loops), temporaries (memory_analysis), flops / useful. `best` per backend: the form with the
    fewest counted flops among those within 1.3x of the useful work (ties: fewer bytes); `auto` is what
    models.config.GMM_BY_PLATFORM picks there.
    """
    cd = get_policy(compute).compute_dtype
    useful = 2.0 * rows * d_model * d_ff * (3 if backward else 1)
    out = {"rows": rows, "d_model": d_model, "d_ff": d_ff, "experts": experts, "backward": backward,
           "compute_dtype": str(jnp.dtype(cd)), "useful_flops": useful, "backends": {}}
    for target in targets:
        if target == "cpu":
            dev, platform = jax.devices("cpu")[0], "cpu"
        else:
            dev = topo.tpu_devices(target)[0]
            platform = dev.platform
        sh = SingleDeviceSharding(dev)
        args = (jax.ShapeDtypeStruct((rows, d_model), cd, sharding=sh),
                jax.ShapeDtypeStruct((experts, d_model, d_ff), jnp.float32, sharding=sh),
                jax.ShapeDtypeStruct((experts,), jnp.int32, sharding=sh))
        forms = {}
        for impl in impls:
            if impl == "gmm" and platform != "tpu":
                forms[impl] = {"compiled": False, "why": "megablox gmm is a TPU (Mosaic) kernel"}
                continue

            def fwd(x, w, gs, impl=impl):
                return grouped.grouped_matmul(x, w, gs, cd, impl)

            def fwd_bwd(x, w, gs, impl=impl):
                def loss(x, w):
                    return jnp.sum(grouped.grouped_matmul(x, w, gs, cd, impl) ** 2)
                return jax.grad(loss, argnums=(0, 1))(x, w)

            try:
                comp = compile_program(fwd_bwd if backward else fwd, *args, analytic=False)
            except Exception as e:  # noqa: BLE001 - a form a backend cannot compile is an answer
                forms[impl] = {"compiled": False, "why": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                continue
            c = comp.cost
            forms[impl] = {"compiled": True, "flops": c.counted_flops, "bytes": c.counted_bytes,
                           "temp_bytes": c.temp_bytes, "flops_over_useful": c.counted_flops / useful,
                           "compile_s": comp.compile_s}
        ok = {k: v for k, v in forms.items() if v.get("compiled") and v["flops_over_useful"] <= 1.3}
        best = min(ok, key=lambda k: (ok[k]["flops"], ok[k]["bytes"])) if ok else None
        out["backends"][target] = {"platform": platform, "forms": forms, "best": best,
                                   "auto": grouped.choose_impl("auto", platform)}
    return out
