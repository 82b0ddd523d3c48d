"""The tiling study: padding waste across the presets, the shape sawtooth from compiled TPU programs, the Pallas
tile search against the XLA dot, and what the fused kernel changes.

    python -m benchmarks.tiling_study [--quick] [--out reports/tiling]

(a) padding: every preset's training-step matmuls on tpu-v5e, tpu-v6e and h100 (workbench.programs.tiling
    .shape_report): matrix-unit utilization, the wasted share of the step's flops, the dimension to blame and its
    nearest friendly value. Analytic: no compile.
(b) sawtooth: x[4096, k] @ y[k, 4096] in bf16 compiled for a v5e and a v6e chip across k (libtpu, compile-only
    devices), predicted from the compiled layouts, beside the TPU compiler's own cycle estimate; and on this host,
    compiled and measured (float32, smaller sizes).
(c) tile search: the Pallas blocked matmul at 4096^3 bf16 for a v5e: ranked blocks, the best few compiled, against
    the XLA dot of the same shape (its compiled program's cycle estimate and the roofline at the tile model's padding).
(d) fused kernels: act(x @ w + b) and causal attention compiled for the v5e by XLA and as the Pallas kernels:
    kernels in each program, their HBM bytes and temp memory (workbench.cost.report from the compiled HLO).

Every figure lands in the results store (kind `tiling_study`) and under --out (CSV, Markdown, PNG). Timings taken
while other work shares the machine are void; the compile-only TPU parts do not time anything.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

from models.kernels.attention import causal_attention
from models.kernels.matmul import activate, matmul
from partitioning.topology import tpu_devices
from workbench.cost.compile import compile_program
from workbench.hardware.devices import request_devices
from workbench.hardware.hostmem import reexec_with_hugepages
from workbench.hardware.tiles import tile_model
from workbench.measure.calibrate import get_spec
from workbench.programs.tiling import compiler_cycles, search, shape_report, sweep, tpu_clock_hz
from workbench.results.figures import markdown_table
from workbench.results.store import Store, make_record

PRESETS = ("small", "gpt2-small", "llama2-7b", "llama3-8b", "llama3-70b", "mixtral-8x7b", "gpt3-175b")
CHIPS = ("tpu-v5e", "tpu-v6e", "h100")


def padding_section(out: str, step_batch: int = 8, seq: int | None = None) -> list[dict]:
    rows = []
    for preset in PRESETS:
        for chip in CHIPS:
            r = shape_report(chip, preset=preset, step_batch=step_batch, seq=seq).to_record()  # seq None: the config's
            top = r["suggestions"][0] if r["suggestions"] else None
            total = sum(m["wasted_flops"] for m in r["matmuls"]) + sum(
                2.0 * m["m"] * m["n"] * m["k"] * m["batch"] * m["count"] for m in r["matmuls"])
            rows.append({"preset": preset, "chip": chip, "utilization": r["utilization"],
                         "wasted_share": r["wasted_flops"] / total if total else 0.0,
                         "predicted_s": r["predicted_s"], "predicted_unpadded_s": r["predicted_unpadded_s"],
                         "worst_dim": top["field"] if top else "", "worst_value": top["value"] if top else "",
                         "friendly_up": top["friendly_up"] if top else "", "worst_share": top["share"] if top else 0})
    _write(out, "padding", rows)
    _bar(rows, os.path.join(out, "padding.png"))
    return rows


def sawtooth_section(out: str, quick: bool) -> list[dict]:
    step = 64 if quick else 32
    res = []
    for tgt in ("tpu-v5e:1x1", "tpu-v6e:1x1"):
        r = sweep(tgt, 4096, 4096, 896, 1280, step, plot=os.path.join(out, f"sawtooth-{tgt.split(':')[0]}.png"))
        res.append(r.to_record())
    h = sweep("host", 512, 512, 448, 640, 32 if quick else 16, dtype="float32", repeats=5,
              plot=os.path.join(out, "sawtooth-host.png"))
    res.append(h.to_record())
    flat = [{"target": r["target"], "k": p["k"], "lhs_layout": p["layouts"][0], "padded_k": p["padded"]["k"],
             "mxu_k": p["mxu_padded"]["k"], "predicted_s": p["predicted_s"],
             "compiler_estimated_s": p["compiler_estimated_s"], "measured_s": p["measured_s"]}
            for r in res for p in r["points"]]
    _write(out, "sawtooth", flat)
    return res


def search_section(out: str, quick: bool) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding


    r = search("matmul", 4096, 4096, 4096, "tpu-v5e:1x1", top=2 if quick else 3)
    dev = tpu_devices("tpu-v5e:1x1")[0]
    s = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=SingleDeviceSharding(dev))
    xla = jax.jit(lambda a, b: a @ b).lower(s, s).compile()
    cyc = compiler_cycles(xla.as_text())
    clock = tpu_clock_hz(tile_model("tpu-v5e"), get_spec("tpu-v5e"))
    rec = r.to_record()
    rec["xla_dot_compiler_estimated_s"] = cyc / clock if cyc else None
    rows = [{"block": "x".join(map(str, c["block"])), "fits": c["fits"], "onchip_MiB": c["onchip_bytes"] / 2**20,
             "steps": c["steps"], "predicted_s": c["predicted_s"], "compiled": c["compiled"],
             "compile_s": c["compile_s"], "reason": c["reason"]} for c in rec["candidates"][:25]]
    _write(out, "search", rows)
    return rec


def fused_section(out: str) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding


    dev = tpu_devices("tpu-v5e:1x1")[0]
    sh = SingleDeviceSharding(dev)
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=sh)
    w = jax.ShapeDtypeStruct((4096, 16384), jnp.bfloat16, sharding=sh)
    b = jax.ShapeDtypeStruct((16384,), jnp.bfloat16, sharding=sh)

    def xla_fn(x, w, b):
        y = jnp.dot(x, w, preferred_element_type=jnp.float32) + b.astype(jnp.float32)
        return activate(y, "gelu").astype(jnp.bfloat16)

    def pallas_fn(x, w, b):
        return matmul(x, w, b, block=(512, 1024, 512), activation="gelu")


    qkv = jax.ShapeDtypeStruct((16, 2048, 128), jnp.bfloat16, sharding=sh)  # (batch·heads, seq, head_dim)

    def xla_attn(q, k, v):
        s = jnp.einsum("bqd,bkd->bqk", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(128.0)
        s = jnp.where(jnp.tril(jnp.ones((2048, 2048), bool)), s, -1e30)
        return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1).astype(q.dtype), v)

    def pallas_attn(q, k, v):
        return causal_attention(q, k, v, block_q=256, block_k=256)

    out_rows = {}
    for name, fn, args in (("epilogue/xla", xla_fn, (x, w, b)), ("epilogue/pallas", pallas_fn, (x, w, b)),
                           ("attention/xla", xla_attn, (qkv, qkv, qkv)),
                           ("attention/pallas", pallas_attn, (qkv, qkv, qkv))):
        c = compile_program(fn, *args, analytic=False, compute_dtype="bfloat16")
        out_rows[name] = {"kernels": len(c.cost.kernels), "kernel_kinds": [k.kind for k in c.cost.kernels],
                          "hlo_bytes": c.cost.hlo_bytes, "cost_analysis_bytes": c.cost.bytes_accessed,
                          "flops": c.cost.flops, "temp_bytes": c.cost.temp_bytes, "compile_s": c.compile_s}
    _write(out, "fused", [{"program": k, **{kk: (json.dumps(vv) if isinstance(vv, list) else vv)
                                           for kk, vv in v.items()}} for k, v in out_rows.items()])
    return out_rows


def _write(out: str, name: str, rows: list[dict]) -> None:
    if not rows:
        return
    with open(os.path.join(out, f"{name}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)

    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(markdown_table(rows, list(rows[0])) + "\n")


def _bar(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(9, 4))
    x = np.arange(len(PRESETS))
    for i, chip in enumerate(CHIPS):
        vals = [next(r["utilization"] for r in rows if r["preset"] == p and r["chip"] == chip) for p in PRESETS]
        ax.bar(x + (i - 1) * 0.27, vals, 0.27, label=chip)
    ax.set_xticks(x, PRESETS, rotation=20, fontsize=8)
    ax.set_ylim(0.4, 1.02)
    ax.set_ylabel("matrix-unit utilization of the training step's matmuls")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    reexec_with_hugepages()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer sweep points, two compiled candidates")
    p.add_argument("--out", default=os.path.join("reports", "tiling"))
    p.add_argument("--skip", default="", help="comma list of sections to skip: padding,sawtooth,search,fused")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)

    request_devices(None)
    skip = set(filter(None, a.skip.split(",")))
    t0 = time.time()
    body: dict = {}
    for name, fn in (("padding", lambda: padding_section(a.out)), ("sawtooth", lambda: sawtooth_section(a.out, a.quick)),
                     ("search", lambda: search_section(a.out, a.quick)), ("fused", lambda: fused_section(a.out))):
        if name in skip:
            continue
        print(f"tiling_study: {name} ...", file=sys.stderr, flush=True)
        body[name] = fn()
    body["wall_s"] = time.time() - t0
    Store().append(make_record("tiling_study", {"quick": a.quick, "skip": sorted(skip)}, extra=body))
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(body, f, indent=1, default=str)
    print(f"tiling_study: done in {body['wall_s']:.0f}s; tables and figures under {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
