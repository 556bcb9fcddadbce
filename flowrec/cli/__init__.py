"""The `flowrec` command line. Only this package prints; everything else returns data.

Each command group lives in its own module and registers itself on the app; heavy imports
(torch, dask) happen inside the commands that need them, so `flowrec plan` starts fast.
"""
from __future__ import annotations

import errno
import os
import shutil
import sys

import typer
from typer.core import TyperCommand

from flowrec.cli.common import EXIT_INVALID, SHOW_VERSION, OneLineErrorsGroup, RepeatedArgumentsCommand, exit_without_teardown
from flowrec.version import __version__
from flowrec.cli import (calibrate_cmd, data_cmds, doctor_cmd, export_cmd, plan_cmd, predict_cmd, spec_cmds,
                         train_cmds)

APP_HELP = """Declare, validate, plan and train recommendation models (wide-and-deep, DLRM, DCN, DIN, sequence transformers, two towers, MMoE / PLE, your own modules).

\b
Examples:
  flowrec train specs/dlrm_criteo.yaml     # the default job, on rows drawn from the spec
  flowrec validate my_model.yaml
  flowrec plan my_model.yaml
  flowrec data convert csv clicks.csv data/clicks/ --spec my_model.yaml --test-fraction 0.1
  flowrec train my_model.yaml --data data/clicks/ --out runs/first
  flowrec eval runs/first --data data/clicks/test
  flowrec export runs/first pkg/first
  flowrec predict pkg/first new_rows.csv --format csv --out scores.parquet
  flowrec COMMAND --help                   # its options and examples
"""

app = typer.Typer(
    name="flowrec",
    help=APP_HELP,
    cls=OneLineErrorsGroup,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _show_version(ctx: typer.Context, value: bool) -> None:
    """Note `--version` for `OneLineErrorsGroup.parse_args`, which prints it once it knows that
    nothing follows it (`flowrec --version extra` printed the version and ignored `extra`)."""
    if value:
        ctx.meta[SHOW_VERSION] = f"flowrec {__version__}"


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                           help="Print the flowrec version and exit.")) -> None:
    """Declare, validate, plan and train recommendation models (wide-and-deep, DLRM, DCN, DIN, sequence transformers, two towers, MMoE / PLE, your own modules)."""


spec_cmds.register(app)
plan_cmd.register(app)
data_cmds.register(app)
train_cmds.register(app)
export_cmd.register(app)
app.command("predict")(predict_cmd.predict)
doctor_cmd.register(app)
calibrate_cmd.register(app)


def _repeated_parameters_as_elements(typer_app: typer.Typer) -> None:
    """Every command's repeated arguments and options read in `--help` as the others do
    (`RepeatedArgumentsCommand`), its subgroups' commands too."""
    for info in typer_app.registered_commands:
        if info.cls in (None, TyperCommand):  # typer's default
            info.cls = RepeatedArgumentsCommand
    for group in typer_app.registered_groups:
        _repeated_parameters_as_elements(group.typer_instance)


_repeated_parameters_as_elements(app)


RICH_HELP_COLUMNS = 110  # from this terminal width on, `--help` draws rich's panels


def help_layout(columns: int | None = None) -> str | None:
    """How `--help` is laid out in a terminal `columns` wide (default: this one's, else 80): rich's
    panels ("rich") where they fit, click's plain layout (None) where they do not. Below about 100
    columns the panels' option table cut option names and words of their help short with an
    ellipsis (`--checkpoint-eve…` in `flowrec train --help` at 80 columns), and they keep the
    docstrings' line breaks, wrapped again raggedly; click's layout rewraps every paragraph to the
    width and cuts nothing."""
    if columns is None:
        columns = shutil.get_terminal_size((80, 24)).columns
    return "rich" if columns >= RICH_HELP_COLUMNS else None


def stdout_failure(exc: OSError) -> str | None:
    """What refused a write to the standard output, where `exc` was that (`flowrec schema >
    full/schema.json`, `plan`, `eval --json -` to a full disk or /dev/full: a traceback of
    click's echo or of the write): the error's words when stdout itself refuses a write now
    (/dev/full) or lies on a file system with no free block; None otherwise (another file's
    error, or a terminal). Click handles a closed pipe (EPIPE) itself."""
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
        return None
    try:
        if os.isatty(1):
            return None
        os.write(1, b"")  # /dev/full refuses any write
        blocks = os.fstatvfs(1)
    except OSError as probe:
        return probe.strerror or str(probe)
    return os.strerror(exc.errno) if (blocks.f_bavail == 0 or blocks.f_bfree == 0) else None


def _silence_stdout() -> None:
    """Point the standard output at /dev/null, so the interpreter's flush at exit does not fail again
    (`Exception ignored ... No space left on device`)."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.close(null)
    except OSError:
        pass


def main() -> None:
    """Run the command line (its `--help` laid out for this terminal: `help_layout`). A command that read a CSV file through pyarrow's streaming reader ends
    without the interpreter's teardown, its output flushed and its exit status kept: Arrow's IO
    threads can still hold that reader's Python row handler, and releasing it during the teardown
    aborted the process now and then (exit 134 after a correct result or a one-line error:
    `flowrec.data.sources.arrow_threads_may_hold_python`), as a finished training rank does for
    gloo's threads; so does one where a custom module class started a thread that is still running
    (the teardown would wait for it, for ever where it loops)."""
    layout = help_layout()
    for typer_app in (app, data_cmds.data_app):
        typer_app.rich_markup_mode = layout
    try:
        try:
            app()
        except OSError as exc:
            if (problem := stdout_failure(exc)) is None:
                raise
            sys.stderr.write(f"error: cannot write the command's output to its standard output: {problem} "
                             "(redirected to a full disk?); what it holds of the output is incomplete\n")
            _silence_stdout()
            raise SystemExit(EXIT_INVALID) from None
    except SystemExit as exc:
        sources = sys.modules.get("flowrec.data.sources")
        if sources is not None and sources.arrow_threads_may_hold_python():
            exit_without_teardown(exc.code)
        user_code = sys.modules.get("operators.custom_code")
        lingering = user_code.lingering_threads() if user_code is not None else []
        if lingering:  # a custom module's thread that never ends: the interpreter's exit would wait for ever
            sys.stderr.write(f"note: not waiting for the threads a custom module class started and left running: "
                             f"{', '.join(lingering[:3])}{' ...' if len(lingering) > 3 else ''} (start them with "
                             "daemon=True, or end them)\n")
            exit_without_teardown(exc.code)
        raise

