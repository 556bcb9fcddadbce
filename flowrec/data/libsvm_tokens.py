"""The form of one libsvm / libfm token: which column it gives, its index and its value.

A libsvm token is ``index:value`` (its column by position, or by the feature map), a libfm one
``field:index:value`` (the field a number, the column at that position of ``fields``, or a column
name). An index is the categorical value a column receives: whole numbers as libsvm writes them
(``5``, ``0``) or text (libfm's ``user:u12:1``); a number that is no whole number >= 0 (``-3``,
``5.5``, ``1e3``) is no index. Each problem is a ValueError whose text is the reason of a
malformed row.

Example:
    >>> token_column("1:5:1", 0, ["user", "item"], None, {"user", "item"})
    ('item', '5', '1')
    >>> token_column("1 :7".split()[1], 0, ["user"], None, {"user"})
    Traceback (most recent call last):
    ValueError: token ':7' has an empty index (a libsvm token is index:value, e.g. 5:1; libfm's field:index:value, e.g. 2:5:1)
"""
from __future__ import annotations

import re

TOKEN_FORM = "a libsvm token is index:value, e.g. 5:1; libfm's field:index:value, e.g. 2:5:1"
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")  # a decimal number as text writes it


def token_column(tok: str, pos: int, fields: list[str], fmap: dict[str, str] | None,
                 known: set[str]) -> tuple[str, str, str]:
    """(column, index, value) of the token `tok` at feature position `pos` of its row.

    Args:
        tok: one whitespace-free token of a row (not its label, not a ``qid:``).
        pos: its position among the row's feature tokens (the column of an ``index:value`` by
            position).
        fields: the ``fields`` option (columns by position or by libfm field number).
        fmap: the feature map (index -> column), or None.
        known: every column the options name.

    Raises:
        ValueError: a token of another form (an empty part, no or too many colons), a numeric
            index that is no whole number >= 0, a field past ``fields`` or naming no column, an
            index the feature map lacks ('unknown index'), more tokens than fields.
    """
    parts = tok.split(":")
    if len(parts) == 2:
        field, (idx, val) = None, parts
    elif len(parts) == 3:
        field, idx, val = parts
    else:
        raise ValueError(f"token {tok!r} has {len(parts) - 1} colons ({TOKEN_FORM})")
    if not (idx and val and field != ""):
        empty = [what for what, part in zip(("field", "index", "value")[3 - len(parts):], parts) if not part]
        raise ValueError(f"token {tok!r} has an empty {' and an empty '.join(empty)} ({TOKEN_FORM})")
    if not (idx.isdigit() and idx.isascii()) and _NUMBER.fullmatch(idx):  # digits first: most indices
        raise ValueError(f"token {tok!r} has the index {idx!r}: an index written as a number is a whole number "
                         f">= 0 ({TOKEN_FORM})")
    if field is not None:
        return _field_column(tok, field, fields, known), idx, val
    if fmap is not None:
        if idx not in fmap:
            raise ValueError(f"unknown index {idx!r}")
        return fmap[idx], idx, val
    if pos >= len(fields):
        raise ValueError(f"more tokens than fields ({len(fields)})")
    return fields[pos], idx, val


def is_number(text: str) -> bool:
    """Whether `text` is a decimal number as text writes it (no nan, no inf).

    >>> [is_number(t) for t in ("1", "-0.5", "1e-3", "", "x", "nan")]
    [True, True, True, False, False, False]
    """
    return (text.isdigit() and text.isascii()) or bool(_NUMBER.fullmatch(text))  # digits first: most values


def _field_column(tok: str, field: str, fields: list[str], known: set[str]) -> str:
    """The column of a libfm token's field: by number in `fields`, else by name."""
    if field.isdigit() and fields and field.isascii():
        number = int(field)
        if number >= len(fields):
            raise ValueError(f"token {tok!r} gives the field {field}, past the {len(fields)} of the fields option "
                             f"(libfm's fields count from 0)")
        return fields[number]
    if field not in known:
        raise ValueError(f"token {tok!r} gives the field {field!r}, which names no column (the columns: "
                         f"{', '.join(sorted(known))[:200]})")
    return field
