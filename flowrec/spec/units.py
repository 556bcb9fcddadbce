"""Units and ranges of spec numbers: byte sizes ("4GiB" / "512MB" / 1073741824) and seeds."""
from __future__ import annotations

import math
import re

MAX_BYTES = 2**50  # 1 PiB: the largest byte size (device budget) flowrec accepts
MAX_SEED = 2**63 - 1  # seeds are stored as signed 64-bit integers
_UNITS = {  # bytes per unit
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,  # the limit is said in PiB
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int | float) -> int:
    """Parse a byte size such as ``"4GiB"``, ``"512 MB"`` or ``1024``, at most `MAX_BYTES`.

    Raises:
        ValueError: on an unknown unit, a malformed, negative or non-finite size, one over 1 PiB, or a
            fraction of a byte (`1.5`: a unit left out; `1.5KB` is 1,500 bytes).

    Example:
        >>> parse_bytes("4GiB"), parse_bytes("1.5 KB"), parse_bytes(1024), parse_bytes("0")
        (4294967296, 1500, 1024, 0)
        >>> parse_bytes("1.5")
        Traceback (most recent call last):
        ValueError: not a byte size: '1.5' is a fraction of a byte; give its unit, e.g. 1.5GiB or 1.5MiB
    """
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, (int, float)):
        size = value
        bare = True
    else:
        m = _SIZE.match(str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"not a byte size: {value!r} (use e.g. 4GiB, 512MB, 1073741824)")
        size = float(m.group(1)) * _UNITS[m.group(2).lower()]
        bare = _UNITS[m.group(2).lower()] == 1
    if bare and isinstance(size, float) and math.isfinite(size) and not size.is_integer():
        # `--device-budget 1.5` was a budget of 1 byte: a unit left out, not a part of a byte
        shown = str(value).strip().rstrip("bB").strip()
        raise ValueError(f"not a byte size: {value!r} is a fraction of a byte; give its unit, e.g. {shown}GiB or "
                         f"{shown}MiB")
    if not (isinstance(size, int) or math.isfinite(size)) or not 0 <= size <= MAX_BYTES:
        raise ValueError(f"byte size {str(value)[:40]!r} is out of range (0 .. 1 PiB)")
    return int(size)


def check_seed(value: object) -> str | None:
    """Why `value` is not a seed (an integer in 0 .. 2^63-1, given as an int or decimal text), or None.

    Example:
        >>> check_seed(7) is None, check_seed(-1)
        (True, 'must be an integer in 0..9223372036854775807 (got -1)')
    """
    text = str(value).strip() if isinstance(value, str) else None
    seed = int(text) if text is not None and text.isdigit() else value
    if isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed <= MAX_SEED:
        return None
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return f"must be an integer in 0..{MAX_SEED} (got {shown})"


def counted(n: int | float, noun: str) -> str:
    """A count and its noun, singular for one: every count phrase of a message ("(1 rows)" read wrong).

    >>> counted(1, "row"), counted(12345, "row"), counted(0, "class"), counted(2, "batch")
    ('1 row', '12,345 rows', '0 classes', '2 batches')
    """
    plural = noun + ("es" if noun.endswith(("s", "sh", "ch", "x")) else "s")
    return f"{n:,} {noun if n == 1 else plural}"


def format_bytes(n: int | float) -> str:
    """Format bytes with binary units: 1536 -> '1.5 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
