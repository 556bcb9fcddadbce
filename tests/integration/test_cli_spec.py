"""`flowrec validate` / `flowrec schema` through typer's CliRunner: exit codes, output, --json."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flowrec.cli import app

REPO = Path(__file__).resolve().parents[2]
DLRM = REPO / "specs" / "dlrm_criteo.yaml"


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def _run(runner: CliRunner, *args: str):
    result = runner.invoke(app, list(args))
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    return result


@pytest.fixture
def bad_spec(tmp_path) -> Path:
    text = DLRM.read_text().replace("hash_buckets: 584, dim: 16", "hash_buckets: 584, dim: 0")
    text = text.replace("inputs: [interaction, bottom]", "inputs: [interaction, botom]")
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


def test_valid_file_exit_0(runner):
    result = _run(runner, "validate", str(DLRM))
    assert result.exit_code == 0
    assert result.output == f"ok  {DLRM}\n"


def test_invalid_file_every_error_exit_2(runner, bad_spec):
    result = _run(runner, "validate", str(bad_spec))
    assert result.exit_code == 2
    assert result.output.splitlines() == [
        f"{bad_spec}: features[14].dim: must be >= 1",
        f"{bad_spec}: modules[2].inputs[1]: unknown module 'botom' (did you mean 'bottom'?)",
    ]


def test_folder_scanned(runner, tmp_path, bad_spec):
    (tmp_path / "good.yml").write_text(DLRM.read_text())
    (tmp_path / "notes.txt").write_text("not a spec")
    result = _run(runner, "validate", str(tmp_path))
    assert result.exit_code == 2
    assert f"ok  {tmp_path / 'good.yml'}" in result.output
    assert "notes.txt" not in result.output
    assert result.output.count(str(bad_spec)) == 2


def test_a_folder_scan_leaves_out_the_files_flowrec_wrote_for_itself(runner, tmp_path):
    """`flowrec validate .` over a project reported its runs' plan.json and run.json, its datasets'
    records and its packages' manifests as invalid specs, dozens of lines each, exit 2; now a scan
    leaves them out, and such a file named alone is one line saying what it is."""
    from flowrec.graph.plan_io import plan_json
    from flowrec.planner.manager import make_plan
    from flowrec.spec import load_spec
    from flowrec.spec.load import to_dict

    (tmp_path / "good.yaml").write_text(DLRM.read_text())
    run = tmp_path / "runs" / "exp1"
    run.mkdir(parents=True)
    (run / ".flowrec.lock").write_text("1")
    (run / "run.json").write_text(json.dumps({"epochs": 1, "device": "cpu"}))
    (run / "spec.json").write_text(json.dumps(to_dict(load_spec(DLRM))))
    (run / "plan.json").write_text(plan_json(make_plan(load_spec(DLRM))))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "_flowrec.json").write_text(json.dumps({"rows": 10, "labels": ["click"]}))
    (tmp_path / "data" / "encoder.json").write_text(json.dumps({"format": "flowrec-encoder", "version": 1}))
    result = _run(runner, "validate", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [f"ok  {tmp_path / 'good.yaml'}", f"ok  {run / 'spec.json'}"]
    line = (f"{run / 'plan.json'}: not a model spec: flowrec wrote this file for itself (format 'flowrec-plan'); "
            "a plan trains as `flowrec train SPEC --plan FILE`")
    for command in ("validate", "plan"):  # plan (train, calibrate) listed every spec key the plan lacks
        result = _run(runner, command, str(run / "plan.json"))
        assert result.exit_code == 2
        assert result.output.splitlines() == [line], command


def test_a_folder_scan_leaves_out_printed_schemas_and_eval_metrics(runner, tmp_path):
    """`flowrec schema > s.json` and `flowrec eval RUN --json m.json` in a project: `validate .`
    reported both as broken specs (every key a spec needs, line after line), though the docs say
    it leaves out the files flowrec writes. Now both are left out of a folder scan, and each named
    alone is one line saying what it is; a metrics-like file that is not flowrec's is still read."""
    (tmp_path / "good.yaml").write_text(DLRM.read_text())
    for name, args in (("s.json", ["schema"]), ("p.json", ["schema", "--plan"])):
        result = _run(runner, *args)
        assert result.exit_code == 0
        (tmp_path / name).write_text(result.output)
    (tmp_path / "m.json").write_text(json.dumps({"ctr": {"auc": 0.71, "logloss": None, "samples": 4096},
                                                 "cvr": {"mse": 0.2, "samples": 4096}}, indent=2))
    (tmp_path / "other.json").write_text(json.dumps({"ctr": {"auc": 0.71}}))  # no samples: not eval's
    result = _run(runner, "validate", str(tmp_path))
    assert result.exit_code == 2
    assert f"ok  {tmp_path / 'good.yaml'}" in result.output.splitlines()
    assert not any(name in result.output for name in ("s.json", "p.json", "m.json")), result.output
    assert "other.json" in result.output
    for name, says in (("s.json", "the JSON Schema 'model-spec.schema.json', as `flowrec schema` prints it"),
                       ("p.json", "the JSON Schema 'plan.schema.json'"), ("m.json", "metrics of `flowrec eval --json`")):
        result = _run(runner, "validate", str(tmp_path / name))
        assert result.exit_code == 2 and len(result.output.splitlines()) == 1 and says in result.output, result.output


def test_a_stray_copy_of_a_runs_settings_is_told_as_such(runner, tmp_path):
    """A run's run.json copied outside its run folder (beside the specs it was trained from) was
    reported by `validate DIR` as a broken spec, 25 lines of missing and unknown keys, exit 2. Now a
    folder scan leaves it out as it does inside a run folder, and named alone it is one line."""
    (tmp_path / "good.yaml").write_text(DLRM.read_text())
    settings = {"data": None, "eval_data": None, "rows": 2000, "seed": 0, "epochs": None, "max_steps": 2,
                "eval_every": 0, "cache": "auto", "device": "auto", "nan_policy": "stop"}
    (tmp_path / "run.json").write_text(json.dumps(settings, indent=2))
    (tmp_path / "near.json").write_text(json.dumps({k: v for k, v in settings.items() if k != "rows"}))
    result = _run(runner, "validate", str(tmp_path))
    assert result.exit_code == 2  # near.json lacks a setting every run.json holds: read as a spec
    assert f"ok  {tmp_path / 'good.yaml'}" in result.output.splitlines()
    assert "run.json" not in result.output and "near.json" in result.output, result.output
    result = _run(runner, "validate", str(tmp_path / "run.json"))
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1, result.output
    assert "not a model spec" in result.output and "a training run's settings" in result.output, result.output


def test_a_folder_scan_leaves_out_hidden_folders(runner, tmp_path):
    """`flowrec validate .` in a project read its .venv's and .github's JSON and YAML files as specs:
    thousands of lines, exit 2. Hidden files and folders below the folder named are left out; a
    hidden folder named itself is scanned."""
    (tmp_path / "good.yaml").write_text(DLRM.read_text())
    for name in (".venv/lib/site-packages/pkg/meta.json", ".github/workflows/ci.yml", ".draft.yaml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text('{"not": "a spec"}')
    result = _run(runner, "validate", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [f"ok  {tmp_path / 'good.yaml'}"]
    result = _run(runner, "validate", str(tmp_path / ".github"))
    assert result.exit_code == 2 and "ci.yml" in result.output


def test_a_link_to_a_missing_spec_in_a_folder_is_reported(runner, tmp_path):
    """A dangling link was skipped: the folder validated, exit 0, with a spec that cannot be read."""
    (tmp_path / "good.yaml").write_text(DLRM.read_text())
    (tmp_path / "moved.yaml").symlink_to(tmp_path / "gone" / "moved.yaml")
    result = _run(runner, "validate", str(tmp_path), "--quiet")
    assert result.exit_code == 2
    assert result.output.splitlines() == [f"{tmp_path / 'moved.yaml'}: a link to '{tmp_path / 'gone' / 'moved.yaml'}', "
                                          "which does not exist: point it at the spec, or give the spec's own path"]


def test_examples_folder_valid_quiet(runner):
    result = _run(runner, "validate", str(REPO / "specs"), "--quiet")
    assert result.exit_code == 0
    assert result.output == ""


def test_json_report(runner, bad_spec):
    result = _run(runner, "validate", "--json", str(DLRM), str(bad_spec))
    assert result.exit_code == 2
    report = json.loads(result.output)
    assert report["files"][0] == {"path": str(DLRM), "valid": True, "errors": []}
    assert report["files"][1]["valid"] is False
    assert report["files"][1]["errors"][0] == {"path": "features[14].dim", "message": "must be >= 1"}


def test_missing_file(runner, tmp_path):
    missing = tmp_path / "nope.yaml"
    result = _run(runner, "validate", str(missing))
    assert result.exit_code == 2
    assert result.output.splitlines() == [f"{missing}: no such file"]


def test_unparseable_yaml(runner, tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\nfeatures: {\n")
    result = _run(runner, "validate", str(broken))
    assert result.exit_code == 2
    assert "not valid YAML/JSON" in result.output and "line" in result.output


def test_non_mapping_and_empty_files(runner, tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "empty.yaml").write_text("")
    result = _run(runner, "validate", str(tmp_path))
    assert result.exit_code == 2
    assert f"{tmp_path / 'empty.yaml'}: the file is empty; a spec is a mapping with name, " in result.output
    assert f"{tmp_path / 'list.json'}: the spec must be a mapping (got [1, 2])" in result.output


def test_empty_folder_is_an_error(runner, tmp_path):
    result = _run(runner, "validate", str(tmp_path))
    assert result.exit_code == 2
    assert "no spec files" in result.output


def test_schema_command(runner):
    result = _run(runner, "schema")
    assert result.exit_code == 0
    schema = json.loads(result.output)
    assert schema["title"] == "flowrec model spec"


def test_schema_plan(runner):
    result = _run(runner, "schema", "--plan")
    plan_schema = REPO / "schemas" / "plan.schema.json"
    if plan_schema.is_file():
        assert result.exit_code == 0
        assert json.loads(result.output) == json.loads(plan_schema.read_text())
    else:
        assert result.exit_code == 2
        assert "cannot read schema" in result.output


def test_help_has_examples(runner):
    result = _run(runner, "validate", "--help")
    assert result.exit_code == 0
    assert "flowrec validate specs/" in result.output
