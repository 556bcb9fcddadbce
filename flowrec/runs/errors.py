"""The one error of the run lifecycle: a message of one line and the exit status the CLI gives it.

The lifecycle (`flowrec.runs`) never prints and never exits: it raises `RunError`; the CLI turns
it into its one line on stderr and `code`, the API lets the caller catch it.
"""
from __future__ import annotations

EXIT_USAGE = 2  # bad input: spec, data, options, folder
EXIT_OUT_OF_MEMORY = 3
EXIT_RANK_FAILED = 4  # another rank died or hung: this one stopped at the --dist-timeout
EXIT_INTERRUPTED = 130  # 128 + SIGINT


class Terminated(KeyboardInterrupt):
    """SIGTERM (what `kill`, `timeout` and schedulers send) outside the training loop, which has its
    own handler: stopped as Ctrl-C stops it (the start-up's one line, the folder left as found),
    instead of Python's default, which ended the process without a word or any cleanup."""


def interrupt_name(exc: BaseException) -> str:
    """How a stop's line names what stopped it: SIGTERM (`Terminated`) or Ctrl-C."""
    return "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C"


class RunError(ValueError):
    """A run cannot start or go on; `str(error)` is one line, `code` the CLI's exit status, `cause`
    the error of a lower layer it reports (a `DataError`, say), for callers that want that type."""

    def __init__(self, message: str, code: int = EXIT_USAGE, cause: BaseException | None = None):
        super().__init__(message)
        self.code = code
        self.cause = cause
