"""Options shared by the commands that run programs."""
from __future__ import annotations

import typer

from workbench.errors import positive_int

PLATFORM_HELP = ("where programs run: auto (the GPU or TPU this host has, else the CPU) | cpu (on the host; "
                 "`--devices N` simulates N devices) | gpu | tpu")


def platform_option():
    """`--platform auto|cpu|gpu|tpu` (workbench.hardware.devices.select_platform)."""
    return typer.Option("auto", "--platform", help=PLATFORM_HELP)


def check_inputs(*, batch=None, seq=None, microbatches=None) -> None:
    """One-line errors for a predict/plan spec's sizes, before any target device is built (names are checked where
    they are resolved, once: workbench.programs.predict.resolve)."""
    for name, v in (("--batch", batch), ("--seq", seq), ("--microbatches", microbatches)):
        if v is not None:
            positive_int(name, v)
