"""`--help` is readable in an 80-column terminal: every option's name and every word of its help
in full (rich's panels cut them with an ellipsis there), the examples one command a line."""
from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from flowrec.cli import RICH_HELP_COLUMNS, app, data_cmds, help_layout

COMMANDS = (["validate"], ["plan"], ["schema"], ["data", "convert"], ["data", "synth"], ["data", "profile"],
            ["data", "inspect"], ["train"], ["eval"], ["export"], ["predict"], ["calibrate"], ["doctor"], [])


@pytest.fixture
def narrow() -> CliRunner:
    """The app laid out as `main` lays it out in an 80-column terminal."""
    kept = app.rich_markup_mode, data_cmds.data_app.rich_markup_mode
    for typer_app in (app, data_cmds.data_app):
        typer_app.rich_markup_mode = help_layout(80)
    yield CliRunner()
    app.rich_markup_mode, data_cmds.data_app.rich_markup_mode = kept


def test_the_layout_follows_the_terminal_width() -> None:
    assert help_layout(80) is None and help_layout(RICH_HELP_COLUMNS - 1) is None
    assert help_layout(RICH_HELP_COLUMNS) == "rich" and help_layout(200) == "rich"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "flowrec")
def test_every_option_is_shown_in_full_at_80_columns(narrow: CliRunner, command: list[str]) -> None:
    shown = narrow.invoke(app, [*command, "--help"], env={"COLUMNS": "80"})
    assert shown.exit_code == 0, shown.output
    assert "…" not in shown.output
    words = " ".join(shown.output.split())
    for name in _option_names(command):
        assert re.search(rf"(^|[\s,]){re.escape(name)}([\s,=]|$)", words), f"{name} not shown in full"


@pytest.mark.parametrize("command, example", [
    (["train"], "flowrec train specs/dlrm_criteo.yaml --data data/criteo/ --device cuda --out runs/exp1"),
    (["plan"], "flowrec plan specs/dlrm_criteo.yaml --target h100 --device-budget 1GiB --cache lookahead"),
    (["data", "convert"], "flowrec data convert csv day2.csv data/day2/ --spec spec.yaml --encoder-from runs/day1"),
    (["calibrate"], "flowrec calibrate specs/dlrm_criteo.yaml --nproc 2 --out cpu2.json"),
])
def test_an_example_stays_one_line(narrow: CliRunner, command: list[str], example: str) -> None:
    shown = narrow.invoke(app, [*command, "--help"], env={"COLUMNS": "80"}).output
    assert example in [line.strip() for line in shown.splitlines()]


def _option_names(command: list[str]) -> list[str]:
    """The long option names of `flowrec COMMAND`, read from the click command itself."""
    import typer.main

    click_command = typer.main.get_command(app)
    for name in command:
        click_command = click_command.commands[name]
    return [opt for param in click_command.params for opt in param.opts if opt.startswith("--")]


@pytest.mark.parametrize("command", COMMANDS[:-1], ids=" ".join)
def test_the_usage_line_names_arguments_as_the_docs_do(narrow: CliRunner, command: list[str]) -> None:
    """`Usage: flowrec predict [OPTIONS] {MODEL} {raw}`, `flowrec train ... {spec_path}`: arguments
    without a metavar showed their Python names; every one is upper case, as docs and examples write
    them (`flowrec train SPEC`)."""
    result = narrow.invoke(app, [*command, "--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    usage = next(line for line in result.output.splitlines() if "Usage:" in line)
    names = re.findall(r"[\[{]([^\]}]+)[\]}]", usage.split("[OPTIONS]", 1)[-1])
    assert all(name.isupper() for name in names), usage
    assert names or command in (["schema"], ["doctor"]), usage


@pytest.mark.parametrize("layout", [None, "rich"])
@pytest.mark.parametrize("command, row_text, shape", [
    ("validate", "Spec files or folders", r"SPEC\s+<path>\.\.\.\s"),
    ("predict", "Raw column to pass through", r"--keep\s+<str>\.\.\.\s"),
])
def test_a_repeated_parameter_reads_as_the_others(layout: str | None, command: str, row_text: str, shape: str) -> None:
    """`flowrec validate --help` showed typer's Python annotation, `SPEC <list[Path]>`, where every
    other command shows `SPEC <path>`, and `flowrec predict --help` `--keep <list[str]>`: a
    repeated argument or option is the element's type and `...`."""
    kept = app.rich_markup_mode
    app.rich_markup_mode = layout
    try:
        shown = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "120"}, terminal_width=120)
    finally:
        app.rich_markup_mode = kept
    assert shown.exit_code == 0, shown.output
    row = next(line for line in shown.output.splitlines() if row_text in line)
    assert re.search(shape, row), row
    assert "list[" not in shown.output


def test_every_option_of_every_command_is_named_in_the_docs() -> None:
    """`data synth --alpha` and `data profile --window` were in --help only: no page of docs/ (nor
    the README) said what they do. Every option of every command is now named in one of them
    (docs/benchmarks.md, a record of measurements, does not count)."""
    from pathlib import Path

    import typer.main

    root = Path(__file__).resolve().parents[2]
    pages = [root / "README.md", *sorted(p for p in (root / "docs").glob("*.md") if p.name != "benchmarks.md")]
    text = "\n".join(p.read_text(encoding="utf-8") for p in pages)
    missing = []

    def walk(group, words: list[str]) -> None:
        for name, command in group.commands.items():
            if hasattr(command, "commands"):
                walk(command, [*words, name])
                continue
            for param in command.params:
                for opt in [*param.opts, *(getattr(param, "secondary_opts", None) or [])]:
                    if opt.startswith("--") and opt != "--help" and not re.search(rf"{re.escape(opt)}(?![\w-])", text):
                        missing.append(f"flowrec {' '.join([*words, name])} {opt}")

    walk(typer.main.get_command(app), [])
    assert missing == []
