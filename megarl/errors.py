"""Whose fault an error is, and the one line the ``megarl`` command prints for it.

Errors the user can fix from the message alone -- a config field, a data row, a missing file, an
API key a server refuses, a server that cannot be reached, a model that does not fit its memory --
end a command with one line naming the field, file:line or server and exit status 2 (a config
with several wrong fields: one line per field under one header). Anything else is megarl's own
fault and keeps its traceback (``megarl --debug`` shows tracebacks for all).

Error classes mark themselves by deriving from :class:`UserError`. This module imports nothing
from megarl (nor torch or ray), so any module can do that without an import cycle, and the CLI can
classify an exception that crossed a process boundary (Ray wraps a worker's exception in a
``RayTaskError`` whose ``.cause`` is the original) without importing what raised it.
"""
from __future__ import annotations

from typing import Optional

USER_EXIT = 2

# A missing file is the user's (a recipe, data file, model folder without weights: megarl raises
# FileNotFoundError naming the field or folder); the others only when they name a path.
MISSING = (FileNotFoundError,)
PATH_ERRORS = (NotADirectoryError, IsADirectoryError, PermissionError)
# Out of device/host memory in torch (torch.OutOfMemoryError, torch.cuda.OutOfMemoryError): the
# model, batch or parallel layout does not fit, which `megarl plan` estimates before a launch.
OOM_NAMES = ("OutOfMemoryError",)


class UserError(Exception):
    """Marker base: caused by the user's input or setup, fixable from the message alone.

    Subclasses keep their usual base too (``class DataError(UserError, ValueError)``) so existing
    ``except ValueError`` handlers still catch them."""


class RunStopped(Exception):
    """The run stopped on a signal before its end (SIGTERM: a SLURM preemption or ``scancel``) at a
    phase boundary; ``exit_code`` is what the process exits with (the launcher requeues on it)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def failure_reason(exc: BaseException) -> Optional[str]:
    """The reason an exception declares for a sample without a reward, or None. An exception class
    with a string class attribute ``reason`` (``rewards.failures.RewardFailed``,
    ``envs.sandbox.SandboxCrashed``) says: infrastructure failed here, not the model's answer -- the
    sample is failed, never scored (an instance may narrow the reason). Here, not in ``rewards/``,
    so the sandbox, which runs where torch is not installed, can declare one without importing it."""
    if not isinstance(getattr(type(exc), "reason", None), str):
        return None
    return str(getattr(exc, "reason"))


def _wrapped(exc: BaseException) -> Optional[BaseException]:
    """The exception ``exc`` wraps: a Ray task error's ``.cause`` (the worker's exception, also when
    Ray made the wrapper an instance of the cause's class), else ``raise ... from`` (``__cause__``)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        return cause
    return exc.__cause__


def _is_user_error(exc: BaseException) -> bool:
    if isinstance(getattr(exc, "cause", None), BaseException):
        return False                        # a wrapper: judge what it wraps, print its words
    if isinstance(exc, (UserError, *MISSING)):
        return True
    if isinstance(exc, PATH_ERRORS) and exc.filename is not None:
        return True
    return type(exc).__name__ in OOM_NAMES and type(exc).__module__.split(".")[0] == "torch"


def find_user_error(exc: BaseException) -> Optional[BaseException]:
    """The user error behind ``exc`` -- ``exc`` itself or one it wraps -- or None (an internal error)."""
    seen: set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _is_user_error(current):
            return current
        current = _wrapped(current)
    return None


def describe(exc: BaseException) -> str:
    """``exc``'s message for the user: one line -- ``"head: a"`` for a one-item ``"head:\\n  a"`` list
    (a ConfigError of one field), ``"PATH: reason"`` for an OS error about a path, the first line of
    an out-of-memory message -- except a list of several items, one per line under its head."""
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if type(exc).__name__ in OOM_NAMES:
        return f"out of memory: {lines[0]} (`megarl plan RECIPE` estimates the memory of a run)"
    head, rest = lines[0], lines[1:]
    if len(rest) == 1 and head.endswith(":"):
        return f"{head} {rest[0]}"
    if rest and head.endswith(":"):
        return "\n  ".join(lines)
    return "; ".join(lines)


def user_error_line(exc: BaseException) -> Optional[str]:
    """What to print for ``exc`` when it is (or wraps) a user error, else None."""
    found = find_user_error(exc)
    return None if found is None else describe(found)
