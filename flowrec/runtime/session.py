"""Everything `flowrec train` needs, resolved from a spec, a plan and the options: the lowered
model of the plan (run exactly as planned: the runtime never edits a plan) and the train /
evaluation data.

Data, in order of precedence: `--data DIR` (an encoded dataset; `DIR/train` + `DIR/test` when
split), the spec's data binding (raw files converted once into the run folder), or synthetic data
generated from the spec (the embedded default job).

Example:
    >>> s = prepare(spec, Path("specs/dlrm_criteo.yaml"), SessionOptions(synthetic_rows=10_000),
    ...             plan, torch.device("cpu"))  # doctest: +SKIP
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from flowrec.data.cores import thread_budget
from flowrec.data.dataset import MemorySource, ParquetSource, split_table
from flowrec.data.layout import DataError, META_FILE, check_spec, read_meta
from flowrec.graph.kinds import PLACEMENTS
from flowrec.graph.types import Plan
from flowrec.runtime.atomic import atomic_write
from flowrec.runtime.lowering import GroupAllocationError, LoweredModel, lower
from flowrec.runtime.messages import shell_word
from flowrec.runtime.rundir import run_folder_of
from flowrec.spec.model import ModelSpec
from flowrec.spec.schema_errors import did_you_mean
from flowrec.spec.units import counted

SYNTH_ROWS = 400_000  # default synthetic training rows of the embedded job
EVAL_FRACTION = 0.2  # synthetic evaluation rows, as a fraction of the training rows
SYNTH_PARTITIONS = 8


@dataclass(frozen=True)
class SessionOptions:
    """How to resolve a run.

    Args:
        data: encoded dataset folder (overrides the spec's binding).
        eval_data: encoded evaluation dataset folder.
        device: auto, cpu or cuda.
        device_budget: device memory budget for the planner (e.g. "4GiB").
        synthetic_rows: rows of synthetic training data when no data is given or bound.
        seed: overrides the spec's training seed.
        workdir: where bound raw data is converted (the run folder).
        resumed: the run in `workdir` continues (its encoded data stays its data, even where the raw
            files changed since); a new run there encodes raw files that changed again.
        init_from: the run a new run in `workdir` starts from (--init-from): bound raw data is encoded
            with its encoder, new values given its spare rows.
        dask: read partitions through Dask: a scheduler address, or "local" for a local cluster
            (None: direct pyarrow reads, the faster default; see docs/data.md).
        split_rule: the seeded split's rule of the run (`flowrec.data.convert.SPLIT_RULE`; a run of
            before rule 3 records none: 2), with which its bound data is encoded again when gone.
        python: the run is `flowrec.train`'s: its lines name the keywords (`data=`), not the flags of
            `flowrec train` (`--data`).
    """

    data: Path | None = None
    eval_data: Path | None = None
    device: str = "auto"
    device_budget: str | None = None
    synthetic_rows: int = SYNTH_ROWS
    seed: int | None = None
    workdir: Path | None = None
    resumed: bool = False
    dask: str | None = None
    init_from: Path | None = None
    split_rule: int | None = None
    python: bool = False


@dataclass
class Session:
    """A resolved run: the spec, the plan it runs unchanged, its model, device and data."""

    spec: ModelSpec
    plan: Plan
    model: LoweredModel
    device: torch.device
    train: Any
    eval: Any | None
    data_note: str

    def close_data(self) -> None:
        """Close the data sources (their reader threads, check records, a local Dask cluster)."""
        for source in {id(s): s for s in (self.train, self.eval) if s is not None}.values():
            source.close()


def device_problem(name: str) -> str | None:
    """Why `name` is no device flowrec runs on (`--device`, `device=`): None for auto and every cpu
    or cuda[:N] name torch reads, else the rest of one line ("must be auto, cpu or cuda[:N], not
    ..."). The one check of train, eval, calibrate and the API, made before a run folder is made.

    A name torch reads but flowrec does not run on (meta, mps, xpu) is refused too: `meta` trained
    into a traceback on the first loss it read, leaving a run folder behind.

    Example:
        >>> device_problem("cuda:1") is None, device_problem("meta")
        (True, "must be auto, cpu or cuda[:N], not 'meta': flowrec trains and scores on the CPU or a CUDA GPU")
    """
    if not name.strip():  # torch.device("") says "Device string must not be empty"
        return "must be auto, cpu or cuda[:N], not an empty string"
    if name == "auto":
        return None
    try:
        kind = torch.device(name).type
    except RuntimeError:
        return f"must be auto, cpu or cuda[:N], not {name[:40]!r}{did_you_mean(name, ('auto', 'cpu', 'cuda'))}"
    if kind not in ("cpu", "cuda"):  # the words of flowrec.api's check of device=
        return f"must be auto, cpu or cuda[:N], not {name[:40]!r}: flowrec trains and scores on the CPU or a CUDA GPU"
    return None


NO_CUDA_NOTE = " (`flowrec doctor` shows the torch build and the devices it finds)"


def resolve_device(name: str, from_spec: bool = False) -> torch.device:
    """auto -> cuda when available, else cpu; a bad name or cuda without CUDA is a clear error
    (RuntimeError, one line), naming the spec's plan.device where `name` is that (`from_spec`: no
    --device was given), not a --device the user never gave."""
    problem = device_problem(name)
    if problem is not None:
        raise RuntimeError(f"--device {problem}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        if from_spec:
            raise RuntimeError(f"the spec's plan.device is {name}, but CUDA is not available on this machine: give "
                               f"--device cpu, or set plan.device: auto in the spec{NO_CUDA_NOTE}")
        raise RuntimeError(f"--device {name} was asked for, but CUDA is not available on this machine: give "
                           f"--device cpu or auto{NO_CUDA_NOTE}")
    return torch.device(name)


def prepare(spec: ModelSpec, spec_path: Path, opts: SessionOptions, plan: Plan, device: torch.device,
            status: Callable[[str], None] = lambda _: None, world: Any = None) -> Session:
    """Resolve data and build the model of `plan` on `device` (the plan runs exactly as given;
    `world`: this rank's part of a distributed run, its groups sharded as the plan says)."""
    if opts.seed is not None:
        spec = replace(spec, training=replace(spec.training, seed=opts.seed))
    train, evaluation, note = resolve_data(spec, spec_path, opts, status)
    for line in label_warnings(spec, train):
        status(f"warning: {line}")
    for g in plan.meta.groups:
        if PLACEMENTS[g.placement].cached:
            status(f"group {g.name}: placement {g.placement} with {g.cache_rows:,} device rows")
    status(f"building model on {device} ({counted(len(plan.meta.groups), 'packed group')})")
    slow = precision_note(spec.training.precision, device)
    if slow:
        status(f"warning: {slow}")
    try:
        model = lower(plan, spec, device, world=world)
    except GroupAllocationError as exc:
        raise RuntimeError(out_of_memory_message(plan, device, exc)) from None
    return Session(spec, plan, model, device, train, evaluation, note)


def label_warnings(spec: ModelSpec, train: Any) -> list[str]:
    """A line per binary head whose training labels are all one class, and per sample-weight column
    whose training weights are all 0, as the conversion counted them (`_flowrec_stats.json`), else
    as the dataset's Parquet parts hold them (a dataset written by another tool, or its statistics
    file removed; `flowrec.data.rawstats.training_means`; none for synthetic rows): such a head
    learns to predict that class alone, or nothing (its loss is 0 at every step), and a run trained
    without a word (a filter that kept the clicks only, a label column of another convention, a
    weight column of another meaning). Labels of a binary head are 0 or 1 and weights >= 0
    (`flowrec.data.checks`), so a mean of 0 or 1 is every label that class, and of 0 every weight 0.
    A head with a task space (`trained_where`) whose labels are of both classes over all rows is
    judged within its space too (`_space_line`): an ESMM conversion head whose every clicked row
    converted has a mean of 0.5 over all rows."""
    from flowrec.data.layout import label_columns, weight_columns
    from flowrec.data.rawstats import training_means

    path = getattr(train, "path", None)
    if path is None:
        return []
    binary = [(head, label) for head, label in zip(spec.heads, label_columns(spec)) if head.task == "binary"]
    weights = weight_columns(spec)
    wanted = {label: (0.0, 1.0) for _, label in binary}
    wanted.update({column: (*wanted.get(column, ()), 0.0) for column in weights})  # the values a line names
    rows, means = training_means(path, wanted)
    lines = []
    for head, label in binary:
        mean = means.get(label)
        if mean in (0.0, 1.0):
            lines.append(f"every training label of head {head.name} (column {label}) in {path} is {int(mean)} "
                         f"({counted(rows, 'row')}): it can only learn to predict {int(mean)}")
        elif head.trained_where is not None:  # a task space may hold one class where all rows hold two
            lines.extend(_space_line(head, label, path))
    for column in weights:
        if means.get(column) == 0.0:
            heads = ", ".join(h.name for h in spec.heads if h.sample_weight == column)
            lines.append(f"every sample weight of head {heads} (column {column}) in {path} is 0 "
                         f"({counted(rows, 'row')}): its loss is 0 at every step, so it learns nothing")
    return lines


def _space_line(head: Any, label: str, path: Path) -> list[str]:
    """The line of a binary head whose labels in its task space (`trained_where`, an ESMM-style
    conversion head read on clicked rows) are all one class, or that no training row is in
    (`flowrec.data.rawstats.space_constant`)."""
    from flowrec.data.rawstats import space_constant

    where = head.trained_where
    found = space_constant(path, label, where.label, where.equals)
    if found is None:
        return []
    rows, value = found
    space = f"its task space ({where.label} = {where.equals:g})"
    if value not in (0.0, 1.0):  # None: no row is in the space (validate refuses a space no row can be in)
        return []
    return [f"every training label of head {head.name} (column {label}) in {space} in {path} is {int(value)} "
            f"({counted(rows, 'row')}): it can only learn to predict {int(value)}"]


def precision_note(precision: str, device: torch.device) -> str | None:
    """Why the spec's precision gains nothing on `device` (bf16 without bf16 hardware), or None."""
    from operators.device import bf16_native

    if precision != "bf16" or bf16_native(device):
        return None
    return (f"training.precision is bf16, but this {device.type.upper()} has no bf16 matrix kernels (oneDNN's "
            "need AVX-512): flowrec runs its bf16 matrix products as fp32 products of bf16 values "
            "(bf16's rounding at fp32's speed, where torch's emulated kernels take about 20x longer), "
            "so bf16 is no faster than fp32 here; set training.precision: fp32 for fp32's accuracy")


def out_of_memory_message(plan: Plan, device: torch.device, exc: GroupAllocationError) -> str:
    """Name the group whose table could not be allocated and the budget the planner assumed."""
    from flowrec.spec.units import format_bytes

    g = exc.group
    where = "host memory" if g.placement != "device" or device.type == "cpu" else str(device)
    advice = ("Give a smaller --device-budget so more tables go to host or cache placements, or train "
              "with --device cpu." if device.type != "cpu" else
              "The tables do not fit this machine's memory: shrink the tables in the spec (rows or "
              "hash_buckets) or train on a machine with more memory.")
    return (f"out of memory building the model on {device}: group {g.name} ({len(g.tables)} tables, "
            f"{format_bytes(g.bytes)} with optimizer state, placement {g.placement}) did not fit in "
            f"{where}; the planner assumed a device budget of {format_bytes(plan.device_budget_bytes)}. "
            f"{advice} ({exc.reason})")


def resolve_data(spec: ModelSpec, spec_path: Path, opts: SessionOptions,
                 status: Callable[[str], None]) -> tuple[Any, Any | None, str]:
    """(train source, eval source or None, a note saying where the data came from)."""
    from flowrec.data.parquet_folder import unread_lines

    for given in (opts.data, opts.eval_data):  # a job still writing into it: the rows it holds are not read
        for line in unread_lines(Path(given), raw=False) if given is not None else ():
            status(f"warning: {line}")
    if opts.data is not None:
        train, evaluation = dataset_pair(Path(opts.data), spec, opts.dask, test_needed=opts.eval_data is None)
        if opts.eval_data is not None:
            evaluation = _replace_evaluation(train, evaluation, Path(opts.eval_data), spec, opts.dask)
        return train, evaluation, f"data: {opts.data}"
    if spec.data is not None and spec.data.bound:
        if opts.eval_data is not None:  # refused before the bound raw data is encoded (minutes, a folder)
            check_spec(read_meta(Path(opts.eval_data)), spec, Path(opts.eval_data))
        folder = bound_dataset(spec, spec_path, opts.workdir, status, opts.resumed, opts.init_from, opts.split_rule)
        if spec.data.format == "parquet":  # the user's own encoded dataset, not flowrec's encoding of raw data:
            # never 'remove it' (a raw Parquet file bound so was told to remove itself)
            for line in unread_lines(folder, raw=False):
                status(f"warning: {line}")
            train, evaluation = dataset_pair(folder, spec, opts.dask, test_needed=opts.eval_data is None)
        else:
            remake = _remake_advice(folder)
            try:
                train, evaluation = dataset_pair(folder, spec, opts.dask, test_needed=opts.eval_data is None,
                                                 remake=remake)
            except DataError as exc:  # e.g. its Parquet files deleted: 'RUN/data/train: no Parquet files'
                if remake in str(exc):
                    raise
                raise DataError(f"{exc}; {folder} is flowrec's encoding of the spec's data: {remake}") from None
        if opts.eval_data is not None:  # given, it evaluates instead of the bound data's test split
            evaluation = _replace_evaluation(train, evaluation, Path(opts.eval_data), spec, opts.dask)
        return train, evaluation, f"data: {spec.data.format} at {spec.data.path} (encoded in {folder})"
    if opts.eval_data is not None:  # it would be ignored: synthetic rows have their own evaluation rows
        given = "data=" if opts.python else "--data"
        raise DataError(f"evaluation data {opts.eval_data} needs training data encoded alike: give the training "
                        f"data too ({given}, or data bound in the spec), not synthetic rows")
    return synthetic_sources(spec, opts.synthetic_rows, status)


def _remake_advice(folder: Path) -> str:
    """How to make a run's encoding of its spec's bound data (`folder`, RUN/data) again: remove it
    to encode the same split again, unless its record names no split rule (an older flowrec's
    seeded split, which this one may not make again: the run would go on with other rows in test,
    rows it trained on among them)."""
    from flowrec.data.convert import older_seeded_split

    try:
        split = read_meta(folder / "train").split if (folder / "train" / META_FILE).is_file() else {}
    except DataError:
        split = {}
    if older_seeded_split(split):
        return (f"{folder} was split by a flowrec of before 2026-12-06 (its {META_FILE} names no split rule), and "
                f"encoding the spec's data again may split it otherwise (other rows in test, rows the run trained "
                f"on among them): put the missing files back, or start over with --out {folder.parent} --overwrite")
    return f"remove {folder} to encode the spec's data again (the same split)"


def _replace_evaluation(train: Any, split_test: Any | None, path: Path, spec: ModelSpec,
                        dask: str | None) -> Any:
    """The evaluation source opened from `path`, closing the dataset's own test split it replaces
    (left open, its readers lived as long as the run); when `path` is refused, the training
    source is closed too (nothing is left open behind the error)."""
    try:
        return open_dataset(path, spec, dask)
    except BaseException:
        train.close()
        raise
    finally:
        if split_test is not None:
            split_test.close()


def open_dataset(path: Path, spec: ModelSpec, dask: str | None = None) -> Any:
    """An encoded dataset checked against the spec, read directly or through Dask."""
    check_spec(read_meta(path), spec, path)
    if dask is None:
        return ParquetSource(path, threads=thread_budget().readers)
    from flowrec.data.dataset import DaskSource

    return DaskSource(path, address=None if dask == "local" else dask)


def dataset_pair(path: Path, spec: ModelSpec, dask: str | None = None, test_needed: bool = True,
                 remake: str = "") -> tuple[Any, Any | None]:
    """A dataset folder, or its train/ and test/ parts when it was split. A split whose test part
    is gone is a `DataError` when `test_needed` (no other evaluation data was given): the run would
    train without evaluating, saying the data has no test split; `remake` says how to make it again."""
    if (path / "train" / META_FILE).is_file():
        test = path / "test"
        if test_needed and not (test / META_FILE).is_file():
            recorded = read_meta(path / "train").split
            if recorded:
                raise DataError(
                    f"{test} is missing: {path / 'train' / META_FILE} records a split (test fraction "
                    f"{recorded.get('test_fraction')}) whose test part is gone, so nothing would be evaluated; "
                    f"{remake or 'restore it'}, or give --eval-data DIR (eval_data=) to evaluate on other data")
        evaluation = open_dataset(test, spec, dask) if (test / META_FILE).is_file() else None
        return open_dataset(path / "train", spec, dask), evaluation
    return open_dataset(path, spec, dask), None


def bound_dataset(spec: ModelSpec, spec_path: Path, workdir: Path | None,
                  status: Callable[[str], None], resumed: bool = False, init_from: Path | None = None,
                  split_rule: int | None = None) -> Path:
    """Encode the spec's bound raw data once (reused while it exists). Encoding holds a lock on
    the folder it goes in (runs/<spec name> without a run folder), so two runs started together
    encode it once: the second waits, then reuses it (never a clash or a half-replaced folder).
    A new run in a run folder (`--overwrite`) whose encoding is older than the raw files (or
    unstamped) encodes them again; a `resumed` one keeps its data, and one whose data is gone encodes
    the raw data again with the run's own encoder (RUN/encoder: the same ids as the rows it trained on,
    whichever rows a new fit would see). A new run in its folder started from another (`init_from`)
    encodes it with that run's encoder, new values given its spare rows (an extension the run takes):
    a new fit need not give the ids the model learnt (an older flowrec fitted on a split's test rows too).
    A resumed run's data is split again by the run's `split_rule` (the rows it trained on)."""
    from flowrec.data.convert import SPLIT_RULE, convert
    from flowrec.data.error_log import SKIP_HINT
    from flowrec.data.sources import spec_file_options
    from flowrec.data.output import folder_locked
    from flowrec.data.paths import unusable_path

    assert spec.data is not None and spec.data.path is not None
    if problem := unusable_path(spec_path.parent / spec.data.path):  # a link loop: resolve() raised RuntimeError
        raise DataError(f"the spec's data binding {spec.data.path}: {problem}")
    raw = (spec_path.parent / spec.data.path).resolve()
    if spec.data.format == "parquet":
        return raw
    if not raw.exists():
        raise DataError(f"the spec's data binding points to {raw}, which does not exist: put the data there "
                        f"(data.path {spec.data.path} is relative to the spec's folder), give --data DIR (a dataset "
                        "`flowrec data convert` wrote), or train on synthetic rows (--rows N) with a copy of the "
                        "spec without data.path")
    out = (workdir or Path("runs") / spec.name) / "data"

    def encoded() -> bool:
        return (out / META_FILE).is_file() or (out / "train" / META_FILE).is_file()

    def current() -> bool:  # an encoding this run may use as it is
        if workdir is None:  # runs/<name>/data, which other runs may read: changed raw files are one line
            if _changed_since(out, raw, missing=False):
                raise DataError(f"{out} holds {raw} encoded before the file changed (its size or time differ): "
                                f"remove {out} to encode it again, or give out= a run folder (its data is encoded "
                                "there)")
            return True
        # a new run in its folder encodes raw files that changed since (or were never stamped) again
        return resumed or not _changed_since(out, raw, missing=True)

    if encoded() and current():
        return out
    with folder_locked(out.parent, lambda: status(f"waiting for another flowrec process encoding into {out}")):
        if encoded() and current():  # it did, while this one waited
            return out
        if resumed and workdir is not None:
            _refuse_lost_encoding(spec, workdir, out)
        replaced = out.exists()  # this new run's folder held the encoding of raw files that changed since:
        if replaced:  # the new encoding replaces it once complete, after the flowrec processes reading it (a
            # `flowrec eval RUN`) are done, as `data convert --overwrite` does; it was removed under them at once
            status(f"{raw} changed since {out} was encoded: encoding it again" if encoded() else
                   f"{out} holds no complete encoding (no {META_FILE} of its own or of its train/ part): "
                   "encoding it again")
        owner = None if workdir is None else workdir if resumed else run_folder_of(init_from) if init_from else None
        own = _run_encoder(spec, owner) if owner is not None else None
        status(f"encoding {spec.data.format} data from {raw} into {out}"
               + (f" with the encoder of {owner}" if own is not None else ""))
        try:
            report = convert(spec, spec.data.format, [raw], out, options=spec_file_options(spec, spec_path.parent),
                             overwrite=replaced, encoder=own, grow=not resumed, status=status,
                             split_rule=split_rule if resumed and split_rule is not None else SPLIT_RULE)
        except DataError as exc:  # `flowrec train` and `flowrec.train` have no --on-error of their own
            shown = shell_word(str(spec_path)) if spec_path.is_file() else "SPEC"  # a command that runs as written
            raise DataError(str(exc).replace(SKIP_HINT, (
                f"to skip such rows, convert them with `flowrec data convert {spec.data.format} {shell_word(str(raw))} "
                f"DIR --spec {shown} --on-error skip` and train on DIR: --data DIR, or data=DIR in Python"))) from None
        atomic_write(out / RAW_STAMP, json.dumps(_raw_stamp(raw), sort_keys=True).encode())
        for line in report.warnings:
            status(f"warning: {line}")
    return out


def _refuse_lost_encoding(spec: ModelSpec, workdir: Path, out: Path) -> None:
    """A resumed run whose bound data (`out`, RUN/data) and encoder record (RUN/encoder) are both
    gone cannot be given the ids it trained on: a new fit need not give them (a flowrec of before
    2026-12-06 fitted a split's encoder on its test rows too; a changed raw file gives others), and
    its checkpoint holds no vocabulary to check one against. It went on with a new fit, other ids
    under the same rows, without a word; now a DataError (one line) saying what to put back."""
    from flowrec.data.encoder_record import ENCODER_FILE, RUN_ENCODER_DIR
    from flowrec.runtime.rundir import CHECKPOINT_NAME

    record = workdir / RUN_ENCODER_DIR
    if (record / ENCODER_FILE).is_file() or not (workdir / CHECKPOINT_NAME).is_file():
        return  # its own encoder encodes the data again (`_run_encoder`); a run with no checkpoint trained nothing
    raise DataError(f"{out} (the run's encoding of the spec's {spec.data.format if spec.data else ''} data) and "
                    f"{record} (the encoder it was made with) are both gone: encoding the data again with a new "
                    f"fit need not give the ids the run trained on, and its checkpoint cannot tell; put {record} "
                    f"(or {out}) back to resume, or start over (a new run, another --out)")


RAW_STAMP = "_flowrec_raw.json"  # the bound raw files' sizes and times when they were encoded


def _run_encoder(spec: ModelSpec, folder: Path) -> Any:
    """The encoder the run in `folder` recorded (RUN/encoder), to encode a resumed run's gone RUN/data
    again, or a run started from it, with the ids it trained on: fitting one anew need not give them
    (a flowrec of before 2026-12-06 fitted a split's encoder on its test rows too). None without one
    to encode raw data with (no record yet, synthetic rows, another spec's): the data is fitted, and
    the run's checks of its encoder speak."""
    from flowrec.data.encoder_record import ENCODER_FILE, RUN_ENCODER_DIR, load_encoder, read_record, synthetic
    from flowrec.data.layout import data_hash

    target = folder / RUN_ENCODER_DIR
    if not (target / ENCODER_FILE).is_file():
        return None
    record = read_record(target)
    if synthetic(record) or record.data_hash != data_hash(spec):
        return None
    return load_encoder(record, spec)  # each vocabulary read once, checked against its digest (checked_vocab)


def _raw_stamp(raw: Path) -> dict[str, list[int]]:
    """Size and modification time (ns) of each raw file (a folder's files: movielens)."""
    files = [raw] if raw.is_file() else sorted(p for p in raw.rglob("*") if p.is_file())
    stats = {str(p.relative_to(raw)) if p != raw else p.name: p.stat() for p in files}
    return {name: [st.st_size, st.st_mtime_ns] for name, st in stats.items()}


def _changed_since(out: Path, raw: Path, missing: bool) -> bool:
    """Whether the raw files differ from those `out` was encoded from (`missing`: the answer for
    an encoding without a stamp, one written before flowrec stamped them)."""
    stamp = out / RAW_STAMP
    if not stamp.is_file():
        return missing
    try:
        return json.loads(stamp.read_text()) != _raw_stamp(raw)
    except ValueError:  # a damaged stamp: the encoding cannot be told current
        return True


def synthetic_sources(spec: ModelSpec, rows: int, status: Callable[[str], None]) -> tuple[Any, Any, str]:
    """Synthetic train and evaluation data from the spec (same hidden model, disjoint rows)."""
    from flowrec.data.synth import SynthConfig, synth_table

    eval_rows = synthetic_eval_rows(rows)
    status(f"generating {rows:,} + {eval_rows:,} synthetic rows from the spec (Zipf ids, hidden-model labels)")
    table = synth_table(spec, rows + eval_rows, SynthConfig(seed=spec.training.seed))
    train = MemorySource(split_table(table.slice(0, rows), SYNTH_PARTITIONS))
    evaluation = MemorySource(split_table(table.slice(rows, eval_rows), 2))
    return train, evaluation, f"data: synthetic, {rows:,} train + {eval_rows:,} eval rows"


def synthetic_eval_rows(rows: int) -> int:
    """How many evaluation rows a run on `rows` synthetic training rows draws after them."""
    return max(int(rows * EVAL_FRACTION), 1)


def synthetic_evaluation(spec: ModelSpec, rows: int) -> tuple[MemorySource, MemorySource]:
    """The (training, evaluation) rows of a run on `rows` synthetic rows of the trained `spec` (its
    seed), drawn again as `synthetic_sources` drew them: `flowrec eval RUN` of such a run scores
    what it evaluated on (a retrieval head with exclude_seen leaving out the training pairs)."""
    train, evaluation, _ = synthetic_sources(spec, rows, lambda _: None)
    return train, evaluation
