"""`flowrec plan` through typer's CliRunner; goldens byte for byte; planning imports no torch/dask."""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET

import jsonschema
import pytest
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.testing.processes import run_bounded

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, ["plan", *map(str, args)])


@pytest.fixture
def dlrm(repo):
    return repo / "specs" / "dlrm_criteo.yaml"


def test_text_report(dlrm):
    r = invoke(dlrm, "--target", "h100", "--device-budget", "1GiB")
    assert r.exit_code == 0, r.output
    assert "packed groups:" in r.output and "g0_d16" in r.output
    assert "static_hot" in r.output and "samples/s" in r.output
    assert "pass cache: changed" in r.output


def test_until_stops_early(dlrm):
    r = invoke(dlrm, "--until", "packed")
    assert r.exit_code == 0, r.output
    assert "pass pack: changed" in r.output and "pass cache" not in r.output
    assert invoke(dlrm, "--until", "lowered").exit_code == 2


def test_json_to_stdout_validates(dlrm, repo):
    r = invoke(dlrm, "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    schema = json.loads((repo / "schemas" / "plan.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(doc)
    (group,) = doc["groups"]
    assert [t["row_offset"] for t in group["tables"]][:2] == [0, 1461]
    assert len(group["features"]) == 26


def test_dot_to_stdout(dlrm):
    r = invoke(dlrm, "--dot", "-")
    assert r.exit_code == 0, r.output
    assert r.output.startswith('digraph "dlrm_criteo"')
    assert 'subgraph "cluster_sparse"' in r.output and "g0_d16: 26 fields" in r.output


def test_one_output_at_most_to_stdout(dlrm, tmp_path, monkeypatch):
    """`--json - --dot -` printed the JSON and the DOT text one after the other (neither parseable);
    `--svg -` wrote a file named '-'."""
    monkeypatch.chdir(tmp_path)
    for args in (("--json", "-", "--dot", "-"), ("--svg", "-"), ("--png", "-")):
        r = invoke(dlrm, *args)
        assert r.exit_code == 2 and "stdout" in r.output and "Traceback" not in r.output, r.output
        assert r.output.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_svg_and_png_files(repo, tmp_path):
    svg, png = tmp_path / "plan.svg", tmp_path / "plan.png"
    r = invoke(repo / "specs" / "two_task.yaml", "--svg", svg, "--png", png)
    assert r.exit_code == 0, r.output
    root = ET.parse(svg).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert any("fields" in (t or "") for t in texts) and any("2 MLPs" in (t or "") for t in texts)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_spec_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nfeatures: []\n")
    r = invoke(bad)
    assert r.exit_code == 2
    assert "Traceback" not in r.output
    assert str(bad) in r.output
    assert invoke(tmp_path / "missing.yaml").exit_code == 2


def test_bad_options_exit_2(dlrm):
    assert invoke(dlrm, "--target", "tpu").exit_code == 2
    assert invoke(dlrm, "--device-budget", "lots").exit_code == 2


def test_goldens_byte_for_byte(repo):
    sys.path.insert(0, str(repo / "tools"))
    try:
        from regen_goldens import GOLDEN, golden_texts
    finally:
        sys.path.remove(str(repo / "tools"))
    specs = sorted((repo / "specs").glob("*.yaml"))
    assert specs
    for spec in specs:
        for name, text in golden_texts(spec).items():
            path = GOLDEN / name
            assert path.exists(), f"missing golden {name}: run tools/regen_goldens.py"
            assert path.read_text(encoding="utf-8") == text, f"{name} differs: run tools/regen_goldens.py"


def test_planning_imports_no_torch_or_dask(repo):
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from flowrec.cli import app\n"
        f"r = CliRunner().invoke(app, ['plan', {str(repo / 'specs' / 'dlrm_criteo.yaml')!r}, '--json', '-'])\n"
        "assert r.exit_code == 0, r.output\n"
        "heavy = sorted(m for m in ('torch', 'dask', 'cupy', 'distributed') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = run_bounded([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, check=True, timeout_s=120)
    assert out.stdout.strip() == ""


@pytest.mark.parametrize("bad", [["--profile", "missing.json"], ["--until", "lowered"]])
def test_a_plan_that_fails_takes_back_the_folders_made_for_its_outputs(dlrm, tmp_path, monkeypatch, bad):
    """The output guard makes the folders above --json and --svg before any work; a plan that then
    failed (a missing profile, a bad --until) left them behind, empty."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kept").mkdir()
    r = invoke(dlrm, *bad, "--json", "new/sub/p.json", "--svg", "kept/more/p.svg", "-q")
    assert r.exit_code == 2, r.output
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["kept"]
    r = invoke(dlrm, "--json", "new/sub/p.json", "-q")
    assert r.exit_code == 0 and (tmp_path / "new" / "sub" / "p.json").is_file(), r.output
