"""Trained models outside training: load a run for scoring, the serving module of a package.

`load_trained(run, device, scoring)` rebuilds the model of a checkpoint from the spec and the plan
stored in it (never planning again; `scoring` is the planner's rule that maps the trained plan to
the one it is scored with, `flowrec.planner.contract.scoring_plan`) for `flowrec eval`.
`ServingModel` is the model for serving: one table per packed group (its logical tables one after
another, no optimizer state, fp32 or half), one lookup per group (`flowrec.serving.lookups`), plus
the dense operators; `flowrec.serving.export` exports it with `torch.export` into a model package.

Example:
    >>> serving = ServingModel(trained.spec, trained.model)  # doctest: +SKIP
    >>> probs = serving(dense, {"C1": (ids, offsets), ...})  # (B, n_heads)  # doctest: +SKIP
"""
from __future__ import annotations

import ctypes
import mmap
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.encoder_record import (
    ENCODER_FILE,
    RUN_ENCODER_DIR,
    EncoderRecord,
    check_same_encoder,
    check_vocabularies,
    read_record,
    record_of_dataset,
)
from flowrec.data.id_forms import changed_forms
from flowrec.data.layout import META_FILE, DataError
from flowrec.graph.kinds import OP_KINDS
from flowrec.graph.plan_io import plan_from_document, with_class_files
from flowrec.graph.types import Plan
from flowrec.spec.class_paths import run_class_files
from flowrec.spec.json_doc import parse_json_text
from flowrec.runtime.checkpoint.store import (
    CheckpointError,
    check_tensors,
    checkpoint_path,
    load_checkpoint,
)
from flowrec.runtime.checkpoint.delta import delta_files
from flowrec.runtime.rundir import run_folder_of
from flowrec.runtime.evaluation.evaluate import evaluate, group_slot
from flowrec.runtime.lowering import LoweredModel, lower
from flowrec.runtime.evaluation.scores import scores
from flowrec.runtime.managed_state import eval_remapper
from flowrec.runtime.messages import first_line, out_of_memory
from flowrec.runtime.session import open_dataset, resolve_device
from flowrec.spec.load import spec_from_dict
from flowrec.spec.model import ModelSpec
from flowrec.spec.validate import validate_document
from flowrec.serving.lookups import GroupLookup, as_int64, check_dense, positions
from operators.custom_code import UserCodeRefused
from operators.embedding import restoring_tables



MADV_DONTNEED = 4  # Linux madvise advice: drop the pages of a mapping


@dataclass
class Trained:
    """A model restored from a checkpoint, with its spec and the plan it is scored with."""

    spec: ModelSpec
    model: LoweredModel
    plan: Plan
    encoder: EncoderRecord | None = None  # None for runs made before encoders were recorded
    step: int | None = None  # the training step of the checkpoint it was restored from
    notes: tuple[str, ...] = ()  # a line per class file found in place of a gone one (`run_class_files`)

    @property
    def excludes_seen(self) -> bool:
        """The model has a retrieval head with exclude_seen (evaluation leaves users' training items out)."""
        binding = self.model.retrieval
        return binding is not None and bool(binding.attrs.get("exclude_seen"))

    def check_data(self, path: Path, record: EncoderRecord | None = None) -> None:
        """Raise DataError if the dataset at `path` (`record`: its encoder record, when already
        read) was not encoded with the model's encoder (or an extension of it into spare rows)."""
        if self.encoder is not None:
            check_same_encoder(self.encoder, record or record_of_dataset(Path(path)), str(path), extension=True)

    def form_lines(self, path: Path, record: EncoderRecord | None = None) -> list[str]:
        """A warning line per hashed or managed feature whose ids the dataset at `path` (`record`:
        its encoder record, when already read; of the model's encoder: a dataset converted on its
        own from rows pandas wrote with a missing id, "12.0", has the same fingerprint) wrote in
        another form than the model's training rows (`flowrec.data.id_forms`): each such id was
        scored as one never seen. Nothing for a model or a dataset recorded before forms were."""
        if self.encoder is None or not self.encoder.id_forms:
            return []
        found = record or record_of_dataset(Path(path))
        return [f"evaluation data {path}: {line}"
                for line in changed_forms(self.spec, found.columns, self.encoder.id_forms, found.id_forms)]

    def evaluate_dataset(self, path: Path, group_by: str | None = None, seen: Path | None = None,
                         warn: Callable[[str], None] | None = None) -> dict[str, dict[str, float]]:
        """Metrics per head on an encoded dataset (gAUC over `group_by`'s values when given;
        `seen`: a training dataset whose (user, item) pairs a retrieval head with exclude_seen
        leaves out of each user's ranking; `warn`: called, once scored, with each of the dataset's
        `form_lines`, told from the encoder record its encoder was checked by: its _flowrec.json
        is read once)."""
        if group_by is not None:  # a feature that cannot group fails before any data is read
            group_slot(self.model, group_by)
        if not (Path(path) / META_FILE).is_file() and (Path(path) / "test" / META_FILE).is_file():
            raise DataError(f"{path} is a split dataset (its parts train/ and test/ are the datasets): "
                            f"score its test part, {Path(path) / 'test'}")  # not "convert it first"
        source = open_dataset(Path(path), self.spec)
        try:
            record = None if self.encoder is None else record_of_dataset(Path(path), getattr(source, "meta", None))
            self.check_data(path, record)
            metrics = self.evaluate_source(source, group_by, seen)
        finally:
            source.close()
        for line in self.form_lines(path, record) if warn is not None else ():
            warn(line)
        return metrics

    def evaluate_drawn(self, rows: int, group_by: str | None = None, seen: Any = None) -> dict[str, dict[str, float]]:
        """Metrics per head on the evaluation rows of a run on `rows` synthetic training rows
        (`flowrec.runs.recorded.synthetic_rows`), drawn again from its seed; `seen` defaults to
        its training rows drawn again (a retrieval head with exclude_seen leaves them out)."""
        from flowrec.runtime.session import synthetic_evaluation

        train_rows, eval_rows = synthetic_evaluation(self.spec, rows)
        return self.evaluate_source(eval_rows, group_by, seen or train_rows)

    def evaluate_source(self, source: Any, group_by: str | None = None,
                        seen: Any = None) -> dict[str, dict[str, float]]:
        """Metrics per head on an open source of encoded rows (`evaluate_dataset`'s, or the
        synthetic evaluation rows of a run on synthetic rows), its encoder already checked;
        `seen`: a training dataset's path, or an open training source (a run's synthetic rows)."""
        if group_by is not None:
            group_slot(self.model, group_by)
        opts = StagingOptions(batch_size=self.spec.training.batch_size, shuffle=False, lookahead=0)
        with iterate_batches(self.spec, source, opts, 0, 0, self.model.groups,
                             remap=eval_remapper(self.model)) as batches:
            return evaluate(self.model, batches, self.spec.training.precision, group_by,
                            _seen_of(self, seen, group_by))


def _seen_of(trained: "Trained", path: Any, group_by: str | None) -> Any:
    """The training pairs of `path` (a dataset, or an open source) for a retrieval head with
    exclude_seen (None otherwise)."""
    binding = trained.model.retrieval
    if path is None or not trained.excludes_seen or group_by is None:
        return None
    if group_by == binding.item_feature:
        raise ValueError(f"cannot group by {group_by!r} with exclude_seen: it is the item id; group by the user")
    from flowrec.runtime.evaluation.retrieval import SeenItems

    if not isinstance(path, (str, Path)):  # an open source: a run's synthetic training rows
        return SeenItems.of(path, group_by, binding.item_feature)
    trained.check_data(path)
    source = open_dataset(Path(path), trained.spec)
    try:
        return SeenItems.of(source, group_by, binding.item_feature)
    finally:
        source.close()


def _spec_of(state: dict[str, Any], source: Path | str = "the file") -> ModelSpec:
    try:
        doc = parse_json_text(state["spec"], f"the spec in {source}")
    except (TypeError, ValueError):
        raise CheckpointError(f"{source} is damaged: its spec is not JSON") from None
    issues = validate_document(doc) if isinstance(doc, dict) else ["not a mapping"]
    if issues:
        raise CheckpointError(f"{source} holds a spec that is not valid: {issues[0]}")
    return spec_from_dict(doc)


def stored_plan(state: dict[str, Any], where: str) -> Plan:
    """The plan a checkpoint (or export) was trained with. Raises CheckpointError when it has none."""
    text = state.get("plan") or ""
    try:
        return plan_from_document(parse_json_text(text, f"the plan in {where}"))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{where} holds no complete plan (made by an older flowrec?): "
                              f"{type(exc).__name__}: {exc}") from None


def load_trained(run: Path, device: str, scoring: Callable[[Plan], Plan], mmap: bool = False) -> Trained:
    """Restore the model of a run folder / checkpoint file on `device`, with its stored plan as
    `scoring` maps it (the planner's rule for scoring a trained plan). With `mmap` (CPU), the
    parameters are mapped from the checkpoint file, not copied, and their pages given back after
    the content check (export of large tables).

    On the CPU the model's tensors are the checkpoint's own, mapped from its file (copy on write),
    in any case: the tables are neither drawn first nor copied (`flowrec eval` of dlrm_criteo's
    2.2 GB of tables: about half the peak memory), and scoring reads only the rows it looks up.

    Raises:
        CheckpointError: a damaged or foreign checkpoint, or one that does not fit its spec's model.
    """
    source = checkpoint_path(Path(run))
    dev = resolve_device(device)
    assign = mmap or dev.type == "cpu"  # the checkpoint's tensors become the model's
    state = load_checkpoint(source, mmap=assign)
    try:  # a moved run's class files, found beside it
        spec, notes = run_class_files(_spec_of(state, source), run_folder_of(source))
    except ValueError as exc:
        raise CheckpointError(f"{source}: {exc}") from None
    plan = scoring(with_class_files(stored_plan(state, str(run)), spec))
    with restoring_tables():  # every row is loaded next: nothing is drawn
        model = lower(plan, spec, "meta" if mmap else dev)
    check_tensors(source, "model", model.state_dict(), state["model"])
    try:
        model.load_state_dict(state["model"], assign=assign)
    except (RuntimeError, ValueError) as exc:  # e.g. a managed map the checkpoint holds is damaged
        if isinstance(exc, UserCodeRefused):  # a custom module's load code tried to end the process
            raise CheckpointError(f"cannot load {source}: {exc}") from None
        if out_of_memory(exc):
            raise
        raise CheckpointError(f"{source} does not fit the spec's model ({first_line(exc)})") from None
    if mmap:  # lowered on meta: the plan's constants on the mapped tensors' device (the CPU)
        model.assigned(torch.device("cpu"))
    if mmap and not delta_files(source):  # the content check read every page: give them back until
        # they are used (not when deltas were applied: their rows live only in those private pages)
        for tensor in state["model"].values():
            drop_mapped_pages(tensor)
    encoder = run_encoder(source)
    if model.retrieval is not None:  # evaluation ranks the items the run's encoder holds, as serving
        model.retrieval.set_items(encoder)
    return Trained(spec, model, plan, encoder, state["position"]["step"], tuple(notes))


def run_encoder(checkpoint: Path) -> EncoderRecord | None:
    """The encoder recorded in the run folder of a checkpoint (RUN/best's is its run's), its
    vocabularies checked (`check_vocabularies`), or None (a run made before encoders)."""
    folder = run_folder_of(Path(checkpoint)) / RUN_ENCODER_DIR
    return check_vocabularies(read_record(folder)) if (folder / ENCODER_FILE).is_file() else None


def missing_encoder(run: Path, trained: Trained) -> str | None:
    """A line when the run folder of `run` holds no encoder (None when it does): removed, or a run
    made before encoders were recorded. Its evaluation data is then not checked against the run's
    encoding, and a retrieval head ranks every row of its item table, not only the rows that hold
    an item (its metrics differ from the run's own evaluations, without a word)."""
    if trained.encoder is not None:
        return None
    folder = run_folder_of(checkpoint_path(Path(run))) / RUN_ENCODER_DIR
    what = "data scored is not checked against the run's encoding"
    if trained.model.retrieval is not None:
        what += (", and the retrieval head ranks every row of its item table, not only the rows that hold "
                 "an item, so its metrics differ from the run's own evaluations")
    return f"{folder} is missing (removed, or a run made before encoders were recorded): {what}"


class ServingModel(nn.Module):
    """A trained model for serving: a table per packed group, one lookup per group (per run of its
    pooled fields of one pooling: `flowrec.serving.lookups`) + the dense operators.

    Args:
        spec: the model spec.
        lowered: a lowered model whose packed tables become the serving tables, each group's
            logical tables one after another in the group's order (taken from it group by group).
        mapped: the lowered model's tables are mapped from a checkpoint file that it alone
            holds (`load_trained` with mmap, for this export only): each table is then used in
            place, not copied (`_in_place`; copying wide_1000's 3.9 GB took about 3.9 s). Other
            tables are copied (a caller may still train the lowered model: the package's tables
            must not change under it).

    Forward:
        dense: dense features in spec order.  # (B, n_dense)
        sparse: feature -> (ids, offsets): table-local ids and bag
            boundaries, one bag per sample (include_last_offset).  # (nnz,), (B + 1,)
        Returns probabilities for binary heads, values for regression heads, a probability per
        class for multiclass heads, side by side in head order.  # (B, sum of head widths)
    """

    def __init__(self, spec: ModelSpec, lowered: LoweredModel, mapped: bool = False) -> None:
        super().__init__()
        self.fields = {g.name: g.fields for g in lowered.groups}
        self.tasks = lowered.tasks
        packed, lookups = [], []
        self.places: dict[str, tuple[int, int, int]] = {}  # table -> (group index, first row, rows)
        for i, g in enumerate(lowered.groups):
            emb = lowered.embeddings.pop(g.name)  # the packed tables are freed group by group
            packed.append(nn.Parameter(_group_rows(emb, g, mapped), requires_grad=False))
            first = 0
            for slot in g.tables:
                self.places[slot.table] = (i, first, slot.rows)
                first += slot.rows
            lookups.append(GroupLookup(g.fields, {t: p[1:] for t, p in self.places.items() if p[0] == i}))
            del emb
        self.tables = nn.ParameterList(packed)  # one (rows, D) table per packed group: its tables in turn
        self.lookups = nn.ModuleList(lookups)
        self.dense_model = lowered  # the dense part of the model, without its packed tables
        self.dense_width = len(spec.dense_features)  # columns of the dense input

    def table(self, name: str) -> torch.Tensor:
        """The rows of one logical table inside its group's table (a view).  # (rows, D)"""
        group, first, rows = self.places[name]
        return self.tables[group][first:first + rows]

    def cast_tables(self, dtype: torch.dtype) -> None:
        """Store the tables in `dtype` (fp16 / bf16: half the bytes), one group at a time."""
        for weight in self.tables:
            weight.data = weight.data.to(dtype)

    def forward(self, dense: torch.Tensor, sparse: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        check_dense(dense, self.dense_width)
        emb, masks = {}, {}
        for group, weight, lookup in zip(self.fields, self.tables, self.lookups):
            emb[group] = lookup(weight, sparse)  # (B, S, D)
        for step in self.dense_model.steps:
            seq_slot = OP_KINDS[step.kind].sequence_slot
            if seq_slot is not None:
                seq_feature = step.slots[seq_slot].fields[0]
                offsets = as_int64(sparse[seq_feature][1])  # (a bool offset subtracts as an int)
                lengths = (offsets[1:] - offsets[:-1]).clamp(max=emb_len(self.fields, seq_feature))
                places = positions(offsets, emb_len(self.fields, seq_feature))  # (L,) on the inputs' device
                masks[step.name] = places.unsqueeze(0) < lengths.unsqueeze(1)  # (B, L)
        logits = self.dense_model.dense_forward(dense, emb, masks)
        return scores(logits, self.tasks, self.dense_model.head_widths)


def _group_rows(emb: nn.Module, group: Any, mapped: bool) -> torch.Tensor:
    """A packed group's tables one after another, in the group's order: the packed table's own
    rows where they lie so, used in place when `mapped` (`ServingModel`), else a copy.  # (rows, D)"""
    slots = group.tables
    rows = sum(slot.rows for slot in slots)
    weight = getattr(emb, "weight", None)
    in_turn = all(a.row_offset + a.rows == b.row_offset for a, b in zip(slots, slots[1:]))
    if isinstance(weight, torch.Tensor) and in_turn:
        whole = weight[slots[0].row_offset:slots[0].row_offset + rows].detach()
        if mapped and whole.device.type == "cpu" and whole.is_contiguous():
            return _in_place(whole)
        return whole.to("cpu", copy=True)
    return torch.cat([emb.table_rows(slot.table).detach().to("cpu") for slot in slots])


def _in_place(rows: torch.Tensor) -> torch.Tensor:
    """The rows of a contiguous CPU view as a tensor whose storage is exactly their memory, not a
    copy: `torch.export.save` writes it as a record of its own (a view of the packed table would
    share the packed table's storage: one record of the whole group), so model.pt2 is byte for
    byte the one a copy gives.  # (rows, D)"""
    raw = rows.view(torch.uint8) if rows.element_size() > 1 else rows  # (numpy has no bfloat16)
    return torch.from_numpy(raw.numpy()).view(rows.dtype)


def drop_mapped_pages(tensor: torch.Tensor) -> None:
    """Give the pages of a FILE-MAPPED tensor back to the OS (Linux; they would be read from the file
    again if touched). Never call it on other tensors: their contents would be lost."""
    if sys.platform != "linux" or tensor.numel() == 0:
        return
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    low, high = -(-start // page) * page, end // page * page
    if high > low:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(low), ctypes.c_size_t(high - low), MADV_DONTNEED)


def emb_len(fields: dict[str, Any], feature: str) -> int:
    return next(f.max_len for fs in fields.values() for f in fs if f.feature == feature)
