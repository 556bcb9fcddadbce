"""The encoder a training run adopts: that of its training data, kept in ``RUN/encoder/``.

A new run takes the encoder of its training dataset (its evaluation data must share it); a
resumed run, and a run started ``--init-from`` another, must be given data of the encoder it
already has. Data whose encoder extends the model's into spare rows (`flowrec.data.vocab_growth`)
is accepted as evaluation data and as training data of an ``--init-from`` run, whose encoder is
then the extended one. Data from another encoder is refused with one line naming the first differing
feature (`flowrec.data.encoder_record`).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from flowrec.data.encoder_record import (
    ENCODER_FILE,
    RUN_ENCODER_DIR,
    EncoderRecord,
    check_same_encoder,
    check_vocabularies,
    find_record,
    read_record,
    record_of_dataset,
    synthetic_record,
    write_record,
)
from flowrec.data.id_forms import changed_forms
from flowrec.runtime.rundir import run_folder_of
from flowrec.spec.model import ModelSpec


def adopt_encoder(spec: ModelSpec, folder: Path, train: Any, evaluation: Any | None, resuming: bool,
                  parent: Path | None = None, status: Callable[[str], None] = lambda _: None) -> EncoderRecord:
    """Check the data's encoders and record the run's in `folder`/encoder (returned).

    Args:
        spec: the run's spec.
        folder: the run folder.
        train: the training source (a dataset with `.path` and `.meta`, or synthetic in memory).
        evaluation: the evaluation source, or None.
        resuming: the run continues; its recorded encoder must match the data.
        parent: the run this one starts from (--init-from); the data's encoder must be its encoder
            or an extension of it into spare rows (then recorded as the run's, with the parent's
            forms of hashed and managed ids: those its rows were trained on). Data that writes such
            ids in another form (`flowrec.data.id_forms`) is a warning line to `status`, as is
            evaluation data that does (`eval_form_lines`).

    Raises:
        DataError: one line naming the data and the first differing feature.
    """
    record = data_encoder(spec, train, evaluation)
    target = Path(folder) / RUN_ENCODER_DIR
    if parent is not None:
        parents = find_record(run_folder_of(parent))  # RUN/best's encoder is its run's
        check_same_encoder(parents, record, f"training data {_where(train)}", extension=True)
        for line in changed_forms(spec, record.columns, parents.id_forms, record.id_forms):
            status(f"warning: training data {_where(train)}: {line}")
        record = replace(record, id_forms={**record.id_forms, **parents.id_forms},
                         id_types={**record.id_types, **parents.id_types})
    for line in eval_form_lines(spec, record, evaluation):
        status(line)
    if resuming and (target / ENCODER_FILE).is_file():
        own = check_vocabularies(read_record(target))  # a damaged vocabulary file, as export refuses it
        check_same_encoder(own, record, f"training data {_where(train)}")
        return own
    if target.is_symlink() or (os.path.lexists(target) and not target.is_dir()):
        target.unlink()  # a link goes, never what it names: the record was written into the folder it named
    else:
        shutil.rmtree(target, ignore_errors=True)
    write_record(record, target)  # encoder.json last: a killed write is written again on resume
    return read_record(target)


def data_encoder(spec: ModelSpec, train: Any, evaluation: Any | None) -> EncoderRecord:
    """The encoder of the training data (a run's, also one without a folder: `flowrec.train(out=None)`);
    evaluation data of another encoder is a DataError (one line)."""
    record = _record_of(spec, train)
    if evaluation is not None:
        check_same_encoder(record, _record_of(spec, evaluation), f"evaluation data {_where(evaluation)}",
                           extension=True)
    return record


def eval_form_lines(spec: ModelSpec, record: EncoderRecord, evaluation: Any | None) -> list[str]:
    """A warning line per hashed or managed feature whose ids the evaluation dataset wrote in another
    form than the run's training rows (`record`'s forms, `flowrec.data.id_forms`): a dataset converted
    on its own from rows pandas wrote with a missing id ("12.0") has the run's fingerprint, and each of
    its ids was scored as one never seen, without a word."""
    if evaluation is None or getattr(evaluation, "path", None) is None or not record.id_forms:
        return []
    found = _record_of(spec, evaluation)
    return [f"warning: evaluation data {_where(evaluation)}: {line}"
            for line in changed_forms(spec, found.columns, record.id_forms, found.id_forms)]


def _record_of(spec: ModelSpec, source: Any) -> EncoderRecord:
    path = getattr(source, "path", None)
    return record_of_dataset(Path(path), source.meta) if path is not None else synthetic_record(spec)


def _where(source: Any) -> str:
    path = getattr(source, "path", None)
    return str(path) if path is not None else "(synthetic)"
