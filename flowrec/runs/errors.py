"""The one error of the run lifecycle: a message of one line and the exit status the CLI gives it.

The lifecycle (`flowrec.runs`) never prints and never exits: it raises `RunError`; the CLI turns
it into its one line on stderr and `code`, the API lets the caller catch it.
"""
from __future__ import annotations

EXIT_USAGE = 2  # bad input: spec, data, options, folder
EXIT_OUT_OF_MEMORY = 3
EXIT_RANK_FAILED = 4  # another rank died or hung: this one stopped at the --dist-timeout
EXIT_INTERRUPTED = 130  # 128 + SIGINT


class RunError(ValueError):
    """A run cannot start or go on; `str(error)` is one line, `code` the CLI's exit status, `cause`
    the error of a lower layer it reports (a `DataError`, say), for callers that want that type."""

    def __init__(self, message: str, code: int = EXIT_USAGE, cause: BaseException | None = None):
        super().__init__(message)
        self.code = code
        self.cause = cause
