"""Raw ids of managed tables: a stable 64-bit hash of each raw value, kept in the data.

A managed table's column holds no row: it holds ``hash(value)`` as int64 (pandas' SipHash with a
fixed key over the value's string form, as hashed tables use, but all 64 bits), so the data
does not depend on the table's capacity and the id-to-row map (`flowrec.data.managed`) is model
state. ``MISSING_ID`` (0) is a missing value; a value whose hash is 0 is stored as 1.

Example:
    >>> import pyarrow as pa
    >>> ids = raw_id_hashes(pa.array(["a", None, "a", "7"]))
    >>> bool(ids[0] == ids[2]), int(ids[1])
    (True, 0)
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

MISSING_ID = 0  # the raw id of a missing value


def as_strings(values: pa.Array) -> pa.Array:
    """The values as strings, empty strings as nulls; of floats, NaN as null (a missing id, as a
    Parquet dense column's NaN is a missing value: it was the id 'nan', a row of its own).

    >>> as_strings(pa.array([3.0, float("nan"), None, 2.5])).to_pylist()
    ['3', None, None, '2.5']
    """
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if not pa.types.is_string(values.type) and not pa.types.is_large_string(values.type):
        if pa.types.is_floating(values.type):  # 3.0 -> "3": floats that hold ids
            if values.type == pa.float16():  # (exact as float32; Arrow has no floor of half floats)
                values = pc.cast(values, pa.float32())
            values = pc.if_else(pc.is_nan(values), pa.scalar(None, values.type), values)
            # only where int64 holds the value: 1e20 or inf cast to int64 were all one id, INT64_MIN
            whole = pc.and_(pc.equal(values, pc.floor(values)),
                            pc.and_(pc.greater_equal(values, -2.0 ** 63), pc.less(values, 2.0 ** 63)))
            ints = pc.cast(values, pa.int64(), safe=False)
            values = pc.if_else(whole, pc.cast(ints, pa.string()), pc.cast(values, pa.string()))
        else:
            values = _text(values)
    return pc.if_else(pc.equal(values, ""), pa.scalar(None, pa.string()), values)


def check_ids(column: pa.ChunkedArray | pa.Array, name: str, multi: bool) -> None:
    """Raise DataError unless a sparse feature's raw column holds ids: plain values, or for a list
    feature (multi-hot, sequence) lists of plain values or text to split (as CSV's `a^b`); nested
    lists, structs and maps were an Arrow cast error naming no column (conversion's traceback)."""
    kind = column.type
    if multi and (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        kind = kind.value_type
    if pa.types.is_dictionary(kind):  # pandas categories: their values are the ids
        kind = kind.value_type
    if pa.types.is_nested(kind):
        from flowrec.data.layout import DataError

        wanted = "ids or lists of ids" if multi else "one id per row"
        raise DataError(f"column {name} holds {column.type}, not {wanted}")
    try:  # (no values cast: whether Arrow has text of such values at all)
        pc.cast(pa.nulls(0, kind), pa.string())
    except pa.ArrowNotImplementedError:  # an interval (pandas' DateOffset): its cast was a traceback
        from flowrec.data.layout import DataError

        raise DataError(f"column {name} holds {column.type} values, which have no text to be ids: give the ids as "
                        "integers or text") from None
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):  # bytes ids are read as UTF-8 text
        values = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        why = not_utf8(pc.list_flatten(values) if pa.types.is_nested(values.type) else values)
        if why is not None:
            from flowrec.data.layout import DataError

            raise DataError(f"column {name} {why}")


def check_float_ids(column: pa.ChunkedArray | pa.Array, name: str, rows: np.ndarray | None = None) -> None:
    """Raise DataError when an id column of floats holds one that the float may have rounded from
    another id: a finite magnitude of 2**53 or more (float32: 2**24), where not every whole number
    is a float. pandas writes a column of integers with a missing value as float64 (Parquet files
    too), which rounded 2**60 + 1 to 2**60 before flowrec saw it; such ids are not encoded as the
    float's text. Smaller floats are exact (3.0 is the id "3"); `rows`: each row's 1-based number
    in the input (else rows are named 0-based).

    >>> check_float_ids(pa.array([3.0, None, 2.5, float("inf")]), "user")
    >>> check_float_ids(pa.array([[1.0], [2.0 ** 60]]), "user")
    Traceback (most recent call last):
    ...
    flowrec.data.layout.DataError: column user: id 1152921504606846976.0 at row 1 (0-based) is a float of magnitude 2**53 or more, which float64 may have rounded from another id (pandas writes a column of integers with a missing value as float64): write the ids as integers (pandas' nullable dtype "Int64" or "UInt64" keeps every 64-bit id and its missing values) or as text
    """
    kind = column.type
    listed = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    kind = kind.value_type if listed else kind
    if not pa.types.is_floating(kind.value_type if pa.types.is_dictionary(kind) else kind):
        return  # (every chunk of every id column of a conversion comes here: no copy before the type says)
    whole = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    values = pc.list_flatten(whole) if listed else whole
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if not len(values):
        return
    x = values.fill_null(0).to_numpy(zero_copy_only=False)
    bits = np.finfo(x.dtype).nmant + 1  # every whole number below 2**bits is exact (float64 53, float32 24)
    with np.errstate(invalid="ignore"):
        bad = np.flatnonzero(np.isfinite(x) & (np.abs(x) >= 2.0 ** bits))
    if not len(bad):
        return
    i = int(bad[0])
    row = int(pc.list_parent_indices(whole).to_numpy()[i]) if listed else i
    where = f"row {row} (0-based)" if rows is None else f"row {int(rows[row])} (1-based)"
    from flowrec.data.layout import DataError

    raise DataError(f"column {name}: id {float(x[i]):.1f} at {where} is a float of magnitude 2**{bits} or more, "
                    f"which {x.dtype} may have rounded from another id (pandas writes a column of integers "
                    f"with a missing value as float64): write the ids as integers (pandas' nullable dtype "
                    f"\"Int64\" or \"UInt64\" keeps every 64-bit id and its missing values) or as text")


def _text(values: pa.Array) -> pa.Array:
    """Ids as text; bytes that are not UTF-8 (a binary column) are a DataError naming the first."""
    try:
        return pc.cast(values, pa.string())
    except pa.ArrowInvalid:
        why = not_utf8(values)
        if why is None:
            raise
        from flowrec.data.layout import DataError

        raise DataError(f"an id column {why}") from None


def not_utf8(values: pa.Array) -> str | None:
    """What is wrong with a binary column of ids whose bytes are not all UTF-8 text (None if they
    are, or it holds no bytes): ids are read as text."""
    if not (pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type)):
        return None
    try:
        pc.cast(values, pa.string())  # Arrow's own check; the rows are walked only to name a bad one
        return None
    except pa.ArrowInvalid:
        pass
    for row, value in enumerate(values.to_pylist()):
        try:
            value is None or value.decode("utf-8")
        except UnicodeDecodeError:
            return (f"holds bytes that are not UTF-8 text ({value[:16]!r} at row {row}, 0-based): ids are "
                    f"text or integers; decode the bytes (or write them as hex) first")
    return None


def value_hashes(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """The 64-bit hash of each distinct string form of `values` (pandas' SipHash, fixed key), and
    each value's index into them (-1: null or ""): hashed tables' rows and managed tables' raw ids
    both come from it.  # (U,) uint64, (n,) int64"""
    strings = as_strings(values).dictionary_encode()
    uniques = strings.dictionary.to_numpy(zero_copy_only=False).astype(object)
    return pd.util.hash_array(uniques, categorize=False), strings.indices.fill_null(-1).to_numpy(zero_copy_only=False)


def raw_id_hashes(values: pa.Array) -> np.ndarray:
    """Stable 64-bit hash of each value's string form; nulls and "" -> MISSING_ID.  # (N,) int64"""
    hashed, index = value_hashes(values)
    table = hashed.view(np.int64)
    table = np.where(table == MISSING_ID, 1, table)
    out = np.full(len(index), MISSING_ID, np.int64)
    valid = index >= 0
    out[valid] = table[index[valid]]
    return out

