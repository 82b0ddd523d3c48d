"""`workbench` command line. Each command group lives in workbench/commands/<name>.py and exposes register(app).

Errors a user can fix print one line `workbench: error: ...` and exit 2; JSON goes to stdout, progress to stderr.
"""
from __future__ import annotations

import importlib
import os
import sys

import typer

from workbench.errors import WorkbenchError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  rich_markup_mode=None, help=__doc__.splitlines()[0])

# command modules, registered in this order; each defines register(app: typer.Typer)
COMMAND_MODULES = ["hw", "calibrate", "roofline", "results", "demo", "model_info", "run", "predict", "plan",
                   "precision", "moe"]


def _register():
    for name in COMMAND_MODULES:
        modname = f"workbench.commands.{name}"
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name == modname:
                continue  # not built yet
            raise
        mod.register(app)


_register()


def main(argv: list[str] | None = None) -> int:
    try:
        app(args=argv, standalone_mode=False)
        return 0
    except WorkbenchError as e:
        print(f"workbench: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("workbench: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # click usage errors and the unexpected
        import click

        if isinstance(e, click.exceptions.UsageError):
            cmd = e.ctx.command_path.split(" ", 1)[-1] if e.ctx else ""
            print(f"workbench: error: {e.format_message()} (see `workbench {cmd} --help`)", file=sys.stderr)
            sys.exit(2)
        if isinstance(e, click.exceptions.Exit):
            sys.exit(e.exit_code)
        if isinstance(e, click.exceptions.Abort):
            sys.exit(1)
        if os.environ.get("WORKBENCH_DEBUG"):
            raise
        print(f"workbench: error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
              "(set WORKBENCH_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
