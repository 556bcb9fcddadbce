"""Spare vocabulary rows: values a run's vocabulary has not seen take the free rows after it.

A vocabulary table with ``vocab_spare: N`` has ``vocab + 1 + N`` rows from the first run on. A
fitted vocabulary fills rows 1..(at most vocab); the rows after its last value are free. When raw
data is encoded with an existing encoder (``flowrec data convert --encoder-from RUN``), a first
pass finds the values the vocabulary does not hold, in order of first appearance (row by row in
the data's order; within a row, features in spec order, then positions in a multi-hot list),
counts them, and appends those seen at least ``min_freq`` times to the vocabulary, one free row
each, in that order. When the free rows run out, the remaining new values go to row 0 (as unknown
values do without spare rows) and are counted. The extended vocabulary starts with the old one,
so every value keeps its row: the new encoder is an *extension* of the old one
(`flowrec.data.encoder_record.first_difference` accepts it where a model may read it).

Example:
    >>> encoder, growth = grow_encoder(run_encoder, chunks)  # doctest: +SKIP
    >>> growth[0].added, growth[0].overflow_values  # doctest: +SKIP
    (212, 0)
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flowrec.data.encode import Encoder, vocab_strings
from flowrec.data.layout import is_multi
from flowrec.spec.model import TableSpec


@dataclass(frozen=True)
class TableGrowth:
    """How one table's vocabulary grew in a conversion.

    Args:
        table: table name.
        first_row: row of the first value added (the vocabulary's old length + 1).
        added: new values given a row (rows first_row .. first_row + added - 1).
        free_left: free rows left after them.
        overflow_values: new values (seen >= min_freq times) left without a row: they go to row 0.
        overflow_rows: occurrences of those values in the data.
    """

    table: str
    first_row: int
    added: int
    free_left: int
    overflow_values: int
    overflow_rows: int


def growable_tables(encoder: Encoder) -> tuple[TableSpec, ...]:
    """The vocabulary tables of the encoder's spec that reserve spare rows."""
    return tuple(t for t in encoder.spec.tables if t.vocab_spare and not t.hashed)


class NewValues:
    """Accumulates, per growable table, the values its vocabulary lacks (first appearance, count)."""

    def __init__(self, encoder: Encoder):
        self.encoder = encoder
        self.tables = growable_tables(encoder)
        self.counts: dict[str, dict[str, int]] = {t.name: {} for t in self.tables}

    def add(self, raw: pa.Table) -> None:
        """Count the unseen values of one raw chunk, in order of first appearance."""
        for table in self.tables:
            values, rows = self._unknown(table.name, raw)
            if not len(values):
                continue
            ordered = values.take(pa.array(np.argsort(rows, kind="stable")))
            counts = pc.value_counts(ordered)  # in order of first appearance
            seen = self.counts[table.name]
            for value, n in zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist()):
                seen[value] = seen.get(value, 0) + n

    def _unknown(self, table: str, raw: pa.Table) -> tuple[pa.Array, np.ndarray]:
        """Values of the table's features missing from its vocabulary, with their row index."""
        vocab = self.encoder.vocabs[table]
        parts, rows = [], []
        for f in self.encoder.spec.sparse_features:
            if f.table != table:
                continue
            values = self.encoder.sparse_values(f, raw)
            if is_multi(f):
                row = pc.list_parent_indices(values).to_numpy(zero_copy_only=False)
                flat = vocab_strings(pc.list_flatten(values), vocab)
            else:
                row, flat = np.arange(len(values)), vocab_strings(values, vocab)
            new = pc.and_(flat.is_valid(), pc.is_null(pc.index_in(flat, value_set=vocab)))
            new_np = new.to_numpy(zero_copy_only=False)
            parts.append(flat.filter(new).cast(pa.string()))
            rows.append(row[new_np])
        if not parts:
            return pa.array([], pa.string()), np.zeros(0, np.int64)
        return pa.concat_arrays(parts), np.concatenate(rows)

    def grown(self) -> tuple[Encoder, tuple[TableGrowth, ...]]:
        """The encoder with the new values appended to its vocabularies, and what each table got."""
        vocabs, report = dict(self.encoder.vocabs), []
        for table in self.tables:
            old = vocabs[table.name]
            free = table.rows - 1 - len(old)
            eligible = [v for v, n in self.counts[table.name].items() if n >= table.min_freq]
            kept, dropped = eligible[:free], eligible[free:]
            vocabs[table.name] = pa.concat_arrays([old, pa.array(kept, pa.string())])
            overflow_rows = sum(self.counts[table.name][v] for v in dropped)
            report.append(TableGrowth(table.name, len(old) + 1, len(kept), free - len(kept), len(dropped),
                                      overflow_rows))
        return replace(self.encoder, vocabs=vocabs), tuple(report)


def grow_encoder(encoder: Encoder, chunks: Iterable[pa.Table]) -> tuple[Encoder, tuple[TableGrowth, ...]]:
    """One pass over raw chunks: the encoder whose vocabularies also hold the new values.

    Args:
        encoder: an existing encoder (a run's).
        chunks: the raw data to be encoded with it, in row order.

    Returns:
        The extended encoder (the same one if no table has spare rows) and one `TableGrowth` per
        table with spare rows.
    """
    acc = NewValues(encoder)
    if not acc.tables:
        return encoder, ()
    for raw in chunks:
        acc.add(raw)
    return acc.grown()
