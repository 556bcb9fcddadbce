"""Exact duplicate rows of a raw input: a 64-bit hash of each row's values, and the count of rows
that copy an earlier one.

A file joined to itself (`cat a.csv a.csv > b.csv`) was converted without a word, and a seeded
train/test split drew each copy's side apart from its row's: the same rows in train and test, a
test AUC of rows the model trained on. `row_hashes` gives each row a hash of all its values (the
line column aside), the same whatever the chunking, the process or the machine, so the seeded split
can draw a row's side from it (`flowrec.data.convert.split_by_hash`: copies land on one side), and
`Duplicates` counts the copies over a conversion in bounded memory: every row's hash while they
fit in `KEPT_HASHES`, then the rows of a shrinking share of hash values (copies share their hash,
so the share's count, scaled, estimates the whole). The copies are kept, and said in one line with
their share of the rows: a click log of (user, item, label) repeats rows that are events of their own.

Example:
    >>> import pyarrow as pa
    >>> t = pa.table({"user": ["a", "b", "a"], "price": [1.5, 2.0, 1.5]})
    >>> h = row_hashes(t)
    >>> bool(h[0] == h[2]), bool(h[0] == h[1])
    (True, False)
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

LINE_COLUMN = "__line__"  # the readers' line of each row (`flowrec.data.sources.LINE_COLUMN`): no value of the row
KEPT_HASHES = 1 << 18  # rows' records held to count copies (56 bytes each; about 60 MB at the most with the merge's
# copies: 1 << 20 held 246 MB); beyond, a share of hash values
JOIN_ROWS = 1024  # rows of a chunk below which `row_hashes` joins the columns of a type into one array
GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment: spreads the column position and null marks
POLY = 0x100000001B3  # FNV's 64-bit prime: odd, so invertible modulo 2^64 (a string's hash of its own bytes)
MASK64 = (1 << 64) - 1
NULL_MARK = np.uint64(0x6A09E667F3BCC909)  # a missing value's hash (not an empty string's, not 0's)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's output function (a bijection of uint64 that spreads every input bit)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def row_hashes(table: pa.Table) -> np.ndarray:
    """A 64-bit hash of each row of `table` over its columns in order (`LINE_COLUMN` aside): equal
    rows hash alike in any chunk; a missing value, an empty string and 0 differ. A row's hash is the sum of
    its values' hashes mixed with their columns' places; a chunk of few rows hashes the columns of one
    plain type as one array (one row of 100,000 columns took 12 s as 100,000 rounds of Arrow calls,
    0.6 s so), a chunk of many rows column by column (faster there).  # (n,) uint64"""
    n = table.num_rows
    if n == 0:
        return np.zeros(0, np.uint64)
    by_type: dict[pa.DataType, list[tuple[int, pa.ChunkedArray]]] = {}
    for place, name in enumerate(table.column_names):
        if name != LINE_COLUMN:
            column = table.column(name)
            by_type.setdefault(column.type, []).append((place, column))
    total = np.zeros(n, np.uint64)
    with np.errstate(over="ignore"):
        for kind, columns in by_type.items():
            places = np.array([place + 1 for place, _ in columns], np.uint64)[:, None] * GOLDEN  # (k, 1)
            if len(columns) > 1 and n < JOIN_ROWS and _plain(kind):  # a value's hash is its own either way
                joined = pa.concat_arrays([chunk for _, column in columns for chunk in column.chunks])
                hashes = column_hashes(joined).reshape(len(columns), n)  # (k, n): a column's rows in a row
                total += mix64(hashes + places).sum(axis=0, dtype=np.uint64)
                continue
            for (_, column), place in zip(columns, places[:, 0]):
                total += mix64(column_hashes(column) + place)
        return mix64(total + GOLDEN)


def _plain(kind: pa.DataType) -> bool:
    """A type whose columns `row_hashes` joins into one array: numbers, booleans, times and text."""
    return (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
            or pa.types.is_temporal(kind) or pa.types.is_string(kind) or pa.types.is_binary(kind)
            or pa.types.is_large_string(kind) or pa.types.is_large_binary(kind))


def column_hashes(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A 64-bit hash of each value of an Arrow column: numbers by their float64 or int64 bits, text
    and bytes by their bytes, other values (lists, structs) by their text form.  # (n,) uint64"""
    values = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    kind = values.type
    if pa.types.is_dictionary(kind):
        values = values.dictionary_decode()
        kind = values.type
    if pa.types.is_null(kind):
        return np.full(len(values), NULL_MARK, np.uint64)
    if pa.types.is_floating(kind) or pa.types.is_decimal(kind):
        bits = pc.cast(values, pa.float64(), safe=False).fill_null(0.0).to_numpy(zero_copy_only=False)
        bits = np.where(bits == 0.0, 0.0, bits).view(np.uint64)  # -0.0 is 0.0
    elif pa.types.is_integer(kind) or pa.types.is_boolean(kind) or pa.types.is_temporal(kind):
        bits = pc.cast(values, pa.int64(), safe=False).fill_null(0).to_numpy(zero_copy_only=False).view(np.uint64)
    else:
        if not (pa.types.is_string(kind) or pa.types.is_binary(kind) or pa.types.is_large_string(kind)
                or pa.types.is_large_binary(kind)):
            values = value_texts(values)
        encoded = pc.dictionary_encode(values)  # each distinct value hashed once (Arrow's own hash table finds them)
        distinct = _bytes_hashes(pc.cast(encoded.dictionary, pa.large_binary()))
        bits = distinct[encoded.indices.fill_null(0).to_numpy(zero_copy_only=False)] if len(distinct) else \
            np.zeros(len(values), np.uint64)
    if values.null_count == 0:
        return bits
    return np.where(values.is_valid().to_numpy(zero_copy_only=False), bits, NULL_MARK)  # `row_hashes` mixes them


def value_texts(values: pa.Array) -> pa.Array:
    """Each value's Python text form, `repr` of what `to_pylist` gives (None where missing), as a large
    string array: the text `column_hashes` hashes for a value of no plain type. Lists of integers and of
    plain ASCII text (most multi-hot columns) are written by Arrow's own kernels, with the same bytes;
    a list holding other text, and every other type, by Python, row by row (2.8 s a 200,000-row
    column of lists did so, all of it).  # (n,) large_string"""
    texts = _list_texts(values)
    if texts is None:
        return pa.array([None if v is None else repr(v) for v in values.to_pylist()], pa.large_string())
    return texts


SAFE_TEXT = r"^[\x20-\x26\x28-\x5b\x5d-\x7e]*$"  # printable ASCII less ' and \: `repr` quotes it as it is


def _list_texts(values: pa.Array) -> pa.Array | None:
    """`value_texts` of a list array of integers or text by Arrow's kernels; None for any other type.
    A list's text is "[" + its items' texts joined by ", " + "]": an integer's decimal digits, a text's
    between single quotes; rows holding text `repr` would escape or quote otherwise are written by
    Python."""
    kind = values.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        return None
    item = kind.value_type
    texty = pa.types.is_string(item) or pa.types.is_large_string(item)
    if not (pa.types.is_integer(item) or texty):
        return None
    items = pc.cast(values.flatten(), pa.large_string())  # the items of the rows in view (a missing row's none)
    lengths = pc.fill_null(pc.list_value_length(values), 0).to_numpy(zero_copy_only=False)
    odd_rows = None
    if texty:
        odd = pc.invert(pc.fill_null(pc.match_substring_regex(items, SAFE_TEXT), True))
        if pc.any(odd).as_py():
            parents = np.repeat(np.arange(len(values)), lengths)
            odd_rows = np.unique(parents[odd.to_numpy(zero_copy_only=False)])
        items = pc.binary_join_element_wise(_text("'"), items, _text("'"), _text(""))
    items = pc.fill_null(items, "None")
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    joined = pc.binary_join(pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), items), _text(", "))
    texts = pc.binary_join_element_wise(_text("["), joined, _text("]"), _text(""))
    if values.null_count:
        texts = pc.if_else(values.is_valid(), texts, pa.scalar(None, pa.large_string()))
    if odd_rows is not None:
        mask = np.zeros(len(values), bool)
        mask[odd_rows] = True
        written = [repr(values[int(row)].as_py()) for row in odd_rows]
        texts = pc.replace_with_mask(texts, pa.array(mask), pa.array(written, pa.large_string()))
    return texts


def _text(text: str) -> pa.Scalar:
    return pa.scalar(text, pa.large_string())


def _bytes_hashes(values: pa.Array) -> np.ndarray:
    """The polynomial hash (base `POLY`, modulo 2^64) of each value's bytes plus its length, from the
    array's data buffer: no Python object per value.  # (n,) uint64"""
    n = len(values)
    _, offsets_buffer, data_buffer = values.buffers()
    offsets = np.frombuffer(offsets_buffer, np.int64)[values.offset:values.offset + n + 1]
    lengths = np.diff(offsets)
    with np.errstate(over="ignore"):
        out = lengths.astype(np.uint64) * GOLDEN
        if n == 0 or offsets[-1] == offsets[0]:
            return out
        data = np.frombuffer(data_buffer, np.uint8)[offsets[0]:offsets[-1]]
        place = np.arange(len(data), dtype=np.int64) - np.repeat(offsets[:-1] - offsets[0], lengths)  # byte k of its value
        weighted = data * _powers(POLY, int(lengths.max()))[place]
        filled = lengths > 0
        out[filled] += np.add.reduceat(weighted, (offsets[:-1] - offsets[0])[filled])
    return out


def _powers(base: int, n: int) -> np.ndarray:
    """base^0 .. base^(n-1) modulo 2^64.  # (n,) uint64"""
    out = np.full(n, base & MASK64, np.uint64)
    out[0] = 1
    with np.errstate(over="ignore"):
        return np.cumprod(out, dtype=np.uint64)


MAX = np.iinfo(np.int64).max  # no place: a row without a copy
FIELDS = ("hashes", "order", "file", "line", "copies", "copy_order", "copy_file", "copy_line")


class Duplicates:
    """Counts the rows of a conversion's input that are exact copies of an earlier row.

    `observe` each chunk's hashes (`row_hashes`) and where its rows are (input file, line); `line`
    then says how many rows copy an earlier one and where the first copy is. Memory is bounded:
    one record per hash value (its first row, its copies' count, its first copy), and beyond
    `limit` of them only hash values below a falling bound are kept, the count scaled (said as
    about so many).
    """

    def __init__(self, limit: int = KEPT_HASHES) -> None:
        self.limit = limit
        self.shift = 0  # hash values kept: those below 2^(64 - shift)
        self.rows = 0
        self.files: list[str] = []
        self._pending: list[dict[str, np.ndarray]] = []
        self._held = 0
        self._kept = _records(np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.int32),
                              np.zeros(0, np.int64))

    def observe(self, file: str, hashes: np.ndarray, lines: np.ndarray) -> None:
        """Take in a chunk's rows: their hashes (`row_hashes`) and lines in `file`."""
        if file not in self.files:
            self.files.append(file)
        order = np.arange(self.rows, self.rows + len(hashes), dtype=np.int64)
        self.rows += len(hashes)
        kept = self._within(hashes)
        self._pending.append(_records(hashes[kept], order[kept], np.full(int(kept.sum()), self.files.index(file),
                                                                         np.int32), lines[kept].astype(np.int64)))
        self._held += int(kept.sum())
        if self._held > self.limit:
            self._compact()

    def _within(self, hashes: np.ndarray) -> np.ndarray:
        if self.shift == 0:
            return np.ones(len(hashes), bool)
        return (hashes >> np.uint64(64 - self.shift)) == 0

    def _compact(self) -> None:
        """One record per hash value (its first row, its copies, its first copy); while more than half
        the limit are held, the hash values of the upper half are let go."""
        every = {f: np.concatenate([self._kept[f], *(p[f] for p in self._pending)]) for f in FIELDS}
        self._pending = []
        by = np.lexsort((every["order"], every["hashes"]))  # by hash, then by place: a group's first row leads
        every = {f: v[by] for f, v in every.items()}
        lead = np.ones(len(by), bool)
        lead[1:] = every["hashes"][1:] != every["hashes"][:-1]
        starts = np.flatnonzero(lead)
        group = np.cumsum(lead) - 1
        copies = np.add.reduceat(every["copies"] + ~lead, starts) if len(starts) else every["copies"][:0]
        # a group's first copy: its record's own (a lead's), or the first of its later rows
        candidate = np.where(lead, every["copy_order"], every["order"])
        ranked = np.lexsort((candidate, group))  # by group, then by place
        pick = ranked[np.searchsorted(group[ranked], np.arange(len(starts)))]
        kept = {f: every[f][starts] for f in ("hashes", "order", "file", "line")}
        kept["copies"] = copies.astype(np.int64)
        kept["copy_order"] = candidate[pick]
        kept["copy_file"] = np.where(lead[pick], every["copy_file"][pick], every["file"][pick])
        kept["copy_line"] = np.where(lead[pick], every["copy_line"][pick], every["line"][pick])
        while len(kept["hashes"]) > self.limit // 2:
            self.shift += 1
            inside = self._within(kept["hashes"])
            kept = {f: v[inside] for f, v in kept.items()}
        self._kept = kept
        self._held = len(kept["hashes"])

    def count(self) -> tuple[int, bool]:
        """(rows that copy an earlier row, whether that is an estimate from a share of hash values)."""
        self._compact()
        return int(self._kept["copies"].sum()) << self.shift, self.shift > 0

    def example(self) -> tuple[tuple[str, int], tuple[str, int]] | None:
        """((file, line) of the first copy kept, (file, line) of the row it copies), or None."""
        self._compact()
        k = self._kept
        if not len(k["hashes"]) or k["copy_order"].min() == MAX:
            return None
        i = int(np.argmin(k["copy_order"]))
        return ((self.files[int(k["copy_file"][i])], int(k["copy_line"][i])),
                (self.files[int(k["file"][i])], int(k["line"][i])))

    def line(self, unit: str = "line", split: bool = False) -> str | None:
        """One line: how many rows repeat an earlier one, their share of the rows read and the first
        such copy; None when none does. Repeats are kept (a click log's equal rows are events of
        their own), so the line tells what was found, not a fault. `unit`: what a place is called
        (line, or row for Parquet); `split`: the conversion splits the rows into train and test by
        their values (say that copies share their row's side)."""
        count, estimate = self.count()
        example = self.example()
        if not count or example is None:
            return None
        (copy_file, copy_line), (row_file, row_line) = example
        of = "" if copy_file == row_file else f" of {row_file}"
        about = "about " if estimate else ""
        rows = f"{about}{count:,} rows" if estimate or count > 1 else "1 row"
        return (f"{copy_file}: {rows} ({about}{share(count, self.rows)} of the {self.rows:,} rows read) "
                f"{'repeats' if count == 1 and not estimate else 'repeat'} an earlier row in every column (first: "
                f"{unit} {copy_line} repeats {unit} {row_line}{of}); all kept, each a row of its own (as a click "
                "log's repeated events are)" + ("; the split keeps a row's copies on its side, so none is in both "
                                                "train and test" if split else "")
                + "; if they are copies made by mistake (a file joined to itself), remove them to train on each "
                  "row once")


def share(part: int, whole: int) -> str:
    """`part` of `whole` as a percentage that is never 0% or 100% unless exactly so.

    >>> share(1, 3), share(1, 100_000), share(99_999, 100_000), share(0, 5)
    ('33.3%', 'under 0.1%', 'over 99.9%', '0%')
    """
    if not part or part >= whole:
        return "0%" if not part else "100%"
    if part / whole < 0.001:
        return "under 0.1%"
    if part / whole > 0.999:
        return "over 99.9%"
    return f"{part / whole:.1%}"


def _records(hashes: np.ndarray, order: np.ndarray, file: np.ndarray, line: np.ndarray) -> dict[str, np.ndarray]:
    """Records of rows not yet merged: no copies, no first copy."""
    n = len(hashes)
    return {"hashes": hashes, "order": order, "file": file, "line": line, "copies": np.zeros(n, np.int64),
            "copy_order": np.full(n, MAX, np.int64), "copy_file": np.zeros(n, np.int32),
            "copy_line": np.zeros(n, np.int64)}
