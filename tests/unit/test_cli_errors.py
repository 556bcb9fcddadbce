"""The command line's own errors, as a hostile user meets them: every one is one line `error: ...`
with exit status 2, as flowrec's other errors are, whatever the command and the mistake."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from flowrec.cli import app


def _one_error_line(result) -> str:
    """The single line a refused command printed (its output mixes stdout and stderr)."""
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: "), result.output
    return lines[0]


@pytest.mark.parametrize("args, named", [
    (["train", "s.yaml", "--epochs", "0"], "--epochs"),
    (["train", "s.yaml", "--epochs", "x"], "--epochs"),
    (["predict", "pkg", "rows.csv", "--top-k", "0"], "--top-k"),
    (["calibrate", "--nproc", "0"], "--nproc"),
    (["train"], "SPEC"),
    (["train", "s.yaml", "--no-such-option"], "--no-such-option"),
    (["data", "convert", "csv"], "SOURCE"),
    (["data", "no-such-command"], "no-such-command"),
    (["no-such-command"], "no-such-command"),
    (["--no-such-option"], "--no-such-option"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else None)
def test_click_errors_are_one_line(args: list[str], named: str) -> None:
    line = _one_error_line(CliRunner().invoke(app, args))
    assert named in line
    assert "--help" in line  # where to look, on the same line


@pytest.mark.parametrize("args, meant", [
    (["data", "convert", "--eval", "0.1", "csv", "in.csv", "out"], "(did you mean --test-fraction?)"),
    (["data", "convert", "--validation=0.1", "csv", "in.csv", "out"], "(did you mean --test-fraction?)"),
    (["train", "s.yaml", "--eval", "d"], "(did you mean --eval-data or --eval-every?)"),
    (["train", "s.yaml", "--epoch", "2"], "(did you mean --epochs?)"),
    (["eval", "runs/x", "--grop-by", "user"], "(did you mean --group-by?)"),
    (["predict", "pkg", "rows.csv", "--topk", "5"], "(did you mean --top-k?)"),
    (["export", "runs/x", "out", "--precision", "bf16"], "(did you mean --dtype?)"),
    (["calibrate", "--gpu"], "(did you mean --device?)"),
    (["train", "s.yaml", "--batch-size", "512"], "(set in the spec, not on the command line: training.batch_size)"),
    (["train", "s.yaml", "--lr", "0.1"], "optimizer.dense.lr and optimizer.sparse.lr)"),
    (["train", "s.yaml", "--precision", "bf16"], "training.precision)"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else None)
def test_an_unknown_option_names_what_was_meant(args: list[str], meant: str) -> None:
    """`data convert --eval` was told "(Possible options: --help)", click's one close match, and
    `train --lr` "--rows or --plan": the line names the option or spec setting a user meant."""
    line = _one_error_line(CliRunner().invoke(app, args))
    assert meant in line
    assert "Possible options" not in line and "mean --help" not in line


@pytest.mark.parametrize("args", [["data", "convert", "--xyzzy", "csv", "a", "b"], ["train", "s.yaml", "-z"]],
                         ids=lambda a: " ".join(a))
def test_an_unknown_option_like_none_suggests_nothing(args: list[str]) -> None:
    line = _one_error_line(CliRunner().invoke(app, args))
    assert args[-4 if args[0] == "data" else -1] in line and "mean" not in line and "spec" not in line


@pytest.mark.parametrize("command", [[], ["data"], ["train"], ["data", "convert"]])
def test_help_is_as_before(command: list[str]) -> None:
    shown = CliRunner().invoke(app, [*command, "--help"])
    assert shown.exit_code == 0 and "Usage:" in shown.output and "error:" not in shown.output
    if len(command) <= 1 and command != ["train"]:  # a group given no command shows its help
        bare = CliRunner().invoke(app, command)
        assert "Usage:" in bare.output and "error:" not in bare.output


@pytest.mark.parametrize("args, named", [
    (["eval", "runs/x", "--group-by", ""], "--group-by"),
    (["train", "s.yaml", "--dask", ""], "--dask"),
    (["plan", "s.yaml", "--cache", ""], "--cache"),
    (["predict", "pkg", "rows.csv", "--keep", "a", "--keep", ""], "--keep"),
    (["data", "convert", "", "in.csv", "out"], "FORMAT"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else None)
def test_an_empty_text_value_is_refused(args: list[str], named: str) -> None:
    """`--group-by ""` (an unset shell variable) was read as no --group-by: scored without gAUC."""
    line = _one_error_line(CliRunner().invoke(app, args))
    assert f"{named} is empty" in line


@pytest.mark.parametrize("flag, name, named", [
    ("--svg", "plan.png", "--png"), ("--png", "plan.svg", "--svg"), ("--dot", "plan.png", "--png"),
    ("--json", "plan.dot", "--dot"), ("--svg", "plan.pdf", ".svg"),
])
def test_a_drawing_is_not_written_under_another_format_s_name(tmp_path, flag: str, name: str, named: str) -> None:
    """`plan --svg x.png` wrote SVG text into a .png name without a word."""
    from pathlib import Path

    spec = Path(__file__).parents[2] / "specs" / "avazu.yaml"
    out = tmp_path / name
    line = _one_error_line(CliRunner().invoke(app, ["plan", str(spec), flag, str(out), "-q"]))
    assert flag in line and named in line
    assert not out.exists()


def test_a_drawing_under_its_own_name_is_written(tmp_path) -> None:
    from pathlib import Path

    spec = Path(__file__).parents[2] / "specs" / "avazu.yaml"
    done = CliRunner().invoke(app, ["plan", str(spec), "--svg", str(tmp_path / "PLAN.SVG"), "--dot", str(tmp_path / "p.gv"), "-q"])
    assert done.exit_code == 0, done.output
    assert (tmp_path / "PLAN.SVG").exists() and (tmp_path / "p.gv").exists()


@pytest.mark.parametrize("given, meant", [("CSV", "csv"), ("Criteo", "criteo"), ("LibSVM", "libsvm")])
def test_a_format_in_another_case_names_the_known_one(tmp_path, given: str, meant: str) -> None:
    """`data convert CSV ...` said only "unknown data format 'CSV'", as a spec's data.format: CSV says
    (did you mean 'csv'?)."""
    from pathlib import Path

    raw = tmp_path / "rows.csv"
    raw.write_text("a,b\n1,2\n")
    spec = Path(__file__).parents[2] / "specs" / "avazu.yaml"
    line = _one_error_line(CliRunner().invoke(app, ["data", "convert", given, str(raw), str(tmp_path / "out"),
                                                    "--spec", str(spec)]))
    assert f"did you mean {meant!r}" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["train", "calibrate"])
def test_more_cuda_ranks_than_gpus_are_refused_before_the_launch(tmp_path, monkeypatch, command: str) -> None:
    """`train SPEC --device cuda --nproc 4` on a machine with 2 GPUs launched the ranks, and those
    past the last GPU failed after starting; `calibrate --nproc` checked it: now both do, at once."""
    from pathlib import Path

    import torch

    import flowrec.cli.ranks as ranks

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    launched = []
    monkeypatch.setattr(ranks, "launch_ranks", lambda *a, **k: launched.append(a) or 0)
    spec = Path(__file__).parents[2] / "specs" / "avazu.yaml"
    args = {"train": ["train", str(spec), "--device", "cuda", "--nproc", "4", "--rows", "100",
                      "--out", str(tmp_path / "run")],
            "calibrate": ["calibrate", "--device", "cuda", "--nproc", "4", "--out", str(tmp_path / "p.json")]}
    line = _one_error_line(CliRunner().invoke(app, args[command]))
    assert "--nproc 4" in line and "has 2" in line
    assert not launched and not (tmp_path / "run").exists() and not (tmp_path / "p.json").exists()


def test_synth_refuses_rows_the_disk_cannot_hold(tmp_path, monkeypatch) -> None:
    """`data synth SPEC --rows 1000000000000000000 --out d` wrote until the disk was full."""
    import shutil
    from pathlib import Path

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**6, 10**6 - 1000, 1000))
    spec = Path(__file__).parents[2] / "specs" / "avazu.yaml"
    line = _one_error_line(CliRunner().invoke(app, ["data", "synth", str(spec), "--rows", "20000", "--out",
                                                    str(tmp_path / "d"), "-q"]))
    assert "--rows" in line and "free" in line
    assert not (tmp_path / "d").exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command, flag", [
    (["plan", "SPEC", "-q"], "--device-budget"),
    (["train", "SPEC", "--max-steps", "1", "--out", "OUT"], "--device-budget"),
    (["data", "profile", "SPEC", "OUT"], "--budget"),
])
def test_a_budget_that_is_not_a_byte_size_names_its_option(tmp_path, command: list[str], flag: str) -> None:
    """`plan SPEC --device-budget xx` said only "not a byte size: 'xx'", naming no option."""
    from pathlib import Path

    spec = Path(__file__).parents[2] / "specs" / "avazu.yaml"
    args = [str(spec) if a == "SPEC" else str(tmp_path / "out") if a == "OUT" else a for a in command]
    line = _one_error_line(CliRunner().invoke(app, [*args, flag, "12XB"]))
    assert f"{flag}:" in line and "12XB" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["predict", "pkg", "rows.csv", "--out", "s.parquet"],
                                     ["data", "convert", "csv", "rows.csv", "out", "--spec", "s.yaml"]])
def test_a_bad_on_error_names_the_value_given(command: list[str]) -> None:
    """`--on-error SKIP` said only "--on-error must be skip or fail", not which value was refused."""
    line = _one_error_line(CliRunner().invoke(app, [*command, "--on-error", "SKIP"]))
    assert "--on-error" in line and "'SKIP'" in line and line.endswith("(did you mean 'skip'?)")


@pytest.mark.parametrize("command, value, close", [
    (["export", "run", "pkg", "--dtype"], "FP16", "fp16"),
    (["export", "run", "pkg", "--index"], "FAISS", "faiss"),
    (["eval", "run", "--device"], "CPU", "cpu"),
    (["train", "s.yaml", "--device"], "Cuda", "cuda"),
    # since ea05daa these listed the values alone; A100 was matched to h100 (difflib's tie)
    (["train", "s.yaml", "--cache"], "LOOKAHEAD", "lookahead"),
    (["train", "s.yaml", "--nan-policy"], "Skip-Batch", "skip-batch"),
])
def test_a_value_written_in_another_case_names_the_close_one(command: list[str], value: str, close: str) -> None:
    """`export --dtype FP16`, `--index FAISS`, `--device CPU` listed the accepted values without the
    close one, where a format written `CSV` says (did you mean 'csv'?)."""
    line = _one_error_line(CliRunner().invoke(app, [*command, value]))
    assert repr(value) in line and f"(did you mean {close!r}?)" in line, line


@pytest.mark.parametrize("flag, value, close", [
    ("--until", "PACKED", "packed"), ("--cache", "Static_Hot", "static_hot"), ("--target", "A100", "a100"),
])
def test_a_plan_option_written_in_another_case_names_the_close_value(tmp_path, flag: str, value: str,
                                                                      close: str) -> None:
    """plan --until PACKED and --cache Static_Hot listed the values without the close one (since
    ea05daa the other options name it), and --target A100 was answered (did you mean 'h100'?)."""
    from flowrec.testing.specs import run_spec

    spec = tmp_path / "s.yaml"
    spec.write_text(run_spec("close", batch_size=32, epochs=1))
    line = _one_error_line(CliRunner().invoke(app, ["plan", str(spec), flag, value]))
    assert repr(value) in line and f"(did you mean {close!r}?)" in line, line


def test_the_guide_lists_every_exit_status_the_commands_use() -> None:
    """The statuses were named page by page (2 in the guide, 3 in plan.md, 4 in distributed.md,
    1 in doctor's help): the guide's table holds each one the code defines."""
    import re
    from pathlib import Path

    from flowrec.cli import train_cmds
    from flowrec.cli.common import EXIT_INVALID
    from flowrec.runs import errors

    guide = (Path(__file__).parents[2] / "docs" / "guide.md").read_text()
    listed = {int(n) for n in re.findall(r"^\| (\d+) \|", guide, re.M)}
    used = {0, 1, EXIT_INVALID, errors.EXIT_USAGE, errors.EXIT_RANK_FAILED, errors.EXIT_INTERRUPTED,
            train_cmds.EXIT_OUT_OF_MEMORY, train_cmds.EXIT_RANK_FAILED, train_cmds.EXIT_INTERRUPTED}
    assert used <= listed, f"not in docs/guide.md's exit status table: {sorted(used - listed)}"


@pytest.mark.parametrize("name", ["nosuch.json", "folder", "latin1.json"])
def test_an_unreadable_plan_is_one_plain_line(tmp_path, name: str) -> None:
    """`train SPEC --plan nosuch.json` said "(FileNotFoundError: [Errno 2] No such file ...)", the
    Python exception, where every other unreadable file is "cannot read X: why"."""
    from pathlib import Path

    (tmp_path / "folder").mkdir()
    (tmp_path / "latin1.json").write_bytes(b'{"caf\xe9": 1}')
    spec = Path(__file__).parents[2] / "specs" / "avazu.yaml"
    line = _one_error_line(CliRunner().invoke(app, ["train", str(spec), "--plan", str(tmp_path / name),
                                                    "--max-steps", "1", "--out", str(tmp_path / "run")]))
    assert name in line and "Error" not in line and "Errno" not in line
    assert not (tmp_path / "run").exists()


def test_a_run_folder_given_as_the_plan_names_its_plan_file(tmp_path) -> None:
    """`train SPEC --plan RUN` (the run whose plan is meant) said 'RUN: cannot read the plan: Is a
    directory'; now the line names the plan file the folder holds."""
    from pathlib import Path

    (tmp_path / "ran").mkdir()
    (tmp_path / "ran" / "plan.json").write_text("{}")
    spec = Path(__file__).parents[2] / "specs" / "avazu.yaml"
    line = _one_error_line(CliRunner().invoke(app, ["train", str(spec), "--plan", str(tmp_path / "ran"),
                                                    "--max-steps", "1", "--out", str(tmp_path / "run")]))
    assert f"give the plan it holds, {tmp_path / 'ran' / 'plan.json'}" in line and "Is a directory" not in line


@pytest.mark.parametrize("flag, name", [("--png", "profile.svg"), ("--json", "profile.png")])
def test_data_profile_does_not_write_under_another_format_s_name(tmp_path, flag: str, name: str) -> None:
    """`data profile SPEC DATA --png p.svg` wrote a PNG into a .svg name, as plan --svg x.png did."""
    from pathlib import Path

    spec = Path(__file__).parents[2] / "specs" / "avazu.yaml"
    line = _one_error_line(CliRunner().invoke(app, ["data", "profile", str(spec), str(tmp_path / "data"),
                                                    flag, str(tmp_path / name), "-q"]))
    assert flag in line and name in line
    assert "--svg" not in line  # data profile has no --svg to suggest


@pytest.mark.parametrize("rate", ["0", "nan", "2", "-0.5"])
def test_a_bad_sample_rate_names_its_option(tmp_path, rate: str) -> None:
    """`data profile SPEC DATA --sample-rate 0` said "sample rate must be in (0, 1]", no option named,
    after the data was opened (a missing dataset was named instead)."""
    from pathlib import Path

    spec = Path(__file__).parents[2] / "specs" / "avazu.yaml"
    line = _one_error_line(CliRunner().invoke(app, ["data", "profile", str(spec), str(tmp_path / "data"),
                                                    "--sample-rate", rate]))
    assert "--sample-rate" in line and rate.lstrip("-") in line


@pytest.mark.parametrize("seconds", ["nan", "inf", "0", "11"])
def test_calibrate_seconds_out_of_range_names_the_value(seconds: str) -> None:
    """`calibrate --seconds nan` said "--seconds: ... should be less than or equal to 10" of a NaN."""
    line = _one_error_line(CliRunner().invoke(app, ["calibrate", "--seconds", seconds]))
    assert "--seconds" in line and seconds in line


@pytest.mark.parametrize("extra", [["extra"], ["train", "s.yaml"]], ids=" ".join)
def test_version_refuses_arguments_after_it(extra: list[str]) -> None:
    """`flowrec --version extra` printed the version and ignored `extra`."""
    line = _one_error_line(CliRunner().invoke(app, ["--version", *extra]))
    assert "--version" in line and " ".join(extra) in line
    shown = CliRunner().invoke(app, ["--version"])
    assert shown.exit_code == 0 and shown.output.startswith("flowrec ") and len(shown.output.splitlines()) == 1


@pytest.mark.parametrize("command", [["data", "profile", "s.yaml", "data"], ["train", "s.yaml"]], ids=" ".join)
@pytest.mark.parametrize("seed", ["-1", str(2**63), str(2**64), "99999999999999999999999"])
def test_a_seed_out_of_range_names_its_option_and_range(command: list[str], seed: str) -> None:
    """`data profile --seed 2**64` (any seed above 2**63-1) was taken, where a run's seed is refused."""
    line = _one_error_line(CliRunner().invoke(app, [*command, "--seed", seed]))
    assert "--seed" in line and seed in line and "2^63-1" in line


@pytest.mark.parametrize("window", ["0", "1025", str(2**63 - 1), "99999999999999999999"])
def test_a_profile_window_beyond_the_spec_s_range_names_its_option(tmp_path, window: str) -> None:
    """`data profile --window 9223372036854775807` ended in a segmentation fault (a larger one in
    numba's traceback): the cache simulation overflowed. Now --window is the spec's plan.window range."""
    import json
    from pathlib import Path

    from flowrec.data.profile import MAX_WINDOW

    root = Path(__file__).parents[2]
    schema = json.loads((root / "schemas" / "model-spec.schema.json").read_text())
    assert schema["properties"]["plan"]["properties"]["window"]["maximum"] == MAX_WINDOW
    line = _one_error_line(CliRunner().invoke(app, ["data", "profile", str(root / "specs" / "avazu.yaml"),
                                                    str(tmp_path / "data"), "--window", window]))
    assert "--window" in line and window in line and "1..1024" in line


def test_data_profile_json_dash_writes_stdout_as_plan_s_does(tmp_path, monkeypatch) -> None:
    """`data profile SPEC DATA --json -` wrote a file named '-' in the working folder (and said
    nothing on stdout), where `flowrec plan --json -` and `flowrec eval --json -` write stdout."""
    import json

    from flowrec.testing.specs import run_spec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text(run_spec())
    made = CliRunner().invoke(app, ["data", "synth", "s.yaml", "--rows", "300", "--out", "data", "-q"])
    assert made.exit_code == 0, made.output
    result = CliRunner().invoke(app, ["data", "profile", "s.yaml", "data", "--json", "-"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["format"] == "flowrec-access-profile"
    assert not (tmp_path / "-").exists()
    line = _one_error_line(CliRunner().invoke(app, ["data", "profile", "s.yaml", "data", "--png", "-"]))
    assert "--png" in line and not (tmp_path / "-").exists()


def test_predict_out_dash_is_refused_not_a_file_named_dash(tmp_path, monkeypatch) -> None:
    """`predict PKG RAW --out -` (stdout, as `plan --json -`) wrote Parquet to a file named '-'."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.csv").write_text("user\na\n")
    line = _one_error_line(CliRunner().invoke(app, ["predict", "pkg", "rows.csv", "--out", "-"]))
    assert "--out -" in line and "not stdout" in line and not (tmp_path / "-").exists()
