"""Options shared by the commands that run programs."""
from __future__ import annotations

import typer

PLATFORM_HELP = ("where programs run: auto (the GPU or TPU this host has, else the CPU) | cpu (on the host; "
                 "`--devices N` simulates N devices) | gpu | tpu")


def platform_option():
    """`--platform auto|cpu|gpu|tpu` (workbench.hardware.devices.select_platform)."""
    return typer.Option("auto", "--platform", help=PLATFORM_HELP)
