"""workbench: compile JAX programs, read their costs, place them on a roofline, measure and record them.

Each command group lives in workbench/commands/<name>.py and exposes register(app).
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
                   "precision", "moe", "sweep", "paper", "fusion", "tiling", "serve"]


def _register():
    for name in COMMAND_MODULES:
        importlib.import_module(f"workbench.commands.{name}").register(app)


_register()


def main(argv: list[str] | None = None) -> int:
    try:
        rc = app(args=argv, standalone_mode=False)  # a command's typer.Exit(n) comes back as n
        if isinstance(rc, int) and rc:
            sys.exit(rc)
        return 0
    except WorkbenchError as e:
        print(f"workbench: {'error: ' if e.exit_code else ''}{e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("workbench: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # click usage errors (typer vendors click in some versions) and the unexpected
        names = {c.__name__ for c in type(e).__mro__}
        if "NoArgsIsHelpError" in names:
            print(e.format_message())
            sys.exit(2)
        if "UsageError" in names:
            ctx = getattr(e, "ctx", None)
            path = ctx.command_path if ctx is not None and ctx.command_path else "workbench"
            print(f"workbench: error: {e.format_message()} (see `{path} --help`)", file=sys.stderr)
            sys.exit(2)
        if "Exit" in names:
            sys.exit(getattr(e, "exit_code", 0))
        if "Abort" in names:
            sys.exit(1)
        if os.environ.get("WORKBENCH_DEBUG"):
            raise
        print(f"workbench: error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
              "(set WORKBENCH_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
