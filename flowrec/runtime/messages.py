"""One-line error messages: what every command and runtime error shows of an exception it wraps.

Example:
    >>> first_line(ValueError("bad row\\n  details"))
    'bad row'
    >>> first_line(KeyError())
    'KeyError'
    >>> first_line(RuntimeError("Error(s) in loading state_dict for M:\\n\\tmanaged table t: damaged"))
    'Error(s) in loading state_dict for M: managed table t: damaged'
"""
from __future__ import annotations

import math
import os
import re
import shlex
import stat
from pathlib import Path


SMALL, LARGE = 1e-3, 1e8  # a value outside [SMALL, LARGE) is shown with an exponent, its 5 digits kept
_LINE_BREAKS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f\x85\u2028\u2029]")  # what splitlines() splits on, and controls


def one_line(text: str) -> str:
    """`text` with its line breaks and control characters escaped as Python writes them in a
    string's repr, so that a message naming a file whose name holds a line break stays one line.

    >>> one_line("input not found: bad\\nname.csv")
    'input not found: bad\\\\nname.csv'
    """
    return _LINE_BREAKS.sub(lambda m: repr(m.group())[1:-1], text)


def shell_word(text: str) -> str:
    """`text` as one word of a shell command that a message prints (a `--resume` command): quoted
    as `shlex.quote` does, or, when it holds a line break or another control character, in bash's
    $'...' quoting with those characters escaped, so the command stays one line (`one_line` leaves
    it alone) and still names the folder when pasted.

    >>> shell_word("my run"), shell_word("r\\nun"), shell_word("it's\\n")
    ("'my run'", "$'r\\\\nun'", "$'it\\\\'s\\\\n'")
    """
    if not _LINE_BREAKS.search(text) and "\t" not in text:
        return shlex.quote(text)
    named = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    return "$'" + "".join(named.get(c) or (f"\\u{ord(c):04x}" if ord(c) > 0x7f else f"\\x{ord(c):02x}")
                          if c in named or _LINE_BREAKS.match(c) else c for c in text) + "'"


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when the message is empty); a
    first line that only announces what follows (ends with ':', as torch's `load_state_dict`
    errors do) keeps the line after it, which says what is wrong. flowrec's own errors (DataError,
    CheckpointError, ...) are one line already: a line break in one belongs to a name, escaped
    (`one_line`)."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    if type(exc).__module__.partition(".")[0] == "flowrec":  # flowrec's own errors are one line: a line
        return one_line(text)  # break in one is a file's name (cut there, 'malformed row at q' said no more)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def out_of_memory(exc: BaseException) -> bool:
    """True for an allocation that failed: torch's `OutOfMemoryError` (CUDA), Python's
    `MemoryError`, or the `RuntimeError` torch's CPU allocator raises (it has no type of its own;
    its message says it cannot allocate memory)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and "allocat" in text and "memory" in text


def number_cell(value: float) -> str:
    """A metric or a mean in a table, the loss of the progress bar: 4 decimals, or 5 digits with an
    exponent outside [SMALL, LARGE) (an mse of 3e-06 is not 0.0000, nor one of 4e+48 a 49-digit cell).

    >>> number_cell(0.25), number_cell(3.2e-06), number_cell(0.0)
    ('0.2500', '3.2000e-06', '0.0000')
    """
    if value != 0 and math.isfinite(value) and not SMALL <= abs(value) < LARGE:
        return f"{value:.4e}"
    return f"{value:.4f}"


def not_a_file(path: Path) -> str | None:
    """What stands at `path` where a regular file was expected, in a line's words ("a pipe (FIFO)",
    "a folder", "a broken link", ...), or None when it is a file or nothing is there: a run's
    run.json made a FIFO was said to be "missing".

    >>> not_a_file(Path("/")), not_a_file(Path("/no/such/file"))
    ('a folder', None)
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken link" if os.path.islink(path) else None
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    kinds = ((stat.S_ISREG, None), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a pipe (FIFO)"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")
