"""How far a seeded split by row values (rule 3) lands from its test_fraction, said.

Rule 3 draws one side for each distinct row, and a row's copies go with it
(`flowrec.data.convert.split_by_hash`). An input of few distinct rows, each repeated many times,
splits in those units: 3 distinct rows repeated 1,000 times each put 0, 1,000, 2,000 or 3,000
rows in test, whatever the test_fraction, without a word (a test part of none was "change
test_fraction or split_seed, or convert more rows", though more copies would not help). A test
share far from the fraction asked is now one line naming both and the distinct rows, and a side
left empty by copies an error that says so.

Example:
    >>> far_from(1_000, 3_000, 0.1), far_from(310, 3_000, 0.1)
    (True, False)
"""
from __future__ import annotations

import math
from pathlib import Path

from flowrec.data.duplicates import share

SPREAD = 4.0  # standard deviations of a split of independent rows that the test share may stray by
SLACK = 0.25  # and the share of test_fraction it may stray by, before it is said (both must be passed)
ADVICE = "give each row a value of its own (an event id or time column)"


def far_from(test: int, rows: int, fraction: float) -> bool:
    """Whether `test` of `rows` rows is farther from `fraction` than a split of independent rows
    strays (SPREAD standard deviations) and by more than SLACK of the fraction."""
    if not rows or not fraction:
        return False
    off = abs(test / rows - fraction)
    return off > SPREAD * math.sqrt(fraction * (1 - fraction) / rows) and off > SLACK * fraction


def distinct_words(distinct: int, estimate: bool) -> str:
    """'3 distinct rows', 'about 2,000 distinct rows'."""
    return f"{'about ' if estimate else ''}{distinct:,} distinct row{'' if distinct == 1 and not estimate else 's'}"


def share_line(inputs: list[Path], train: int, test: int, fraction: float, distinct: int, estimate: bool) -> str:
    """The line of a split whose test share is far from `fraction` because the rows hold few distinct ones.

    >>> share_line([Path("clicks.csv")], 2_000, 1_000, 0.1, 3, False)
    'clicks.csv: the split put 1,000 of the 3,000 rows (33.3%) in test, not about 10% (test_fraction 0.1): it draws one side for each distinct row and its copies go with it (rule 3), and the rows hold 3 distinct rows; to split closer to test_fraction, give each row a value of its own (an event id or time column)'
    """
    rows = train + test
    return (f"{', '.join(str(p) for p in inputs)}: the split put {test:,} of the {rows:,} rows ({share(test, rows)}) "
            f"in test, not about {fraction * 100:g}% (test_fraction {fraction:g}): it draws one side for each distinct "
            f"row and its copies go with it (rule 3), and the rows hold {distinct_words(distinct, estimate)}; to split "
            f"closer to test_fraction, {ADVICE}")


def empty_side_error(inputs: list[Path], side: str, rows: int, fraction: float, distinct: int,
                     estimate: bool) -> str:
    """The error of a split that left `side` (train or test) empty because its rows hold few distinct ones.

    >>> empty_side_error([Path("clicks.csv")], "test", 3_000, 0.1, 3, False)
    'no rows converted from clicks.csv into the test split: its 3,000 rows hold 3 distinct rows, and the split draws one side for each distinct row and its copies go with it (rule 3): none was drawn for test at test_fraction 0.1; give each row a value of its own (an event id or time column), or raise test_fraction or change split_seed'
    """
    drawn = "none was drawn for test" if side == "test" else "every one was drawn for test"
    change = "raise test_fraction or change split_seed" if side == "test" else "lower test_fraction or change split_seed"
    return (f"no rows converted from {', '.join(str(p) for p in inputs)} into the {side} split: its {rows:,} rows hold "
            f"{distinct_words(distinct, estimate)}, and the split draws one side for each distinct row and its copies "
            f"go with it (rule 3): {drawn} at test_fraction {fraction:g}; {ADVICE}, or {change}")
