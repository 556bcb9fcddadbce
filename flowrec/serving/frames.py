"""A pandas DataFrame of raw rows as an Arrow table, as `pa.Table.from_pandas` reads it, faster for wide frames.

`pa.Table.from_pandas` makes a Series of every column and a metadata entry for it: 80 to 160 ms for
the one-row frame of a 1,000-field model, whatever its rows. For a frame of a few rows (up to
`FEW_ROWS`: online scoring) the columns of plain numpy numbers and bools (most of a wide model's)
are read here a block of one dtype at a time, each column an Arrow array of its values (NaN a
null, as `from_pandas` reads it); the other columns (text, pandas' nullable and categorical dtypes,
times) go through `pa.Table.from_pandas` together, as before. The table equals `from_pandas`'s but
for the pandas metadata of its schema, which nothing that scores reads. A larger frame is read by
`from_pandas` alone: its columns' overhead is small beside their values, which it reads without
the copies made here.

Example:
    >>> table = frame_table(pd.DataFrame({"user": [3, 5], "price": [1.5, np.nan], "city": ["a", None]}))
    >>> table.column_names, table.column("price").null_count, table.schema.field("user").type
    (['user', 'price', 'city'], 1, DataType(int64))
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

PLAIN_KINDS = "iufb"  # numpy dtype kinds read column by column: signed and unsigned ints, floats, bools
FEW_ROWS = 1024  # rows of a frame read column by column at most (each value made a Python object here)


def frame_table(frame: pd.DataFrame) -> pa.Table:
    """`frame` (columns named by text, none twice) as an Arrow table of its columns in order.

    Raises:
        What `pa.Table.from_pandas` raises for the columns it reads (text mixed with numbers, ...).
    """
    names = list(frame.columns)
    groups: dict[np.dtype, list[int]] = {}
    others = []
    for i, kind in enumerate(frame.dtypes):
        if isinstance(kind, np.dtype) and kind.kind in PLAIN_KINDS and kind != np.float16:
            groups.setdefault(kind, []).append(i)
        else:
            others.append(i)
    if len(frame) > FEW_ROWS or not groups or not all(type(name) is str for name in names):
        return pa.Table.from_pandas(frame, preserve_index=False)  # (it names columns of other names its way)
    # every value as a Python object (exact: ints, floats and bools are), in one pass over the frame's
    # blocks: taking a dtype's columns (iloc) from read_csv's frame, a block per column, took 23 ms
    values = frame.to_numpy(dtype=object)  # (rows, columns)
    arrays: list[pa.Array | pa.ChunkedArray | None] = [None] * len(names)
    for kind, columns in groups.items():
        block = np.ascontiguousarray(values[:, columns].T).astype(kind)  # (columns, rows), the column's dtype
        for j, i in enumerate(columns):
            arrays[i] = pa.array(block[j], from_pandas=True)
    if others:
        rest = pa.Table.from_pandas(frame.iloc[:, others], preserve_index=False)
        for j, i in enumerate(others):
            arrays[i] = rest.column(j)
    return pa.table(arrays, names=names)
