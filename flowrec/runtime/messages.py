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


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when the message is empty); a
    first line that only announces what follows (ends with ':', as torch's `load_state_dict`
    errors do) keeps the line after it, which says what is wrong."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
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
