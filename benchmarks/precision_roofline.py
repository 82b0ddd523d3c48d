"""Study (c): what each precision policy buys in bytes and predicted step time, per target, and what it costs here.

    python -m benchmarks.precision_roofline [--presets tiny,small,gpt2-small,llama3-8b] [--targets ...] [--tiny]

Two parts, both recorded (kind 'precision_roofline') and drawn:

1. Accelerator targets (H100, H200, B200, B300, TPU v5e/v6e/v5p/v7x, and the host): the training step's GEMMs - every einsum the
   model sends through its precision policy, found by tracing the model abstractly (no compile, so large presets
   are cheap) - become an analytic CostReport: per GEMM the forward, dgrad and wgrad products, each reading its two
   operands at the policy's storage width (fp8: 1 byte; MX: element bits + 8 bits per 32-element block) and writing
   its output (the compute dtype; weight gradients float32). workbench.roofline.prediction.predict prices every GEMM at the
   chip's peak for the policy's matmul dtype (fp8 where the chip has fp8 units; the catalogue's fallback otherwise -
   the prediction's notes say so) and its memory bandwidth. What this leaves out: the non-GEMM work (norms, softmax,
   the optimizer), the cost of computing scales and casting, and MX's per-block scaling on chips without MX units
   (H100/H200 run MXFP8 as fp8 with software block scales: priced at the fp8 peak, an optimistic bound).
2. This host: the real training step of `tiny`/`small` per policy, compiled (workbench.cost.compile.compile_program:
   the CostReport of the program XLA:CPU runs), predicted against the calibrated host, and measured with
   workbench.measure.harness. XLA:CPU has no bf16/fp16/fp8/MX units: these programs are emulations (float32 arithmetic plus
   casts and clamps), so the measured time is the cost of the emulation, never a speedup.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from models.precision import PrecisionPolicy, available, get_policy
from models.presets import get_config
from models.quant import POLICY_ORDER, Fp8Policy, MxPolicy, get_format, matmul_format
from models.transformer import Transformer
from partitioning.mesh import make_mesh
from workbench.cost.compile import compile_program
from workbench.cost.hlo import KernelCost
from workbench.cost.report import CostReport
from workbench.errors import WorkbenchError
from workbench.hardware.devices import default_platform
from workbench.measure.calibrate import get_spec
from workbench.measure.harness import measure_steps
from workbench.programs.data import Batches, shard_batch
from workbench.programs.step import abstract_with, build_train_step
from workbench.results import store as results
from workbench.roofline.prediction import predict

# generations side by side: TPU v5p runs fp8 at its bf16 rate, v7x (Ironwood) has native fp8 at twice it; B300 beside
# B200 (the same fp8 rate, fp4 raised)
TARGETS = ["h100-sxm", "h200", "b200", "b300", "tpu-v5e", "tpu-v6e", "tpu-v5p", "tpu-v7x"]
BATCH = {"tiny": (8, None), "small": (8, None), "gpt2-small": (8, 1024), "llama3-8b": (1, 4096)}  # (batch, seq)


# ------------------------------------------------------------------------------------------------ GEMM inventory
@dataclasses.dataclass(frozen=True)
class Gemm:
    eq: str
    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    flops: float  # one product (forward); dgrad and wgrad cost the same
    w_is_param: bool  # heuristic: a weight has no batch label 'b' (activation x activation einsums carry it)


def gemm_inventory(cfg, batch: int, seq: int) -> list[Gemm]:
    """Every einsum the model sends through its precision policy in one forward pass (abstract: nothing runs)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx


    seen: list[Gemm] = []

    class Recorder(nnx.Module):
        def __call__(self, eq, x, w):
            ins, out = eq.replace(" ", "").split("->")
            xl, wl = ins.split(",")
            size = {**dict(zip(xl, x.shape)), **dict(zip(wl, w.shape))}
            flops = 2.0 * float(np.prod([size[c] for c in set(xl + wl)], dtype=np.float64))
            seen.append(Gemm(eq, tuple(x.shape), tuple(w.shape), tuple(size[c] for c in out), flops, "b" not in wl))
            return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    @dataclasses.dataclass(frozen=True)
    class RecordingPolicy(PrecisionPolicy):
        def einsum_module(self, rngs=None):
            return Recorder()

    pol = RecordingPolicy("recording", jnp.bfloat16)
    model = nnx.eval_shape(lambda: Transformer(cfg, pol, nnx.Rngs(0)))
    jax.eval_shape(lambda m, t: m(t), model, jax.ShapeDtypeStruct((batch, seq), jnp.int32))
    return seen


# ------------------------------------------------------------------------------------------------ formats per policy
def policy_widths(policy) -> dict:
    """Storage width in bytes per element (scale overhead included) of forward operands, gradients, backward
    operands, and outputs; plus the dtype whose peak prices the GEMMs."""
    import numpy as np


    f = matmul_format(policy)
    out_b = np.dtype(policy.compute_dtype).itemsize
    if isinstance(policy, MxPolicy):
        blk = 8.0 / policy.spec.block_size
        fwd = (get_format(policy.spec.fwd).bits + blk) / 8
        grad = (get_format(policy.spec.grad).bits + blk) / 8
        bwd = (get_format(policy.spec.bwd_operand).bits + blk) / 8
    elif isinstance(policy, Fp8Policy):
        fwd = grad = bwd = 1.0
    else:
        fwd = grad = bwd = float(out_b)
    return {"fwd": fwd, "grad": grad, "bwd_operand": bwd, "out": float(out_b), "peak_dtype": f["peak_dtype"],
            "element": f["element"]}


def gemm_cost(gemms: list[Gemm], policy, peak_dtype: str):
    """Analytic CostReport of the step's GEMMs (forward + dgrad + wgrad) at the policy's widths. Per device = the
    whole step on one chip."""
    import numpy as np


    w = policy_widths(policy)
    kernels = []
    for i, g in enumerate(gemms):
        nx, nw, ny = (float(np.prod(s, dtype=np.float64)) for s in (g.x_shape, g.w_shape, g.out_shape))
        dw_b = 4.0 if g.w_is_param else w["out"]
        kernels += [
            KernelCost(f"gemm{i}.fwd {g.eq}", "gemm", str(g.out_shape), (nx + nw) * w["fwd"], ny * w["out"], g.flops, 0.0),
            KernelCost(f"gemm{i}.dgrad", "gemm", str(g.x_shape), ny * w["grad"] + nw * w["bwd_operand"], nx * w["out"],
                       g.flops, 0.0),
            KernelCost(f"gemm{i}.wgrad", "gemm", str(g.w_shape), nx * w["bwd_operand"] + ny * w["grad"], nw * dw_b,
                       g.flops, 0.0),
        ]
    flops = sum(k.flops for k in kernels)
    nbytes = sum(k.bytes for k in kernels)
    return CostReport(flops=flops, transcendentals=0.0, bytes_accessed=nbytes, kernels=tuple(kernels), n_devices=1,
                      compute_dtype=peak_dtype, platform="analytic",
                      notes=("analytic: the training step's GEMMs only (forward, dgrad, wgrad), operands at the "
                             "policy's storage width; non-GEMM work, scale computation and casts excluded",))


def target_dtype(spec, policy_peak_dtype: str) -> tuple[str, str | None]:
    """The dtype to price with on `spec`, and a note when it differs from the policy's matmul dtype."""
    if policy_peak_dtype == "float4_e2m1fn" and "float4_e2m1fn" not in spec.peak_flops:
        return "float8_e4m3fn", f"{spec.name} has no FP4 units in the catalogue: MXFP4 priced as fp8"
    if policy_peak_dtype == "float32" and spec.kind == "gpu" and "tf32" in spec.peak_flops:
        return "tf32", ("float32 matmuls at JAX's default precision run as TF32 on NVIDIA tensor cores: priced at the "
                        "tf32 peak")
    if policy_peak_dtype == "float32" and spec.kind == "tpu":
        return "bfloat16", ("float32 matmuls at JAX's default precision run as one bfloat16 pass on TPU MXUs: priced "
                            "at the bfloat16 peak")
    return policy_peak_dtype, None


# ------------------------------------------------------------------------------------------------ the study
def run(presets=("tiny", "small", "gpt2-small", "llama3-8b"), targets=None, host_presets=("tiny", "small"),
        policies=None, host_steps: int = 10, out_dir: str = "reports/precision", record: bool = True) -> list[dict]:
    targets = targets or TARGETS
    policies = policies or [p for p in POLICY_ORDER if p in available()]
    store = results.Store() if record else None
    rows: list[dict] = []
    try:
        host = get_spec("host", calibrate_if_missing=False)
    except (WorkbenchError, Exception) as e:  # no calibration cached: run `workbench calibrate` first
        host, host_err = None, f"{type(e).__name__}: {e}"[:200]
    specs = [get_spec(t) for t in targets] + ([host] if host is not None else [])
    for preset in presets:
        cfg = get_config(preset, None)
        batch, seq = BATCH.get(preset, (8, None))
        seq = seq or cfg.seq_len
        gemms = gemm_inventory(cfg, batch, seq)
        for pname in policies:
            pol = get_policy(pname)
            pdt = matmul_format(pol)["peak_dtype"]
            for spec in specs:
                dt, note = target_dtype(spec, pdt)
                cost = gemm_cost(gemms, pol, dt)
                pred = predict(cost, spec, dtype=dt, simulated_mesh=False)
                row = {"part": "gemms_analytic", "preset": preset, "policy": pname, "target": spec.name,
                       "batch": batch, "seq_len": seq, "n_gemms_per_step": 3 * len(gemms),
                       "gemm_flops": cost.flops, "gemm_bytes": cost.bytes_accessed, "priced_dtype": dt,
                       "peak_dtype_used": pred.peak_dtype, "predicted_s": pred.predicted_s,
                       "compute_s": pred.compute_s, "memory_s": pred.memory_s, "bound": pred.bound,
                       "notes": [n for n in (note, *pred.notes) if n]}
                rows.append(row)
                if store is not None:
                    store.append(results.make_record(
                        "precision_roofline", {k: row[k] for k in ("part", "preset", "policy", "target", "batch",
                                                                    "seq_len")}, cost, pred, None, extra=row))
        if preset in host_presets:
            rows += host_part(cfg, preset, policies, host, batch, host_steps, store)
    # speedups relative to bf16 on the same preset and target
    base = {(r["preset"], r["target"]): r["predicted_s"] for r in rows
            if r["part"] == "gemms_analytic" and r["policy"] == "bf16"}
    for r in rows:
        b = base.get((r["preset"], r["target"]))
        if r["part"] == "gemms_analytic" and b:
            r["speedup_vs_bf16"] = b / r["predicted_s"]
    if host is None:
        rows.append({"part": "note", "note": f"host not calibrated ({host_err}); run `workbench calibrate`"})
    os.makedirs(out_dir, exist_ok=True)
    figure(rows, os.path.join(out_dir, "precision_roofline.png"))
    write_table(rows, os.path.join(out_dir, "precision_roofline.md"))
    return rows


def host_part(cfg, preset, policies, host, batch, steps, store) -> list[dict]:
    """Compile, predict (calibrated host) and measure the real training step of `cfg` per policy on one CPU device."""
    import jax


    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    out = []
    for pname in policies:
        prog = build_train_step(cfg, policy=pname, mesh=mesh, strategy="dp", batch_size=batch, total_steps=steps + 2)
        abs_state = abstract_with(jax.eval_shape(lambda s: s, prog.state), prog.state_shardings)
        abs_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=prog.batch_sharding)
                     for k, v in prog.batch.items()}
        comp = compile_program(prog.step, abs_state, abs_batch, mesh=mesh, n_devices=1, analytic=False,
                               compute_dtype="float32")
        b = Batches(batch, prog.seq_len, 0)
        batches = [shard_batch(b.train(i), prog.batch_sharding) for i in range(4)]
        st = {"s": prog.state}

        def step(i):
            st["s"], m = comp.compiled(st["s"], batches[i % 4])
            return m["loss"]

        meas = measure_steps(step, warmup=2, repeats=steps, compile_s=comp.compile_s)
        pred = predict(comp.cost, host, dtype="float32") if host is not None else None
        row = {"part": "host_measured", "preset": preset, "policy": pname, "target": "host", "batch": batch,
               "seq_len": prog.seq_len, "emulated": pname != "float32",
               "compiled_flops": comp.cost.flops, "compiled_bytes": comp.cost.bytes_accessed,
               "predicted_s": pred.predicted_s if pred else None, "measured_s": meas.median_s,
               "measured_iqr_s": meas.iqr_s,
               "note": ("XLA:CPU emulates this format (float32 arithmetic plus casts/clamps/scales): the time is the "
                        "emulation's, not a speedup" if pname != "float32" else "native float32")}
        out.append(row)
        if store is not None:
            store.append(results.make_record("precision_roofline", {k: row[k] for k in ("part", "preset", "policy",
                                                                                         "target", "batch")},
                                             comp.cost, pred, meas, extra=row))
    return out


def figure(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    an = [r for r in rows if r.get("part") == "gemms_analytic"]
    presets = list(dict.fromkeys(r["preset"] for r in an))
    if not presets:
        return
    fig, axes = plt.subplots(1, len(presets), figsize=(5.5 * len(presets), 4.5), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        sel = [r for r in an if r["preset"] == preset]
        targets = list(dict.fromkeys(r["target"] for r in sel))
        pols = list(dict.fromkeys(r["policy"] for r in sel))
        w = 0.8 / len(pols)
        for i, p in enumerate(pols):
            ys = [next((r.get("speedup_vs_bf16") or 0 for r in sel if r["policy"] == p and r["target"] == t), 0)
                  for t in targets]
            ax.bar([j + i * w for j in range(len(targets))], ys, w, label=p)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(targets))], targets, rotation=30, fontsize=8)
        ax.axhline(1.0, color="k", lw=0.5)
        ax.set_title(f"{preset}: predicted GEMM time, speedup vs bf16", fontsize=10)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("bf16 GEMM time / policy GEMM time (predicted)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_table(rows: list[dict], path: str) -> None:
    def g(v, fmt=".3g"):
        return "" if v is None else format(v, fmt)

    lines = ["| part | preset | policy | target | bytes | predicted s | bound | speedup vs bf16 | measured s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("part") == "note":
            lines.append(f"| note | {r['note']} | | | | | | | |")
            continue
        nbytes = r.get("gemm_bytes", r.get("compiled_bytes"))
        meas = g(r.get("measured_s")) + (" (emulated)" if r.get("emulated") else "")
        lines.append(f"| {r['part']} | {r['preset']} | {r['policy']} | {r['target']} | {g(nbytes)} | "
                     f"{g(r.get('predicted_s'))} | {r.get('bound', '')} | {g(r.get('speedup_vs_bf16'), '.2f')} | "
                     f"{meas} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,small,gpt2-small,llama3-8b")
    ap.add_argument("--host-presets", default="tiny,small", help="presets also compiled and measured on this host")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--policies", default=None)
    ap.add_argument("--steps", type=int, default=10, help="measured host steps per policy")
    ap.add_argument("--tiny", action="store_true", help="smoke run: tiny preset, two policies, 2 host steps")
    ap.add_argument("--out", default="reports/precision")
    a = ap.parse_args(argv)

    default_platform()
    if a.tiny:
        rows = run(("tiny",), None, ("tiny",), ["bf16", "fp8-delayed"], 2, a.out)
    else:
        rows = run(tuple(a.presets.split(",")), a.targets.split(","), tuple(filter(None, a.host_presets.split(","))),
                   a.policies.split(",") if a.policies else None, a.steps, a.out)
    with open(os.path.join(a.out, "precision_roofline.md")) as f:
        print(f.read())
    print(f"{len(rows)} rows; figure {a.out}/precision_roofline.png")
    return 0


if __name__ == "__main__":
    from workbench.hardware.hostmem import reexec_with_hugepages

    reexec_with_hugepages()  # before JAX starts: huge pages for XLA:CPU buffers (workbench/hostmem.py)
    sys.exit(main())
