"""The app's user-facing errors: one line on stderr, a non-zero exit status, no traceback."""


class UserError(Exception):
    """A mistake in the settings or inputs: reported as one line, exit status 2 (no traceback)."""

    exit_code = 2


class ReferenceFailed(UserError):
    """The reference system itself failed or timed out (e.g. a vLLM engine error): one line with its root cause,
    exit status 3."""

    exit_code = 3
