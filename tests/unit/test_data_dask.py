"""Dask staging: each rank's batches are Dask tasks keyed (run, epoch, batch, rank), equal to direct
reads; row groups are checked on the cluster; a bad row is one error naming file and row."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowrec.data import convert
from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import DaskSource, ParquetSource
from flowrec.data.layout import DataError
from flowrec.data.synth import synth_dataset
from flowrec.spec import spec_from_dict

distributed = pytest.importorskip("distributed")
ROWS = 600


def make_spec():
    return spec_from_dict({
        "name": "d",
        "features": [{"name": "x", "type": "dense"},
                     {"name": "a", "type": "categorical", "hash_buckets": 50, "dim": 4},
                     {"name": "tags", "type": "sequence", "vocab": 30, "dim": 4, "max_len": 3, "pooling": "mean"}],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
        "heads": [{"name": "h", "input": "m"}],
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
        "training": {"batch_size": 40, "seed": 5},
    })


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                                  dashboard_address=None) as c:
        yield c.scheduler_address


@pytest.fixture()
def data(tmp_path, monkeypatch):
    monkeypatch.setattr(convert, "ROW_GROUP_ROWS", 32)
    synth_dataset(make_spec(), tmp_path / "d", ROWS, rows_per_file=250)
    return tmp_path / "d"


def _batches(source, world: int, rank: int) -> list:
    opts = StagingOptions(batch_size=40, shuffle_buffer=160, workers=2, world_size=world, rank=rank)
    with iterate_batches(make_spec(), source, opts, epoch=1) as it:
        return list(it)


def _same(a, b) -> bool:
    return (a.index == b.index and torch_equal(a.dense, b.dense) and torch_equal(a.labels, b.labels)
            and all(torch_equal(a.groups[k].ids, b.groups[k].ids) for k in a.groups))


def torch_equal(x, y) -> bool:
    return x.shape == y.shape and bool((x == y).all())


@pytest.mark.parametrize("world", [1, 2])
def test_dask_batches_are_keyed_tasks_equal_to_direct_reads(data, cluster, world):
    for rank in range(world):
        direct = ParquetSource(data)
        expected = _batches(direct, world, rank)
        direct.close()
        source = DaskSource(data, address=cluster)
        keys = []
        stage = source.stage
        source.stage = lambda key, *a: keys.append(key) or stage(key, *a)
        got = _batches(source, world, rank)
        assert source.bytes_read == direct.bytes_read  # the same row groups, read on the cluster
        source.close()
        assert len(got) == len(expected) == -(-ROWS // 40)
        assert all(_same(a, b) for a, b in zip(got, expected))
        assert [k[1:] for k in keys] == [(1, i, rank) for i in range(len(expected))]
        assert len({k[0] for k in keys}) == 1 and keys[0][0].startswith("flowrec-batch-")


def test_a_bad_row_is_found_on_the_cluster_and_named_within_its_file(data, cluster):
    part = sorted(data.glob("part-*.parquet"))[1]
    table = pq.read_table(part)
    ids = table.column("a").to_numpy().copy()
    ids[70] = 99  # row 70 of the file: in its third row group
    meta = pq.ParquetFile(part).metadata
    pq.write_table(table.set_column(table.column_names.index("a"), "a", pa.array(ids)), part,
                   row_group_size=meta.row_group(0).num_rows)
    source = DaskSource(data, address=cluster)
    with pytest.raises(DataError, match=rf"^{part}: column 'a': id 99 outside \[0, \d+\) .* at row 70 \(0-based\)"):
        _batches(source, 1, 0)
    source.close()


def test_recomputing_a_batch_gives_the_same_rows(data, cluster):
    """A batch task is a pure function of its key: submitting it again (as after a lost worker)
    gives the same table."""
    source = DaskSource(data, address=cluster)
    first = _batches(source, 2, 1)
    again = _batches(source, 2, 1)
    source.close()
    assert all(_same(a, b) for a, b in zip(first, again))
    assert not np.array_equal(first[0].dense.numpy(), first[1].dense.numpy())


@pytest.mark.parametrize("address", ["bogus", "tcp://host", "http://h:8786", "tcp://"])
def test_a_dask_address_that_names_no_scheduler_is_one_line_before_the_run(tmp_path, data, address):
    """`train --dask bogus` encoded the data, then said only distributed's 'missing port number in
    address' and held the exit 60 s (a traceback from Client.__del__); now the form is refused
    first, naming --dask, and nothing is written."""
    from typer.testing import CliRunner

    from flowrec.cli import app
    from flowrec.testing.specs import run_spec

    spec = tmp_path / "s.yaml"
    spec.write_text(run_spec("dask", batch_size=32, epochs=1))
    result = CliRunner().invoke(app, ["train", str(spec), "--data", str(data), "--dask", address,
                                      "--out", str(tmp_path / "run"), "-q"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith(f"error: --dask '{address}'"), \
        result.output
    assert not (tmp_path / "run").exists()


def test_a_dask_scheduler_that_cannot_be_reached_is_a_data_error(data):
    """--dask tcp://HOST:PORT with no scheduler there ended in distributed's OSError traceback."""
    import dask

    with dask.config.set({"distributed.comm.timeouts.connect": "0.5s"}):
        with pytest.raises(DataError, match=r"--dask tcp://127\.0\.0\.1:1: cannot reach a Dask scheduler"):
            DaskSource(data, address="tcp://127.0.0.1:1")
