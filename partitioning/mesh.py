"""Device meshes from a spec string like 'data=2,model=4'.

Mesh axis names are fixed (one sharding vocabulary): data, model, expert, seq, context, stage. Axes are AxisType.Auto: the models
annotate parameters and key activations and rely on XLA's sharding propagation for the rest.
"""
from __future__ import annotations

import math
from typing import Sequence

from workbench import compat
from workbench.errors import WorkbenchError

MESH_AXES = ("data", "model", "expert", "seq", "context", "stage")
STAGE_AXIS = "stage"  # the axis pipeline parallelism splits the stacked layers over (models/pipeline.py)
TENSOR_AXIS = "model"  # the axis tensor parallelism splits heads, mlp and vocab over (partitioning/rules.py)
CONTEXT_AXIS = "context"  # the axis context parallelism splits the sequence over (strategies cp, fsdp+cp, fsdp+tp+cp)


def parse_mesh_spec(spec: str | dict) -> dict[str, int]:
    """'data=2,model=4' -> {'data': 2, 'model': 4} (order kept). Bad names, sizes, duplicates: one-line errors."""
    if isinstance(spec, dict):
        items = list(spec.items())
    else:
        text = (spec or "").strip()
        if not text:
            raise WorkbenchError("empty mesh spec; write e.g. --mesh data=8 or --mesh data=2,model=4")
        items = []
        for part in text.split(","):
            part = part.strip()
            if "=" not in part:
                raise WorkbenchError(f"mesh axis {part!r} is not of the form name=size (e.g. --mesh data=2,model=4)")
            name, size = (p.strip() for p in part.split("=", 1))
            items.append((name, size))
    out: dict[str, int] = {}
    for name, size in items:
        if name not in MESH_AXES:
            raise WorkbenchError(f"unknown mesh axis {name!r}; mesh axes are {', '.join(MESH_AXES)}")
        if name in out:
            raise WorkbenchError(f"mesh axis {name!r} given twice in the mesh spec")
        try:
            n = int(size)
        except (TypeError, ValueError):
            raise WorkbenchError(f"mesh axis {name} size must be a positive whole number, got {size!r}") from None
        if n < 1 or str(n) != str(size).strip():
            raise WorkbenchError(f"mesh axis {name} size must be a positive whole number, got {size!r}")
        out[name] = n
    return out


def mesh_spec_str(mesh) -> str:
    return ",".join(f"{a}={s}" for a, s in mesh.shape.items())


def make_mesh(spec: str | dict, devices: Sequence | None = None):
    """A jax.sharding.Mesh over `devices` (default: all of jax.devices(); or e.g. TPU topology devices for AOT).

    The product of the axis sizes must equal the number of devices.
    """
    import jax

    axes = parse_mesh_spec(spec)
    if devices is None:
        devices = jax.devices()
    devices = list(devices)
    size = math.prod(axes.values())
    if size != len(devices):
        spec_s = ",".join(f"{a}={s}" for a, s in axes.items())
        raise WorkbenchError(
            f"mesh {spec_s} has {size} devices but {len(devices)} are available; make the axis sizes multiply to "
            f"{len(devices)} (or pass --devices {size} to simulate {size} CPU devices)")
    names = tuple(axes)
    shape = tuple(axes.values())
    types = compat.auto_axes(len(names))
    try:
        return compat.jax_mesh(shape, names, devices=devices, axis_types=types)
    except Exception:  # topology-aware ordering can refuse unusual shapes: fall back to the given order
        import numpy as np

        return jax.sharding.Mesh(np.array(devices).reshape(shape), names, axis_types=types)
