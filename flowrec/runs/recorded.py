"""The data a run recorded in its run.json: what it trained on and what it evaluated on.

`flowrec eval RUN` (no `--data`), `Run.evaluate()` (no data), `flowrec export` (the rows it
compares the exported program on) and the seen-pairs of a retrieval evaluation read them here.
A run trained on a split dataset evaluated on its test part; one given `--eval-data` on that;
a run of the spec's bound raw data encoded it into RUN/data; a run on synthetic rows records their
count, from which its evaluation rows are drawn again (`synthetic_rows`).
Paths are recorded absolute (`flowrec.runs.settings.write_run_file`); older runs' relative paths
are read relative to the working folder, as they were written.

Example:
    >>> recorded_eval_data(Path("runs/exp1"))   # doctest: +SKIP
    PosixPath('/data/clicks/test')
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from flowrec.data.layout import META_FILE, DataError
from flowrec.runs.settings import lost_relative_path, read_run_file
from flowrec.runtime.messages import not_a_file
from flowrec.runtime.rundir import RUN_FILE, RunFolderError, run_folder_of


def run_folder(run_dir: Path) -> Path:
    """The run folder of a run, of its RUN/best, or of a checkpoint file in either."""
    return run_folder_of(Path(run_dir))


def _scored_settings(folder: Path, how: str) -> dict:
    """The run's recorded settings (`read_run_file`) for scoring it: a damaged run.json said only
    that the run cannot be resumed, where `flowrec eval RUN --data DIR` scores it (`how`)."""
    try:
        return read_run_file(folder) or {}
    except RunFolderError as exc:
        raise DataError(f"{exc}; it also records the data the run evaluated on: give {how}") from None


def _data_folder(folder: Path, settings: dict) -> Path:
    return Path(settings["data"]) if settings.get("data") else folder / "data"


def recorded_train_data(run_dir: Path) -> Path | None:
    """The training dataset a run recorded (its train part when split), or None (synthetic rows)."""
    folder = run_folder(run_dir)
    data = _data_folder(folder, read_run_file(folder) or {})
    if (data / "train").is_dir():
        return data / "train"
    return data if (data / META_FILE).is_file() else None


def recorded_eval_data(run_dir: Path, how: str = "--data DIR") -> Path | None:
    """The evaluation data a run recorded: its --eval-data, else the test part of its split
    dataset; None when it recorded none (the folder is not checked to exist). A damaged run.json
    is a DataError saying to give other data (`how`)."""
    folder = run_folder(run_dir)
    settings = _scored_settings(folder, how)
    if settings.get("eval_data"):
        return Path(settings["eval_data"])
    test = _data_folder(folder, settings) / "test"
    return test if test.is_dir() else None


def synthetic_rows(run_dir: Path, spec: Any, how: str = "--data DIR") -> int | None:
    """The training row count of a run on synthetic rows (`flowrec train SPEC --rows N` without
    data; `spec` the run's), whose evaluation rows `flowrec eval RUN` draws again from its seed
    (`flowrec.runtime.session.synthetic_evaluation`); None for a run on data (or without run.json).
    A damaged run.json is a DataError saying to give data (`how`)."""
    settings = _scored_settings(run_folder(run_dir), how)
    if not settings or settings.get("data") or settings.get("eval_data") or (spec.data is not None and spec.data.bound):
        return None
    rows = settings.get("rows")
    return rows if isinstance(rows, int) and not isinstance(rows, bool) and rows >= 1 else None


def eval_data_to_score(run_dir: Path, how: str = "--data DIR") -> Path:
    """`recorded_eval_data`, checked to be an encoded dataset; `how` says how to give other data.

    Raises:
        DataError: the run recorded none (an unsplit dataset, synthetic rows), or it moved.
    """
    found = recorded_eval_data(run_dir, how)
    if found is None or not (found / META_FILE).is_file():
        folder = run_folder(run_dir)
        settings = read_run_file(folder) or {}
        for key in ("eval_data",) if settings.get("eval_data") else ("data",):
            if problem := lost_relative_path(folder, settings, key, how):
                raise DataError(problem)
    if found is None:
        data = _data_folder(folder, settings)
        bound = _bound_data(folder)
        why = (f"its data {data} has no test part" if (data / META_FILE).is_file()
               else f"the test part of its split data, {data / 'test'}, is gone" if (data / "train" / META_FILE).is_file()
               else f"its data {data} is gone" if settings.get("data")
               else f"its encoded data {data} is gone, split into train and test by a flowrec of before 2026-12-05, "
                    "otherwise than this one splits the spec's data"
               if bound is not None and "train_rows" not in settings and _seeded(bound)
               else f"its encoded data {data} is gone, which `flowrec train SPEC --resume {folder}` encodes again"
               if bound is not None
               else "it trained on synthetic rows" if settings
               else f"its {RUN_FILE}, which records the data it trained and evaluated on, is "
                    f"{f'{kind}, not the file the run wrote' if (kind := not_a_file(folder / RUN_FILE)) else 'missing'}")
        raise DataError(f"{run_dir} recorded no evaluation data to score ({why}): give {how}")
    if not (found / META_FILE).is_file():
        raise DataError(f"the evaluation data {run_dir} recorded, {found}, is not an encoded dataset (moved, "
                        f"or recorded relative to another folder): give {how}")
    return found


def split_since(run_dir: Path, how: str = "--data DIR") -> str | None:
    """A warning for scoring a run's recorded evaluation data, or None: the run is of a flowrec of
    before 2026-12-05 (its run.json records no train_rows) and its --data folder has since been
    converted again by this flowrec (its record names the split rule), whose seeded split draws
    other test rows: rows the run trained on among them, so the metrics are not of held-out rows."""
    folder = run_folder(run_dir)
    settings = read_run_file(folder) or {}
    if not settings or "train_rows" in settings or not settings.get("data") or settings.get("eval_data"):
        return None
    data = Path(settings["data"])
    if resplit_since_start(folder, data) is None:
        return None
    return (f"{data} was converted again since {run_dir} was trained by a flowrec of before 2026-12-05 (its "
            f"run.json records no train_rows), and this flowrec's split draws other test rows: rows the run "
            f"trained on are among them, so these metrics are not of held-out rows; give {how} with the test "
            f"part that flowrec converted")


def resplit_since_start(folder: Path, data: Path) -> dict[str, Any] | None:
    """The split record of the dataset `data` (its train part's) when this flowrec's seeded split
    made it (its record names the split rule) after the run in `folder` started
    (`converted_since_start`): converted again since, so its test rows are not the ones an older
    flowrec drew for the run; else None (an unreadable record is named when the data is opened)."""
    from flowrec.data.convert import older_seeded_split
    from flowrec.data.layout import read_meta

    try:
        split = read_meta(data / "train").split if (data / "train" / META_FILE).is_file() else {}
    except DataError:
        return None
    if "split_seed" not in split or older_seeded_split(split) or not converted_since_start(folder, data):
        return None
    return split


def converted_since_start(folder: Path, data: Path) -> bool:
    """The dataset `data` (its train/_flowrec.json) was written after the run in `folder` started
    (its RUN/encoder/encoder.json, which its resumes keep), so converted again since; also True
    for a run without that record. A run of this flowrec on data converted first, whose run.json
    an older flowrec's resume rewrote without train_rows, is not taken for one."""
    from flowrec.data.encoder_record import ENCODER_FILE, RUN_ENCODER_DIR

    try:
        started = (folder / RUN_ENCODER_DIR / ENCODER_FILE).stat().st_mtime_ns
    except OSError:
        return True
    try:
        return (data / "train" / META_FILE).stat().st_mtime_ns > started
    except OSError:
        return False


def _seeded(data: dict[str, Any]) -> bool:
    """The spec.json `data` binding splits its rows into train and test by a seed (`seeded_split`),
    a split older flowrecs made otherwise."""
    from flowrec.data.convert import seeded_split

    options = data.get("options") or {}
    try:
        return isinstance(options, dict) and seeded_split(options)
    except (ValueError, TypeError):
        return False


def _bound_data(folder: Path) -> dict[str, Any] | None:
    """The run's spec.json `data` binding when the run trained on its spec's bound raw data,
    encoded into RUN/data (not synthetic rows, though it recorded no --data); None otherwise."""
    doc = _spec_document(folder)
    data = doc.get("data") if isinstance(doc, dict) else None
    return data if isinstance(data, dict) and data.get("path") and data.get("format") != "parquet" else None


def group_by_problem(run_dir: Path, feature: str) -> str | None:
    """Why the run's evaluation cannot be grouped by `feature` (`flowrec eval --group-by`), read from
    its spec.json alone, before its checkpoint (GBs of tables) is loaded: not a feature of the model,
    or not a one-id categorical one (dense, multi-hot, a sequence). None when it can, or when the run
    holds no readable spec.json (a checkpoint file alone: its own spec decides, once loaded)."""
    from flowrec.spec.schema_errors import did_you_mean
    from flowrec.spec.semantic import is_one_id_categorical

    doc = _spec_document(run_folder(run_dir))
    features = doc.get("features") if isinstance(doc, dict) else None
    if not isinstance(features, list):
        return None
    named = {f["name"]: f for f in features if isinstance(f, dict) and isinstance(f.get("name"), str)}
    usable = ", ".join(name for name, body in named.items() if is_one_id_categorical(body)) or "none"
    body = named.get(feature)
    if body is None:
        what = f"{run_dir}'s model has no feature {feature!r}{did_you_mean(feature, named)}"
    elif is_one_id_categorical(body):
        return None
    elif body.get("type") == "dense":
        what = f"{feature!r} is a dense feature"
    else:
        kind = "a sequence" if body.get("type") == "sequence" else "a multi-hot categorical feature"
        what = f"{feature!r} is {kind} of up to {body.get('max_len')} ids per sample"
    return f"--group-by {feature}: {what}; group by a one-id categorical feature (this model's: {usable})"


def _spec_document(folder: Path) -> Any:
    """The run folder's spec.json as read by every JSON document flowrec reads (size- and
    depth-bounded: a deeply nested one was a RecursionError here), or None where it cannot be read."""
    from flowrec.spec.json_doc import read_json_document

    try:
        return read_json_document(folder / "spec.json")
    except ValueError:
        return None
