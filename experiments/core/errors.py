"""The app's user-facing errors: one line on stderr, a non-zero exit status, no traceback.

Exit statuses (README, "Exit status"): 0 done, 1 an exact plan failed its oracle, 2 a user error, 3 the reference
failed, 4 the operating system refused what the run needed. A sweep exits with the highest status of its runs.
"""

from __future__ import annotations

import errno
import os


class UserError(Exception):
    """A mistake in the settings or inputs: reported as one line, exit status 2 (no traceback)."""

    exit_code = 2


class ReferenceFailed(UserError):
    """The reference system itself failed, timed out or answered something that is not an answer (e.g. a vLLM engine
    error, a truncated answer): one line with its root cause, exit status 3."""

    exit_code = 3


class EnvironmentFailure(UserError):
    """The operating system refused what the run needed: no space left, not a directory, permission denied, a
    read-only filesystem, a name too long... One line naming the path and the reason, exit status 4."""

    exit_code = 4


def environment_failure(e: BaseException, what: str | None = None, path=None) -> EnvironmentFailure | None:
    """The EnvironmentFailure for an error the OS raised (an OSError with an errno; a timeout is not one), else None.
    `what` says what the run was doing ("record"); `path` is named when the error names none (a failed write)."""
    if not isinstance(e, OSError) or isinstance(e, TimeoutError) or e.errno is None:
        return None
    reason = e.strerror or os.strerror(e.errno)
    name = errno.errorcode.get(e.errno, str(e.errno))
    named = (e.filename, e.filename2) if e.filename is not None else (path, None)
    paths = " -> ".join(show_path(p) for p in named if p is not None)
    return EnvironmentFailure(": ".join(x for x in (what or "the OS refused", paths, f"{reason} [{name}]") if x))


def show_path(path) -> str:
    """A path for a one-line message: control characters escaped, a very long one shortened with its length."""
    text = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
    text = text.encode("unicode_escape", "backslashreplace").decode("ascii") if not text.isprintable() else text
    return text if len(text) <= 160 else f"{text[:80]}...{text[-40:]} ({len(text)} characters)"


def one_line(message: str) -> str:
    """A message on one line (a root cause with "(also: ...)" lines, a worker's multi-line error)."""
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())
