"""Regenerate the XLA:GPU optimized-HLO fixtures of tests/cost/test_gpu_kernels.py (deviceless compiles for an H200).

Needs the JAX CUDA plugin of the pinned jaxlib (`pip install -e '.[gpu-aot]'`, docs/targets.md); no GPU. Run from the
repository root:  .venv/bin/python tests/data/gpu_hlo/make_fixtures.py

Each fixture is the optimized HLO text of one program (`compiled.as_text()`, the source-location tables at its head
dropped), gzipped when over 200 KB; `fixtures.json` says what each program is, the flags it was compiled with and the
jax/plugin versions. The tests parse the text only, so they run where the plugin is absent (CI).
"""
from __future__ import annotations

import gzip
import importlib.metadata
import json
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent
TARGET = "h200:1"  # sm_90 (partitioning/topology.py GPU_FAMILIES)
GZIP_ABOVE_BYTES = 200_000
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}  # dots go to cuBLAS custom calls


def strip_locations(text: str) -> str:
    """The HLO text without the FileNames / FunctionNames / FileLocations / StackFrames tables (local paths)."""
    out, skipping = [], False
    for line in text.splitlines():
        if re.match(r"^(FileNames|FunctionNames|FileLocations|StackFrames)$", line):
            skipping = True
            continue
        if skipping and (not line.strip() or re.match(r"^\d+ ", line)):
            continue
        skipping = False
        out.append(line)
    return "\n".join(out) + "\n"


def write(name: str, text: str) -> str:
    data = strip_locations(text).encode()
    for old in HERE.glob(name + ".hlo*"):
        old.unlink()
    if len(data) > GZIP_ABOVE_BYTES:
        path = HERE / f"{name}.hlo.gz"
        path.write_bytes(gzip.compress(data, mtime=0))
    else:
        path = HERE / f"{name}.hlo"
        path.write_bytes(data)
    print(f"{path.name}: {path.stat().st_size} bytes", file=sys.stderr)
    return path.name


def main() -> None:
    sys.path.insert(0, str(HERE.parents[2]))  # run as a script from anywhere: the repository's packages
    import jax
    import jax.numpy as jnp

    from partitioning import topology as topo
    from workbench.programs import predict as wp

    if not topo.gpu_compiler_available():
        raise SystemExit("make_fixtures: the JAX CUDA plugin is not installed (pip install -e '.[gpu-aot]')")
    dev = topo.xla_gpu_devices(TARGET)[0]
    sh = jax.sharding.SingleDeviceSharding(dev)

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    def compiled_text(fn, *args, options=None):
        lowered = jax.jit(fn).lower(*args)
        return (lowered.compile(compiler_options=options) if options else lowered.compile()).as_text()

    manifest: dict = {"target": TARGET, "jax": jax.__version__,
                      "jax_cuda12_plugin": importlib.metadata.version("jax-cuda12-plugin"), "fixtures": {}}

    def add(name, text, **about):
        manifest["fixtures"][name] = {"file": write(name, text), **about}

    m = n = k = 1024
    a = arg((m, k), jnp.bfloat16)
    b = arg((k, n), jnp.bfloat16)
    add("matmul_bf16_cublas", compiled_text(jnp.matmul, a, b, options=NO_TRITON_GEMM),
        program=f"bf16[{m},{k}] @ bf16[{k},{n}]", compiler_options=NO_TRITON_GEMM, m=m, n=n, k=k)
    add("matmul_bf16_default", compiled_text(jnp.matmul, a, b),
        program=f"bf16[{m},{k}] @ bf16[{k},{n}]", compiler_options={}, m=m, n=n, k=k)

    def fp8_matmul(x, y):
        return jax.lax.dot_general(x, y, (((1,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16)

    a8, b8 = arg((m, k), jnp.float8_e4m3fn), arg((k, n), jnp.float8_e4m3fn)
    add("matmul_fp8_cublas", compiled_text(fp8_matmul, a8, b8, options=NO_TRITON_GEMM),
        program=f"f8e4m3fn[{m},{k}] @ f8e4m3fn[{k},{n}] -> bf16", compiler_options=NO_TRITON_GEMM, m=m, n=n, k=k)

    bsz, seq, heads, head_dim = 4, 1024, 8, 64
    q = arg((bsz, seq, heads, head_dim), jnp.bfloat16)

    def attention(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    def attention_loss(q, k, v):
        return attention(q, k, v).astype(jnp.float32).sum()

    about = dict(batch=bsz, seq=seq, heads=heads, head_dim=head_dim, causal=True, implementation="cudnn")
    add("attention_cudnn_fwd", compiled_text(attention, q, q, q), program="dot_product_attention (BTNH)", **about)
    add("attention_cudnn_grad", compiled_text(jax.grad(attention_loss, argnums=(0, 1, 2)), q, q, q),
        program="grad of sum(dot_product_attention) wrt q, k, v", **about)

    spec = wp.PredictSpec("tiny", TARGET, "dp", batch=8, seq=64, remat="none", gpu_compiler="xla-gpu")
    lw = wp.lower(spec)
    program = (f"workbench predict --preset tiny --target {TARGET} --strategy dp --batch 8 --seq 64 --remat none "
               "(programs/train.py build_train_step)")
    about = dict(preset="tiny", batch=8, seq=64, remat="none", mode="train")
    add("train_step_tiny", lw.lowered.compile().as_text(), program=program, compiler_options={}, **about)
    add("train_step_tiny_cublas", lw.lowered.compile(compiler_options=NO_TRITON_GEMM).as_text(), program=program,
        compiler_options=NO_TRITON_GEMM, **about)
    (HERE / "fixtures.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
