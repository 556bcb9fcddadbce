"""Synthetic data for any spec: Zipf-skewed ids, multi-hot lengths, dense values, learnable labels.

Every sparse feature draws ranks from a Zipf law (exponent `alpha`, default 1.1: a few rows take
most accesses) over its table's rows 1..R-1; a per-table affine bijection of the ranks places the
hot rows at random-looking rows (not just the low ids). Labels come from a hidden model: every
(table, row) has a hidden weight (a hash of the row: no storage, any table size), dense features
have hidden weights, and ``label ~ Bernoulli(sigmoid(logit))``, so a model can learn AUC well above
0.5. Rows are generated in fixed blocks seeded by (seed, block): the data is identical for a seed
whatever the partitioning. Output: the encoded layout (`flowrec.data.layout`).

Example:
    >>> table = synth_table(spec, rows=1000, seed=0)  # doctest: +SKIP
    >>> table.num_rows  # doctest: +SKIP
    1000
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

from flowrec.data.convert import PartWriter, check_rows_per_file
from flowrec.data.layout import DataError, DatasetMeta, data_hash, encoded_rows, is_multi, unique_labels, write_meta
from flowrec.data.raw_ids import MISSING_ID
from flowrec.data.output import staged_output
from flowrec.spec.model import DenseFeature, ModelSpec, SparseFeature, TableSpec
from flowrec.spec.tasks import TASKS

BLOCK_ROWS = 1 << 16  # rows per seeded generation block
ZIPF_ALPHA = 1.1  # default skew, near real CTR data
LOGIT_SCALE = 2.5  # spread of the hidden logits (higher: more learnable)
LOGIT_BIAS = -1.0  # hidden bias: about a 30% positive rate
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MANAGED_SPACE = 2  # a managed table's synthetic ids: this many distinct values per row of capacity


@dataclass(frozen=True)
class SynthConfig:
    """Settings of the generator.

    Args:
        seed: base seed; the data is a function of (spec, seed, alpha).
        alpha: Zipf exponent of the id distribution.
        dense_weight: share of the hidden logit coming from the dense features.
    """

    seed: int = 0
    alpha: float = ZIPF_ALPHA
    dense_weight: float = 0.3


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a bijective scramble of uint64 values."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _salt(name: str, seed: int) -> np.uint64:
    h = np.frombuffer(name.encode()[:64].ljust(8, b"\0"), np.uint8).astype(np.uint64)
    with np.errstate(over="ignore"):
        acc = np.uint64(seed) * GOLDEN
        for b in h:
            acc = _mix(np.asarray(acc ^ b) + GOLDEN)
    return np.uint64(acc)


def zipf_ranks(rng: np.random.Generator, n: int, size: int, alpha: float) -> np.ndarray:
    """Ranks in 0..n-1 with P(k) ~ (k+1)^-alpha (inverse CDF of the continuous law)."""
    u = rng.random(size)
    if abs(alpha - 1.0) < 1e-9:
        k = np.exp(u * np.log(n + 1.0))
    else:
        e = 1.0 - alpha
        with np.errstate(over="ignore", invalid="ignore"):  # a steep negative alpha overflows to inf
            k = (u * (np.float64(n + 1.0) ** e - 1.0) + 1.0) ** (1.0 / e)
        k = np.where(np.isnan(k), 1.0, k)  # u == 0 under that overflow (0 * inf): rank 0, as the law says
    return np.minimum(k, float(n)).astype(np.int64) - 1  # clipped before the cast (inf cast to garbage)


def rank_to_row(ranks: np.ndarray, rows: int, salt: np.uint64) -> np.ndarray:
    """Affine bijection of ranks 0..rows-2 onto rows 1..rows-1 (hot rows scattered); always < rows."""
    n = rows - 1
    if n <= 1:
        return np.full_like(ranks, max(n, 0))
    a = int(salt % np.uint64(n)) | 1
    while np.gcd(a, n) != 1:
        a += 2
    b = int((salt >> np.uint64(20)) % np.uint64(n))
    return (ranks * a + b) % n + 1 if n < (1 << 31) else (
        (ranks.astype(object) * a + b) % n + 1).astype(np.int64)


def hidden_weight(rows: np.ndarray, salt: np.uint64) -> np.ndarray:
    """The hidden model's weight of each (table, row): uniform in [-1, 1), from a hash."""
    h = _mix(rows.astype(np.uint64) ^ salt)
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 52) - 1.0


def _stored(ids: np.ndarray, table: TableSpec) -> np.ndarray:
    """The column values of drawn ids: rows, or for a managed table raw ids (a bijective 64-bit
    scramble of the drawn ids by the table's name alone, so a value keeps its raw id whatever
    the seed: data synthesised with other seeds are other days of the same users, never
    MISSING_ID)."""
    if table.managed is None:
        return ids
    raw = _mix(ids.astype(np.uint64) ^ _salt(table.name, 0)).view(np.int64)
    return np.where(raw == MISSING_ID, 1, raw)


def _block(spec: ModelSpec, cfg: SynthConfig, block: int, n: int) -> pa.Table:
    rng = np.random.default_rng([cfg.seed, block])
    logit = np.zeros(n)
    n_sparse = max(len(spec.sparse_features), 1)
    cols: dict[str, pa.Array] = {}
    for f in spec.features:
        if isinstance(f, DenseFeature):
            x = _dense(f, rng, n)
            logit += cfg.dense_weight * hidden_weight(np.array([0]), _salt(f.name, cfg.seed))[0] * (
                x - x.mean()) / (x.std() + 1e-6) / np.sqrt(max(len(spec.dense_features), 1))
            cols[f.name] = pa.array(x.astype(np.float32))
            continue
        table = spec.table(f.table)
        salt = _salt(table.name, cfg.seed)
        space = table.rows if table.managed is None else MANAGED_SPACE * table.rows + 1
        if is_multi(f):
            lengths = rng.integers(0, f.max_len + 1, n)
            ids = rank_to_row(zipf_ranks(rng, space - 1, int(lengths.sum()), cfg.alpha), space, salt)
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            w = np.add.reduceat(np.append(hidden_weight(ids, salt), 0.0), offsets[:-1])
            w = np.where(lengths > 0, w / np.maximum(lengths, 1), 0.0)
            cols[f.name] = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(_stored(ids, table)))
        else:
            ids = rank_to_row(zipf_ranks(rng, space - 1, n, cfg.alpha), space, salt)
            w = hidden_weight(ids, salt)
            cols[f.name] = pa.array(_stored(ids, table))
        logit += (1.0 - cfg.dense_weight) * w * np.sqrt(3.0 / n_sparse)
    logit = LOGIT_SCALE * logit + LOGIT_BIAS
    tasks = {h.label or (spec.data.label if spec.data else "label"): h.task for h in spec.heads}
    classes = {h.label or (spec.data.label if spec.data else "label"): h.width for h in spec.heads}
    for label in unique_labels(spec):
        cols[label] = pa.array(_label(tasks.get(label), classes.get(label, 1), logit, rng))
    return pa.table(cols)


def _label(task: str | None, classes: int, logit: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A label column of `task` following the hidden logit (None: a sample-weight column, > 0)."""
    if task is None:
        return rng.uniform(0.25, 2.0, len(logit)).astype(np.float32)
    return SYNTH_LABELS[TASKS[task].labels](logit, classes, rng).astype(np.float32)


def _binary(logit: np.ndarray, classes: int, rng: np.random.Generator) -> np.ndarray:
    return rng.random(len(logit)) < 1.0 / (1.0 + np.exp(-logit))


def _finite(logit: np.ndarray, classes: int, rng: np.random.Generator) -> np.ndarray:
    return logit + 0.1 * rng.standard_normal(len(logit))


def _class(logit: np.ndarray, classes: int, rng: np.random.Generator) -> np.ndarray:
    """The quantile band of the noisy logit: class 0 .. classes - 1."""
    edges = np.quantile(logit, np.linspace(0, 1, classes + 1)[1:-1])
    return np.searchsorted(edges, logit + 0.5 * np.std(logit) * rng.standard_normal(len(logit)))


SYNTH_LABELS = {"binary": _binary, "finite": _finite, "class": _class}  # by `TaskInfo.labels`


def _dense(f: DenseFeature, rng: np.random.Generator, n: int) -> np.ndarray:
    if f.transform == "log1p":
        return np.log1p(rng.exponential(5.0, n))
    return rng.standard_normal(n)


def synth_blocks(spec: ModelSpec, rows: int, cfg: SynthConfig = SynthConfig()):
    """Yield the encoded tables of consecutive generation blocks (BLOCK_ROWS rows each)."""
    for block, start in enumerate(range(0, rows, BLOCK_ROWS)):
        yield _block(spec, cfg, block, min(BLOCK_ROWS, rows - start))


def synth_table(spec: ModelSpec, rows: int, cfg: SynthConfig = SynthConfig()) -> pa.Table:
    """`rows` synthetic encoded rows as one table."""
    return pa.concat_tables(list(synth_blocks(spec, rows, cfg))).combine_chunks()


def synth_dataset(spec: ModelSpec, out: Path, rows: int, cfg: SynthConfig = SynthConfig(),
                  rows_per_file: int = 1 << 18, overwrite: bool = False,
                  status: Callable[[str], None] | None = None) -> DatasetMeta:
    """Write `rows` synthetic rows as a partitioned encoded Parquet dataset in `out`.

    Written into a new sibling folder and swapped in when complete (`flowrec.data.output`).

    Raises:
        DataError: `rows` or `rows_per_file` < 1, a non-finite `cfg.alpha`, a seed outside
            [0, 2^64), or `out` is not empty
            and not `overwrite`.
    """
    if rows < 1:
        raise DataError(f"--rows must be at least 1 (got {rows})")
    if not np.isfinite(cfg.alpha):  # NaN drew one row for every id, inf rank 0 for every id
        raise DataError(f"--alpha must be a finite number (the Zipf exponent of the ids), not {cfg.alpha}")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, (int, np.integer)) or not 0 <= cfg.seed < 1 << 64:
        # the blocks' generators take no negative seed, the salts no seed past uint64 (a traceback)
        raise DataError(f"--seed must be an integer from 0 to 2^64-1, not {cfg.seed!r}")
    check_rows_per_file(rows_per_file)
    check_disk_room(spec, Path(out), rows)
    with staged_output(Path(out), overwrite, status=status) as tmp:  # status: a wait for readers of `out`
        return _write(spec, tmp, rows, cfg, rows_per_file)


def least_disk_bytes(spec: ModelSpec, rows: int) -> int:
    """The fewest bytes `rows` synthetic rows can take on disk: a bit for each of a row's values
    (its dense values, labels and at least one id of each sparse feature), Parquet's best case for
    ids of a tiny vocabulary; real rows take 10 to 100 times more."""
    values = len(spec.dense_features) + len(spec.heads) + len(spec.sparse_features)
    return rows * max(values, 1) // 8


def check_disk_room(spec: ModelSpec, out: Path, rows: int) -> None:
    """DataError when even `least_disk_bytes` of the rows is more than the free space where `out`
    is written: `data synth --rows 10**18` wrote until the disk was full, for hours."""
    import shutil

    from flowrec.spec.units import format_bytes

    folder = next((p for p in Path(out).absolute().parents if p.is_dir()), None)
    if folder is None:
        return
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    need = least_disk_bytes(spec, rows)
    if need > free:
        raise DataError(f"--rows {rows:,} synthetic rows take at least {format_bytes(need)} on disk, more than the "
                        f"{format_bytes(free)} free in {folder}: give fewer --rows, or --out on a larger disk")


def _write(spec: ModelSpec, out: Path, rows: int, cfg: SynthConfig, rows_per_file: int) -> DatasetMeta:
    writer = PartWriter(out, rows_per_file)
    for table in synth_blocks(spec, rows, cfg):
        writer.write(table)
    writer.close()
    encoding = {f.name: {"table": f.table, "rows": encoded_rows(spec.table(f.table)), "mode": "synthetic",
                         "max_len": f.max_len} for f in spec.sparse_features}
    dense = {f.name: {"transform": f.transform, "fill": f.fill, "mean": None, "std": None}
             for f in spec.dense_features}
    meta = DatasetMeta(spec.name, data_hash(spec), writer.rows, unique_labels(spec), encoding, dense,
                       {"format": "synthetic", "seed": cfg.seed, "alpha": cfg.alpha})
    write_meta(out, meta)
    return meta
