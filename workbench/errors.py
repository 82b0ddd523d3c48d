"""Errors a user can act on. The CLI prints them as one line and exits 2 (usage) or 1 (runtime)."""

import math


class WorkbenchError(Exception):
    """Bad input or an impossible request; message names the problem and the fix. Exit code 2."""

    exit_code = 2


class NothingToDo(WorkbenchError):
    """The request is already satisfied (a resumed run that reached its steps): said in one line, exit 0, so that a
    scheduler re-queueing the job sees success."""

    exit_code = 0


class RecompileError(WorkbenchError):
    """A program recompiled while it was being timed."""

    exit_code = 1


class DoesNotFit(WorkbenchError):
    """A program needs more memory than the device has."""

    exit_code = 1


def positive_int(name: str, value) -> int:
    """Validate a size argument: a positive whole number."""
    try:
        iv = int(value)
    except (TypeError, ValueError):
        raise WorkbenchError(f"{name} must be a positive whole number, got {value!r}") from None
    if iv != value and str(iv) != str(value) or iv <= 0:
        raise WorkbenchError(f"{name} must be a positive whole number, got {value!r}")
    return iv


def finite_number(name: str, value, minimum: float | None = None, strictly_above: bool = False) -> float:
    """Validate a real-valued argument: finite (no inf/nan), and >= minimum (> minimum when strictly_above)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise WorkbenchError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise WorkbenchError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and (v <= minimum if strictly_above else v < minimum):
        raise WorkbenchError(f"{name} must be {'>' if strictly_above else '>='} {minimum:g}, got {value!r}")
    return v
