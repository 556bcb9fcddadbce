"""`flowrec export RUN OUT/`: write a model package (flowrec.serving.package) from a trained run."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import typer

from flowrec.cli.common import fail, missing_parents, remove_empty, say, warn
from flowrec.runtime.messages import first_line
from flowrec.spec.schema_errors import did_you_mean

EXIT_INTERRUPTED = 130
COMPARE_ROWS = 65_536  # evaluation rows the half-dtype score difference is measured on


def export(
    run_dir: Path = typer.Argument(..., metavar="RUN", help="Run folder (with checkpoint.pt) or a checkpoint file."),
    out: Path = typer.Argument(..., metavar="OUT", help="Package folder to create (absent or empty); never inside a run folder, package or dataset."),
    dtype: str = typer.Option("fp32", "--dtype", help="Table dtype in the package: fp32, fp16 or bf16 (half the bytes; the largest score difference on the run's evaluation data is reported)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT when it holds a model package (never a folder of other files, a run folder, dataset or encoder)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary lines."),
    index: str = typer.Option("auto", "--index", help="Retrieval runs: the item index beside items.parquet: faiss (an exact flat inner-product index; needs the ann extra, faiss-cpu), exact (none: predict --top-k scores every item in torch) or auto (faiss when installed)."),
) -> None:
    """Export a trained run as a self-contained model package.

    OUT/model.pt2 is a torch.export program over encoded inputs (dynamic batch; load it with
    torch.export.load, no flowrec needed); OUT/encoder.json + vocab/ turn raw rows into those
    inputs; spec.json, plan.json and manifest.json (versions, encoder fingerprint, metrics) describe
    it. `flowrec predict OUT RAW` and `flowrec.load_model(OUT)` score raw rows with it. The package
    is written into a temporary folder and renamed when complete.

    \b
    Examples:
      flowrec export runs/ml pkg/ml
      flowrec export runs/dlrm pkg/dlrm --dtype fp16
      flowrec export runs/tt pkg/tt --index faiss    # retrieval: query tower + items.parquet + items.faiss

    A run with a retrieval head exports its query tower as model.pt2 (raw user rows -> query
    vectors), every catalogue item's vector with its raw id (items.parquet) and, with --index
    faiss, an exact index; `flowrec predict OUT RAW --top-k K` returns each row's K best items.
    """
    export_package(run_dir, out, dtype, overwrite, quiet, index)


def export_package(run_dir: Path, out: Path, dtype: str, overwrite: bool, quiet: bool, index: str,
                   interrupts_raised: bool = False) -> None:
    """`flowrec export` with its options read (`train --follow --follow-export` calls it for each
    day). `interrupts_raised`: Ctrl-C or SIGTERM removes the staging folder, then is raised as a
    KeyboardInterrupt for the caller's line (the stream's, with the command that continues it),
    instead of export's own line."""
    from flowrec.data.encoder_record import find_record, tables_without_vocabulary
    from flowrec.data.layout import DataError
    from flowrec.data.output_guard import replace_folder, written_path
    from flowrec.planner.contract import scoring_plan
    from flowrec.runtime.rundir import run_folder_of
    from flowrec.serving.export import DTYPES, remove_partial, write_package
    from flowrec.serving.retrieval import INDEX_CHOICES
    from flowrec.serving.trained import load_trained
    from operators.custom import custom_failure

    if dtype not in DTYPES:
        fail(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}{did_you_mean(dtype, DTYPES)}")
    if index not in INDEX_CHOICES:
        fail(f"--index must be one of {', '.join(INDEX_CHOICES)}, not {index!r}{did_you_mean(index, INDEX_CHOICES)}")
    from flowrec.cli.streams import refuse_stream_folder

    refuse_stream_folder(run_dir, "export")
    folder = run_folder_of(run_dir)  # RUN/best's encoder and metrics are its run's
    made = missing_parents(out)  # the check makes them; a failed export removes them again
    _check_target(folder, out, overwrite)
    target = written_path(out)  # a link keeps naming the package, now the new one
    staged = _staging_folder(target)

    def undo() -> None:
        """Remove what the failed export wrote: the staging folder, the parents made for OUT."""
        remove_partial(staged)
        remove_empty(made)

    from flowrec.runtime.signals import interrupt_name, terminated_as_interrupted

    try:  # SIGTERM as Ctrl-C: the staging folder is removed (Python's default left it)
        with terminated_as_interrupted():
            trained = load_trained(run_dir, "cpu", scoring_plan, mmap=True)  # tables mapped, not copied
            for line in trained.notes:
                say(f"note: {line}", err=True)
            encoder = trained.encoder or find_record(folder)
            report = write_package(trained, staged, dtype, encoder, _last_eval(folder, trained.step),
                                   _compare_rows(folder, trained) if dtype != "fp32" else None, mapped=True,
                                   index=index)
            replace_folder(staged, target, overwrite)  # the old package stays until the new one is in place
    except (DataError, OSError, ValueError, RuntimeError) as exc:
        undo()
        fail(f"cannot export to {out}: {custom_failure(exc) or first_line(exc)}{_disk_full(target, exc)}")
    except KeyboardInterrupt as exc:
        undo()
        if interrupts_raised:
            raise
        fail(f"interrupted ({interrupt_name(exc)}); {out} was not written", EXIT_INTERRUPTED)
    except Exception as exc:  # a user's custom module may raise anything while it is traced
        undo()  # the staging folder was left beside OUT
        if custom_failure(exc) is None:
            raise
        fail(f"cannot export to {out}: {custom_failure(exc)}")
    unfitted = tables_without_vocabulary(trained.spec, encoder.vocab_files)
    if unfitted:  # a note, not a refusal: the package scores encoded rows (`flowrec data synth`'s)
        say(f"note: the run's encoder has no vocabulary for its tables {unfitted} (a run on synthetic rows has "
            f"none): the package scores encoded rows, and `flowrec predict {out} RAW` refuses raw rows; to score "
            "raw rows, train on converted data (`flowrec train SPEC --data DIR`)", err=True)
    if quiet:
        return
    say(f"wrote {out} ({', '.join(package_listing(out))}) in "
        f"{report.seconds:.1f} s; tables {report.table_bytes / 2**20:,.1f} MiB {dtype}")
    if report.max_score_diff is not None:
        typer.echo(f"largest score difference {dtype} vs fp32: {report.max_score_diff:.2e} over "
                   f"{report.compared_rows:,} rows")



PACKAGE_FIRST = ("model.pt2", "encoder.json", "spec.json", "plan.json", "manifest.json")


def package_listing(out: Path) -> list[str]:
    """What the package in `out` holds, for the line `export` prints: the files every package has,
    then the others it has (a retrieval run's items.parquet and items.faiss, managed tables'
    managed/), without the encoder's vocab/. The line once named the five files whatever was
    written, so a retrieval package's items.parquet, which predict --top-k reads, went unmentioned.

    >>> package_listing(Path("no-such-package"))
    ['model.pt2', 'encoder.json', 'spec.json', 'plan.json', 'manifest.json']
    """
    try:
        present = sorted(p.name + ("/" if p.is_dir() else "") for p in Path(out).iterdir())
    except OSError:
        present = []
    return [*PACKAGE_FIRST, *(n for n in present if n.rstrip("/") not in (*PACKAGE_FIRST, "vocab"))]


def _staging_folder(out: Path) -> Path:
    """A staging folder of this export beside OUT, `.OUT.export-PID-HOST-X`: its own, so two exports
    to one OUT at once never write into (or remove) each other's (a fixed `.OUT.export-tmp` was
    removed by the second export while the first wrote into it: 'Parent directory ... does not
    exist'). Those that commands no longer running (killed) left are removed, with a line
    (`remove_leftovers`: the rule of every output)."""
    from flowrec.data.output_guard import remove_leftovers, short, temp_tag

    remove_leftovers(out, lambda line: say(line, err=True))
    return out.with_name(f".{short(out.name)}.export-{temp_tag()}")


LOW_SPACE_BYTES = 16 << 20  # free bytes below which a failed write is told as a full disk (16 MiB)


def _disk_full(target: Path, exc: BaseException) -> str:
    """What a failed export adds when the disk holding `target` is (nearly) full once the staged
    package is removed: torch's writer says only 'basic_ios::clear: iostream error' (or 'file write
    failed'), naming neither the disk nor the cause; '' otherwise (an OSError's own words say
    'No space left on device' already).

    >>> _disk_full(Path("/"), OSError(28, "No space left on device"))
    ''
    """
    import errno
    import shutil

    from flowrec.spec.units import format_bytes

    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ""
    try:
        free = shutil.disk_usage(target.parent).free
    except OSError:
        return ""
    if free >= LOW_SPACE_BYTES:
        return ""
    return (f" (the disk holding {target.parent} has {format_bytes(free)} free: it is full, most likely; free "
            "space there or export elsewhere)")


def _check_target(folder: Path, out: Path, overwrite: bool) -> None:
    """OUT: a new or empty folder, or (with --overwrite) a model package; never in or over the run
    folder or any folder flowrec owns for something else (`flowrec.data.output_guard`)."""
    from flowrec.data.layout import DataError
    from flowrec.data.output_guard import check_folder_output

    try:
        check_folder_output(out, [folder], overwrite, "a model package")
    except DataError as exc:
        fail(str(exc))


def _last_eval(folder: Path, step: int | None = None) -> dict[str, Any]:
    """The metrics of the run's last evaluation (metrics.jsonl) at or before `step` (the exported
    checkpoint's: RUN/best's is its evaluation's), {} when it has none."""
    from flowrec.runtime.run_log import read_records

    last: dict[str, Any] = {}
    for record in read_records(folder / "metrics.jsonl"):  # a line that is not UTF-8 JSON is skipped,
        # as on --resume (it refused the export: 'utf-8' codec can't decode byte 0xff)
        if record.get("event") == "eval" and isinstance(record.get("metrics"), dict) and (
                step is None or not isinstance(record.get("step"), int) or record["step"] <= step):
            last = record["metrics"]
    return last


def lost_data(folder: Path) -> str | None:
    """The --eval-data (else --data) the run's run.json records, when it is not found (moved, or
    an older flowrec's path relative to the folder the run was started from); else None."""
    from flowrec.runs.settings import read_run_file

    settings = read_run_file(folder) or {}
    recorded = settings.get("eval_data") or settings.get("data")
    return recorded if isinstance(recorded, str) and recorded and not Path(recorded).exists() else None


def _compare_rows(folder: Path, trained) -> Iterator[Any] | None:
    """Up to COMPARE_ROWS rows of the run's evaluation data (None when it had only synthetic data)."""
    from flowrec.data.layout import META_FILE, DataError

    from flowrec.runs.recorded import recorded_eval_data

    try:
        data = recorded_eval_data(folder)
    except DataError:  # its run.json damaged: the package is made from the checkpoint all the same
        warn(f"the score difference is measured on random rows, not on the run's evaluation data: "
             f"{folder / 'run.json'}, which names that data, is damaged")
        return None
    if data is None or not (data / META_FILE).is_file():
        if (lost := lost_data(folder)) is not None:  # random rows would be compared without a word
            why = ("recorded relative to the folder the run was started from, as an older flowrec did: export from "
                   "that folder to compare on it" if not Path(lost).is_absolute() else "moved or removed")
            warn(f"the score difference is measured on random rows, not on the run's evaluation data: {lost} is "
                 f"not found ({why})")
        return None
    from flowrec.data.encoder_record import record_of_dataset

    record = record_of_dataset(data) if trained.encoder is not None else None  # (a run of before encoders: none)
    trained.check_data(data, record)
    for line in trained.form_lines(data, record):  # hashed ids compared in other rows, managed ones as unseen
        warn(f"the score difference is measured on the run's {line}")
    import pyarrow.dataset as ds

    columns = [f.name for f in trained.spec.features]
    scanner = ds.dataset(data, format="parquet", exclude_invalid_files=True).scanner(columns=columns)
    return _head(scanner.to_batches(), COMPARE_ROWS)


def _head(batches, limit: int) -> Iterator[Any]:
    import pyarrow as pa

    taken = 0
    for batch in batches:
        if taken >= limit:
            return
        batch = batch.slice(0, limit - taken)
        taken += batch.num_rows
        if batch.num_rows:
            yield pa.Table.from_batches([batch])


def register(app: typer.Typer) -> None:
    app.command("export")(export)
