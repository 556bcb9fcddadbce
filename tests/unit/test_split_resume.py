"""A run made before rule 3 (its bound data split by row index, rule 2, its run.json naming no
split rule) whose RUN/data is gone is encoded again by rule 2 on `--resume`: end to end, through
`flowrec train`, the resumed run's train and test parts hold the rows they held before."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.data import convert as convert_module
from flowrec.data.convert import INDEX_SPLIT_RULE, SPLIT_RULE, split_by_hash, split_mask
from flowrec.data.duplicates import row_hashes
from flowrec.data.layout import read_meta
from flowrec.data.sources import reader
from flowrec.data.error_log import ErrorLog

runner = CliRunner()
FRACTION, SEED = 0.3, 11


def _bound_spec(tmp_path: Path, rng: np.random.Generator) -> tuple[Path, int]:
    """A spec bound to a raw CSV of skewed rows, each its own (`rid`, read back from the parts), with
    some copies, split by a seed; and its number of rows."""
    n = int(rng.integers(150, 300))
    rows = [f"{int(rng.random() < 0.25)},{r},c{rng.zipf(1.4) % 40}" for r in range(n)]
    rows += [rows[i] for i in rng.integers(0, n, n // 10)]  # copies: rule 3 keeps them together, rule 2 not
    (tmp_path / "raw.csv").write_text("label,rid,c1\n" + "\n".join(rows) + "\n")
    (tmp_path / "s.yaml").write_text(
        "name: old_split\n"
        "features:\n  - {name: rid, type: dense}\n  - {name: c1, type: categorical, vocab: 50, dim: 4}\n"
        "modules:\n  - {name: deep, kind: mlp, inputs: ['@dense', '@sparse'], layers: [4]}\n"
        "heads:\n  - {name: ctr, input: deep, task: binary, loss: bce}\n"
        f"data: {{format: csv, path: raw.csv, label: label, options: {{test_fraction: {FRACTION}, split_seed: {SEED}}}}}\n"
        "training: {batch_size: 16, epochs: 2, seed: 0}\n")
    return tmp_path / "s.yaml", len(rows)


def _parts(data: Path) -> dict[str, list[int]]:
    return {part: sorted(pq.read_table(data / part, columns=["rid"]).column("rid").to_numpy().astype(int).tolist())
            for part in ("train", "test")}


def test_a_run_of_before_rule_3_resumed_without_its_data_trains_and_evaluates_on_the_same_rows(tmp_path: Path,
                                                                                                monkeypatch):
    rng = np.random.default_rng()
    spec, n = _bound_spec(tmp_path, rng)
    real = convert_module.convert
    # the flowrec of 2026-12-05: its bound data split by row index, recorded with no rule
    monkeypatch.setattr(convert_module, "convert", lambda *a, **k: real(*a, **{**k, "split_rule": INDEX_SPLIT_RULE}))
    run = tmp_path / "run"
    made = runner.invoke(app, ["train", str(spec), "--out", str(run), "--max-steps", "3", "-q"])
    assert made.exit_code == 0, made.output
    monkeypatch.undo()
    for record in (run / "run.json", run / "data" / "train" / "_flowrec.json", run / "data" / "test" / "_flowrec.json"):
        doc = json.loads(record.read_text())  # as that flowrec wrote them: no split rule
        doc.pop("split_rule", None)
        doc.get("split", {}).pop("split_rule", None)
        doc.get("split", {}).pop("fit_on", None)
        record.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    before = _parts(run / "data")
    raw = next(reader("csv")(tmp_path / "raw.csv", {}, ErrorLog("fail", "raw.csv"), {"rid", "label"}))
    rids = raw.column("rid").to_numpy().astype(int)
    assert before["test"] == sorted(rids[split_mask(0, n, FRACTION, SEED)].tolist())  # rule 2's rows
    by_values = sorted(rids[split_by_hash(row_hashes(raw), FRACTION, SEED)].tolist())
    assert before["test"] != by_values  # rule 3 would hold other rows in test: the test can tell them apart
    shutil.rmtree(run / "data")
    resumed = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "6", "-q"])
    assert resumed.exit_code == 0, resumed.output
    assert _parts(run / "data") == before  # the rows it trained and evaluated on, in the same parts
    assert read_meta(run / "data" / "test").split["split_rule"] == INDEX_SPLIT_RULE
    assert json.loads((run / "run.json").read_text())["split_rule"] == INDEX_SPLIT_RULE  # and so on its next resume
    # a new run of the same spec splits by rule 3
    fresh = runner.invoke(app, ["train", str(spec), "--out", str(tmp_path / "new"), "--max-steps", "1", "-q"])
    assert fresh.exit_code == 0, fresh.output
    assert _parts(tmp_path / "new" / "data")["test"] == by_values
    assert read_meta(tmp_path / "new" / "data" / "test").split["split_rule"] == SPLIT_RULE
