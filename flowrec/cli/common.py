"""What every command shares: one-line errors with exit status 2, and loading a spec that way."""
from __future__ import annotations

import difflib
import os
import sys
from contextlib import contextmanager, redirect_stdout
from pathlib import Path, PurePath
from typing import Callable, Iterator, NoReturn, Sequence, TextIO, get_args

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from flowrec.runtime.messages import one_line
from flowrec.data.paths import unusable_path
from flowrec.spec.errors import SpecError
from flowrec.spec.load import load_spec
from flowrec.spec.model import DRY_RUN_KINDS, ModelSpec, unresolved_modules
from flowrec.spec.units import MAX_SEED

EXIT_INVALID = 2  # invalid spec, option, data or profile
SHOW_VERSION = "flowrec.show_version"  # ctx.meta key: `--version` was given (its text)


def _repeated_type(param: TyperArgument | TyperOption) -> str:
    """The `--help` type of a parameter given one or more times (`List[Path]`, `List[str]`): the
    element's type and `...` (`<path>...`, `<str>...`), where typer writes the Python annotation
    (`<list[Path]>`)."""
    (element,) = get_args(param.type_descriptor.annotation)
    is_path = isinstance(element, type) and issubclass(element, PurePath)
    return f"<{'path' if is_path else param._bare_type(element)}>..."


class RepeatedArgument(TyperArgument):
    """An argument given one or more times, its `--help` type as `_repeated_type` writes it
    (`SPEC <path>...`)."""

    def display_type(self, ctx: typer.Context) -> str:
        return _repeated_type(self)


class RepeatedOption(TyperOption):
    """An option given one or more times, its `--help` type as `_repeated_type` writes it
    (`--keep <str>...`)."""

    def display_type(self, ctx: typer.Context) -> str:
        return _repeated_type(self)


class RepeatedArgumentsCommand(TyperCommand):
    """A command whose repeated arguments and options read in `--help` as `_repeated_type` writes
    them, and whose paths are checked for names flowrec cannot use (`unusable_path`) before it runs
    (flowrec.cli gives it to every command typer would make a `TyperCommand`). SIGTERM and SIGHUP
    stop every command as Ctrl-C does, and a stop its own code does not say is one line,
    `error: interrupted (SIGTERM)`, exit 130: `plan`, `validate` or `data inspect` of a long input
    ended without a word at status 143 (SIGTERM), or said click's 'Aborted!' at status 1 (Ctrl-C)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if type(param) is TyperArgument and param.nargs != 1:
                param.__class__ = RepeatedArgument
            elif type(param) is TyperOption and param.multiple:
                param.__class__ = RepeatedOption
            if _takes_paths(param) or _takes_text(param):
                param.process_value = _refusing_empty(param, param.process_value)

    def invoke(self, ctx: typer.Context):
        for param in self.params:
            value = ctx.params.get(param.name)
            text_path = isinstance(param, TyperOption) and param.opts[0] in PATH_TEXT_OPTIONS
            for path in value if isinstance(value, (list, tuple)) else [value]:
                if text_path and isinstance(path, str) and path != "-":
                    path = Path(path)
                if isinstance(path, PurePath) and (problem := unusable_path(path)):
                    name = param.opts[0] if isinstance(param, TyperOption) else (param.metavar or param.name.upper())
                    fail(f"{name}: {problem}")
        from flowrec.runs.errors import EXIT_INTERRUPTED
        from flowrec.runtime.signals import interrupt_name, terminated_as_interrupted

        try:
            with terminated_as_interrupted():
                return super().invoke(ctx)
        except KeyboardInterrupt as exc:  # (a command that says where it stopped has said it, and exited)
            fail(f"interrupted ({interrupt_name(exc)})", EXIT_INTERRUPTED)


def click_error_line(exc: Exception) -> str:
    """One line for click's own error (a value out of range, a missing argument, an unknown option,
    a wrong type), where click and typer print a usage block or a boxed panel: `--epochs: 0 is not
    in the range x>=1 (flowrec train --help)`."""
    if (isinstance(exc, click_errors.BadParameter) and not isinstance(exc, click_errors.MissingParameter)
            and exc.param is not None):
        hint = exc.param_hint if isinstance(exc.param_hint, str) else None
        name = hint or (exc.param.opts[0] if exc.param.param_type_name == "option" else exc.param.human_readable_name)
        message = f"{name.strip(QUOTES)}: {exc.message}"
    elif isinstance(exc, click_errors.NoSuchOption):
        message = unknown_option_line(exc)
    else:
        message = exc.format_message()
    ctx = getattr(exc, "ctx", None)
    usage = f" ({ctx.command_path} --help)" if isinstance(exc, click_errors.UsageError) and ctx is not None else ""
    return f"{one_line(message).rstrip('.')}{usage}"


QUOTES = "'\""

# what an unknown option most likely asks for: a split of the data, or a setting the spec holds
SPLIT_WORDS = frozenset({"eval", "evaluation", "valid", "validation", "val", "holdout", "test", "dev", "split"})
SPLIT_OPTIONS = ("--test-fraction", "--eval-data")
SPEC_SETTINGS = {
    "batch-size": "training.batch_size", "batch": "training.batch_size", "bs": "training.batch_size",
    "batchsize": "training.batch_size", "lr": "optimizer.dense.lr and optimizer.sparse.lr",
    "learning-rate": "optimizer.dense.lr and optimizer.sparse.lr", "optimizer": "optimizer.dense and optimizer.sparse",
    "precision": "training.precision", "bf16": "training.precision", "fp16": "training.precision",
    "amp": "training.precision", "dropout": "a module's dropout",
}
OPTION_ALIASES = {"precision": ("--dtype",), "bf16": ("--dtype",), "fp16": ("--dtype",),
                  "gpu": ("--device",), "cuda": ("--device",), "cpu": ("--device",)}


def unknown_option_line(exc: Exception) -> str:
    """click's line for an unknown option, with what a user may have meant: the command's option for
    it (`export --precision` -> `--dtype`, `--gpu` -> `--device`), its options that hold the given
    word (`train --eval` -> `--eval-data`), an option for a split (`data convert --valid` ->
    `--test-fraction`), the options spelt closest (`--grop-by` -> `--group-by`); else where the spec
    holds the setting (`train --batch-size` -> training.batch_size). Never click's `--help`, the only
    option it offered for `data convert --eval`, nor its loose matches (`--lr` -> `--rows or
    --plan`): `No such option: --eval (did you mean --test-fraction?)`."""
    given = exc.option_name.split("=", 1)[0]
    word = given.lstrip("-").lower().replace("_", "-")
    ctx = getattr(exc, "ctx", None)
    options = sorted({o for p in (ctx.command.params if ctx is not None else [])
                      for o in getattr(p, "opts", []) if o.startswith("--") and o != "--help"})
    aliases = [o for o in OPTION_ALIASES.get(word, ()) if o in options]
    holding = [o for o in options if len(word) >= 3 and word in o[2:].split("-")]
    split = [o for o in SPLIT_OPTIONS if o in options] if word in SPLIT_WORDS else []
    close = difflib.get_close_matches(given, options, n=3, cutoff=CLOSE_OPTION)
    meant = list(dict.fromkeys(aliases + holding + split + close))[:3]
    if meant:
        return f"{exc.message} (did you mean {' or '.join(meant)}?)"
    if word in SPEC_SETTINGS:
        return f"{exc.message} (set in the spec, not on the command line: {SPEC_SETTINGS[word]})"
    return exc.message


CLOSE_OPTION = 0.75  # difflib's ratio: `--grop-by` -> `--group-by` 0.94, `--epoch` -> `--epochs` 0.92; `--lr` -> `--rows` 0.67
# click's exceptions, wherever typer takes them from (it vendors click as typer._click since 0.22)
click_errors = sys.modules[typer.BadParameter.__module__]


class OneLineErrorsGroup(TyperGroup):
    """The app (and its groups): click's own errors end as every flowrec error does, one line
    `error: ...` and exit 2 (`click_error_line`), not click's usage block or typer's boxed panel;
    `--help`, and a group given no command (its help), are as click writes them."""

    def make_context(self, *args, **kwargs):
        with _one_line_click_errors():
            return super().make_context(*args, **kwargs)

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        """The group's options and arguments; `--version` (eager, noted by its callback in
        `ctx.meta`) prints the version and exits here, and only when no argument follows it."""
        rest = super().parse_args(ctx, args)
        version = ctx.meta.pop(SHOW_VERSION, None)
        if version is not None:
            extra = [*getattr(ctx, "_protected_args", ()), *ctx.args]  # the command's name, its arguments
            if extra:
                raise click_errors.UsageError(
                    f"--version takes no arguments, and prints only the version: got {' '.join(extra)!r}", ctx)
            typer.echo(version)
            raise typer.Exit()
        return rest

    def invoke(self, ctx: typer.Context):
        with _one_line_click_errors():
            return super().invoke(ctx)


@contextmanager
def _one_line_click_errors() -> Iterator[None]:
    try:
        yield
    except click_errors.ClickException as exc:
        if isinstance(exc, getattr(click_errors, "NoArgsIsHelpError", ())):  # a group given no command: its help
            raise
        typer.echo(f"error: {rank_prefix()}{click_error_line(exc)}", err=True)
        raise typer.Exit(exc.exit_code) from None


PATH_TEXT_OPTIONS = frozenset({"--json", "--dot", "--svg", "--png"})  # a path as text, or - for stdout


def _takes_paths(param: TyperArgument | TyperOption) -> bool:
    """Whether `param` names files or folders (a Path, a list of them, or a PATH_TEXT_OPTIONS text)."""
    annotation = param.type_descriptor.annotation
    if isinstance(param, TyperOption) and param.opts[0] in PATH_TEXT_OPTIONS:
        return annotation is str
    return annotation is Path or Path in get_args(annotation)


def _takes_text(param: TyperArgument | TyperOption) -> bool:
    """Whether `param` takes a text value (a str, or a list of them): a feature, a policy, an address."""
    annotation = param.type_descriptor.annotation
    return annotation is str or str in get_args(annotation)


def _refusing_empty(param: TyperArgument | TyperOption, process_value: Callable) -> Callable:
    """`param`'s process_value, refusing an empty text first (a path, or any text value): a Path
    reads "" as '.', so `--out ""` (an unset shell variable, `--out "$OUT"`) trained into the
    working folder, `validate ""` scanned it and `data convert ... ""` refused '.' as the input's
    folder."""
    def checked(ctx: typer.Context, value):
        if any(v == "" for v in (value if isinstance(value, (list, tuple)) else [value])):
            name = param.opts[0] if isinstance(param, TyperOption) else (param.metavar or param.name.upper())
            if not _takes_paths(param):  # `--group-by ""` was read as no --group-by, as if not given
                fail(f"{name} is empty: give a value, or leave {name} out for its default")
            fail(f"{name} is an empty path: give a file or folder name ('.' for the working folder)")
        return process_value(ctx, value)
    return checked


def missing_parents(*outs: Path) -> list[Path]:
    """The folders above `outs` that do not exist yet, deepest first (what `mkdir -p` makes for
    them, and the output guard before any work: `remove_empty` takes them back after a failure).

    >>> missing_parents(Path("/no-such-root/a/pkg"))
    [PosixPath('/no-such-root/a'), PosixPath('/no-such-root')]
    """
    missing = set()
    for out in outs:
        for folder in Path(out).absolute().parents:
            if os.path.lexists(folder):
                break
            missing.add(folder)
    return sorted(missing, key=lambda f: (-len(f.parts), str(f)))


def remove_empty(folders: list[Path]) -> None:
    """Remove those of `folders` (deepest first) that are empty: the parents a failed command made
    for its outputs (`export RUN new/sub/pkg` left new/sub behind)."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            continue


def say(message: str, err: bool = False) -> None:
    """Print a success or progress line ('wrote N rows to OUT') on stdout (stderr with `err`), one
    line: a line break in it (a file's name) is escaped, as in `fail` and `warn`."""
    typer.echo(one_line(message), err=err)


_OUTPUT_STREAMS: list[TextIO] = []  # the real stdout of each `stdout_reserved` block, innermost last


@contextmanager
def stdout_reserved(reserve: bool = True) -> Iterator[None]:
    """While `reserve`: stdout carries the command's machine-readable output alone (train --json,
    eval --json -), written to `output_stream()`; whatever else prints to stdout meanwhile (a
    custom module's constructor or forward, as the dry run of plan --json - already does) goes to
    stderr, so the JSON stays parseable."""
    if not reserve:
        yield
        return
    _OUTPUT_STREAMS.append(sys.stdout)
    try:
        with redirect_stdout(sys.stderr):
            yield
    finally:
        _OUTPUT_STREAMS.pop()


def output_stream() -> TextIO:
    """Where the command's machine-readable output goes: stdout (the real one inside `stdout_reserved`)."""
    return _OUTPUT_STREAMS[-1] if _OUTPUT_STREAMS else sys.stdout


def warn(message: str) -> None:
    """Print `warning: message` on stderr, one line (a line break in it, a file's name, escaped)."""
    typer.echo(f"warning: {one_line(message)}", err=True)


def check_seed_option(flag: str, seed: int | None) -> None:
    """Refuse a seed option outside the seeds a run takes, 0..2^63-1 (`MAX_SEED`), in one line naming
    `flag`: `train --seed` and `data profile --seed` (which stands for a run's seed) alike."""
    if seed is not None and not 0 <= seed <= MAX_SEED:
        fail(f"{flag} must be in 0..{MAX_SEED} (2^63-1), not {seed}")


def fail(message: str, code: int = EXIT_INVALID, follows: bool = False) -> NoReturn:
    """Print `error: message` on stderr (`error: rank R: message` in a multi-rank launch) and exit
    with `code`. The message is one line: a line break in it (a file's name) is escaped. A rank of a
    launch also reports it to the launcher and the other ranks (`flowrec.cli.rank_reports.report_stop`);
    `follows`: this rank stops only because another one did (status 4 always does)."""
    line = one_line(message)  # a name holding a line break
    typer.echo(f"error: {rank_prefix()}{line}", err=True)
    if rank_prefix():
        from flowrec.cli.rank_reports import report_stop

        report_stop(line, code, follows)
    raise typer.Exit(code)


SKIPPED_WARN_SHARE = 0.1  # skipping more than this share of the rows gets a warning


def skipped_lines(skipped: int, kept: int, what: str, look: str) -> list[str]:
    """The lines `--on-error skip` ends with: how many rows were skipped, of how many, and a warning
    when more than a tenth of them were, since the rows kept may then not stand for the input (a
    label or layout problem that hits most rows is not noise to skip). `what` names the rows kept,
    `look` where the user sees why rows were skipped."""
    total = skipped + kept
    lines = [f"skipped {skipped:,} malformed row{'' if skipped == 1 else 's'} of {total:,} ({skipped / total:.1%})"]
    if skipped > SKIPPED_WARN_SHARE * total:
        lines.append(f"warning: {skipped / total:.0%} of the rows were skipped, so the {kept:,} {what} may not "
                     f"stand for the input; {look} (a format, option or label convention that does not "
                     f"match the file?)")
    return lines


def check_env_switches() -> None:
    """The environment switches of training and measuring, checked before anything is read or
    written: FLOWREC_CPU_GEMM, FLOWREC_CHECKPOINT_WRITES, FLOWREC_MALLOC_TUNING and
    FLOWREC_DATA_PRIORITY (and FLOWREC_RESUME_FULL_LOAD); a bad value is one line and exit 2 (`flowrec calibrate` once showed a
    traceback for `FLOWREC_CPU_GEMM=mlk`)."""
    from flowrec.data.layout import DataError
    from flowrec.data.priority import mode as data_priority
    from flowrec.runtime.hostmem import malloc_tuning_asked
    from flowrec.runs.finished import full_load_asked
    from flowrec.runtime.trainer import background_checkpoints
    from operators.onednn import gemm_library

    try:
        gemm_library()
        background_checkpoints()
        malloc_tuning_asked()
        data_priority()
        full_load_asked()
    except (ValueError, DataError) as exc:
        fail(str(exc))


def check_byte_size(flag: str, text: str | None) -> None:
    """Exit 2 with one line naming `flag` when `text` is not a byte size (`--device-budget xx`
    said only "not a byte size: 'xx'", in plan and train, without the option)."""
    from flowrec.spec.units import parse_bytes

    if text is not None:
        try:
            parse_bytes(text)
        except ValueError as exc:
            fail(f"{flag}: {exc}")


WRITES = {"--json": "JSON", "--dot": "DOT text", "--svg": "SVG", "--png": "PNG"}
FLAG_OF_SUFFIX = {".json": "--json", ".dot": "--dot", ".gv": "--dot", ".svg": "--svg", ".png": "--png"}
OTHER_FORMATS = frozenset({".jpg", ".jpeg", ".pdf", ".gif", ".webp", ".bmp", ".tif", ".tiff", ".eps", ".ps", ".html"})


def misnamed_output(flag: str, path: Path, offered: Sequence[str] = tuple(WRITES)) -> str | None:
    """Why `path` is the wrong name for what `flag` writes (`plan --svg x.png` wrote SVG text into a
    .png name, which an image viewer then could not open; `data profile --png p.svg` a PNG), or
    None: a suffix of another format. `offered`: the command's output flags, the ones it suggests."""
    suffix = path.suffix.lower()
    other = FLAG_OF_SUFFIX.get(suffix)
    if other is not None and other != flag and other in offered:
        return (f"{flag} writes {WRITES[flag]}, but {path} is named {suffix}: give {other} {path} for "
                f"{WRITES[other]}, or a .{flag[2:]} name")
    if suffix in OTHER_FORMATS or other is not None and other != flag:
        return f"{flag} writes {WRITES[flag]}, but {path} is named {suffix}, another format: give a .{flag[2:]} name"
    return None


def check_one_gpu_per_rank(nproc: int, device_type: str) -> None:
    """Exit 2 when `nproc` local processes on CUDA would not each have a GPU (`flowrec calibrate
    --nproc N` on `device_type`), before any is started (`flowrec.runs.launch`'s check)."""
    from flowrec.runs.errors import RunError
    from flowrec.runs.launch import check_one_gpu_per_rank as check

    try:
        check(nproc, device_type, f"--nproc {nproc}")
    except RunError as exc:
        fail(str(exc), exc.code)


def rank_prefix() -> str:
    """`rank R: ` in a multi-rank launch (torchrun's RANK and WORLD_SIZE), else nothing."""
    size, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    return f"rank {rank}: " if size.isdigit() and int(size) > 1 else ""


def is_lead_rank() -> bool:
    """This process reports for the run: one process, or rank 0 of a launch."""
    return os.environ.get("RANK", "0") == "0"


def launch_env() -> tuple[int, int]:
    """(WORLD_SIZE, RANK) of the launch environment (torchrun sets them), else (1, 0); a bad value
    is one line and exit 2."""
    size_text, rank_text = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    if not size_text.isdigit() or int(size_text) < 1:
        fail(f"the environment's WORLD_SIZE must be a positive integer, not {size_text!r}")
    if not rank_text.isdigit() or int(rank_text) >= int(size_text):
        fail(f"the environment's RANK must be in 0..{int(size_text) - 1}, not {rank_text!r}")
    return int(size_text), int(rank_text)


def planned_spec_or_exit(path: Path, run: "Path | None" = None, check_given: bool = False,
                         note: "Callable[[str], None] | None" = None) -> ModelSpec:
    """`load_spec_or_exit`, then the output width of every custom module measured by importing its
    class (`flowrec.runtime.custom`); a class that cannot be used is one line per module, exit 2.
    A relative `file.py` class path is recorded absolute, found in the working folder; for a resumed
    `run`, as the run finds its files (`flowrec.spec.class_paths.run_class_files`: a relative one of
    an older run, an absolute one gone with a moved run), each moved file said by `note` (default:
    a line on stderr), one that differs from the file the run trained refused (exit 2).
    `check_given`: also check the `out_width` a spec gives (`flowrec calibrate` builds the model
    only after a minute of measuring)."""
    from flowrec.spec.class_paths import absolute_class_files, run_class_files

    spec = load_spec_or_exit(path)
    if run is None:
        spec = absolute_class_files(spec)  # a run records the file, found from any folder
    else:
        try:
            spec, notes = run_class_files(spec, run)
        except ValueError as exc:
            fail(str(exc))
        for line in notes:
            (note or (lambda text: say(f"note: {text}", err=True)))(line)
    customs = [m for m in spec.modules if m.kind in DRY_RUN_KINDS]
    if not unresolved_modules(spec) and not (check_given and customs) \
            and all(m.param("param_bytes") is not None for m in customs):
        return spec  # nothing to import (planning stays free of torch)
    from flowrec.runs.errors import EXIT_INTERRUPTED
    from flowrec.runtime.custom import CustomInterrupted, resolve_custom
    from flowrec.runtime.signals import interrupt_name

    notes: list[str] = []
    try:
        spec = resolve_custom(spec, check_given, notes)
    except SpecError as exc:
        _exit_with_issues(path, exc)
    except CustomInterrupted as exc:  # a user's code that never returns: say whose it was
        fail(f"{path}: {exc.where}: interrupted ({interrupt_name(exc.cause)}) while {exc.what}: its code had not "
             "returned (an endless loop at the file's top level, in its constructor or its forward?); nothing was "
             "written", EXIT_INTERRUPTED)
    for line in notes:  # a module whose memory the plan could not count
        (note or (lambda text: say(f"note: {text}", err=True)))(line)
    return spec


def load_spec_or_exit(path: Path) -> ModelSpec:
    """Load a spec; on problems print one line per issue (`path: location: message`) and exit 2."""
    try:
        return load_spec(path)
    except SpecError as exc:
        _exit_with_issues(path, exc)


def _exit_with_issues(path: Path, exc: SpecError) -> NoReturn:
    for issue in exc.issues:
        typer.echo(one_line(f"{path}: {issue}"), err=True)
    raise typer.Exit(EXIT_INVALID)


def bound_files(spec_path: Path, model: ModelSpec) -> list[Path]:
    """The files a spec binds, read where the spec is read: its data.path and a libsvm feature map
    (from the spec's folder, as training reads them). A command's output guard counts them as its
    inputs: `flowrec plan s.yaml --json raw.csv --overwrite` replaced the raw training data the
    spec binds with plan JSON, the guard knowing the spec alone (`eval --json` and `predict --out`
    replace only their own output since 48d21a1 and 0c58e5e)."""
    from flowrec.data.sources import FILE_OPTIONS, spec_file_options

    data = model.data
    if data is None:
        return []
    options = dict(data.options)
    resolved = spec_file_options(model, Path(spec_path).parent)
    files = [Path(spec_path).parent / data.path] if data.path is not None else []
    return files + [Path(resolved.get(key, options[key])) for key in FILE_OPTIONS
                    if isinstance(options.get(key), str) and options[key]]


def guard_outputs(outputs: Sequence[Path], inputs: Sequence[Path | None], overwrite: bool,
                  kinds: Sequence[tuple[str, str]] | None = None) -> None:
    """Check every output file against the output guard (`flowrec.data.output_guard`) before any
    work: one line and exit 2 for the first refused; two outputs naming one file are refused too.

    kinds: per output, (kind, what): `--overwrite` replaces only an empty file or one that holds
        that kind (`holds_kind`), as `eval --json` and `predict --out` replace only their own
        output: the guard knows only the inputs, so `plan --json b.yaml --overwrite` replaced
        another spec.
    """
    from flowrec.data.layout import DataError
    from flowrec.data.output_guard import check_file_output, check_replacing_own_output, holds_kind

    given = [p for p in inputs if p is not None]
    for i, out in enumerate(outputs):
        try:
            check_file_output(out, [*given, *outputs[:i]], overwrite)
            if kinds is not None:
                kind, what = kinds[i]
                check_replacing_own_output(Path(out), lambda p, kind=kind: holds_kind(p, kind), what)
        except (DataError, ValueError) as exc:
            fail(str(exc))


def write_output(out: Path, write: Callable[[Path], object], overwrite: bool = True) -> None:
    """`write(tmp)` then rename tmp over `out` (atomic; without `overwrite` only while `out` is
    absent: `atomic_output`); an OSError, or a file another process wrote meanwhile, is one line
    and exit 2."""
    from flowrec.data.output_guard import OutputError, atomic_output

    try:
        with atomic_output(out, overwrite, lambda line: say(line, err=True)) as tmp:
            write(tmp)
    except OutputError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write {out}: {exc.strerror or exc}")


def exit_without_teardown(code: object = 0) -> NoReturn:
    """Flush the output and end the process at once with `code` (a SystemExit's: None is 0; a
    message is printed and ends with 1), without the interpreter's teardown: where native threads
    (gloo's, Arrow's IO pool) may still release Python objects then, which aborts the process
    ("terminate called without an active exception") after its work is done."""
    import sys

    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
