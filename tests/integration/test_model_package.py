"""From a run to production: `flowrec export` writes a package whose model.pt2 runs with torch alone,
`flowrec predict` / `flowrec.load_model` score raw rows exactly as `flowrec eval` scores the same rows
converted with `--encoder-from`, and bad inputs are one line with exit 2."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.testing.processes import run_bounded

SPEC = """
name: pkg_test
features:
  - {name: price, type: dense, transform: standardize}
  - {name: user, type: categorical, vocab: 60, dim: 8}
  - {name: city, type: categorical, hash_buckets: 50, dim: 8}
  - {name: tags, type: categorical, vocab: 30, dim: 8, max_len: 4, pooling: mean}
modules:
  - {name: top, kind: mlp, inputs: ["@dense", "@sparse"], layers: [16]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: adam, lr: 0.05}
training: {batch_size: 128, epochs: 3, seed: 0}
"""
runner = CliRunner()


def _raw(rows: int, seed: int) -> pd.DataFrame:
    """Skewed raw rows whose label follows a hidden rule of user, tags and price."""
    rng = np.random.default_rng(seed)
    user = rng.zipf(1.3, rows) % 80  # values beyond the 59 vocabulary rows exist
    tags = ["^".join(f"t{t}" for t in rng.zipf(1.5, rng.integers(0, 5)) % 40) for _ in range(rows)]
    price = rng.lognormal(2.0, 1.0, rows)
    logit = np.where(user % 3 == 0, 1.5, -1.0) + np.array([t.count("t1") for t in tags]) - 0.1 * price
    label = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(int)
    return pd.DataFrame({"price": price, "user": [f"u{u}" for u in user],
                         "city": rng.integers(0, 500, rows), "tags": tags, "label": label})


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pkg")
    (root / "spec.yaml").write_text(SPEC)
    _raw(3000, 0).to_csv(root / "train.csv", index=False)
    _raw(1000, 1).to_csv(root / "new.csv", index=False)
    spec = str(root / "spec.yaml")
    made = runner.invoke(app, ["data", "convert", "csv", str(root / "train.csv"), str(root / "data"),
                               "--spec", spec, "-q"])
    assert made.exit_code == 0, made.output
    run = runner.invoke(app, ["train", spec, "--data", str(root / "data"), "--eval-data", str(root / "data"),
                              "--out", str(root / "run"), "--quiet", "--device", "cpu"])
    assert run.exit_code == 0, run.output
    exported = runner.invoke(app, ["export", str(root / "run"), str(root / "pkg")])
    assert exported.exit_code == 0, exported.output
    return {"root": root, "spec": root / "spec.yaml", "run": root / "run", "pkg": root / "pkg"}


def _predict(pkg: Path, raw: Path, out: Path, *extra: str):
    return runner.invoke(app, ["predict", str(pkg), str(raw), "--format", "csv", "--out", str(out), "-q", *extra])


def test_the_package_holds_everything_to_score_raw_rows(package):
    pkg = package["pkg"]
    manifest = json.loads((pkg / "manifest.json").read_text())
    encoder = json.loads((pkg / "encoder.json").read_text())
    assert manifest["format"] == "flowrec-model" and manifest["torch_version"] == torch.__version__
    assert manifest["encoder_fingerprint"] == encoder["fingerprint"]
    assert 0.5 < manifest["metrics_at_export"]["ctr"]["auc"] <= 1.0
    assert (pkg / "vocab" / "user.parquet").is_file() and (pkg / "vocab" / "tags.parquet").is_file()
    assert json.loads((pkg / "plan.json").read_text()) == json.loads((package["run"] / "plan.json").read_text())
    assert json.loads((pkg / "spec.json").read_text())["name"] == "pkg_test"


def test_predict_equals_eval_on_rows_converted_with_the_run_s_encoder(package):
    from flowrec.runtime.run_log import auc

    root = package["root"]
    predicted = _predict(package["pkg"], root / "new.csv", root / "scores.parquet", "--keep", "label",
                         "--keep", "user")
    assert predicted.exit_code == 0, predicted.output
    scores = pq.read_table(root / "scores.parquet").to_pandas()
    assert list(scores.columns) == ["ctr", "label", "user"] and len(scores) == 1000
    made = runner.invoke(app, ["data", "convert", "csv", str(root / "new.csv"), str(root / "new"), "--spec",
                               str(package["spec"]), "--encoder-from", str(package["run"]), "-q"])
    assert made.exit_code == 0, made.output
    scored = runner.invoke(app, ["eval", str(package["run"]), "--data", str(root / "new"), "--json", "-"])
    assert scored.exit_code == 0, scored.output
    expected = json.loads(scored.stdout)["ctr"]["auc"]
    # a kept label of CSV rows was their text ('1'), which had no mean: now numbers, as training reads it
    assert scores["label"].dtype == np.float64 and 0 < scores["label"].mean() < 1
    assert auc(scores["label"].to_numpy(), scores["ctr"].to_numpy()) == pytest.approx(expected, abs=1e-6)

    from flowrec.planner.contract import scoring_plan
    from flowrec.serving.trained import load_trained

    trained = load_trained(package["run"], "cpu", scoring_plan)
    reference = _plain_scores(trained, ds.dataset(root / "new", format="parquet").to_table())
    np.testing.assert_allclose(scores["ctr"].to_numpy(), reference, rtol=0, atol=1e-6)


def _plain_scores(trained, encoded) -> np.ndarray:
    """Scores of the training model (packed tables, unchanged) on encoded rows."""
    from flowrec.data.batches import StagingOptions, iterate_batches
    from flowrec.data.dataset import MemorySource

    out = []
    source = MemorySource([encoded])
    with iterate_batches(trained.spec, source, StagingOptions(batch_size=256, shuffle=False, lookahead=0), 0, 0,
                         trained.model.groups) as batches, torch.no_grad():
        for batch in batches:
            out.append(torch.sigmoid(trained.model.eval()(batch))[:, 0].numpy())
    return np.concatenate(out)


BLOCKED = """
import sys, json, torch
sys.modules["flowrec"] = None  # importing flowrec fails in this process
try:
    import flowrec
    raise SystemExit("flowrec was importable")
except ImportError:
    pass
program = torch.export.load(sys.argv[1]).module()
inputs = torch.load(sys.argv[2])
with torch.no_grad():
    scores = program(inputs["dense"], {k: (v[0], v[1]) for k, v in inputs["sparse"].items()})
    one = program(inputs["dense"][:1], {k: (v[0][:int(v[1][1])], v[1][:2]) for k, v in inputs["sparse"].items()})
torch.save({"scores": scores, "one": one}, sys.argv[3])
"""


def test_model_pt2_runs_with_torch_alone_and_matches_predict(package, tmp_path):
    from flowrec.serving.package import encoded_inputs
    from flowrec.serving.predict import load_model

    model = load_model(package["pkg"])
    raw = pd.read_csv(package["root"] / "new.csv")
    import pyarrow as pa

    encoded = model.encoder.encode(pa.Table.from_pandas(raw, preserve_index=False), labels=False)
    dense, sparse = encoded_inputs(model.spec, encoded)
    torch.save({"dense": dense, "sparse": sparse}, tmp_path / "inputs.pt")
    (tmp_path / "blocked.py").write_text(BLOCKED)
    done = run_bounded([sys.executable, str(tmp_path / "blocked.py"), str(package["pkg"] / "model.pt2"),
                        str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")], capture_output=True,
                       text=True, timeout_s=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    got = torch.load(tmp_path / "out.pt")
    predicted = model.predict(raw)["ctr"].to_numpy()
    np.testing.assert_allclose(got["scores"][:, 0].numpy(), predicted, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got["one"][:, 0].numpy(), predicted[:1], rtol=0, atol=1e-6)


def test_an_fp32_program_holds_no_node_per_field_but_its_lookup(package):
    """Each pooled field's lookup was followed by a no-op cast to float32 (two nodes) and an
    unsqueeze: 3 of the 4 nodes of a 1,000-field program, each read back by torch.export.load
    (26 -> 16.6 s for that package without them). Its scores equal eval's
    (test_predict_equals_eval_on_rows_converted_with_the_run_s_encoder)."""
    from collections import Counter

    program = torch.export.load(package["pkg"] / "model.pt2")
    ops = Counter(str(n.target) for n in program.graph.nodes if n.op == "call_function")
    assert ops["aten.embedding_bag.padding_idx"] == 2, ops  # one group of dim 8: user and city (sum), tags (mean)
    assert ops["aten.unsqueeze.default"] <= 2, ops  # (each lookup's bag starts: none per field)
    assert ops["aten.to.dtype"] <= 1, ops  # (one cast of the dense input)
    assert ops["aten._assert_tensor_metadata.default"] <= 1, ops


def test_scores_of_a_dataframe_keep_its_index(package):
    """`df["ctr"] = model.predict(df)["ctr"]` aligns on the index: the scores of a filtered and
    shuffled DataFrame carry its own index, so each score lands on its row (they were indexed 0, 1,
    ... whatever the input's index, which put scores on other rows, and NaN on some)."""
    from flowrec.serving.predict import load_model

    model = load_model(package["pkg"])
    raw = pd.read_csv(package["root"] / "new.csv")
    whole = model.predict(raw)["ctr"]
    part = raw[raw["price"] > 5].sample(frac=1.0, random_state=0)
    assert not part.index.equals(pd.RangeIndex(len(part)))
    scores = model.predict(part)
    assert scores.index.equals(part.index)
    part = part.assign(ctr=scores["ctr"])  # pandas aligns on the index
    np.testing.assert_allclose(part["ctr"].to_numpy(), whole.loc[part.index].to_numpy(), rtol=0, atol=1e-6)
    import pyarrow as pa

    arrow = model.predict(pa.Table.from_pandas(part.drop(columns=["ctr"]), preserve_index=False))
    assert arrow.index.equals(pd.RangeIndex(len(part)))


def test_half_tables_store_half_the_bytes_and_report_the_score_difference(package):
    root = package["root"]
    made = runner.invoke(app, ["export", str(package["run"]), str(root / "pkg16"), "--dtype", "fp16"])
    assert made.exit_code == 0, made.output
    assert "largest score difference fp16 vs fp32" in made.output
    full = json.loads((package["pkg"] / "manifest.json").read_text())
    half = json.loads((root / "pkg16" / "manifest.json").read_text())
    assert half["table_bytes"] * 2 == full["table_bytes"]
    assert half["half_max_score_diff"]["rows"] == 3000 and 0 < half["half_max_score_diff"]["value"] < 1e-2
    from flowrec.serving.predict import load_model

    raw = pd.read_csv(root / "new.csv")
    a, b = load_model(package["pkg"]).predict(raw), load_model(root / "pkg16").predict(raw)
    assert 0 < float((a["ctr"] - b["ctr"]).abs().max()) < 1e-2


def test_bad_inputs_are_one_line_and_exit_2(package, tmp_path):
    root = package["root"]
    pd.read_csv(root / "new.csv").drop(columns=["tags"]).to_csv(tmp_path / "no_tags.csv", index=False)
    cases = {
        "not_a_package": (_predict(package["run"], root / "new.csv", tmp_path / "s.parquet"),
                          "not a flowrec model package"),
        "missing_column": (_predict(package["pkg"], tmp_path / "no_tags.csv", tmp_path / "s.parquet"),
                           "no_tags.csv: the rows lack columns ['tags']"),  # the file named, not only the rows
        "unknown_keep": (_predict(package["pkg"], root / "new.csv", tmp_path / "s.parquet", "--keep", "nope"),
                         "--keep nope"),
        "missing_raw": (_predict(package["pkg"], tmp_path / "none.csv", tmp_path / "s.parquet"), "not found"),
        "bad_dtype": (runner.invoke(app, ["export", str(package["run"]), str(tmp_path / "p"), "--dtype", "int8"]),
                      "--dtype must be one of"),
        "export_into_the_run": (runner.invoke(app, ["export", str(package["run"]), str(package["run"])]),
                                "training run"),
        "export_over_a_package": (runner.invoke(app, ["export", str(package["run"]), str(package["pkg"])]),
                                  "give --overwrite"),
    }
    for name, (result, fragment) in cases.items():
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and fragment in lines[0], (name, result.output)
        assert "Traceback" not in result.output, name
    assert not (tmp_path / "s.parquet").exists() and not (tmp_path / "p").exists()


LOAD_ONLY = """
import sys
import pandas as pd
import flowrec
model = flowrec.load_model(sys.argv[1])
scores = model.predict(pd.read_csv(sys.argv[2]))
assert len(scores) == 1000, len(scores)
loaded = sorted(m for m in sys.modules if m == "flowrec.runtime" or m.startswith("flowrec.runtime."))
print("RUNTIME:" + ",".join(loaded))
print("SERVING:" + ",".join(sorted(m for m in sys.modules if m.startswith("flowrec.serving"))))
"""


def test_scoring_a_package_imports_no_training_runtime(package, tmp_path):
    """`flowrec.load_model` + predict in a fresh interpreter: no `flowrec.runtime` module is loaded."""
    (tmp_path / "load_only.py").write_text(LOAD_ONLY)
    done = run_bounded([sys.executable, str(tmp_path / "load_only.py"), str(package["pkg"]),
                        str(package["root"] / "new.csv")], capture_output=True, text=True, timeout_s=300,
                       cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(":", 1) for line in done.stdout.splitlines() if line.startswith(("RUNTIME:", "SERVING:")))
    assert "flowrec.serving.predict" in lines["SERVING"].split(",")  # the check saw the scoring path load
    assert lines["RUNTIME"] == ""


DOT_SPEC = """
name: dot_pkg
features:
  - {name: price, type: dense, transform: log1p}
  - {name: user, type: categorical, hash_buckets: 200, dim: 8}
  - {name: city, type: categorical, hash_buckets: 50, dim: 8}
modules:
  - {name: bottom, kind: mlp, inputs: ["@dense"], layers: [8]}
  - {name: interaction, kind: dot, inputs: [bottom, "@sparse"]}
  - {name: top, kind: mlp, inputs: [interaction, bottom], layers: [8]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
training: {batch_size: 128, epochs: 1, seed: 0, eval_every: 0}
"""


def test_a_dot_model_exported_by_a_fresh_process_scores(tmp_path):
    """`flowrec export` in a process of its own (as a user runs it) of a model with a Dot: its
    program holds ATen operators only, so `flowrec predict` takes it (the bf16 probe of the Dot's
    products was traced into model.pt2 where the process had not probed before the export)."""
    import flowrec
    from flowrec.serving.predict import load_model

    spec = tmp_path / "dot.yaml"
    spec.write_text(DOT_SPEC)
    flowrec.train(spec, out=tmp_path / "run", rows=1200, max_steps=3)
    done = run_bounded([sys.executable, "-c", "from flowrec.cli import main; main()", "export",
                        str(tmp_path / "run"), str(tmp_path / "pkg")], capture_output=True, text=True, timeout_s=600)
    assert done.returncode == 0, done.stderr
    model = load_model(tmp_path / "pkg")  # check_archive refuses any operator that is not ATen's
    raw = pd.DataFrame({"price": [3.0, 40.0, 0.5], "user": ["a", "b", "c"], "city": ["x", "y", "x"]})
    scores = model.predict(raw)["ctr"].to_numpy()
    assert scores.shape == (3,) and np.all((scores > 0) & (scores < 1)) and len(set(scores.tolist())) == 3


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_half_export_of_a_dot_model_loads_and_scores(tmp_path, dtype):
    """`flowrec export runs/dlrm pkg/dlrm --dtype fp16` (export --help's example) wrote a package
    that `flowrec predict` refused: measuring the score difference ran the Dot, whose cached pair
    indices the trace then kept as a constant, which torch 2.13 saves as data/constants/tensor_0,
    a name check_archive did not know ('which flowrec's exports never hold')."""
    import flowrec
    from flowrec.serving.predict import load_model

    spec = tmp_path / "dot.yaml"
    spec.write_text(DOT_SPEC)
    flowrec.train(spec, out=tmp_path / "run", rows=1200, max_steps=3)
    full = runner.invoke(app, ["export", str(tmp_path / "run"), str(tmp_path / "pkg")])
    half = runner.invoke(app, ["export", str(tmp_path / "run"), str(tmp_path / "half"), "--dtype", dtype])
    assert full.exit_code == 0 and half.exit_code == 0, full.output + half.output
    raw = pd.DataFrame({"price": [3.0, 40.0, 0.5], "user": ["a", "b", "c"], "city": ["x", "y", "x"]})
    a = load_model(tmp_path / "pkg").predict(raw)["ctr"].to_numpy()
    b = load_model(tmp_path / "half").predict(raw)["ctr"].to_numpy()
    assert b.shape == (3,) and np.abs(a - b).max() < 0.05


def test_a_half_export_measures_and_keeps_the_eval_mode_model(tmp_path):
    """`flowrec export RUN PKG --dtype fp16` of a model with batch norm and dropout (as
    specs/deepfm_regularized.yaml) measured the score difference in training mode: dropout drew
    (0.32 reported for deepfm_regularized, where the packages differ by 1e-4) and batch norm
    took the compared rows' statistics into its running ones, which the package then kept."""
    import flowrec
    from flowrec.serving.predict import load_model

    spec = tmp_path / "reg.yaml"
    spec.write_text(DOT_SPEC.replace("name: dot_pkg", "name: reg_pkg").replace(
        "layers: [8]}\n  - {name: interaction", "layers: [8], norm: batch, dropout: 0.5}\n  - {name: interaction"))
    flowrec.train(spec, out=tmp_path / "run", rows=1200, max_steps=3)
    for out, dtype in (("pkg", "fp32"), ("half", "fp16")):
        made = runner.invoke(app, ["export", str(tmp_path / "run"), str(tmp_path / out), "--dtype", dtype])
        assert made.exit_code == 0, made.output
    raw = pd.DataFrame({"price": [3.0, 40.0, 0.5, 7.0], "user": ["a", "b", "c", "d"], "city": ["x", "y", "x", "z"]})
    a = load_model(tmp_path / "pkg").predict(raw)["ctr"].to_numpy()
    b = load_model(tmp_path / "half").predict(raw)["ctr"].to_numpy()
    reported = json.loads((tmp_path / "half" / "manifest.json").read_text())["half_max_score_diff"]["value"]
    assert np.abs(a - b).max() < 1e-3 and reported < 1e-3, (np.abs(a - b).max(), reported)


def test_lists_written_with_another_separator_are_refused_not_scored_as_one_id(package, tmp_path):
    """`flowrec predict pkg/ml new_ratings.csv --format csv` with genres written 'Children's|Comedy'
    (MovieLens' own separator) scored each list as one unknown id, without a word; data convert
    refuses such a column (docs/data.md), predict and load_model().predict now do too."""
    from flowrec.data.layout import DataError
    from flowrec.serving.predict import load_model

    raw = _raw(50, 4)
    raw = raw.assign(tags=[t.replace("^", "|") for t in raw["tags"]])
    assert raw["tags"].str.contains("|", regex=False).mean() > 0.1
    raw.to_csv(tmp_path / "piped.csv", index=False)
    refused = _predict(package["pkg"], tmp_path / "piped.csv", tmp_path / "s.parquet")
    assert refused.exit_code == 2 and "'tags'" in refused.output and "separated by '^'" in refused.output, \
        refused.output
    assert not (tmp_path / "s.parquet").exists()
    with pytest.raises(DataError, match="separated by '\\^'"):
        load_model(package["pkg"]).predict(raw)
    kept = _raw(50, 4)  # the same rows written with '^' score
    assert len(load_model(package["pkg"]).predict(kept)) == 50


def test_a_libsvm_package_scores_with_its_own_feature_map_from_any_folder(tmp_path, monkeypatch):
    """A libsvm spec's feature_map stayed outside the package: `flowrec predict PKG rows.libsvm` read
    fmap.txt from the working folder, so a moved package scored from elsewhere said 'cannot read
    feature map', or, beside another map, scored other columns' ids without a word. Now the map
    the data was read with travels in the encoder: scores equal the model's on the same columns."""
    import yaml

    from flowrec import load_model

    rng = np.random.default_rng()
    project, elsewhere = tmp_path / "x", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "fmap.txt").write_text("".join(f"{i} user\n" for i in range(1, 41)) +
                                      "".join(f"{i} item\n" for i in range(41, 66)) + "66 price\n")
    (elsewhere / "fmap.txt").write_text("".join(f"{i} item\n" for i in range(1, 41)) +  # another project's map
                                        "".join(f"{i} user\n" for i in range(41, 66)) + "66 price\n")
    users, items, prices = rng.integers(1, 41, 600), rng.integers(41, 66, 600), rng.random(600) * 9
    labels = (rng.random(600) < np.where(users % 3 == 0, 0.8, 0.2)).astype(int)
    text = "".join(f"{y} {u}:1 {i}:1 66:{p:.3f}\n" for y, u, i, p in zip(labels, users, items, prices))
    (project / "t.libsvm").write_text(text)
    rows = "".join(text.splitlines(keepends=True)[:100])
    (elsewhere / "rows.libsvm").write_text(rows)
    doc = {"name": "ls", "features": [{"name": "price", "type": "dense"},
                                      {"name": "user", "type": "categorical", "vocab": 50, "dim": 4},
                                      {"name": "item", "type": "categorical", "vocab": 30, "dim": 4}],
           "modules": [{"name": "m", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
           "heads": [{"name": "h", "input": "m", "task": "binary", "loss": "bce"}],
           "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "adam", "lr": 0.05}},
           "training": {"batch_size": 128, "epochs": 1, "seed": 0},
           "data": {"format": "libsvm", "path": "t.libsvm", "options": {"feature_map": "fmap.txt"}}}
    (project / "s.yaml").write_text(yaml.safe_dump(doc))
    monkeypatch.chdir(project)
    run = runner.invoke(app, ["train", "s.yaml", "--out", "run", "--quiet", "--device", "cpu"])
    assert run.exit_code == 0, run.output
    assert runner.invoke(app, ["export", "run", "pkg"]).exit_code == 0
    (project / "pkg").rename(elsewhere / "pkg")
    monkeypatch.chdir(elsewhere)
    result = runner.invoke(app, ["predict", "pkg", "rows.libsvm", "--out", "s.parquet", "-q"])
    assert result.exit_code == 0, result.output
    scores = pq.read_table(elsewhere / "s.parquet").column("h").to_numpy()
    given = [line.split() for line in rows.splitlines()]
    frame = pd.DataFrame({"user": [g[1].split(":")[0] for g in given], "item": [g[2].split(":")[0] for g in given],
                          "price": [float(g[3].split(":")[1]) for g in given]})
    expected = load_model(elsewhere / "pkg").predict(frame)["h"].to_numpy()
    assert len(scores) == len(given) and np.allclose(scores, expected, atol=1e-6)


NAMED = """
name: named_pkg
features:
  - {name: price, type: dense, transform: standardize}
  - {name: user, type: categorical, vocab: 60, dim: 8}
  - {name: tags, type: categorical, vocab: 30, dim: 8, max_len: 4, pooling: mean}
modules:
  - {name: bottom.v2, kind: mlp, inputs: ["@dense", "@sparse"], layers: [16]}
  - {name: "tower:a", kind: mlp, inputs: [bottom.v2], layers: [8]}
  - {name: tower-b, kind: mlp, inputs: [bottom.v2, user], layers: [8]}
  - {name: both, kind: concat, inputs: ["tower:a", tower-b]}
heads:
  - {name: ctr.v1, input: both}
training: {batch_size: 128, epochs: 1, seed: 0}
"""


def test_module_and_head_names_of_every_allowed_character_train_export_and_score(tmp_path):
    """Names may hold '.', ':' and '-' (spec.md). A module or head name with '.' (bottom.v2, ctr.v1)
    was a traceback building the model (torch's "module name can't contain '.'"), and a package of
    a model with a ':' or '-' name (tower:a) was refused at load ('not a plain tensor record')."""
    from package_flow import train_and_export

    from flowrec.planner.contract import scoring_plan
    from flowrec.serving.predict import load_model
    from flowrec.serving.trained import load_trained

    root = train_and_export(tmp_path, NAMED, _raw(2000, 0).drop(columns=["city"]))
    trained = load_trained(root / "run", "cpu", scoring_plan)
    assert "bottom.v2" in trained.model.ops and "head_ctr.v1" in trained.model.ops
    model = load_model(root / "pkg")
    raw = _raw(300, 1).drop(columns=["city"])
    scores = model.predict(raw)["ctr.v1"].to_numpy()
    encoded = model.encoder.encode(pa.Table.from_pandas(raw, preserve_index=False))
    np.testing.assert_allclose(scores, _plain_scores(trained, encoded), rtol=0, atol=1e-6)
    assert np.std(scores) > 0
