"""Column names that look alike but are written with other characters: an accent written apart
(NFD, as macOS writes names) or a no-break space. Such names print the same, so a line saying a
column is missing while the header has it reads as nonsense; `look_alikes` finds them and
`look_alike_note` shows both with their code points.

Example:
    >>> look_alikes(["price", "use\\u0301r id"], ["us\\u00e9r id", "price"])
    [('use\\u0301r id', 'us\\xe9r id')]
    >>> print(look_alike_note("use\\u0301r id", "us\\u00e9r id"))
    'use\\u0301r id' looks like 'us\\xe9r id' but is written with other characters (an accent written apart, a no-break space)
"""
from __future__ import annotations

import unicodedata


def looks(name: str) -> str:
    """How a column name looks: its NFKC form (accents joined, a no-break space a space).

    >>> looks("use\\u0301r\\u00a0id") == looks("us\\u00e9r id")
    True
    """
    return unicodedata.normalize("NFKC", name)


def look_alikes(names: list[str], wanted: list[str]) -> list[tuple[str, str]]:
    """(a name of `names`, the name of `wanted` it looks like) for each wanted name that `names`
    lacks but holds written with other characters, in the order of `wanted`."""
    return [(n, w) for w in wanted if w not in names for n in names if looks(n) == looks(w)]


def look_alike_note(name: str, wanted: str) -> str:
    """`name` and `wanted` shown with their code points (`ascii`), and how they differ."""
    return (f"{ascii(name)} looks like {ascii(wanted)} but is written with other characters (an accent written "
            "apart, a no-break space)")
