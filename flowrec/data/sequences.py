"""Next-item examples from time-ordered interactions (SASRec-style data), and leave-last-out.

With the MovieLens reader's option ``sequence: {max_len: L}`` each user's ratings are ordered by
time (ties: file order) and every rating after the user's first becomes one next-item example:
``item_id`` is the item rated at step t (the target) and ``history`` the items of the user's up
to L previous ratings, oldest first (a list column for a ``type: sequence`` feature with
``pooling: none``). The user's first rating has no history and is no example. Every other column
(user fields, rating, timestamp, item fields of the target) is the target rating's.

``split: leave_last_out`` (a data option, with a reader that builds sequences) puts each user's
last example, their most recent rating with its history, into ``test/`` and the rest into
``train/`` (the SASRec protocol without its validation item). `TEST_COLUMN` carries the marker
from the reader to the conversion.

Example:
    >>> import pandas as pd
    >>> df = pd.DataFrame({"user_id": [1, 1, 1], "item_id": [5, 6, 7], "timestamp": [3, 1, 2]})
    >>> out = next_item_rows(df, max_len=1)
    >>> out["history"].tolist(), out["item_id"].tolist(), out[TEST_COLUMN].tolist()
    ([[6], [7]], [7, 5], [False, True])
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from flowrec.data.layout import DataError
from flowrec.spec.model import HISTORY_COLUMN, FrozenMapping

TEST_COLUMN = "__test__"  # bool: the row is its user's last example (leave-last-out)
SPLITS = ("leave_last_out",)
MAX_HISTORY = 10_000


def sequence_length(options: dict[str, Any]) -> int | None:
    """L of ``options["sequence"] = {max_len: L}`` (None without the option).

    Raises:
        DataError: a malformed option (one line).
    """
    seq = options.get("sequence")
    if seq is None:
        return None
    if isinstance(seq, FrozenMapping):
        seq = dict(seq)  # a spec's options hold nested mappings frozen
    if not isinstance(seq, dict) or set(seq) != {"max_len"}:
        raise DataError(f"data option sequence must be {{max_len: L}} (got {seq!r})")
    n = seq["max_len"]
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_HISTORY:
        raise DataError(f"data option sequence.max_len must be an integer 1 .. {MAX_HISTORY:,} (got {n!r})")
    return n


def split_option(options: dict[str, Any]) -> str | None:
    """The ``split`` data option (None without it).

    Raises:
        DataError: an unknown split, or one combined with test_fraction / split_by (one line).
    """
    split = options.get("split")
    if split is None:
        return None
    if split not in SPLITS:
        raise DataError(f"unknown data option split {split!r}; known: {', '.join(SPLITS)}")
    clash = [k for k in ("test_fraction", "split_by") if options.get(k)]
    if clash:
        raise DataError(f"data option split: {split} cannot be combined with {clash[0]}")
    return split


def next_item_rows(df: pd.DataFrame, max_len: int, user: str = "user_id", item: str = "item_id",
                   time: str = "timestamp") -> pd.DataFrame:
    """One row per rating after each user's first: the rating's columns, ``history`` (the up to
    `max_len` previous items, oldest first) and `TEST_COLUMN` (the user's last rating)."""
    order = np.lexsort((np.arange(len(df)), df[time].to_numpy(), df[user].to_numpy()))
    df = df.iloc[order].reset_index(drop=True)
    users, items = df[user].to_numpy(), df[item].to_numpy()
    first = np.ones(len(df), bool)
    first[1:] = users[1:] != users[:-1]
    starts = np.maximum.accumulate(np.where(first, np.arange(len(df)), 0))
    histories = [items[max(s, i - max_len):i].tolist() for i, s in enumerate(starts)]
    last = np.ones(len(df), bool)
    last[:-1] = users[:-1] != users[1:]
    df[HISTORY_COLUMN] = histories
    df[TEST_COLUMN] = last
    return df[~first].reset_index(drop=True)
