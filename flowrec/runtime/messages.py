"""One-line error messages: what every command and runtime error shows of an exception it wraps.

Example:
    >>> first_line(ValueError("bad row\\n  details"))
    'bad row'
    >>> first_line(KeyError())
    'KeyError'
"""
from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when the message is empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
