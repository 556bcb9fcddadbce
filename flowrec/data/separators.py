"""The separator of multi-hot values held in one string, checked against the raw data it splits.

A multi-hot or sequence feature (`max_len > 1`, or `type: sequence`) read from a text column
holds its ids in one string per row, split at the data option `sequence_sep` (default `^`, as in
Taobao's `click_sequence`). A column written with another separator (`12|55|7`, MovieLens style)
would split nowhere: every row would become one id, the whole string, and train without a word.
So a conversion whose spec does not set `sequence_sep` looks at the first chunk of each such
column: when no value holds `^` but at least `CANDIDATE_SHARE` of the values hold one of the
`CANDIDATES`, it stops with one line naming the feature, its column, the separator seen and the
option to set. Setting `sequence_sep` (to `^` as well) turns the check off: the user has said.

Example:
    >>> import pyarrow as pa
    >>> check_separator(pa.array(["9|33", "13|63|2"]), "^", "hist", "hist")
    Traceback (most recent call last):
    flowrec.data.layout.DataError: feature 'hist' (column 'hist') holds several ids per row, but no value of the first chunk holds the sequence separator '^' (the default of data option sequence_sep), while 100% hold '|' (e.g. '9|33'): set data.options.sequence_sep: '|' in the spec (or sequence_sep: '^' if each value is one id)
    >>> check_separator(pa.array(["9^33", "13"]), "^", "hist", "hist")
"""
from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from flowrec.data.layout import DataError, is_multi
from flowrec.spec.model import ModelSpec

DEFAULT_SEQUENCE_SEP = "^"  # data option sequence_sep when the spec gives none
CANDIDATES = ("|", ";", ",", " ", "\t")  # separators lists of ids are commonly written with
CANDIDATE_SHARE = 0.1  # share of values holding a candidate that makes it the column's separator


def check_sequence_separators(chunk: pa.Table, spec: ModelSpec, columns: dict[str, str],
                              options: dict, advice: str | None = None) -> None:
    """Check every multi-hot text column of `chunk` (a first chunk of raw rows) against the
    separator it will be split at, unless the options set `sequence_sep` explicitly.

    Args:
        chunk: raw rows, source column names.
        spec: the model spec (its multi-hot and sequence features).
        columns: feature -> source column (default: the feature's name).
        options: the merged data options.
        advice: what to do instead of setting the option (raw rows scored by a package, whose
            encoder's separator is fixed).

    Raises:
        DataError: a column that holds lists written with another separator (`check_separator`).
    """
    if "sequence_sep" in options:
        return
    present = set(chunk.column_names)  # (once: Arrow builds the list anew at each ask)
    for feature in spec.sparse_features:
        column = columns.get(feature.name, feature.name)
        if is_multi(feature) and column in present:
            check_separator(chunk.column(column), DEFAULT_SEQUENCE_SEP, feature.name, column, advice)


def check_separator(values: pa.Array | pa.ChunkedArray, sep: str, feature: str, column: str,
                    advice: str | None = None) -> None:
    """Raise DataError when no value of `values` holds `sep` but many hold another separator.

    Args:
        values: raw values of one multi-hot column (list and numeric columns pass: nothing to split).
        sep: the separator the values will be split at.
        feature, column: named in the message.
        advice: the message's last part (default: set data option sequence_sep in the spec).

    Raises:
        DataError: one line naming the feature, the column, the separator found and the option.
    """
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        return
    present = pc.drop_null(values)
    if len(present) == 0 or pc.any(pc.match_substring(present, sep)).as_py():
        return
    for candidate in CANDIDATES:
        holds = pc.match_substring(present, candidate)
        share = pc.sum(holds).as_py() / len(present)
        if share >= CANDIDATE_SHARE:
            example = pc.filter(present, holds)[0].as_py()
            raise DataError(
                f"feature '{feature}' (column '{column}') holds several ids per row, but no value of the "
                f"first chunk holds the sequence separator {sep!r} (the default of data option "
                f"sequence_sep), while {share:.0%} hold {candidate!r} (e.g. {example[:40]!r}): "
                + (advice or f"set data.options.sequence_sep: {candidate!r} in the spec (or sequence_sep: "
                              f"{sep!r} if each value is one id)"))


HEADER_SEPARATORS = (";", "\t", "|", ",")  # field separators a header read with another one may hold


def header_separator(names: list[str], needed: list[str], other_than: str | None = None) -> str | None:
    """The field separator (`HEADER_SEPARATORS`, not `other_than`) by which the header names `names`,
    read with another one, split into every name in `needed` (a tab-separated file read as commas:
    one column named 'a\\tb\\tc'); None where none does.

    >>> header_separator(["id;click;hour"], ["click", "hour"]), header_separator(["id", "clk"], ["click"])
    (';', None)
    """
    for sep in HEADER_SEPARATORS:
        if sep == other_than:
            continue
        split = {part.strip().strip('"') for name in names for part in str(name).split(sep)}
        if any(sep in str(name) for name in names) and set(needed) <= split:
            return sep
    return None

