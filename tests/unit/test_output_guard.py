"""The output guard's parts: its marker names are the owners' own file names, a failed write leaves
the old file, names from files stay in their folder, JSON documents are bounded."""
from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from flowrec.data.layout import META_FILE, DataError
from flowrec.data.names import inside, plain_name
from flowrec.data.output_guard import (
    OWNERS,
    OutputError,
    atomic_output,
    check_file_output,
    check_folder_output,
    host_tag,
    owner_of,
    replace_folder,
)
from flowrec.spec.json_doc import parse_json_text
from flowrec.testing.processes import run_bounded


def test_the_marker_files_are_the_owners_own_names():
    from flowrec.data.encoder_record import ENCODER_FILE, ENCODER_FORMAT
    from flowrec.runtime.checkpoint.store import CHECKPOINT_NAME
    from flowrec.serving.package import MANIFEST_FILE, PACKAGE_FORMAT
    from flowrec.runtime.rundir import LOCK_NAME, RUN_FILE

    markers = dict(OWNERS)
    assert set(markers["a training run"]) == {CHECKPOINT_NAME, RUN_FILE, LOCK_NAME}
    assert markers["a model package"] == {MANIFEST_FILE: f'"{PACKAGE_FORMAT}"'.encode()}
    assert markers["an encoder"] == {ENCODER_FILE: f'"{ENCODER_FORMAT}"'.encode()}
    assert set(markers["a dataset"]) == {META_FILE, f"train/{META_FILE}"}


def test_a_manifest_of_another_program_does_not_make_a_package(tmp_path: Path):
    (tmp_path / "manifest.json").write_text('{"format": "web-app"}')
    assert owner_of(tmp_path) is None
    (tmp_path / "manifest.json").write_text('{"format": "flowrec-model"}')
    assert owner_of(tmp_path) == "a model package"


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path: Path):
    out = tmp_path / "scores.parquet"
    out.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_output(out) as tmp:
            tmp.write_text("half")
            raise RuntimeError("disk full")
    assert out.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["scores.parquet"]
    with atomic_output(out) as tmp:
        tmp.write_text("new")
    assert out.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["scores.parquet"]


def test_a_file_output_in_a_folder_below_a_run_is_refused(tmp_path: Path):
    (tmp_path / "run" / "sub").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint.pt").write_bytes(b"")
    with pytest.raises(OutputError, match="a training run's folder"):
        check_file_output(tmp_path / "run" / "sub" / "x.json", [], overwrite=True)
    check_file_output(tmp_path / "x.json", [], overwrite=False)


@pytest.mark.parametrize("name", ["..", ".", "a/b", "a\\b", "", "x\x00y", "x\ny", 7, None, "n" * 256])
def test_a_name_that_is_not_one_plain_file_name_is_refused(name):
    with pytest.raises(DataError, match="not a plain name"):
        plain_name(name, "table")


def test_a_relative_path_must_stay_inside_its_folder(tmp_path: Path):
    (tmp_path / "pkg" / "vocab").mkdir(parents=True)
    (tmp_path / "secret.parquet").write_text("x")
    (tmp_path / "pkg" / "vocab" / "link.parquet").symlink_to(tmp_path / "secret.parquet")
    assert inside(tmp_path / "pkg", "vocab/user.parquet", "vocab") == tmp_path / "pkg" / "vocab" / "user.parquet"
    for bad, words in (("/etc/passwd", "not a relative path"), ("vocab/../../secret.parquet", "not a plain name"),
                       ("vocab/link.parquet", "leads outside")):
        with pytest.raises(DataError, match=words):
            inside(tmp_path / "pkg", bad, "vocab")


@pytest.mark.parametrize("text, words", [("[" * 10_000, "nested deeper"), ('{"a": 1, "a": 2}', "duplicate key"),
                                         ("", "is empty"), ("{", "is not JSON")])
def test_a_json_document_is_bounded_before_it_is_parsed(text: str, words: str):
    with pytest.raises(ValueError, match=words):
        parse_json_text(text, "x.json")


def test_nan_is_refused_only_where_numbers_must_be_finite():
    assert math.isnan(parse_json_text('{"a": NaN}', "x.json")["a"])
    with pytest.raises(ValueError, match="NaN"):
        parse_json_text('{"a": NaN}', "x.json", finite=True)


def test_overwrite_never_replaces_a_folder_that_holds_a_run_or_dataset(tmp_path: Path):
    (tmp_path / "out" / "runs" / "x").mkdir(parents=True)
    check_folder_output(tmp_path / "out", [], overwrite=True, kind="a model package")  # empty folders only
    (tmp_path / "out" / "runs" / "x" / "checkpoint.pt").write_bytes(b"")
    with pytest.raises(OutputError, match="holds a training run's folder"):
        check_folder_output(tmp_path / "out", [], overwrite=True, kind="a model package")
    (tmp_path / "ds" / "train").mkdir(parents=True)
    (tmp_path / "ds" / "train" / META_FILE).write_text('{"split": {"part": "train"}}')
    check_folder_output(tmp_path / "ds", [], overwrite=True, kind="a dataset")  # its own kind: replaced whole
    (tmp_path / "mine" / "train").mkdir(parents=True)
    (tmp_path / "mine" / "train" / META_FILE).write_text('{"split": {}}')  # a dataset named train, not a split
    with pytest.raises(OutputError, match="holds a dataset's folder"):
        check_folder_output(tmp_path / "mine", [], overwrite=True, kind="a dataset")


@pytest.mark.parametrize("kind", ["a dataset", "a model package"])
def test_overwrite_never_replaces_a_folder_of_files_flowrec_did_not_write(tmp_path: Path, kind):
    """`data synth --out notes --overwrite` (and `data convert`, `export`) replaced a folder of the
    user's own files whole (train --out refused it); only an empty folder or one of `kind` is."""
    for holding in ("thesis.txt", "a/b/thesis.txt", "a/link"):
        out = tmp_path / holding.replace("/", "_")
        (out / holding).parent.mkdir(parents=True)
        if holding.endswith("link"):
            (out / holding).symlink_to(tmp_path)
        else:
            (out / holding).write_text("mine")
        with pytest.raises(OutputError, match=f"refusing to replace {out}: it is not {kind}'s folder "
                                              f"\\(it holds {holding}\\)"):
            check_folder_output(out, [], overwrite=True, kind=kind)
        assert os.path.lexists(out / holding)


@pytest.mark.parametrize("command", [["data", "synth", "SPEC", "--rows", "8", "--out", "OUT", "--overwrite", "-q"],
                                     ["data", "convert", "csv", "RAW", "OUT", "--spec", "SPEC", "--overwrite", "-q"]])
def test_data_commands_keep_a_folder_of_the_users_files_given_with_overwrite(tmp_path: Path, command):
    from typer.testing import CliRunner

    from flowrec.cli import app
    from flowrec.testing.specs import mini_spec

    spec = tmp_path / "s.yaml"
    spec.write_text(mini_spec("own"))
    (tmp_path / "raw.csv").write_text("d1,user,label\n0.5,a,1\n0.1,b,0\n")
    out = tmp_path / "notes"
    out.mkdir()
    (out / "thesis.txt").write_text("mine")
    given = {"SPEC": str(spec), "RAW": str(tmp_path / "raw.csv"), "OUT": str(out)}
    result = CliRunner().invoke(app, [given.get(a, a) for a in command])
    assert result.exit_code == 2, result.output
    assert "it is not a dataset's folder (it holds thesis.txt)" in result.output, result.output
    assert sorted(p.name for p in out.iterdir()) == ["thesis.txt"]
    (out / "thesis.txt").unlink()  # the empty folder is written
    again = CliRunner().invoke(app, [given.get(a, a) for a in command])
    assert again.exit_code == 0, again.output
    assert (out / META_FILE).is_file()


def test_an_existing_output_that_is_not_a_regular_file_is_refused(tmp_path: Path):
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for name in ("pipe", "dangling"):
        with pytest.raises(OutputError, match="not a regular file"):
            check_file_output(tmp_path / name, [], overwrite=True)
    with pytest.raises(OutputError, match="not a regular file"):
        check_file_output(Path("/dev/null"), [], overwrite=True)


def test_a_pipe_named_like_a_json_document_is_refused_without_blocking(tmp_path: Path):
    from flowrec.spec.json_doc import read_json_document

    os.mkfifo(tmp_path / "run.json")
    with pytest.raises(ValueError, match="not a regular file"):
        read_json_document(tmp_path / "run.json")
    (tmp_path / "pkg").mkdir()
    os.mkfifo(tmp_path / "pkg" / "manifest.json")
    assert owner_of(tmp_path / "pkg") is None  # a marker whose content is read is never opened as a pipe


def test_replacing_a_folder_keeps_the_old_one_when_the_new_cannot_be_moved_in(tmp_path: Path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    with pytest.raises(OSError):
        replace_folder(tmp_path / "missing", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (tmp_path / "out" / "old.txt").is_file()
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "new.txt").write_text("new")
    replace_folder(tmp_path / "new", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["new.txt"]


def test_replacing_a_link_to_a_folder_leaves_neither_the_link_nor_its_folder_changed(tmp_path: Path):
    """`replace_folder` given a link to a folder (the commands give it the folder the link names,
    `written_path`): the link becomes the new folder, the folder it named is untouched, and no
    hidden `.latest.old-*` link is left behind."""
    (tmp_path / "day1").mkdir()
    (tmp_path / "day1" / "old.txt").write_text("old")
    (tmp_path / "latest").symlink_to("day1", target_is_directory=True)
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "new.txt").write_text("new")
    replace_folder(tmp_path / "new", tmp_path / "latest")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day1", "latest"]
    assert not (tmp_path / "latest").is_symlink() and [p.name for p in (tmp_path / "latest").iterdir()] == ["new.txt"]
    assert (tmp_path / "day1" / "old.txt").read_text() == "old"


@pytest.mark.parametrize("check", ["file", "folder"])
def test_missing_folders_above_an_output_are_made_only_once_every_check_passed(tmp_path: Path, check):
    """As `mkdir -p`: `export RUN a/b/pkg` and `--out reports/x/s.parquet` make a/b and reports/x;
    under a file, or under a folder flowrec owns, nothing is made."""
    def guard(out: Path, inputs=(), overwrite=False):
        if check == "file":
            check_file_output(out, list(inputs), overwrite)
        else:
            check_folder_output(out, list(inputs), overwrite, "a model package")

    guard(tmp_path / "a" / "b" / "out")
    assert (tmp_path / "a" / "b").is_dir() and not (tmp_path / "a" / "b" / "out").exists()
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(OutputError, match=r"f\.txt is not a folder"):
        guard(tmp_path / "f.txt" / "c" / "out")
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    with pytest.raises(OutputError, match="a training run's folder"):
        guard(run / "new" / "deeper" / "out")
    assert not (run / "new").exists()
    with pytest.raises(OutputError, match="which this command reads"):
        guard(tmp_path / "x" / "y", inputs=[tmp_path / "x" / "y" / "rows.csv"])
    assert not (tmp_path / "x").exists()


def test_a_split_owns_its_root_and_a_dataset_named_train_does_not(tmp_path: Path):
    split, hand = tmp_path / "split", tmp_path / "hand"
    for root, record in ((split, '{"split": {"part": "train", "test_fraction": 0.1}}'), (hand, '{"split": {}}')):
        (root / "train").mkdir(parents=True)
        (root / "train" / META_FILE).write_text(record)
    assert owner_of(split) == "a dataset" and owner_of(hand) is None
    check_folder_output(hand / "test", [], False, "a dataset")  # the user's test set beside their train set
    with pytest.raises(OutputError, match="a dataset's folder"):
        check_folder_output(split / "extra", [], False, "a dataset")


@pytest.mark.parametrize("command", [
    ["train", "SPEC", "--out", "LONG"],
    ["train", "SPEC", "--resume", "LONG"],
    ["export", "LONG", "pkg"],
    ["export", "run", "LONG"],
    ["eval", "run", "--json", "LONG.json"],
    ["plan", "SPEC", "--json", "LONG.json"],
    ["data", "inspect", "LONG"],
    ["validate", "LONG.yaml"],
])
def test_a_path_whose_name_is_longer_than_a_file_name_can_be_is_one_line(tmp_path: Path, command):
    """Python's Path.exists() raises on a name past the file system's limit (255 bytes) where it
    returns False for a missing file, which ended `train --out`, `export`, `plan --json` and
    `data inspect` in a traceback; every command now names the option and the limit."""
    from typer.testing import CliRunner

    from flowrec.cli import app

    spec = Path(__file__).resolve().parents[2] / "specs" / "two_task.yaml"
    long = str(tmp_path / ("x" * 300))
    args = [str(spec) if a == "SPEC" else a.replace("LONG", long) for a in command]
    result = CliRunner().invoke(app, args)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and "Traceback" not in result.output and len(lines) == 1, result.output
    assert "is 30" in lines[0] and "a file name holds at most 255" in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [
    ["train", "SPEC", "--out", "NAME"],
    ["export", "run", "NAME"],
    ["predict", "pkg", "rows.csv", "--out", "NAME.parquet"],
    ["data", "convert", "csv", "NAME.csv", "out", "--spec", "SPEC"],
])
def test_a_path_whose_name_is_not_utf8_is_one_line(tmp_path: Path, command):
    """A file name of latin-1 bytes (b'day\\xe9'): `train --out` ended in a traceback
    (UnicodeEncodeError writing run.json), `export` in another (torch's writer took the name for a
    file object), and `convert` / `predict` said only "'utf-8' codec can't encode characters"."""
    from typer.testing import CliRunner

    from flowrec.cli import app

    spec = Path(__file__).resolve().parents[2] / "specs" / "two_task.yaml"
    name = str(tmp_path / os.fsdecode(b"day\xe9"))
    args = [str(spec) if a == "SPEC" else a.replace("NAME", name) for a in command]
    result = CliRunner().invoke(app, args)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and "Traceback" not in result.output and len(lines) == 1, result.output
    assert "the name 'day\\xe9" in lines[0] and "is not UTF-8 text" in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []


def test_an_output_whose_name_is_near_the_limit_gets_temp_names_the_file_system_holds(tmp_path: Path):
    """A name of 250 bytes is one the file system holds, but the temp names made from it were not
    ('.NAME.partial-PID-XXXXXXXX': 'cannot create the output folder next to NAME: File name too
    long', the same for predict's, export's and a replaced folder's temp names)."""
    from flowrec.cli.export_cmd import _staging_folder
    from flowrec.data.output import staged_output

    name = "é" * 125  # 250 bytes
    out = tmp_path / f"{name}"
    with atomic_output(tmp_path / f"{name[:-3]}.parquet") as tmp:
        tmp.write_text("scores")
    with staged_output(out, overwrite=False) as tmp:
        (tmp / "part-00000.parquet").write_text("rows")
    with staged_output(out, overwrite=True) as tmp:  # the old folder moved aside, then removed
        (tmp / "part-00000.parquet").write_text("new rows")
    assert (out / "part-00000.parquet").read_text() == "new rows"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, f"{name[:-3]}.parquet"])
    staged = _staging_folder(tmp_path / name)
    staged.mkdir()
    assert staged.parent == tmp_path


@pytest.mark.parametrize("command, name", [
    (["train", "SPEC", "--out", "", "--rows", "64", "-q"], "--out"),
    (["validate", ""], "SPEC"),
    (["validate", "SPEC", ""], "SPEC"),
    (["plan", "SPEC", "--json", "", "-q"], "--json"),
    (["data", "convert", "csv", "rows.csv", "", "--spec", "SPEC"], "OUT"),
    (["data", "synth", "SPEC", "--rows", "64", "--out", "", "-q"], "--out"),
])
def test_an_empty_path_is_one_line_not_the_working_folder(tmp_path: Path, monkeypatch, command, name):
    """A Path reads "" as '.': `train --out ""` (an unset variable in --out "$OUT") trained into
    the working folder, `validate ""` scanned it, and `data convert csv rows.csv ""` said it would
    replace rows.csv; every path option and argument now refuses an empty one, naming it."""
    from typer.testing import CliRunner

    from flowrec.cli import app
    from flowrec.testing.specs import run_spec

    spec = tmp_path / "s.yaml"
    spec.write_text(run_spec("empty", batch_size=32, epochs=1))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    result = CliRunner().invoke(app, [str(spec) if a == "SPEC" else a for a in command])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and "Traceback" not in result.output and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: {name} is an empty path"), lines[0]
    assert list(work.iterdir()) == []


def test_a_folder_output_inside_a_folder_the_command_reads_is_refused(tmp_path: Path):
    """`data convert parquet raw raw/out` wrote the dataset among the raw rows: the next conversion
    of `raw` refused it as an encoded dataset. A file input's folder is no input folder."""
    from flowrec.data.output_guard import check_folder_output

    (tmp_path / "raw" / "day=1").mkdir(parents=True)
    (tmp_path / "s.yaml").write_text("name: x\n")
    for out in (tmp_path / "raw" / "out", tmp_path / "raw" / "day=2" / "out"):
        with pytest.raises(OutputError, match=f"it lies in {tmp_path / 'raw'}, the folder of rows this command reads"):
            check_folder_output(out, [tmp_path / "raw", tmp_path / "s.yaml"], False, "a dataset",
                                rows=[tmp_path / "raw"])
        assert not out.parent.exists() or out.parent == tmp_path / "raw"  # nothing made
    check_folder_output(tmp_path / "out", [tmp_path / "raw", tmp_path / "s.yaml"], False, "a dataset",
                        rows=[tmp_path / "raw"])
    check_folder_output(tmp_path / "raw" / "x", [tmp_path / "raw"], False, "a dataset")  # another input: an
    # encoder's folder (`--encoder-from`) holding a new dataset is read as before


@pytest.mark.parametrize("command", [
    ["plan", "SPEC", "--json", "OUT", "--overwrite", "-q"],
    ["plan", "SPEC", "--dot", "OUT", "--overwrite", "-q"],
    ["data", "profile", "SPEC", "DATA", "--json", "OUT", "--overwrite", "-q"],
    ["calibrate", "SPEC", "--out", "OUT", "--overwrite", "--seconds", "1"],
])
@pytest.mark.parametrize("bound", ["raw.csv", "fmap.txt"])
def test_an_output_never_replaces_a_file_the_spec_binds(tmp_path: Path, command, bound):
    """`flowrec plan s.yaml --json raw.csv --overwrite` replaced the raw data the spec binds (or its
    libsvm feature map) with plan JSON: the guard knew the spec file alone as the command's input.
    Now plan, data profile and calibrate count the spec's bound files as inputs, as eval --json and
    predict --out keep off files they never read since 48d21a1 and 0c58e5e."""
    from typer.testing import CliRunner

    from flowrec.cli import app
    from flowrec.testing.specs import mini_spec

    (tmp_path / "raw.csv").write_text("d1,user,label\n0.5,a,1\n0.1,b,0\n")
    (tmp_path / "fmap.txt").write_text("1 d1\n2 user\n")
    spec = tmp_path / "s.yaml"
    spec.write_text(mini_spec("bound") + "data: {format: csv, path: raw.csv, label: label, "
                                        "options: {feature_map: fmap.txt}}\n")
    data = tmp_path / "data"
    made = CliRunner().invoke(app, ["data", "synth", str(spec), "--rows", "64", "--out", str(data), "-q"])
    assert made.exit_code == 0, made.output
    kept = (tmp_path / bound).read_bytes()
    given = {"SPEC": str(spec), "DATA": str(data), "OUT": str(tmp_path / bound)}
    result = CliRunner().invoke(app, [given.get(a, a) for a in command])
    assert result.exit_code == 2, result.output
    assert f"refusing to write {tmp_path / bound}" in result.output, result.output
    assert (tmp_path / bound).read_bytes() == kept


@pytest.mark.parametrize("command", [
    ["plan", "SPEC", "--json", "OUT", "--overwrite", "-q"],
    ["plan", "SPEC", "--dot", "OUT", "--overwrite", "-q"],
    ["plan", "SPEC", "--svg", "OUT.svg", "--overwrite", "-q"],
    ["data", "profile", "SPEC", "DATA", "--json", "OUT", "--overwrite", "-q"],
    ["calibrate", "SPEC", "--out", "OUT", "--overwrite", "--seconds", "1"],
])
def test_overwrite_replaces_only_the_commands_own_output(tmp_path: Path, command):
    """`flowrec plan a.yaml --json b.yaml --overwrite` replaced another spec (any file the spec does
    not bind) with plan JSON, as data profile --json and calibrate --out did; now --overwrite
    replaces only an empty file or what the command writes there, as eval --json and predict --out."""
    from typer.testing import CliRunner

    from flowrec.cli import app
    from flowrec.testing.specs import mini_spec

    spec = tmp_path / "s.yaml"
    spec.write_text(mini_spec("own"))
    data = tmp_path / "data"
    made = CliRunner().invoke(app, ["data", "synth", str(spec), "--rows", "64", "--out", str(data), "-q"])
    assert made.exit_code == 0, made.output
    other = tmp_path / ("other.svg" if "OUT.svg" in command else "other.yaml")
    other.write_text(mini_spec("another") if other.suffix == ".yaml" else "<p>not a drawing</p>\n")
    kept = other.read_bytes()
    given = {"SPEC": str(spec), "DATA": str(data), "OUT": str(other), "OUT.svg": str(other)}
    result = CliRunner().invoke(app, [given.get(a, a) for a in command])
    assert result.exit_code == 2, result.output
    assert f"refusing to replace {other}: it is not" in result.output, result.output
    assert other.read_bytes() == kept
    if command[0] == "calibrate":
        return  # (its own output takes a measurement: the JSON outputs below are alike)
    other.write_text("")  # an empty file, then the command's own earlier output, are replaced
    for _ in range(2):
        again = CliRunner().invoke(app, [given.get(a, a) for a in command])
        assert again.exit_code == 0, again.output
        assert other.stat().st_size > 0


def test_eval_refuses_its_json_output_before_reading_the_run(tmp_path: Path, monkeypatch):
    """`flowrec eval RUN --json RUN/run.json` (production.md: the guard is checked before any
    work) loaded the run's checkpoint first, every page of a DLRM run's 2.2 GB read for its digest,
    and said 'scoring DATA (the data RUN evaluated on ...)' before refusing the output."""
    from typer.testing import CliRunner

    from flowrec.cli import app
    from flowrec.serving import trained

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}", encoding="utf-8")
    (run / "checkpoint.pt").write_bytes(b"not read")
    loaded = []
    monkeypatch.setattr(trained, "load_trained", lambda *args: loaded.append(args))
    for out, words in ((run / "metrics.json", "a training run's folder"), (tmp_path / "s.yaml", "is not")):
        out.parent.mkdir(exist_ok=True)
        if out.suffix == ".yaml":
            out.write_text("name: mine\n", encoding="utf-8")
        result = CliRunner().invoke(app, ["eval", str(run), "--json", str(out), "--overwrite"])
        assert result.exit_code == 2 and words in result.output, result.output
        assert "scoring" not in result.output
    assert loaded == []


def _dead_pid() -> int:
    """The pid of a process that has ended (and was waited for)."""
    import sys

    return int(run_bounded([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, timeout_s=60).stdout)


def test_temp_files_a_killed_command_left_are_removed_by_the_next_write_of_that_file(tmp_path: Path):
    """`flowrec predict --out F` killed (kill -9) while it wrote left `.F.PID-HOST-X.tmp.parquet` beside F,
    never removed; the next write of F removes such files of processes no longer running, with one
    line naming each and its size, and leaves a running process's, and every other name, alone."""
    dead, live, h = _dead_pid(), os.getpid(), host_tag()
    gone = [f".scores.{dead}-{h}-0123abcd.tmp.parquet"]
    kept = [f".scores.{live}-{h}-0123abcd.tmp.parquet",  # a command writing scores.parquet now
            f".scores.{dead}-{h}-0123abcd.tmp.csv",  # scores.csv's, not this output's
            f".scores.{dead}-{h}-0123abc.tmp.parquet", f".scores.{dead}-{h}-0123abcd.tmp.parquet.bak",
            f".scores2.{dead}-{h}-0123abcd.tmp.parquet", "scores.parquet.tmp"]
    for name in gone + kept:
        (tmp_path / name).write_bytes(b"x" * 3000)
    (tmp_path / f".scores.{dead}-{h}-deadbeef.tmp.parquet").symlink_to(tmp_path / kept[0])  # a link: not flowrec's
    lines: list[str] = []
    with atomic_output(tmp_path / "scores.parquet", status=lines.append) as tmp:
        tmp.write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*kept, f".scores.{dead}-{h}-deadbeef.tmp.parquet", "scores.parquet"])
    assert len(lines) == 1 and f".scores.{dead}-{h}-0123abcd.tmp.parquet (2.9 KiB)" in lines[0], lines


def test_folders_a_killed_conversion_left_are_removed_by_the_next_one(tmp_path: Path):
    """`data convert` / `synth` killed (kill -9) left `.OUT.partial-PID-HOST-X` (a dataset's worth of part
    files), never removed; the next staging of OUT removes those of processes no longer running,
    and export's rule is the same one (`.OUT.export-PID-HOST-X`, the set-aside `.OUT.old-PID-HOST-X`)."""
    from flowrec.cli.export_cmd import _staging_folder
    from flowrec.data.output import staged_output

    dead, live, h = _dead_pid(), os.getpid(), host_tag()
    aside = _dead_pid()  # another command's: its new OUT was in place, the old one half removed
    gone = [f".ds.partial-{dead}-{h}-00000000", f".ds.gone-{aside}-{h}-0000ffff", f".ds.export-{dead}-{h}-12345678"]
    kept = [f".ds.partial-{live}-{h}-00000000", f".ds.partial-{dead}-{h}-0000000", f".ds.partial-{dead}-{h}-00000000x",
            f".dsx.partial-{dead}-{h}-00000000", f"ds.partial-{dead}-{h}-00000000"]
    for name in gone + kept:
        (tmp_path / name).mkdir()
        (tmp_path / name / "part-0.parquet").write_bytes(b"x" * 100)
    (tmp_path / f".ds.partial-{dead}-{h}-11111111").write_text("a file, not a folder flowrec stages")
    kept.append(f".ds.partial-{dead}-{h}-11111111")
    lines: list[str] = []
    with staged_output(tmp_path / "ds", overwrite=False, status=lines.append) as tmp:
        (tmp / "x").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, "ds"])
    assert len(lines) == 1 and all(f"{name} (100 B)" in lines[0] for name in gone), lines
    (tmp_path / f".pkg.partial-{dead}-{h}-00000000").mkdir()
    _staging_folder(tmp_path / "pkg")
    assert not (tmp_path / f".pkg.partial-{dead}-{h}-00000000").exists()


def test_leftovers_of_another_machine_or_an_older_flowrec_are_removed_only_once_stale(tmp_path: Path):
    """On a folder shared between machines (NFS, a cluster's home), `data convert ... OUT` on host B
    removed host A's `.OUT.partial-PID-X` while A still wrote it: PID, a process of A, runs on no
    B. Temp names now carry the machine (`PID-HOST-X`); another machine's, and an older flowrec's
    (`PID-X`, no host), are left, in one line naming them, until nothing in them (the folder or a
    file below it) was modified for STALE_AFTER_S; then they are removed as this machine's are."""
    import random
    import time

    from flowrec.data.output import staged_output
    from flowrec.data.output_guard import STALE_AFTER_S, remove_leftovers

    rng = random.Random()
    dead, h = _dead_pid(), host_tag()
    other = next(t for t in (f"{rng.getrandbits(32):08x}" for _ in range(9)) if t != h)

    def tag() -> str:
        return f"{rng.getrandbits(32):08x}"

    fresh = [f".ds.partial-{dead}-{other}-{tag()}", f".ds.partial-{dead}-{tag()}", ".ds.export-tmp"]
    stale = [f".ds.gone-{dead}-{other}-{tag()}", f".ds.partial-{dead}-{tag()}", f".ds.partial-{dead}-{h}-{tag()}"]
    busy = f".ds.export-{dead}-{other}-{tag()}"  # old files, and one written now
    long_ago = time.time() - STALE_AFTER_S - rng.randint(60, 10 ** 6)
    for name in fresh + stale + [busy]:
        (tmp_path / name / "day=1").mkdir(parents=True)
        for k in range(rng.randint(1, 4)):
            part = tmp_path / name / "day=1" / f"part-{k}.parquet"
            part.write_bytes(rng.randbytes(rng.choice([17, 300, 5000])))
            if name in stale or name == busy:
                os.utime(part, (long_ago, long_ago))
        if name in stale or name == busy:
            os.utime(tmp_path / name / "day=1", (long_ago, long_ago))
            os.utime(tmp_path / name, (long_ago, long_ago))
    (tmp_path / busy / "day=1" / "part-9.parquet").write_bytes(rng.randbytes(99))
    os.utime(tmp_path / busy / "day=1", (long_ago, long_ago))
    os.utime(tmp_path / busy, (long_ago, long_ago))
    lines: list[str] = []
    removed = remove_leftovers(tmp_path / "ds", lines.append)
    assert sorted(p.name for p, _ in removed) == sorted(stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*fresh, busy])
    assert len(lines) == 2 and all(name in lines[1] for name in [*fresh, busy]), lines
    assert not any(name in lines[1] for name in stale), lines
    with staged_output(tmp_path / "ds", overwrite=False) as staged:
        assert staged.name.startswith(f".ds.partial-{os.getpid()}-{h}-")  # this machine's name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*fresh, busy, "ds"])


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_an_output_that_is_a_link_is_written_where_it_leads_and_stays_a_link(tmp_path: Path, kind: str):
    """`data convert ... --overwrite home/latest` (or `export`, `predict --out home/s.csv`), the
    output a link to a dataset (a file) on another disk: the new output was renamed over the link,
    so it landed beside the link, the link was gone, and the old output lived on where no name of
    the user's led. Now the new output replaces what the link names, and the link stays."""
    import random

    from flowrec.data.output import staged_output

    rng = random.Random()
    (tmp_path / "big").mkdir()
    (tmp_path / "home").mkdir()
    old, new = rng.randbytes(rng.randint(10, 4000)), rng.randbytes(rng.randint(10, 4000))
    target = tmp_path / "big" / ("ds1" if kind == "folder" else "s1.csv")
    link = tmp_path / "home" / ("latest" if kind == "folder" else "s.csv")
    if kind == "folder":
        target.mkdir()
        (target / "part-0.parquet").write_bytes(old)
        (target / META_FILE).write_text("{}")  # a dataset: only such a folder --overwrite replaces
        link.symlink_to(target, target_is_directory=True)
        check_folder_output(link, [], True, "a dataset")
        with staged_output(link, overwrite=True) as staged:
            (staged / "part-0.parquet").write_bytes(new)
        assert (target / "part-0.parquet").read_bytes() == new
    else:
        target.write_bytes(old)
        link.symlink_to(target)
        check_file_output(link, [], True)
        with atomic_output(link) as staged:
            staged.write_bytes(new)
        assert target.read_bytes() == new
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert [p.name for p in (tmp_path / "home").iterdir()] == [link.name]
    assert [p.name for p in (tmp_path / "big").iterdir()] == [target.name]  # no temp left beside it


def test_a_kill_between_the_renames_of_a_swap_leaves_the_old_output_put_back(tmp_path: Path):
    """`data convert --overwrite OUT` killed (kill -9) after OUT was renamed aside to `.OUT.old-TAG`
    and before the new folder was renamed in: no OUT, and the next command removed `.OUT.old-TAG`,
    the user's old dataset, as a leftover. It is now renamed back to OUT, in one line. A set-aside
    link (an older flowrec's) is removed, never the folder it names."""
    import random
    import sys

    from flowrec.data.output_guard import remove_leftovers

    rng = random.Random()
    old = {f"part-{k}.parquet": rng.randbytes(rng.randint(1, 3000)) for k in range(rng.randint(1, 5))}
    (tmp_path / "ds").mkdir()
    for name, data in old.items():
        (tmp_path / "ds" / name).write_bytes(data)
    script = f"""
import os, signal
from pathlib import Path
from flowrec.data.output import staged_output
renamed = []
rename = os.rename
def killed_at_the_second(a, b):
    renamed.append(a)
    if len(renamed) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    rename(a, b)
os.rename = killed_at_the_second
with staged_output(Path({str(tmp_path / 'ds')!r}), overwrite=True) as tmp:
    (tmp / "part-0.parquet").write_bytes(os.urandom(77))
"""
    done = run_bounded([sys.executable, "-c", script], capture_output=True, text=True, timeout_s=120)
    assert done.returncode == -9, done.stderr
    assert not (tmp_path / "ds").exists() and len(list(tmp_path.iterdir())) == 2  # .ds.old-*, .ds.partial-*
    elsewhere = tmp_path / "kept"
    elsewhere.mkdir()
    (elsewhere / "x").write_bytes(rng.randbytes(50))
    (tmp_path / f".ds.old-{_dead_pid()}-{host_tag()}-{rng.getrandbits(32):08x}").symlink_to(elsewhere)
    lines: list[str] = []
    remove_leftovers(tmp_path / "ds", lines.append)
    assert {p.name: p.read_bytes() for p in (tmp_path / "ds").iterdir()} == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "kept"] and (elsewhere / "x").is_file()
    assert len(lines) == 2 and "restored" in lines[0] and ".ds.partial-" in lines[1], lines


def test_a_set_aside_output_is_put_back_even_where_its_staged_folder_was_removed_by_hand(tmp_path: Path, monkeypatch):
    """kill -9 between a swap's renames, then `rm -rf .ds.partial-*` by hand (the user cleaning up
    what looked like a leftover): the next command removed `.ds.old-TAG`, the user's only copy of
    the old dataset. A set-aside folder is now always whole (the old one is renamed `.ds.gone-TAG`
    before it is removed), so it is put back without its staged partner; a `.gone-` one is removed.
    An older flowrec's set-aside name (no machine) without its staged folder may be half removed:
    removed, as before."""
    import random

    from flowrec.data import output_guard
    from flowrec.data.output_guard import remove_leftovers

    rng = random.Random()
    h = host_tag()
    old = {f"part-{k}.parquet": rng.randbytes(rng.randint(1, 3000)) for k in range(rng.randint(1, 5))}
    aside = tmp_path / f".ds.old-{_dead_pid()}-{h}-{rng.getrandbits(32):08x}"
    half = tmp_path / f".ds.gone-{_dead_pid()}-{h}-{rng.getrandbits(32):08x}"
    older = tmp_path / f".ds.old-{_dead_pid()}-{rng.getrandbits(32):08x}"
    for folder in (aside, half, older):
        folder.mkdir()
        for name, data in old.items():
            (folder / name).write_bytes(data if folder == aside else data[:1])
    (half / "part-0.parquet").unlink()
    long_ago = __import__("time").time() - output_guard.STALE_AFTER_S - 60
    os.utime(older / "part-0.parquet", (long_ago, long_ago))
    for p in older.iterdir():
        os.utime(p, (long_ago, long_ago))
    os.utime(older, (long_ago, long_ago))
    lines: list[str] = []
    remove_leftovers(tmp_path / "ds", lines.append)
    assert {p.name: p.read_bytes() for p in (tmp_path / "ds").iterdir()} == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    assert "restored" in lines[0] and aside.name in lines[0], lines

    # the swap itself: the old folder is removed under a `.gone-` name, never as a half-removed `.old-`
    removed_as: list[str] = []
    real = output_guard.shutil.rmtree
    monkeypatch.setattr(output_guard.shutil, "rmtree", lambda p, **kw: (removed_as.append(Path(p).name), real(p, **kw)))
    new = tmp_path / "new"
    new.mkdir()
    (new / "part-0.parquet").write_bytes(rng.randbytes(40))
    output_guard.replace_folder(new, tmp_path / "ds")
    assert len(removed_as) == 1 and removed_as[0].startswith(".ds.gone-"), removed_as
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"] and [p.name for p in (tmp_path / "ds").iterdir()] == ["part-0.parquet"]


@pytest.mark.parametrize("folder", ["/proc", "/sys"])
def test_a_file_output_in_a_folder_that_takes_no_file_is_refused_before_the_work(tmp_path: Path, folder: str):
    """`flowrec eval RUN --json ro/m.json` (a read-only mount) scored the whole run, then said
    'cannot write': the check a command runs before its work now writes a probe there."""
    if not Path(folder).is_dir():
        pytest.skip(f"no {folder} on this system")
    with pytest.raises(OutputError, match=rf"cannot write {folder}/m\.json: .* \(its folder {folder} takes no new file\)"):
        check_file_output(Path(folder) / "m.json", [tmp_path / "run"], overwrite=False)


def test_the_probe_leaves_nothing_behind(tmp_path: Path):
    out = tmp_path / "a" / "b" / "m.json"
    check_file_output(out, [tmp_path / "run"], overwrite=False)
    assert out.parent.is_dir() and list(out.parent.iterdir()) == []
