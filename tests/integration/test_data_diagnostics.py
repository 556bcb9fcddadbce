"""Data diagnostics say what the raw data held: raw missing rates of dense columns (filled before
storage), label means, hashed values merged into one row; the profile labels in-sample figures and
warns when its sample is too small."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pytest
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.data.rawstats import read_stats

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def criteo(shared_data: Path, tmp_path: Path) -> Path:
    out = tmp_path / "cr"
    raw = shared_data / "criteo" / "criteo_kaggle_head1000.tsv"
    result = runner.invoke(app, ["data", "convert", "criteo", str(raw), str(out),
                                 "--spec", str(REPO / "specs" / "dlrm_criteo.yaml"), "-q"])
    assert result.exit_code == 0, result.output
    return out


def _raw_columns(shared_data: Path) -> pa.Table:
    names = ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]
    return pcsv.read_csv(shared_data / "criteo" / "criteo_kaggle_head1000.tsv",
                         read_options=pcsv.ReadOptions(column_names=names),
                         parse_options=pcsv.ParseOptions(delimiter="\t"),
                         convert_options=pcsv.ConvertOptions(column_types={n: pa.string() for n in names},
                                                             strings_can_be_null=True))


def test_conversion_records_raw_missing_label_mean_and_hash_merges(criteo: Path, shared_data: Path) -> None:
    raw = _raw_columns(shared_data)
    stats = read_stats(criteo)
    for i in (1, 3, 12):
        expected = raw.column(f"I{i}").null_count
        assert stats["dense_missing"][f"I{i}"]["missing"] == expected
    assert stats["dense_missing"]["I1"]["missing"] == 458  # raw Criteo I1: 458 of the first 1,000 missing
    labels = np.array(raw.column("label").to_pylist(), dtype=float)
    assert stats["label_mean"]["label"] == pytest.approx(labels.mean())
    c9 = stats["hashed"]["C9"]
    assert c9["distinct_values"] == len(set(raw.column("C9").drop_null().to_pylist())) == 2
    assert c9["occupied_rows"] == 1  # hash_buckets 4: both values land on one row


def test_inspect_shows_raw_figures_full_types_and_warns_on_merges(criteo: Path) -> None:
    result = runner.invoke(app, ["data", "inspect", str(criteo)])
    assert result.exit_code == 0, result.output
    i1 = next(line for line in result.stdout.splitlines() if line.startswith("I1 "))
    assert i1.split()[2:5] == ["0", "36", "458"]  # stored missing 0 (filled), unique, raw missing 458
    assert "warning: C9: hashing merges 1 of 2 distinct raw values (50.0%)" in result.output
    assert "C3:" not in result.output.split("warning")[-1]  # 674 values in 674 rows: no merge, no warning
    info = json.loads(runner.invoke(app, ["data", "inspect", str(criteo), "--json"]).stdout)
    assert {c["name"]: c.get("raw_missing") for c in info["columns"]}["I1"] == 458


def test_inspect_prints_whole_type_names(tmp_path: Path) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text("""
name: s
features:
  - {name: hist, type: sequence, hash_buckets: 50, dim: 4, max_len: 3}
modules:
  - {name: top, kind: mlp, inputs: ["@sparse"], layers: [4]}
heads:
  - {name: ctr, input: top}
optimizer: {dense: {name: adam, lr: 0.01}, sparse: {name: adagrad, lr: 0.1}}
""")
    made = runner.invoke(app, ["data", "synth", str(spec), "--rows", "100", "--out", str(tmp_path / "d")])
    assert made.exit_code == 0, made.output
    result = runner.invoke(app, ["data", "inspect", str(tmp_path / "d")])
    assert "list<element: int64>" in result.stdout and "no raw statistics" in result.output


def test_profile_labels_in_sample_figures_and_warns_on_small_samples(criteo: Path, tmp_path: Path) -> None:
    png = tmp_path / "p.png"
    result = runner.invoke(app, ["data", "profile", str(REPO / "specs" / "dlrm_criteo.yaml"), str(criteo),
                                 "--budget", "64KiB", "--png", str(png), "--sample-rate", "0.05"])
    assert result.exit_code == 0, result.output
    assert "of the sampled accesses (in-sample" in result.output
    assert "in the sample," in result.output and "expected over the whole data" in result.output
    assert "warning: the sample holds" in result.output and "warning: the cache curves simulate" in result.output
    assert "tables with the most distinct rows" in result.output and png.stat().st_size > 10_000
    full = runner.invoke(app, ["data", "profile", str(REPO / "specs" / "dlrm_criteo.yaml"), str(criteo),
                               "--sample-rate", "1.0"])
    assert "warning: the sample holds" not in full.output
    default = runner.invoke(app, ["data", "profile", str(REPO / "specs" / "dlrm_criteo.yaml"), str(criteo)])
    assert default.exit_code == 0, default.output  # FAE's sample of 1,000 rows: all of them
    assert "1,000 sampled rows (rate 1)" in default.output and "warning: the sample holds" not in default.output


def test_inspect_of_a_split_dataset_shows_each_part(shared_data: Path, tmp_path: Path) -> None:
    """`data convert --test-fraction` writes train/ and test/ under one folder: inspecting that
    folder shows both parts (it used to refuse it as 'not a folder of day partitions')."""
    out = tmp_path / "cr"
    raw = shared_data / "criteo" / "criteo_kaggle_head1000.tsv"
    made = runner.invoke(app, ["data", "convert", "criteo", str(raw), str(out), "--spec",
                               str(REPO / "specs" / "dlrm_criteo.yaml"), "--test-fraction", "0.2", "-q"])
    assert made.exit_code == 0, made.output
    result = runner.invoke(app, ["data", "inspect", str(out)])
    assert result.exit_code == 0, result.output
    heads = [line for line in result.stdout.splitlines() if " rows in " in line]
    assert [line.split(":")[0] for line in heads] == [str(out / "train"), str(out / "test")]
    counts = [int(line.split(": ")[1].split(" rows")[0].replace(",", "")) for line in heads]
    assert sum(counts) == 1000 and 0 < counts[1] < counts[0]
    info = json.loads(runner.invoke(app, ["data", "inspect", str(out), "--json"]).stdout)
    assert list(info) == ["train", "test"]
    assert [info["train"]["rows"], info["test"]["rows"]] == counts
    days = runner.invoke(app, ["data", "inspect", str(out), "--follow-order", "date:I1"])
    assert days.exit_code == 2 and "is one dataset" in days.output


WRITING_SPEC = """name: writing
features:
  - {name: price, type: dense}
  - {name: user, type: categorical, hash_buckets: 64, dim: 4}
modules:
  - {name: top, kind: mlp, inputs: ["@dense", "@sparse"], layers: [4]}
heads:
  - {name: ctr, input: top}
data: {format: parquet, path: data, label: clicked}
optimizer: {dense: {name: adam, lr: 0.01}, sparse: {name: sgd, lr: 0.1}}
training: {batch_size: 8}
"""


def test_train_eval_and_inspect_of_a_dataset_a_job_still_writes_into_say_so(tmp_path: Path) -> None:
    """`train --data DIR`, `eval RUN --data DIR`, `data inspect DIR` and `data profile SPEC DIR` of a dataset holding a
    `_temporary/` (a Spark job still writing into it) read the committed part files and skipped
    the folder without a word. Each now says so in one warning line; the dataset's own `_vocab/`
    and `_flowrec*.json` stay silent."""
    import pyarrow.parquet as pq

    rng = np.random.default_rng()
    n = int(rng.integers(40, 90))
    (tmp_path / "raw").mkdir()
    pq.write_table(pa.table({"price": rng.lognormal(0, 2, n), "user": [f"u{k}" for k in rng.zipf(1.3, n)],
                             "clicked": (rng.random(n) < 0.2).astype(int)}), tmp_path / "raw" / "part-0.parquet")
    (tmp_path / "spec.yaml").write_text(WRITING_SPEC)
    data = tmp_path / "data"
    done = runner.invoke(app, ["data", "convert", "parquet", str(tmp_path / "raw"), str(data), "--spec",
                               str(tmp_path / "spec.yaml"), "-q"])
    assert done.exit_code == 0 and "writing" not in done.output, done.output
    quiet = runner.invoke(app, ["data", "inspect", str(data)])
    assert quiet.exit_code == 0 and "still writing" not in quiet.output and "not read" not in quiet.output
    (data / "_temporary" / "0").mkdir(parents=True)
    part = next(data.glob("part-*.parquet"))
    (data / "_temporary" / "0" / "part-00001.parquet").write_bytes(part.read_bytes())
    commands = [["train", str(tmp_path / "spec.yaml"), "--data", str(data), "--out", str(tmp_path / "run"),
                 "--device", "cpu"],
                ["eval", str(tmp_path / "run"), "--data", str(data)],
                ["data", "inspect", str(data)],
                ["data", "profile", str(tmp_path / "spec.yaml"), str(data), "-q"]]
    for argv in commands:
        done = runner.invoke(app, argv)
        assert done.exit_code == 0, (argv, done.output)
        lines = [line for line in done.output.splitlines() if "still writing" in line]
        assert len(lines) == 1 and f"{data}/_temporary" in lines[0], (argv, done.output)
        assert "_vocab" not in done.output, done.output
