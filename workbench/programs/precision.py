"""Precision study (a), quick: the matmul error of each precision policy against a float64 reference, and the policy
table. Programs behind `workbench precision ...` and benchmarks.precision_error."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.precision import available, get_policy
from models.quant import POLICY_ORDER, matmul_format
from workbench.errors import WorkbenchError, positive_int
from workbench.results import console
from workbench.results import store as results

INPUTS = ("normal", "outliers", "outlier_damage")


def make_inputs(kind: str, m: int, k: int, n: int, seed: int, step: int = 0, outlier_channels: int = 4,
                outlier_scale: float = 100.0):
    """x (m, k) and w (k, n) as float32 NumPy arrays.

    normal: x ~ N(0, 1), w ~ N(0, 1/k). outliers: as normal, but `outlier_channels` input channels (columns of x, the
    pattern LLM activations show; Dettmers et al. 2022) scaled by `outlier_scale`. outlier_damage: as outliers, but
    the weights of the outlier channels are zero, so the reference is the normal channels' product alone and the error
    is what the outliers' effect on the shared scales costs every other channel. `step` draws a fresh x from the same
    distribution (w is fixed), for recipes with state (delayed scaling).
    """
    if kind not in INPUTS:
        raise WorkbenchError(f"unknown input kind {kind!r}; choose one of {', '.join(INPUTS)}")
    rw = np.random.default_rng([seed, 0])
    w = (rw.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    rx = np.random.default_rng([seed, 1, step])
    x = rx.standard_normal((m, k)).astype(np.float32)
    if kind in ("outliers", "outlier_damage"):
        cols = np.random.default_rng([seed, 2]).choice(k, size=min(outlier_channels, k), replace=False)
        x[:, cols] *= outlier_scale
        if kind == "outlier_damage":
            w[cols, :] = 0.0
    return x, w


def matmul_error(policy_name: str, kind: str = "normal", m: int = 256, k: int = 1024, n: int = 256, seed: int = 0,
                 steps: int = 3, outlier_scale: float = 100.0, outlier_channels: int = 4, **policy_options) -> dict:
    """Relative error of `policy`'s einsum 'mk,kn->mn' against float64, on the last of `steps` calls (stateful
    recipes see `steps - 1` earlier draws from the same distribution first). rel_error = ||y - y64||_F / ||y64||_F."""
    for nm, v in (("m", m), ("k", k), ("n", n), ("steps", steps)):
        positive_int(nm, v)
    policy = get_policy(policy_name, **policy_options)
    module = policy.einsum_module(rngs=nnx.Rngs(seed))

    @nnx.jit
    def call(mod, x, w):
        return mod("mk,kn->mn", x, w).astype(jnp.float32)

    errs = []
    for s in range(steps):
        x, w = make_inputs(kind, m, k, n, seed, step=s, outlier_channels=outlier_channels,
                           outlier_scale=outlier_scale)
        y = np.asarray(jax.device_get(call(module, jnp.asarray(x), jnp.asarray(w))), np.float64)
        ref = x.astype(np.float64) @ w.astype(np.float64)
        err = y - ref
        errs.append({"rel_error": float(np.linalg.norm(err) / np.linalg.norm(ref)),
                     "max_abs_error": float(np.max(np.abs(err))),
                     "finite": bool(np.all(np.isfinite(y)))})
    last = errs[-1]
    fmt = matmul_format(policy)
    return {"policy": policy.name, "inputs": kind, "rel_error": last["rel_error"],
            "max_abs_error": last["max_abs_error"], "finite": last["finite"],
            "rel_error_per_call": [e["rel_error"] for e in errs], "shape_mkn": [m, k, n], "seed": seed,
            "outlier_scale": outlier_scale if kind != "normal" else None,
            "outlier_channels": outlier_channels if kind != "normal" else None,
            "compute_dtype": np.dtype(policy.compute_dtype).name, "matmul_element": fmt["element"],
            "matmul_bits": fmt["bits"], "scale": fmt["scale"], "reference": "float64 NumPy matmul",
            "backend": jax.default_backend(),
            "emulated": bool(fmt["emulated_on_cpu"] and jax.default_backend() == "cpu")}


def error_table(policies: list[str], kinds: list[str], m, k, n, seed, steps, progress=False) -> list[dict]:
    jobs = [(p, kd) for kd in kinds for p in policies]
    it = console.progress(jobs, total=len(jobs), desc="matmul error") if progress else jobs
    return [matmul_error(p, kd, m=m, k=k, n=n, seed=seed, steps=steps) for p, kd in it]


def policies(arg: Optional[str]) -> list[str]:
    if not arg:
        have = set(available())
        return [p for p in POLICY_ORDER if p in have] + sorted(have - set(POLICY_ORDER))
    names = [s.strip() for s in arg.split(",") if s.strip()]
    for nm in names:
        get_policy(nm)  # one-line error for unknown/ambiguous names
    return names


def record_rows(rows: list[dict]) -> None:
    """Append study-a rows as records (kind 'precision_error')."""
    store = results.Store()
    for r in rows:
        spec = {k: r[k] for k in ("policy", "inputs", "shape_mkn", "seed")}
        store.append(results.make_record("precision_error", spec, None, None, None, extra=r, seed=r["seed"]))


def policy_rows() -> list[dict]:
    """One row per registered policy: its dtypes, the matmul's number format and scaling, its loss scaling."""
    rows = []
    for nm in policies(None):
        p = get_policy(nm)
        f = matmul_format(p)
        rows.append({"policy": nm, "compute_dtype": np.dtype(p.compute_dtype).name,
                     "param_dtype": np.dtype(p.param_dtype).name, "matmul_element": f["element"],
                     "matmul_bits": f["bits"], "scale": f["scale"], "peak_dtype": f["peak_dtype"],
                     "loss_scaling": type(p.loss_scaling).__name__ if p.loss_scaling is not None else None,
                     "description": p.description})
    return rows
