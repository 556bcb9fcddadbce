"""Whether a column name is really close to another: the guess behind "the rows have 'userid':
rename it to 'user_id'?" (`flowrec predict`) and "is 'click_sequense' the input's 'click_sequence'?"
(`flowrec data convert`).

difflib's ratio of 0.6 took names that only share a suffix for each other ('cate_id' for 'item_id':
ratio 0.71), so a user renamed the wrong column. A name is close to another here when both, lower
case and without separators ('_', '-', '.', spaces), are the same ('User_ID', 'userid'), or begin
with the same letter and differ by a few edits for their length (one per three characters of the
longer: 'click_sequense', 'prices', 'usr', 'clicked' for 'clicks') and, where both have several
words, share a word of three or more letters ('item_id' and 'item_ids', not 'cate_id' and 'item_id',
whose only shared word is 'id'); two candidates as close as each other are no guess.

Example:
    >>> close_name("user_id", ["userid", "rating"]), close_name("item_id", ["cate_id", "user_id"])
    ('userid', None)
    >>> close_name("user", ["usr", "age"]), close_name("age", ["page"])
    ('usr', None)
"""
from __future__ import annotations

import re

SEPARATORS = re.compile(r"[\s_\-.]+")
FEW = 4  # candidates closest by difflib's ratio that are judged
CHARS_PER_EDIT = 3  # characters of the longer name for each edit a close name may differ by (at least one)


def words(name: str) -> set[str]:
    """The words of a name: split at separators and at camelCase, lower case.

    >>> sorted(words("clickSequence_v2"))
    ['click', 'sequence', 'v2']
    """
    parts = SEPARATORS.split(re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name))
    return {p.lower() for p in parts if p}


def _plain(name: str) -> str:
    return SEPARATORS.sub("", name).lower()


def edits(a: str, b: str) -> int:
    """Levenshtein distance: the fewest insertions, deletions and substitutions from `a` to `b`.

    >>> edits("sequense", "sequence"), edits("cateid", "itemid")
    (1, 3)
    """
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def closeness(name: str, other: str) -> int | None:
    """The edits between two names judged close (0: the same but for case and separators), else None."""
    a, b = _plain(name), _plain(other)
    if not a or not b:
        return None
    if a == b:
        return 0
    d = edits(a, b)
    if a[0] != b[0] or d > max(1, max(len(a), len(b)) // CHARS_PER_EDIT):
        return None
    mine, theirs = words(name), words(other)
    if len(mine) > 1 and len(theirs) > 1:  # names of several words share a word of three letters or more
        if not any(len(w) >= 3 for w in mine & theirs):
            return None
    return d


def close_name(name: str, candidates: list[str]) -> str | None:
    """The one candidate closest to `name` (`closeness`), None for none or for a tie. difflib's
    quick ratios pick the few candidates judged (edits of every pair of 1,000 missing columns and
    1,000 others took 26 s)."""
    import difflib

    lower: dict[str, list[str]] = {}
    for c in candidates:
        lower.setdefault(c.lower(), []).append(c)
    likely = [c for text in difflib.get_close_matches(name.lower(), list(lower), n=FEW, cutoff=0.6)
              for c in lower[text]]
    scored = sorted((d, c) for c in likely if (d := closeness(name, c)) is not None)
    if not scored or (len(scored) > 1 and scored[1][0] == scored[0][0]):
        return None
    return scored[0][1]
