"""`flowrec data convert|synth|profile|inspect`: stage datasets for training.

Heavy modules (pyarrow, torch, dask, matplotlib) are imported inside the commands, so the rest
of the CLI starts fast. Data problems exit with status 2 and a one-line message, no traceback.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import typer

from flowrec.cli.common import (OneLineErrorsGroup, bound_files, check_byte_size, check_seed_option, fail,
                                 guard_outputs, load_spec_or_exit, misnamed_output, say, skipped_lines, warn,
                                 write_output)
from flowrec.runtime.messages import shell_word
from flowrec.spec.schema_errors import did_you_mean
from flowrec.spec.units import counted

if TYPE_CHECKING:
    from flowrec.data.vocab_growth import TableGrowth


DATA_HELP = """Convert, synthesise, profile and inspect flowrec datasets (encoded Parquet).

\b
Examples:
  flowrec data convert csv clicks.csv data/clicks/ --spec my_model.yaml --test-fraction 0.1
  flowrec data synth specs/wide_1000.yaml --rows 50000 --out data/wide/
  flowrec data profile specs/dlrm_criteo.yaml data/criteo/ --budget 2GiB --json profile.json
  flowrec data inspect data/clicks/
  flowrec data COMMAND --help              # its options and examples
"""

data_app = typer.Typer(
    help=DATA_HELP,
    cls=OneLineErrorsGroup,
    no_args_is_help=True,
)

CONVERT_HELP = """Convert raw data to an encoded flowrec Parquet dataset, streaming (bounded memory).

FORMAT is one of criteo (TSV: label, I1..I13, C1..C26), avazu (CSV), libsvm / libfm, csv
(generic, columns mapped by the spec's data.columns), movielens (a MovieLens 100K, 1M, 10M or 20M+ folder), parquet (raw rows in a Parquet file
or a folder of them).
Categorical values are hashed or mapped through a vocabulary as the spec's tables say.
Binary heads take labels 0 or 1 (libsvm / libfm: -1 is read as 0, and counted); any other label
is a malformed row. OUT must be absent or empty unless --overwrite, which replaces a dataset only
once the new dataset is complete (a folder of other files is refused). Converting no rows (empty, header-only or wrong-format input) is an
error and leaves nothing behind. With --encoder-from RUN the rows are encoded with a trained
run's encoder; values its vocabularies lack take the spare rows of tables with vocab_spare (in
order of first appearance; the output says how many, and how many went to row 0 when none was
left) unless --no-grow.

\b
Examples:
  flowrec data convert criteo ~/criteo/day_0.tsv data/criteo/ --spec specs/dlrm_criteo.yaml
  flowrec data convert movielens ml-100k/ data/ml/ --spec specs/movielens.yaml --test-fraction 0.2
  flowrec data convert csv day2.csv data/day2/ --spec spec.yaml --encoder-from runs/day1
  flowrec data convert parquet events/ data/events/ --spec spec.yaml     # a Parquet file or folder
  flowrec data convert csv clicks.csv.gz data/clicks/ --spec spec.yaml   # .gz / .bz2 read as plain
"""

SYNTH_HELP = """Write synthetic data for any spec (Zipf-skewed ids, learnable labels) as Parquet.

--out must be absent or empty unless --overwrite, which replaces a dataset once the new data is
complete (a folder of other files is refused).

\b
Example:
  flowrec data synth specs/wide_1000.yaml --rows 5000000 --out data/wide/
"""

PROFILE_HELP = """Profile row accesses on a sample: skew, the hot set that fits a budget, cache curves.

Writes the access profile JSON the planner's cache pass reads (--json) and a PNG plot (--png).

\b
Example:
  flowrec data profile specs/dlrm_criteo.yaml data/criteo/ --budget 2GiB --png skew.png --json profile.json
"""

INSPECT_HELP = """Show a dataset's rows, partitions, columns and dtypes, metadata, missing/unique counts.

\b
Example:
  flowrec data inspect data/criteo/
"""


def register(app: typer.Typer) -> None:
    """Add the `data` command group to the `flowrec` app."""
    data_app.command("convert", help=CONVERT_HELP)(convert)
    data_app.command("synth", help=SYNTH_HELP)(synth)
    data_app.command("profile", help=PROFILE_HELP)(profile)
    data_app.command("inspect", help=INSPECT_HELP)(inspect)
    app.add_typer(data_app, name="data")


def _run(work: Callable[[], Any]) -> Any:
    """Run a command body; user-facing errors become one line on stderr and exit status 2. SIGTERM
    stops it as Ctrl-C does (one line, exit 130), so a dataset being written (`staged_output`)
    leaves no partial folder behind; Python's default ended the process without a word or cleanup."""
    from flowrec.data.layout import DataError
    from flowrec.runs.errors import EXIT_INTERRUPTED
    from flowrec.runtime.signals import interrupt_name, terminated_as_interrupted

    try:
        with terminated_as_interrupted():
            return work()
    except (DataError, OSError, ValueError) as exc:
        fail(str(exc))
    except KeyboardInterrupt as exc:
        fail(f"interrupted ({interrupt_name(exc)})", EXIT_INTERRUPTED)


def _spec(path: Path):
    return load_spec_or_exit(path)


def convert(
    fmt: str = typer.Argument(..., metavar="FORMAT", help="criteo | avazu | libsvm | libfm | csv | movielens | parquet"),
    source: Path = typer.Argument(..., metavar="SOURCE", help="Input file (a folder for movielens; a Parquet file or a folder of them for parquet)."),
    out: Path = typer.Argument(..., metavar="OUT", help="Output dataset directory."),
    spec: Path = typer.Option(..., "--spec", help="Model spec: features, tables, data.columns/options."),
    on_error: str = typer.Option("fail", "--on-error", help="Malformed rows: skip (count, report) or fail."),
    test_fraction: Optional[float] = typer.Option(None, help="Split off this fraction of the rows (0 <= x < 1) into OUT/test. Default: the spec's data.options.test_fraction, else no split."),
    split_seed: Optional[int] = typer.Option(None, help="Seed of the train/test split, 0 .. 2^64-1 (a row's side is a hash of the seed and its values: the same seed, the same split). Default: the spec's data.options.split_seed, else 0."),
    rows_per_file: int = typer.Option(1 << 20, min=1, help="Rows per Parquet part file."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT's dataset (atomically); a folder of other files is refused."),
    encoder_from: Optional[Path] = typer.Option(None, "--encoder-from", help="Encode with the encoder of this run, export package or encoded dataset (its vocabularies and statistics; unseen values go to row 0 or their hash bucket, or, in tables with vocab_spare, to the free rows after the vocabulary in order of first appearance) instead of fitting a new one."),
    no_grow: bool = typer.Option(False, "--no-grow", help="With --encoder-from: keep the vocabularies as they are (unseen values go to row 0, as `flowrec predict` encodes them)."),
) -> None:
    if on_error not in ("skip", "fail"):
        fail(f"--on-error must be skip or fail, not {on_error!r}{did_you_mean(on_error, ('skip', 'fail'))}")
    if no_grow and encoder_from is None:
        fail("--no-grow applies with --encoder-from only")
    if encoder_from is not None:  # a stream's encoder is its last day's (not "holds no encoder")
        from flowrec.cli.streams import refuse_stream_folder

        refuse_stream_folder(encoder_from, "give --encoder-from")
    options: dict[str, Any] = {}
    if test_fraction is not None:
        options["test_fraction"] = test_fraction
    if split_seed is not None:
        options["split_seed"] = split_seed
    _check_split_flags(options)

    def work():
        from flowrec.data.convert import convert as run_convert
        from flowrec.data.output_guard import check_folder_output
        from flowrec.runtime.progress import rows_spinner

        from flowrec.data.sources import spec_file_options

        model = _spec(spec)
        bound = dict(model.data.options) if model.data is not None else {}
        fraction = options.get("test_fraction", bound.get("test_fraction"))
        if split_seed is not None and not fraction:  # it seeded nothing, without a word
            fail("--split-seed seeds the train/test split, and this conversion makes none: give --test-fraction "
                 "(or the spec's data.options.test_fraction), or leave --split-seed out")
        check_folder_output(out, [source, spec, *([encoder_from] if encoder_from else [])], overwrite, "a dataset",
                            rows=[source])
        given = {**spec_file_options(model, spec.parent), **options}  # a feature map beside the spec
        encoder = None
        if encoder_from is not None:
            from flowrec.data.encoder_record import load_encoder, raw_encoder
            from flowrec.data.sources import FORMAT_ALIASES

            record = raw_encoder(encoder_from)
            encoder = load_encoder(record, model)
            if record.feature_map and FORMAT_ALIASES.get(fmt, fmt) == "libsvm":  # the map its ids were read with
                given["feature_map"] = record.feature_map
        with rows_spinner(f"converting {source.name}", not quiet) as advance:
            return run_convert(model, fmt, [source], out, on_error, given, rows_per_file,
                               progress=advance, overwrite=overwrite,
                               encoder=encoder, grow=not no_grow, status=lambda line: say(line, err=True))

    report = _run(work)
    split = f" (train {report.split['train']:,}, test {report.split['test']:,})" if report.split else ""
    say(f"wrote {report.rows:,} row{'' if report.rows == 1 else 's'} in {report.files} "
        f"file{'' if report.files == 1 else 's'} to {report.out}{split} "
        f"in {report.seconds:.1f}s")
    for line in growth_lines(report.growth):
        typer.echo(line)
    if report.labels_mapped:
        typer.echo(f"read {report.labels_mapped:,} label{'s' if report.labels_mapped != 1 else ''} -1 as 0 "
                   f"(the {fmt} -1/+1 convention)")
    for line in report.warnings:
        warn(line)
    if report.errors:
        lines = skipped_lines(report.errors, report.rows, "rows written", "look at the rows named below")
        for line in lines[:-1]:
            typer.echo(line, err=True)
        typer.echo(f"{lines[-1]}:", err=True)  # the examples follow
        for line in report.error_examples[:20]:
            typer.echo(f"  {line}", err=True)


def growth_lines(growth: Sequence[TableGrowth]) -> list[str]:
    """One line per table whose vocabulary grew into its spare rows (or ran out of them)."""
    lines = []
    for g in growth:
        rows = f"rows {g.first_row:,}..{g.first_row + g.added - 1:,}" if g.added else "no row"
        lines.append(f"table {g.table}: {g.added:,} new values in spare rows ({rows}; "
                     f"{g.free_left:,} free rows left)")
        if g.overflow_values:
            lines.append(f"table {g.table}: spare rows exhausted: {g.overflow_values:,} more new values "
                         f"({g.overflow_rows:,} occurrences) went to row 0")
    return lines


def synth(
    spec: Path = typer.Argument(..., metavar="SPEC", help="Model spec."),
    rows: int = typer.Option(1_000_000, "--rows", help="Rows to generate."),
    out: Path = typer.Option(..., "--out", help="Output dataset directory."),
    seed: int = typer.Option(0, help="Seed (the data is a function of spec, seed, alpha)."),
    alpha: float = typer.Option(1.1, help="Zipf exponent of the ids (higher: more skew)."),
    rows_per_file: int = typer.Option(1 << 18, min=1, help="Rows per Parquet part file."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --out's dataset (atomically); a folder of other files is refused."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary line."),
) -> None:
    def work():
        import time

        from flowrec.data.synth import SynthConfig, synth_dataset

        from flowrec.data.output_guard import check_folder_output

        model = _spec(spec)
        check_folder_output(out, [spec], overwrite, "a dataset")
        start = time.perf_counter()
        meta = synth_dataset(model, out, rows, SynthConfig(seed=seed, alpha=alpha), rows_per_file,
                             overwrite, status=lambda line: say(line, err=True))
        return meta, time.perf_counter() - start

    meta, seconds = _run(work)
    if quiet:
        return
    say(f"wrote {meta.rows:,} synthetic rows for {meta.spec} to {out} in {seconds:.1f}s "
        f"({meta.rows / max(seconds, 1e-9):,.0f} rows/s)")


def profile(
    spec: Path = typer.Argument(..., metavar="SPEC", help="Model spec."),
    data: Path = typer.Argument(..., metavar="DATA", help="Encoded dataset directory."),
    budget: Optional[str] = typer.Option(None, help="Device budget for the hot set, e.g. 2GiB."),
    sample_rate: Optional[float] = typer.Option(
        None, help="Fraction of rows sampled (default: FAE's, 5% of the rows and at least 20,000 or all: the "
                   "rows a run's static hot set is chosen from, so a plan from this profile prices that set)."),
    window: Optional[int] = typer.Option(None, help="Lookahead window W in batches, 1 .. 1024 as the spec's plan.window (default: spec)."),
    seed: Optional[int] = typer.Option(None, help="Sampling seed, 0 .. 2^63-1 (default: the spec's training seed, as a run's)."),
    png: Optional[Path] = typer.Option(None, "--png", help="Write a skew / hit-rate plot here."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Write the access profile JSON to PATH, or - for stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only warnings (and the files asked for)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the --json / --png files when they exist."),
) -> None:
    check_byte_size("--budget", budget)
    check_seed_option("--seed", seed)
    from flowrec.data.profile import MAX_WINDOW

    if window is not None and not 1 <= window <= MAX_WINDOW:  # checked before reading, as --sample-rate
        fail(f"--window must be in 1..{MAX_WINDOW} batches (the spec's plan.window range), not {window}")
    if sample_rate is not None and not 0.0 < sample_rate <= 1.0:  # NaN fails it too; checked before reading
        fail(f"--sample-rate must be a fraction of the rows in (0, 1], not {sample_rate}")
    if png is not None and str(png) == "-":  # (a file named '-' was written)
        fail("--png writes a file, not stdout: give a file name (--json - writes to stdout)")
    to_stdout = json_out == "-"  # as `flowrec plan --json -`: a file named '-' was written
    json_file = Path(json_out) if json_out is not None and not to_stdout else None
    for flag, path in (("--json", json_file), ("--png", png)):
        if path is not None and (problem := misnamed_output(flag, path, ("--json", "--png"))):
            fail(problem)
    model = _spec(spec)
    from flowrec.data.profile import PROFILE_FORMAT

    outputs = [(p, kind) for p, kind in ((json_file, (PROFILE_FORMAT, "an access profile `data profile --json` wrote")),
                                         (png, ("png", "a PNG image"))) if p is not None]
    guard_outputs([p for p, _ in outputs], [spec, *bound_files(spec, model), data], overwrite,
                  [kind for _, kind in outputs])

    from flowrec.data.parquet_folder import unread_lines

    for line in unread_lines(data, raw=False):  # a job still writing: its rows are not in the profile
        warn(line)

    def work():
        from flowrec.data.dataset import ParquetSource
        from flowrec.data.layout import check_spec
        from flowrec.data.profile import plot_profile, profile_access
        from flowrec.runtime.progress import reading_bar
        from flowrec.spec.units import parse_bytes

        source = ParquetSource(data)
        try:
            check_spec(source.meta, model, data)
            with reading_bar(not quiet)("reading the data", sum(source.partition_rows())) as advance:
                prof = profile_access(model, source, sample_rate, model.training.seed if seed is None else seed,
                                      parse_bytes(budget) if budget else None, window, progress=advance)
        finally:
            source.close()
        if json_file is not None:
            write_output(json_file, lambda tmp: tmp.write_text(json.dumps(prof, indent=1) + "\n"), overwrite)
        if png is not None:
            write_output(png, lambda tmp: plot_profile(prof, str(tmp)), overwrite)
        return prof

    prof = _run(work)
    if to_stdout:  # the JSON alone on stdout (the warnings on stderr), as `flowrec plan --json -`
        typer.echo(json.dumps(prof, indent=1))
    _show_profile(prof, quiet or to_stdout)


def _show_profile(prof: dict, quiet: bool) -> None:
    """The profile's figures, each saying what it is measured on (the sample, or the whole data)."""
    from flowrec.data.profile import plotted_tables

    for warning in prof.get("warnings", []):
        warn(warning)
    if quiet:
        return

    typer.echo(f"{prof['spec']}: {prof['samples']:,} sampled rows (rate {prof['sample_rate']:g}), "
               f"{prof['global']['accesses']:,} accesses, {prof['global']['distinct']:,} distinct rows in the sample")
    shown = plotted_tables(prof)
    typer.echo(f"the {len(shown)} tables with the most distinct rows (share of sampled accesses taken by the "
               "hottest rows):")
    for name in shown:
        t = prof["tables"][name]
        unseen = t.get("unseen") or {}
        typer.echo(f"  {name:<16} rows {t['rows']:>11,}  distinct {t['distinct']:>9,}  "
                   + "  ".join(f"{k} {v:.2f}" for k, v in t["skew"].items())
                   + (f"  unseen {unseen['share']:.1%} of all accesses (est.)" if "share" in unseen else ""))
    if "budget" in prof:
        b = prof["budget"]
        typer.echo(f"hot set for {b['bytes']:,} bytes: {sum(g['rows'] for g in b['hot_rows'].values()):,} rows "
                   f"taking {b['hot_access_share']:.1%} of the sampled accesses (in-sample: the set was chosen "
                   f"on them)")
        typer.echo(f"samples entirely hot: {b['hot_sample_fraction_in_sample']:.1%} in the sample, "
                   f"{b['hot_sample_fraction_unseen']:.1%} estimated on unseen rows (cross-validated), "
                   f"{b['hot_sample_fraction']:.1%} expected over the whole data")


def _inspect_days(folder: Path, order_text: str | None, as_json: bool, stream: Path | None = None) -> None:
    """`data inspect DAYS`: per day partition, its rows and, per managed table, the distinct raw ids
    it brings and how many no earlier day brought; with `stream` (a --follow stream's folder), in
    the order that stream takes them (its recorded order, its names compared as it compares them)."""
    from flowrec.data.days import inspect_days, parse_order

    try:
        order = parse_order(order_text or "name")
    except ValueError as exc:
        fail(f"--follow-order: {exc}")
    if stream is not None:
        order = _stream_order(stream, folder, order_text, order)
    # a run folder, package or stream is never a folder of days: a run on the spec's bound data holds
    # its encoding in RUN/data, which was listed as the one day 'data'
    _refuse_stream_given(folder)
    _refuse_owned_given(folder)
    days = _run(lambda: inspect_days(folder, order))
    from flowrec.data.days import skipped_line

    skipped = skipped_line(folder)
    if skipped is not None:  # an empty day folder, a link to nothing or a loop was left out without a word
        warn(skipped)
    if not days:
        fail(f"{folder}: neither an encoded dataset nor a folder of day partitions (datasets with _flowrec.json)")
    if as_json:
        typer.echo(json.dumps({"order": str(order), "days": days}, indent=1))
        return
    tables = sorted({t for d in days for t in d["managed"]})
    head = ["day", *(["first date"] if order.column else []), "rows",
            *[f"{t} {k}" for t in tables for k in ("distinct ids", "new ids")]]
    rows = [[d["day"], *([format(d["date"], "g") if isinstance(d["date"], float) else d["date"]] if order.column else []),
             format(d["rows"], ","),
             *[format(d["managed"].get(t, {}).get(k, 0), ",") for t in tables for k in ("distinct_ids", "new_ids")]]
            for d in days]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        typer.echo("  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w) for i, (v, w) in enumerate(zip(r, widths))))


def _refuse_owned_given(folder: Path) -> None:
    """Fail in one line when `folder`, given as a dataset to inspect, is a training run's folder
    (name the dataset it trained on, or say it trained on synthetic rows) or a model package (no
    rows); return for any other folder. Both were 'neither an encoded dataset nor a folder of day
    partitions', as if the folder were not flowrec's."""
    from flowrec.data.output_guard import owner_of
    from flowrec.runs.recorded import recorded_train_data

    owner = owner_of(folder) if folder.is_dir() else None
    if owner == "a training run":
        try:
            data = recorded_train_data(folder)
        except ValueError:  # a damaged run.json: the data a run on bound data encodes into its folder
            data = folder / "data" if (folder / "data").is_dir() else None
        shown = data.parent if data is not None and data.name == "train" and (data.parent / "test").is_dir() else data
        fail(f"{folder} is a training run's folder, not a dataset: " + (
            f"inspect the data it trained on, {shown}" if data is not None else
            "it keeps no dataset (it trained on synthetic rows, or its data has moved)"))
    if owner == "a model package":
        fail(f"{folder} is a model package, not a dataset: it holds no rows; inspect the data its run trained on")


def _refuse_stream_given(folder: Path) -> None:
    """Fail in one line when `folder`, given as the days to inspect, is a --follow stream folder (its
    days are runs, not datasets): name the folder of days it follows (its last day's recorded
    data) and `--stream`; return for any other folder."""
    from flowrec.cli.streams import DAYS_DIR, is_stream_folder, read_record
    from flowrec.runs.recorded import recorded_train_data
    from flowrec.runtime.rundir import RunFolderError

    if not is_stream_folder(folder):
        return
    days = read_record(folder).days
    try:  # its last day's run records the day's dataset (a damaged record: say DAYS)
        data = recorded_train_data(folder / DAYS_DIR / days[-1]) if days else None
    except (RunFolderError, OSError, ValueError):
        data = None
    given = "DAYS" if data is None else shell_word(str(data.parent))
    fail(f"{folder} is a --follow stream folder (its days are runs, not datasets): inspect the days it "
         f"follows, in its order, with  flowrec data inspect {given} --stream {shell_word(str(folder))}")


def _stream_order(stream: Path, folder: Path, order_text: str | None, order):
    """The order the --follow stream in `stream` takes the days under `folder` in: its recorded
    order (a --follow-order given must be it) and how it compares names (a stream begun before they
    compared naturally keeps text order: day10 before day2)."""
    from flowrec.cli.follow import _names_order
    from flowrec.cli.streams import DAYS_DIR, is_stream_folder, read_record
    from flowrec.data.days import parse_order

    if not is_stream_folder(stream) and not (stream / DAYS_DIR).is_dir():
        fail(f"--stream {stream} is not a --follow stream's folder (it holds no follow.json)")
    record = read_record(stream, None if order_text is None else order)
    recorded = parse_order(record.order) if record.days else order
    return _names_order(stream, record, folder, recorded)


def inspect_table(columns: list[dict], has_raw: bool) -> list[str]:
    """Lines of the column table: full type names; raw columns when conversion recorded them."""
    from flowrec.cli.metrics_table import number_cell

    def cell(c: dict, key: str, fmt: str = ",") -> str:
        return "-" if c.get(key) is None else format(c[key], fmt)

    head = ["column", "type", "missing", "unique"]
    rows = [[c["name"], c["type"], cell(c, "missing"), cell(c, "unique")] for c in columns]
    if has_raw:
        head += ["raw missing", "label mean", "distinct raw", "occupied rows"]
        for row, c in zip(rows, columns):
            row += [cell(c, "raw_missing"), "-" if c.get("label_mean") is None else number_cell(c["label_mean"]),
                    cell(c, "distinct_raw"),
                    cell(c, "occupied_rows")]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    return ["  ".join(str(v).ljust(w) if i < 2 else str(v).rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
            for r in [head, *rows]]


def inspect(
    path: Path = typer.Argument(..., metavar="DATA", help="Encoded dataset directory; a split one (`data convert --test-fraction`: train/ and test/), each part in turn; or a folder of day partitions (as `train --follow` reads): then one line per day."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    follow_order: Optional[str] = typer.Option(None, "--follow-order", help="For a folder of day partitions: their order, `name` (the default) or `date:COLUMN` (as `train --follow-order`)."),
    stream: Optional[Path] = typer.Option(None, "--stream", metavar="RUN", help="For a folder of day partitions: the `train --follow` stream folder (its --out) that trains them; the days are listed in the order it takes them (a stream begun before day names compared naturally keeps text order: day10 before day2)."),
) -> None:
    from flowrec.data.layout import META_FILE

    from flowrec.data.days import split_parts

    parts = split_parts(path) if path.is_dir() and not (path / META_FILE).is_file() else []
    if not parts and not (path / META_FILE).is_file() and path.is_dir():
        _inspect_days(path, follow_order, as_json, stream)
        return
    if follow_order is not None and follow_order != "name":
        fail(f"--follow-order orders the day partitions of a folder of days; {path} is one dataset")
    if stream is not None:
        fail(f"--stream orders the day partitions of a folder of days; {path} is one dataset")

    from flowrec.data.inspect import inspect_dataset

    if not parts:
        info = _run(lambda: inspect_dataset(path))
        if as_json:
            typer.echo(json.dumps(info, indent=1))
        else:
            _show_inspected(info)
        return
    infos = {part.name: _run(lambda part=part: inspect_dataset(part)) for part in parts}  # a split dataset
    if as_json:
        typer.echo(json.dumps(infos, indent=1))
        return
    for i, info in enumerate(infos.values()):
        if i:
            typer.echo("")
        _show_inspected(info)


def _show_inspected(info: dict[str, Any]) -> None:
    """Print one dataset's inspection (`inspect_dataset`'s result) as text."""
    meta = info["meta"]
    say(f"{info['path']}: {counted(info['rows'], 'row')} in {counted(info['partitions'], 'partition')} "
               f"(spec {meta['spec']}, data hash {meta['data_hash']}, source {meta['source'].get('format')})")
    for line in inspect_table(info["columns"], info["raw"] is not None):
        typer.echo(line)
    for table, m in ((info["raw"] or {}).get("managed") or {}).items():
        bound = "at least " if m.get("distinct_is_lower_bound") else ""
        typer.echo(f"managed table {table}: {bound}{m['distinct_ids']:,} distinct raw ids in {m['lookups']:,} "
                   f"lookups ({', '.join(m['features'])})")
    from flowrec.data.inspect import form_line

    for name, rule in info.get("id_forms", {}).items():  # what predict and eval compare new rows with
        typer.echo(form_line(name, rule))
    for warning in info["warnings"]:
        warn(warning)
    from flowrec.data.rawstats import STATS_FILE

    if info["raw"] is None and not (Path(info["path"]) / STATS_FILE).exists():  # a damaged one is warned of
        typer.echo("(no raw statistics: the dataset was not converted from raw files, or by an older flowrec; "
                   "missing counts are of the stored values, after fills)", err=True)
    elif info["raw"] is None:
        typer.echo("(missing counts are of the stored values, after fills)", err=True)
    if info["meta_rows"] != info["rows"]:
        typer.echo(f"warning: the part files hold {info['rows']:,} rows but _flowrec.json records "
                   f"{info['meta_rows']:,}: stale or foreign part files (training refuses this dataset)",
                   err=True)
    if info["scanned_rows"] < info["rows"]:
        typer.echo(f"(missing/unique over the first {info['scanned_rows']:,} rows)", file=sys.stderr)


def _check_split_flags(options: dict[str, Any]) -> None:
    """--test-fraction and --split-seed, refused naming the flag (their check names the spec's
    data.options keys, test_fraction and split_seed, which `--test-fraction nan` never gave)."""
    from flowrec.data.convert import check_split_seed, check_test_fraction
    from flowrec.data.layout import DataError

    for key, flag, check in (("test_fraction", "--test-fraction", check_test_fraction),
                             ("split_seed", "--split-seed", check_split_seed)):
        try:
            check(options)
        except DataError as exc:
            text = str(exc)
            fail(flag + text[len(key):] if text.startswith(key) else f"{flag}: {text}")
