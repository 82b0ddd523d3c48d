"""Benchmark: the pipeline bubble over stages p, microbatches m and repeats v, predicted and measured.

    python -m benchmarks.pipeline_study                      # p in {2, 4}, v in {1, 2}, m in {4, 8, 16}
    python -m benchmarks.pipeline_study --p 4 --v 1 --m 4,8,16 --repeats 5
    python -m benchmarks.pipeline_study --p 4 --v 1 --m 4,8,16 --microbatch-size 4   # microbatch fixed, batch = 4m
    python -m benchmarks.pipeline_study --quick              # a quick check that the script works

What is compared, per (p, v, m), on p simulated CPU devices (docs/pipeline.md says what this does and does not show):
  P  the pipelined layers (models.pipeline.run_layers: shard_map over `stage`, v·m + p − 1 ticks, ppermute between
     stages), forward and backward (gradients of every stage's parameters and of the input), global batch fixed.
  U  the same layers, the same parameters per device, the same microbatch shape, with no bubble: each of the p
     devices runs all L layers on m/p of the microbatches (a scan), forward and backward.
  S  P's own program cut to its steady state: the same tick function, the same shapes, v·m ticks instead of
     v·m + p − 1 (no fill and drain; the last p − 1 microbatches do not finish, the work per tick is unchanged).
P and U do the same useful work (L layers × the global batch). Simulated devices share the host's cores, so a step's
wall time is the work of all devices, and every stage of P computes every tick: P/U measures the ticks computed over
the useful ones, (v·m + p − 1)/(v·m), and `bubble_measured` = 1 − U/P is compared with the analytic (p − 1)/(v·m + p
− 1). `bubble_flops` = 1 − flops(U)/flops(P) from the compiled programs' per-device kernel sums (workbench.cost).
`bubble_measured_ticks` = 1 − S/P: the share of P's time spent in its fill and drain ticks, the bubble as wall time,
with the per-tick costs a pipeline pays (permute, microbatch slicing) in both. And memory: the temporaries
memory_analysis reports for P against what it holds for its in-flight microbatches (every tick's saved activations
until the backward: ticks × L/(p·v) layers × what one layer saves on one microbatch, counted by JAX itself,
workbench.compat.saved_residual_bytes; circular: plus the chunk's weights, a dynamic slice saved at every tick).
Timing: workbench.measure.harness.measure_interleaved, rounds of P, U and S once each in rotating order; the bubble
estimates are medians of the per-round ratios U/P and S/P (drift on a shared host cancels within a round). Records of kind
'pipeline' go to the results store; the chart (bubble vs m) and a Markdown table to --out (default reports/pipeline).
"""
from __future__ import annotations

import argparse
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models import pipeline as pp
from models.analytics import attention_params, mlp_params
from models.presets import get_config
from models.transformer import Transformer
from partitioning.mesh import make_mesh
from workbench import compat
from workbench.cost.compile import compile_program
from workbench.hardware.devices import request_devices
from workbench.measure.harness import measure_interleaved
from workbench.results.console import print_table, say
from workbench.results.figures import markdown_table, pipeline_bubble_chart
from workbench.results.store import Store, make_record


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", default="2,4", help="stage counts")
    ap.add_argument("--v", default="1,2", help="repeats (virtual stages per device; 1 = GPipe)")
    ap.add_argument("--m", default="4,8,16", help="microbatch counts")
    ap.add_argument("--batch", type=int, default=32, help="global batch (sequences), fixed across m")
    ap.add_argument("--microbatch-size", type=int, default=None,
                    help="hold the microbatch (sequences) fixed instead: global batch = this × m at each point, so "
                         "per-microbatch efficiency does not move with m")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--set", dest="overrides", default="n_layers=8,d_model=256,n_heads=4,d_ff=1024",
                    help="model config overrides on the tiny preset")
    ap.add_argument("--repeats", type=int, default=12, help="interleaved rounds (each times P, U and S once)")
    ap.add_argument("--quick", action="store_true", help="p=2, v=1, m=2,4, a smaller model")
    ap.add_argument("--out", default=os.path.join("reports", "pipeline"))
    a = ap.parse_args(argv)
    if a.quick:
        a.p, a.v, a.m, a.overrides, a.repeats = "2", "1", "2,4", "n_layers=4,d_model=64,d_ff=256", 3
    ps, vs, ms = _ints(a.p), _ints(a.v), _ints(a.m)
    request_devices(max(ps))
    if a.microbatch_size is not None and a.microbatch_size < 1:
        ap.error(f"--microbatch-size must be >= 1, got {a.microbatch_size}")
    rows = run(ps, vs, ms, a.batch, a.seq, a.overrides, a.repeats, a.microbatch_size)
    report(rows, a.out)
    return 0


@dataclasses.dataclass(frozen=True)
class _SteadyState(pp.PipelineSpec):
    """The same schedule run for its v·m steady-state ticks only (the S program: timing, not numerics)."""

    @property
    def step_ticks(self) -> int:  # the forward loop's length in models.pipeline.run_layers
        return self.repeats * self.microbatches


def _programs(cfg, pipe, mesh, batch: int, seq: int):
    """(P, U, S) jitted forward+backward functions with their concrete arguments, and the bytes one layer saves for
    its backward on one microbatch (workbench.compat.saved_residual_bytes of the model's own layer function,
    Transformer.block_call with the configured remat, its parameters left out)."""
    model = Transformer(cfg, "float32", nnx.Rngs(0))
    gd, stacked = nnx.split(model.blocks)
    call = model.block_call()
    layer_fn = lambda st, x, pos: call(nnx.merge(gd, st), x, pos)
    m, p = pipe.microbatches, pipe.stages
    mb = batch // m
    x = jax.random.normal(jax.random.key(1), (m, mb, seq, cfg.d_model), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (mb, seq))
    rd = jnp.float32

    def loss_p(params, x, spec=pipe):
        y = pp.run_layers(layer_fn, params, x, pos, spec, mesh, rd)
        return jnp.mean(jnp.square(y))

    stage_sh = jax.tree.map(lambda _: NamedSharding(mesh, P("stage")), stacked)
    rep = NamedSharding(mesh, P())
    fp = jax.jit(jax.value_and_grad(loss_p, argnums=(0, 1)), in_shardings=(stage_sh, rep))
    steady = _SteadyState(pipe.stages, pipe.microbatches, pipe.repeats)
    fs = jax.jit(jax.value_and_grad(lambda w, x: loss_p(w, x, steady), argnums=(0, 1)), in_shardings=(stage_sh, rep))
    args_p = (jax.device_put(stacked, stage_sh), jax.device_put(x, rep))

    def body(params, x_mb):  # one device: all layers over its m/p microbatches, in sequence
        params = jax.tree.map(lambda a: a[0], params)

        def micro(_, xm):
            def one(h, st):
                return layer_fn(st, h, pos)[0].astype(rd), None

            return None, jax.lax.scan(one, xm, params)[0]

        return jax.lax.scan(micro, None, x_mb)[1]

    ref = compat.shard_map(body, mesh=mesh, in_specs=(P("stage"), P("stage")), out_specs=P("stage"))

    def loss_u(params, x):
        return jnp.mean(jnp.square(ref(params, x)))

    copies = jax.tree.map(lambda a: jnp.broadcast_to(a[None], (p,) + a.shape), stacked)  # one copy per device
    x_sh = NamedSharding(mesh, P("stage"))
    fu = jax.jit(jax.value_and_grad(loss_u, argnums=(0, 1)), in_shardings=(stage_sh, x_sh))
    args_u = (jax.device_put(copies, stage_sh), jax.device_put(x, x_sh))
    one = jax.tree.map(lambda a: a[0], stacked)
    layer_res = compat.saved_residual_bytes(lambda st, h: layer_fn(st, h, pos)[0], one,
                                            jax.ShapeDtypeStruct((mb, seq, cfg.d_model), rd), skip_args=("st",))
    return (fp, args_p), (fu, args_u), (fs, args_p), layer_res


def run(ps, vs, ms, batch, seq, overrides, rounds, microbatch_size=None) -> list[dict]:
    cfg = get_config("tiny", overrides).replace(scan_layers=True, seq_len=max(seq, 64), remat="none")
    store = Store()
    rows = []
    aw, ab = attention_params(cfg)
    mw, mb_ = mlp_params(cfg)
    layer_bytes = 4 * (aw + ab + mw + mb_ + 2 * cfg.d_model * (2 if cfg.norm == "layernorm" else 1))
    for p in ps:
        mesh = make_mesh(f"stage={p}", devices=jax.devices()[:p])
        for v in vs:
            for m in ms:
                batch = microbatch_size * m if microbatch_size else batch
                pipe = pp.PipelineSpec(p, m, v)
                try:
                    pipe.check(cfg.n_layers, batch)
                except Exception as e:  # noqa: BLE001 - a grid point the schedule refuses: say so, go on
                    say(f"skip p={p} v={v} m={m}: {e}")
                    continue
                if m % p:
                    say(f"skip p={p} v={v} m={m}: the bubble-free reference splits m over p devices")
                    continue
                (fp, args_p), (fu, args_u), (fs, args_s), layer_res = _programs(cfg, pipe, mesh, batch, seq)
                cp = compile_program(fp, *args_p, mesh=mesh, n_devices=p, analytic=False)
                cu = compile_program(fu, *args_u, mesh=mesh, n_devices=p, analytic=False)
                cs = compile_program(fs, *args_s, mesh=mesh, n_devices=p, analytic=False)
                if not cs.cost.counted_flops < cp.cost.counted_flops:  # the S program must be P with fewer ticks
                    raise SystemExit(f"pipeline_study: the steady-state program does as much work as the pipeline "
                                     f"({cs.cost.counted_flops:.3g} flops): models.pipeline.run_layers no longer "
                                     "takes its loop length from PipelineSpec.step_ticks")
                say(f"p={p} v={v} m={m}: timing pipelined, reference and steady state ({rounds} interleaved rounds)")
                meas, per_round = measure_interleaved({"P": (cp.compiled, *args_p), "U": (cu.compiled, *args_u),
                                                       "S": (cs.compiled, *args_s)}, warmup=1, rounds=rounds,
                                                      compile_s={"P": cp.compile_s, "U": cu.compile_s,
                                                                 "S": cs.compile_s})
                mp, mu, mss = meas["P"], meas["U"], meas["S"]
                # paired within each round: the drift of a shared 2-core host cancels in the ratio
                ratio = lambda a: float(np.median(np.array(per_round[a]) / np.array(per_round["P"])))
                lc = cfg.n_layers // (p * v)
                # what one layer saves for the backward on one microbatch, as JAX traces it (its weights left out)
                acts = pipe.ticks * lc * layer_res
                # circular: the chunk's weights are a dynamic slice per tick, saved for the backward every tick
                weights = pipe.ticks * lc * layer_bytes if v > 1 else 0
                held = acts + weights
                permutes = [c for c in cp.cost.collectives if c.kind == "collective-permute"]
                row = {
                    "stages": p, "repeats": v, "microbatches": m, "batch": batch, "schedule": pipe.schedule, "ticks": pipe.ticks,
                    "bubble_analytic": pipe.bubble_fraction,
                    "pipelined_s": mp.median_s, "reference_s": mu.median_s,
                    "pipelined_iqr_s": mp.iqr_s, "reference_iqr_s": mu.iqr_s,
                    "bubble_measured": 1 - ratio("U"),
                    "steady_s": mss.median_s, "steady_iqr_s": mss.iqr_s,
                    "bubble_measured_ticks": 1 - ratio("S"),
                    "rounds": rounds,
                    "flops_steady": cs.cost.counted_flops,
                    "flops_pipelined": cp.cost.counted_flops, "flops_reference": cu.cost.counted_flops,
                    "bubble_flops": 1 - cu.cost.counted_flops / cp.cost.counted_flops,
                    "temp_bytes": cp.cost.temp_bytes, "layer_residual_bytes": layer_res,
                    "predicted_activation_bytes": acts,
                    "predicted_weight_residual_bytes": weights, "predicted_held_bytes": held,
                    "temp_over_predicted": cp.cost.temp_bytes / held,
                    "permutes_per_step": sum(c.count for c in permutes),
                    "permute_axes": sorted({a for c in permutes for a in c.mesh_axes}),
                }
                row["measured_vs_analytic"] = row["bubble_measured"] / row["bubble_analytic"] - 1
                row["ticks_vs_analytic"] = row["bubble_measured_ticks"] / row["bubble_analytic"] - 1
                rows.append(row)
                store.append(make_record("pipeline", {"stages": p, "repeats": v, "microbatches": m, "batch": batch,
                                                      "seq": seq, "overrides": overrides}, cp.cost, None, mp,
                                         extra=row))
                say(f"  bubble analytic {row['bubble_analytic']:.3f} measured: fill/drain ticks "
                    f"{row['bubble_measured_ticks']:.3f}, against the bubble-free reference {row['bubble_measured']:.3f}; "
                    f"flops {row['bubble_flops']:.3f}")
    return rows


def report(rows: list[dict], out: str) -> None:
    cols = ["stages", "repeats", "microbatches", "batch", "ticks", "bubble_analytic", "bubble_flops",
            "bubble_measured_ticks", "ticks_vs_analytic", "bubble_measured", "measured_vs_analytic", "pipelined_s",
            "steady_s", "reference_s", "temp_bytes", "predicted_held_bytes", "temp_over_predicted"]
    print_table([{k: r[k] for k in cols} for r in rows], title="pipeline bubble: analytic, compiled, measured")
    os.makedirs(out, exist_ok=True)
    if rows:
        path = pipeline_bubble_chart(rows, os.path.join(out, "pipeline_bubble.png"),
                                     title="pipeline bubble vs microbatches (simulated CPU devices)")
        with open(os.path.join(out, "pipeline_study.md"), "w", encoding="utf-8") as f:
            f.write(markdown_table(rows, cols) + "\n")
        print(f"chart {path}")


if __name__ == "__main__":
    from workbench.hardware.hostmem import reexec_with_hugepages

    reexec_with_hugepages()  # before JAX starts: huge pages for XLA:CPU buffers (workbench/hostmem.py)
    raise SystemExit(main())
