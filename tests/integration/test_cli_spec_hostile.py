"""Hostile spec files, one row each: `validate`, `plan` and `train` print one line and exit 2.

Each row writes a file, runs the real CLI through typer's CliRunner and checks the exact line,
the exit status, that no traceback was shown, that the input is unchanged and that `train` wrote
no run folder. Inputs that would crash or hang a YAML loader also run in a subprocess with a
timeout (a segfault cannot be caught in-process).
"""
from __future__ import annotations

import codecs
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.testing.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]
BASE_TEXT = (REPO / "specs" / "two_task.yaml").read_text(encoding="utf-8")
BASE: dict[str, Any] = yaml.safe_load(BASE_TEXT)
COMMANDS = ("validate", "plan", "train")
SUBPROCESS_TIMEOUT_S = 60
LAUGHS = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(9))
DEEP_BRACKETS = "[" * 30_000 + "]" * 30_000
EMPTY_MAPPING = "the file is empty; a spec is a mapping with name, features, modules, heads and optimizer"
# Ends an expected line whose rest is a dependency's own words (the parser's, Python's): the test
# checks flowrec's part (file, position, what flowrec says) and that some reason follows, never
# the dependency's wording, which a new release may change.
ANY = "<the parser's reason>"


def _spec(edit: Callable[[dict], None]) -> str:
    doc = json.loads(json.dumps(BASE))
    edit(doc)
    return yaml.safe_dump(doc, sort_keys=False)


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """An edit setting the value at a dotted path (`optimizer.sparse.lr`, `features.0.fill`)."""
    def edit(doc: dict) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(last) if isinstance(node, list) else last] = value
    return edit


def _sgd(doc: dict) -> None:
    doc["optimizer"]["dense"] = {"name": "sgd", "lr": 0.1, "momentum": 1.5}


NAN, INF = float("nan"), float("inf")
# (id, file name, content: text or bytes, expected line after "FILE: ")
CASES: list[tuple[str, str, str | bytes, str]] = [
    ("duplicate_top_key", "s.yaml", BASE_TEXT + "name: other\n",
     "line 33: duplicate key 'name' (first at line 5)"),
    ("duplicate_deep_key", "s.yaml", BASE_TEXT.replace("{name: adam, lr: 0.001}", "{name: adam, lr: 0.001, lr: 9}"),
     "line 29: duplicate key 'lr' (first at line 29)"),
    ("billion_laughs", "s.yaml", LAUGHS,
     "line 7, column 12: the document expands to more than 1,000,000 values (aliases of aliases?)"),
    ("self_alias", "s.yaml", "a: &a [1, *a]\n",
     "line 1, column 11: alias *a refers to an anchor that is not defined before it or that contains it"),
    ("deep_brackets", "s.yaml", DEEP_BRACKETS, "line 1, column 65: the document nests deeper than 64 levels"),
    ("deep_block", "s.yaml", "".join(" " * i + f"k{i}:\n" for i in range(80)) + " " * 80 + "1\n",
     "line 65, column 65: the document nests deeper than 64 levels"),
    ("python_tag", "s.yaml", "name: !!python/object/apply:os.system [echo hi]\n",
     "line 1, column 7: the tag !!python/object/apply:os.system is not allowed in a spec (plain YAML values only)"),
    ("local_tag", "s.yaml", "name: !shell rm\n",
     "line 1, column 7: the tag !shell is not allowed in a spec (plain YAML values only)"),
    ("set_tagged_key", "s.yaml", "!!set name: x\n", "line 1, column 1: not valid YAML/JSON: " + ANY),
    ("latin1", "s.yaml", BASE_TEXT.replace("Shared-bottom", "Shared-bottóm").encode("latin-1"),
     "line 6, column 25: not UTF-8 text (byte 0xf3); save the file as UTF-8"),
    ("utf16_bom", "s.yaml", BASE_TEXT.encode("utf-16"), "the file is UTF-16 text; save it as UTF-8"),
    ("utf16_no_bom", "s.yaml", BASE_TEXT.encode("utf-16-le"),
     "the file looks like UTF-16 text (without a byte-order mark); save it as UTF-8"),
    ("utf16_be_no_bom", "s.yaml", BASE_TEXT.encode("utf-16-be"),
     "the file looks like UTF-16 text (without a byte-order mark); save it as UTF-8"),
    ("utf32_no_bom", "s.yaml", BASE_TEXT.encode("utf-32-le"),
     "the file looks like UTF-32 text (without a byte-order mark); save it as UTF-8"),
    ("utf32_bom", "s.yaml", codecs.BOM_UTF32_LE + BASE_TEXT.encode("utf-32-le"), "the file is UTF-32 text; save it as UTF-8"),
    ("binary", "s.yaml", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)),
     "a binary file (NUL byte at offset 8), not a YAML or JSON spec"),
    # the parser's "found character that cannot start any token" named no tab
    ("tab_indent", "s.yaml", BASE_TEXT.replace("  - {name: item_id", "\t- {name: item_id"),
     "line 11, column 1: a tab character: YAML indents with spaces, never tabs"),
    # YAML 1.1 reads these unquoted as true / false and base-60 numbers: "(got False)" for `no` said not why
    ("yaml_no_as_name", "s.yaml", BASE_TEXT.replace("name: two_task", "name: no"),
     "name: must be a string (got False); YAML reads yes, no, on, off, true and false as true / false: quote text ('no')"),
    ("yaml_on_as_number", "s.yaml", BASE_TEXT.replace("batch_size: 4096", "batch_size: on"),
     "training.batch_size: must be an integer (got True); YAML reads yes, no, on, off, true and false as true / false"),
    ("yaml_base_60_as_name", "s.yaml", BASE_TEXT.replace("name: two_task", "name: 1:30"),
     "line 5: 1:30 is read by YAML as the base-60 number 90; quote it if it is text, or write the number"),
    # YAML 1.1 read `batch_size: 0100` as octal 64 and `seed: 1:04` as 64 without a word (1.2 and JSON: 100)
    ("yaml_octal_number", "s.yaml", BASE_TEXT.replace("batch_size: 4096", "batch_size: 0100"),
     "line 31: 0100 is read by YAML as the octal number 64, not 100; write the number without its leading zeros"),
    ("yaml_base_60_number", "s.yaml", BASE_TEXT.replace("seed: 0,", "seed: 1:04,"),
     "line 31: 1:04 is read by YAML as the base-60 number 64; quote it if it is text, or write the number"),
    # 'é' is a letter: "must be a name of letters" named neither the name nor the character refused
    ("accented_name", "s.yaml", BASE_TEXT.replace("name: shop_id", "name: boutique_id_é"),
     "features[6].name: must be a name of ASCII letters, digits, '_', '.', ':' or '-' (not starting with '@' or '-') "
     "(got 'boutique_id_é': 'é' is not allowed)"),
    ("control_char", "s.yaml", "name: a\x07b\n", "line 1, column 8: character U+0007 is not allowed in YAML"),
    ("empty", "s.yaml", b"", EMPTY_MAPPING),
    ("too_large", "s.yaml", b"#" * (16 * 2**20 + 1), "the file is larger than 16 MiB; a spec is a small text file"),
    ("comments_only", "s.yaml", "# nothing here\n\n", EMPTY_MAPPING),
    ("json_duplicate", "s.json", '{"name": "a",\n "features": [], "name": "b"}',
     "line 2: duplicate key 'name' (first at line 1)"),
    ("json_nan", "s.json", json.dumps(json.loads(json.dumps(BASE)) | {"description": NAN}),
     "line 1: NaN is not a JSON number (JSON has no NaN or Infinity)"),
    ("json_infinity", "s.json", '{\n"name": -Infinity}', "line 2: -Infinity is not a JSON number (JSON has no NaN or Infinity)"),
    ("json_deep", "s.json", DEEP_BRACKETS, "line 1: the document nests deeper than 64 levels"),
    ("int_5000_digits", "s.yaml", "name: x\nseed: " + "1" * 5000 + "\n",
     "line 2, column 7: not valid YAML/JSON: cannot read this value: " + ANY),
    ("json_int_5000_digits", "s.json", '{"seed": ' + "1" * 5000 + "}",
     "not valid JSON: " + ANY),
    ("impossible_date", "s.yaml", "name: x\nwhen: 2020-13-45\n",
     "line 2, column 7: not valid YAML/JSON: cannot read this value: " + ANY),
    ("json_syntax", "s.json", '{"name": "a",\n}', "line 2, column 1: not valid JSON: " + ANY),
    ("lr_nan", "s.yaml", _spec(_set("optimizer.sparse.lr", NAN)), "optimizer.sparse.lr: must be a finite number, not nan"),
    ("lr_inf", "s.yaml", _spec(_set("optimizer.sparse.lr", INF)), "optimizer.sparse.lr: must be a finite number, not inf"),
    ("lr_huge", "s.yaml", _spec(_set("optimizer.dense.lr", 1e300)), "optimizer.dense.lr: must be <= 1000"),
    ("eps_nan", "s.yaml", _spec(_set("optimizer.sparse.eps", NAN)), "optimizer.sparse.eps: must be a finite number, not nan"),
    ("eps_huge", "s.yaml", _spec(_set("optimizer.sparse.eps", 2.0)), "optimizer.sparse.eps: must be <= 1"),
    ("head_weight_inf", "s.yaml", _spec(_set("heads.1.weight", INF)), "heads[1].weight: must be a finite number, not inf"),
    ("fill_nan", "s.yaml", _spec(_set("features.0.fill", NAN)), "features[0].fill: must be a finite number, not nan"),
    ("fill_huge", "s.yaml", _spec(_set("features.0.fill", -1e300)), "features[0].fill: must be >= -1e+30"),
    ("momentum", "s.yaml", _spec(_sgd), "optimizer.dense.momentum: must be < 1"),
    ("beta", "s.yaml", _spec(_set("optimizer.dense.beta2", 1.0)), "optimizer.dense.beta2: must be < 1"),
    ("dim_float", "s.yaml", _spec(_set("features.2.dim", 16.0)), "features[2].dim: must be an integer (got 16.0)"),
    ("layers_huge", "s.yaml", _spec(_set("modules.0.layers", [512, 10**9])), "modules[0].layers[1]: must be <= 65536"),
    ("batch_huge", "s.yaml", _spec(_set("training.batch_size", 2**70)),
     "training.batch_size: must be an integer within 64 bits (-2^63 .. 2^63-1)"),
    ("epochs_inf", "s.yaml", _spec(_set("training.epochs", INF)), "training.epochs: must be a finite number, not inf"),
    ("seed_64_bits", "s.yaml", _spec(_set("training.seed", 2**63)),
     "training.seed: must be an integer within 64 bits (-2^63 .. 2^63-1)"),
    ("seed_negative", "s.yaml", _spec(_set("training.seed", -1)), "training.seed: must be >= 0"),
    ("hash_buckets_huge", "s.yaml", _spec(_set("features.2.hash_buckets", 2**40)),
     "features[2].hash_buckets: must be <= 68719476736"),
    ("max_len_huge", "s.yaml", _spec(_set("features.4.max_len", 10**7)), "features[4].max_len: must be <= 100000"),
    ("window_huge", "s.yaml", _spec(_set("plan.window", 10**6)), "plan.window: must be <= 1024"),
    ("budget_huge", "s.yaml", _spec(_set("plan.device_budget", "9" * 400 + " TiB")),
     "plan.device_budget: must be at most 1 PiB (got '999999999999999999999999999999999999...)"),
    ("options_nan", "s.yaml", _spec(_set("data", {"format": "csv", "path": "x.csv", "options": {"test_fraction": NAN}})),
     "data.options.test_fraction: must be a finite number, not nan"),
    ("options_int_key", "s.yaml", _spec(_set("data", {"format": "csv", "path": "x.csv", "options": {1: "a"}})),
     "data.options: key 1 must be text (quote it)"),
    ("options_date", "s.yaml", _spec(_set("data", {"format": "csv", "path": "x.csv",
                                                   "options": {"date_column": datetime.date(2024, 1, 2)}})),
     "data.options.date_column: must be text, a number, true / false, null, a list or a mapping (got a date; quote text)"),
]


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


def _args(command: str, spec: Path, tmp_path: Path) -> list[str]:
    if command == "train":
        return ["train", str(spec), "--out", str(tmp_path / "run"), "--quiet"]
    return [command, str(spec)]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name,filename,content,expected", CASES, ids=[c[0] for c in CASES])
def test_hostile_spec_one_line_exit_2(runner, tmp_path, command, name, filename, content, expected):
    spec = tmp_path / filename
    data = content.encode("utf-8") if isinstance(content, str) else content
    spec.write_bytes(data)
    result = runner.invoke(app, _args(command, spec, tmp_path))
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    assert len(lines) == 1, result.output
    if expected.endswith(ANY):
        prefix = f"{spec}: {expected[:-len(ANY)]}"
        assert lines[0].startswith(prefix) and len(lines[0]) > len(prefix), lines[0]
    else:
        assert lines == [f"{spec}: {expected}"]
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert spec.read_bytes() == data
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ("plan", "train"))
def test_folder_as_spec(runner, tmp_path, command):
    folder = tmp_path / "spec.yaml"
    folder.mkdir()
    result = runner.invoke(app, _args(command, folder, tmp_path))
    assert result.exit_code == 2
    assert result.output.splitlines() == [
        f"{folder}: a folder, not a spec file (give a .yaml, .yml or .json file)"]
    assert list(tmp_path.iterdir()) == [folder] and not any(folder.iterdir())


@pytest.mark.parametrize("command", ("plan", "train"))  # (validate reads the spec files a folder holds)
def test_a_run_or_package_folder_as_spec_names_the_spec_it_holds(runner, tmp_path, command):
    # `flowrec plan runs/x` (a run's folder for its spec, as eval and export take it) said only "a folder,
    # not a spec file (give a .yaml, .yml or .json file)", though the folder holds the spec it was made of
    folder = tmp_path / "old_run"
    folder.mkdir()
    data = os.urandom(16).hex().encode()  # not read: the folder is refused before its files
    (folder / "spec.json").write_bytes(data)
    result = runner.invoke(app, _args(command, folder, tmp_path))
    assert result.exit_code == 2
    assert result.output.splitlines() == [
        f"{folder}: a folder, not a spec file (give a .yaml, .yml or .json file; the spec this run or package was "
        f"made of is {folder / 'spec.json'})"], result.output
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["old_run", "spec.json"]
    assert (folder / "spec.json").read_bytes() == data


@pytest.mark.parametrize("command", ("validate", "plan"))
@pytest.mark.parametrize("text,suffix", [(DEEP_BRACKETS, ".yaml"), ("[" * 1_000_000, ".yaml"), (DEEP_BRACKETS, ".json"),
                                         ("{a: " * 100_000 + "1" + "}" * 100_000, ".yml"), (LAUGHS, ".yaml")],
                         ids=["brackets", "unclosed_million", "json", "flow_mappings", "laughs"])
def test_loader_crashers_in_subprocess(tmp_path, command, text, suffix):
    spec = tmp_path / f"hostile{suffix}"
    spec.write_text(text, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = run_bounded([sys.executable, "-c", "from flowrec.cli import main; main()", command, str(spec)],
                       capture_output=True, text=True, timeout_s=SUBPROCESS_TIMEOUT_S, env=env, cwd=REPO)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"{spec}: line ")
    assert "nests deeper than 64 levels" in lines[0] or "expands to more than" in lines[0]


@pytest.mark.parametrize("command", ("validate", "plan"))
def test_fifo_as_spec_does_not_block(tmp_path, command):
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = run_bounded([sys.executable, "-c", "from flowrec.cli import main; main()", command, str(fifo)],
                       capture_output=True, text=True, timeout_s=SUBPROCESS_TIMEOUT_S, env=env, cwd=REPO)
    assert proc.returncode == 2
    assert (proc.stdout + proc.stderr).splitlines() == [f"{fifo}: not a regular file"]


@pytest.mark.parametrize("budget", ["9" * 400 + "TiB", "1025TiB"])
def test_plan_device_budget_option_out_of_range(runner, budget):
    result = runner.invoke(app, ["plan", str(REPO / "specs" / "dlrm_criteo.yaml"), "--device-budget", budget])
    assert result.exit_code == 2
    shown = repr(budget) if len(budget) <= 40 else repr(budget[:40])
    assert result.output.splitlines() == [f"error: --device-budget: byte size {shown} is out of range (0 .. 1 PiB)"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("args", [["schema"], ["plan", "SPEC"], ["--help"]])
def test_output_to_a_full_disk_is_one_line_not_a_traceback(tmp_path, args):
    """`flowrec schema > full/schema.json` (plan, --help alike) on a full disk ended in click's
    traceback 'OSError: [Errno 28] No space left on device'."""
    import subprocess

    given = [str(REPO / "specs" / "wide_deep.yaml") if a == "SPEC" else a for a in args]
    with open("/dev/full", "w") as full:
        done = run_bounded([sys.executable, "-m", "flowrec", *given], timeout_s=120, stdout=full,
                           stderr=subprocess.PIPE, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1:] == [
        "error: cannot write the command's output to its standard output: No space left on device (redirected to a "
        "full disk?); what it holds of the output is incomplete"], done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
