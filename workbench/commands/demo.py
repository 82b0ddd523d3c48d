"""`workbench demo`: the headline study (what `make demo` runs)."""
from __future__ import annotations

from typing import Optional

import typer

from workbench.commands.options import platform_option
from workbench.hardware.devices import request_devices


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo_cmd(out: Optional[str] = typer.Option(None, help="report folder (default reports/demo-<time>)"),
                 tiny: bool = typer.Option(False, help="tiny sizes (seconds; for tests)"),
                 platform: str = platform_option()):
        """Built-in ops at a few sizes on this CPU, measured and predicted; a table and a report folder with a
        roofline chart."""
        from workbench.programs.demo import run_demo

        request_devices(None, platform)
        run_demo(out, tiny=tiny)
