"""Raw data on its way in, as a hostile user gives it: the seeded train/test split, Parquet folders
whose files disagree, spec files that are not there. One test per defect (each fails on the code
before its fix)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flowrec.data.convert import convert, split_mask

SPLIT_SEEDS = (0, 1, 2, 7, 1 << 32, (1 << 64) - 1)  # split_seed's range is [0, 2^64)


def _spec(**data: object) -> object:
    from flowrec.spec.load import spec_from_dict

    return spec_from_dict({
        "name": "ingest",
        "features": [{"name": "price", "type": "dense"},
                     {"name": "user", "type": "categorical", "hash_buckets": 64, "dim": 4}],
        "modules": [{"name": "top", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
        "heads": [{"name": "ctr", "input": "top"}],
        "data": {"format": "csv", "path": "x.csv", "label": "clicked", **data},
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
        "training": {"batch_size": 8},
    })


@pytest.mark.parametrize("seed", range(64))
def test_no_row_is_in_test_at_every_fraction_for_a_seed(seed: int) -> None:
    """Seed 0 (the default) drew 0 for row 0, so row 0 was a test row at any fraction above 0."""
    assert not split_mask(0, 1_000, 1e-9, seed).any()


@pytest.mark.parametrize("seed", SPLIT_SEEDS)
def test_every_seed_splits_off_its_fraction_of_rows_and_of_the_first_rows(seed: int) -> None:
    rows, fraction = 200_000, 0.2
    test = split_mask(0, rows, fraction, seed)
    spread = 5 * np.sqrt(rows * fraction * (1 - fraction))  # 5 sigma of a binomial count
    assert abs(int(test.sum()) - rows * fraction) < spread
    first = test[:1_000]  # the first rows of a file are rows like the others
    assert abs(int(first.sum()) - 200) < 5 * np.sqrt(1_000 * fraction * (1 - fraction))


def test_a_split_is_its_seeds_whatever_the_chunks_and_seeds_differ() -> None:
    whole = split_mask(0, 10_000, 0.3, 5)
    assert (np.concatenate([split_mask(0, 3_333, 0.3, 5), split_mask(3_333, 6_667, 0.3, 5)]) == whole).all()
    assert (split_mask(0, 10_000, 0.3, 5) == whole).all()
    assert (split_mask(0, 10_000, 0.3, 6) != whole).mean() > 0.3  # two uniform splits disagree on 42 %


def test_the_first_row_of_a_converted_file_is_not_always_a_test_row(tmp_path: Path) -> None:
    """`data convert --test-fraction 0.01`: the row written first went to test/ under the default seed."""
    import pyarrow.parquet as pq

    path = tmp_path / "rows.csv"
    path.write_text("price,user,clicked\n" + "".join(f"{i},u{i},{i % 2}\n" for i in range(1_000)), encoding="utf-8")
    convert(_spec(), "csv", [path], tmp_path / "out", options={"test_fraction": 0.01})
    prices = pq.read_table(tmp_path / "out" / "test").column("price").to_pylist()
    assert 0.0 not in prices and 0 < len(prices) < 30
