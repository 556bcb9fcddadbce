"""The runtime side of a retrieval head: item ids, sampled negatives, item vectors, the catalogue.

- Item ids: each row's item is read from the batch's own packed lookups (the item-id feature's
  bag in its group, minus the table's row offset) and written into the head's label column, so
  the loss, evaluation and every rank see the same ids as the lookups.
- Sampled negatives: N items per step drawn by a generator seeded by (seed, epoch, batch) (a
  resumed run and every rank draw what an uninterrupted one-process run draws), uniform over the
  catalogue (rows 1 .. vocab) or by training frequency, appended in the data stage to the item
  group's lookups as N extra samples (`flowrec.data.negatives`, only the item bag filled), so the
  caches, the casting and the sharded exchange see them, and the one lookup of that group reads
  them and its backward updates their rows once per step with the batch's rows.
- Item vectors: the item tower (the dense nodes between the item-id feature and the head) run on
  item rows: for negatives in training, for the whole catalogue in evaluation and export.

Example:
    >>> binding = model.retrieval                          # doctest: +SKIP
    >>> labels = item_labels(binding, batch, batch.labels)  # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
import torch

from flowrec.data.batches import Batch, GroupIds
from flowrec.data.negatives import NegativeSampler, item_samples
from flowrec.graph.edges import Slot, input_slots
from flowrec.graph.types import PackedGroup
from flowrec.runtime.modes import eval_mode
from operators.dense import flat_rows
from operators.retrieval import Candidates

CATALOGUE_CHUNK = 65_536  # items per item-tower call when scoring the whole catalogue


@dataclass
class RetrievalBinding:
    """Where a retrieval head's items live in a lowered model.

    Args:
        head: the head's index (its label column and loss position).
        node: the head node.
        item_feature: the item-id feature.
        group: the packed group holding it.
        bag: its bag within a sample's bags of that group.
        row_offset: its table's first packed row.
        vocab: catalogue size: items are table rows 1 .. vocab.
        table: the item-id feature's table.
        item_slot: the head's item-tower input slot.
        item_steps: dense nodes the item tower needs, in the model's order.
        attrs: the head node's attributes (metric, temperature, negatives, ...).
        log_q: log sampling probability per table row (`set_counts`; None before).  # (rows,)
    """

    head: int
    node: str
    item_feature: str
    group: str
    bag: int
    row_offset: int
    vocab: int
    table: str
    item_slot: Slot
    item_steps: tuple[str, ...]
    attrs: dict[str, Any]
    bags: int = 1
    log_q: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    named: np.ndarray | None = None  # the catalogue rows that hold an item (`set_items`; None: all)

    def set_items(self, record: Any) -> None:
        """The catalogue items of the data's encoder (`EncoderRecord`, None for none): the rows a raw
        id was fitted to, which evaluation ranks as serving does (`catalogue_ids`)."""
        ids = catalogue_ids(record, self.table, self.vocab) if record is not None else None
        self.named = None if ids is None else np.array([i + 1 for i, raw in enumerate(ids) if raw is not None],
                                                        np.int64)

    @property
    def sampled(self) -> bool:
        return self.attrs["negatives"] == "sampled"

    @property
    def needs_counts(self) -> bool:
        """It needs item frequencies of the training data (logQ, or unigram sampling)."""
        return bool(self.attrs["logq_correction"]) or (self.sampled and self.attrs["distribution"] == "unigram")

    def set_counts(self, counts: np.ndarray, device: torch.device) -> None:
        """Item frequencies from the training data (table rows; row 0 and rows past the vocab are
        never drawn): the sampling distribution and its logs. Sampled draws (uniform or unigram)
        take the rows that hold an item (`set_items` first; every row 1 .. vocab without it), never a
        row no raw id was fitted to."""
        counts = np.asarray(counts, np.float64)[: self.vocab + 1].copy()
        counts = np.pad(counts, (0, self.vocab + 1 - len(counts)))
        counts[0] = 0.0
        if self.sampled and self.attrs["distribution"] == "uniform":  # the rows that hold an item, alike
            counts[1:] = 1.0
        else:
            counts[1:] = np.maximum(counts[1:], 0.5)  # an item never seen in training is drawn rarely, not never
        named = None if self.named is None or not len(self.named) else self.named[self.named <= self.vocab]
        if self.sampled and named is not None:  # a draw never lands on a row no raw id was fitted to
            held = np.zeros(len(counts), bool)
            held[named] = True
            counts[~held] = 0.0
        p = counts / counts.sum()
        self.probs = torch.tensor(p)  # on the host, where every step draws from it
        self.log_q = torch.log(torch.tensor(p, device=device).clamp_min(1e-30)) \
            if self.attrs["logq_correction"] else None


def small_catalogue(binding: RetrievalBinding | None, head: str) -> str | None:
    """A line saying that K of the head's top_k is at least the catalogue evaluation ranks (the rows
    that hold an item, `set_items`): every item is then in the top K, hr@K 1.0 whatever the model
    (an item vocab of 1682 filled by data of 50 items, top_k [100]). None when no K is.

    >>> b = RetrievalBinding(0, "h", "item", "g", 0, 0, 1682, "items", None, (), {"top_k": [10, 100]})
    >>> b.named = np.arange(1, 51)
    >>> small_catalogue(b, "h").split(",")[0]
    'head h ranks a catalogue of 50 items'
    >>> b.attrs["top_k"] = [10]
    >>> small_catalogue(b, "h") is None
    True
    """
    if binding is None:
        return None
    items = binding.vocab if binding.named is None else len(binding.named)
    ks = [k for k in binding.attrs.get("top_k") or () if k >= items]
    if not ks:
        return None
    return (f"head {head} ranks a catalogue of {items:,} items, the rows of the {binding.vocab:,}-row table "
            f"{binding.table} its data's raw ids were fitted to, and top_k {', '.join(map(str, ks))} "
            f"{'is' if len(ks) == 1 else 'are'} at least that: every item is in the top "
            f"{ks[0]}, so hr@{ks[0]}, recall@{ks[0]} and ndcg@{ks[0]} say nothing of the model "
            f"(give smaller top_k)")


def bind(graph: nx.DiGraph, groups: dict[str, PackedGroup], spec: Any, steps: list[Any],
         head_nodes: list[str]) -> RetrievalBinding | None:
    """The retrieval head of a lowered model (None when it has none)."""
    for i, node in enumerate(head_nodes):
        op = graph.nodes[node]["op"]
        if op.attr("task") != "retrieval":
            continue
        attrs = dict(op.attrs)
        feature = attrs["item_feature"]
        group = next(g for g in groups.values() if any(f.feature == feature for f in g.fields))
        table = next(f.table for f in group.fields if f.feature == feature)
        item_slot = input_slots(graph, node)[1]
        needed = nx.ancestors(graph, item_slot.source) | {item_slot.source}
        return RetrievalBinding(
            i, node, feature, group.name, group.field_bags()[feature].start, group.row_offsets[table],
            spec.table(table).vocab_size, table, item_slot,
            tuple(s.name for s in steps if s.name in needed), attrs, group.bags_per_sample)
    return None


def catalogue_ids(record: Any, table: str, vocab: int) -> list[str | None] | None:
    """The raw item id of each catalogue row 1 .. vocab (index r - 1; None for a row no value was
    fitted to: a spare row not yet taken, or a row of a vocab larger than the data's values), from
    an encoder's vocabulary of the item table (`EncoderRecord`). None for an encoder without raw
    ids (synthetic data), whose items are every row."""
    from flowrec.data.encoder_record import read_vocab

    if table not in record.vocab_files:
        return None
    raw = read_vocab(Path(record.vocab_files[table])).to_pylist()[:vocab]
    return raw + [None] * (vocab - len(raw))


def batch_items(binding: RetrievalBinding, batch: Batch) -> torch.Tensor:
    """Each row's item id (table row) from the batch's packed lookups.  # (B,) int64"""
    ids = batch.groups[binding.group]
    starts = ids.offsets[:-1].view(-1, binding.bags)[: batch.size, binding.bag]  # not the drawn items after
    return ids.ids[starts] - binding.row_offset


def item_labels(binding: RetrievalBinding | None, batch: Batch, labels: torch.Tensor) -> torch.Tensor:
    """The label tensor with the retrieval head's column holding each row's item id (as is
    without a retrieval head).  # (B, T [+ weights])"""
    if binding is None or batch.size == 0:
        return labels
    labels = labels.clone()
    labels[:, binding.head] = batch_items(binding, batch).to(labels.device, labels.dtype)
    return labels


def sampler(binding: RetrievalBinding, seed: int) -> NegativeSampler:
    """The data stage's sampler of a sampled-negatives head (after `set_counts` where the head
    needs the items' training frequencies; uniform draws without logQ need none)."""
    if binding.probs is None:
        if binding.needs_counts:
            raise RuntimeError("sampled negatives: item frequencies were not set (RetrievalBinding.set_counts)")
        binding.set_counts(np.zeros(binding.vocab + 1), torch.device("cpu"))  # uniform over the catalogue
    return NegativeSampler(binding.group, binding.bag, binding.bags, binding.row_offset,
                           int(binding.attrs["num_negatives"]), binding.probs, seed)


def draw_negatives(binding: RetrievalBinding, seed: int, batch: Batch) -> torch.Tensor:
    """The step's sampled items (table rows), seeded by (seed, epoch, batch index).  # (N,) int64"""
    return sampler(binding, seed).draw(batch.epoch, batch.index)


def with_negatives(binding: RetrievalBinding, model: Any, batch: Batch) -> Batch:
    """A batch with its drawn items in the item group: as staged, or (a batch staged without a
    sampler) drawn and appended now, as the data stage would have."""
    if batch.negatives is not None:
        return batch
    return sampler(binding, model.noise_seed).attach(batch, model.group_map[binding.group])


def item_vectors(model: Any, binding: RetrievalBinding, rows: torch.Tensor) -> torch.Tensor:
    """The item tower on item rows (pooled lookups of the item bag).  # (N, D) -> (N, Dv)"""
    group = model.group_map[binding.group]
    n = rows.shape[0]
    full = rows.new_zeros(n, group.bags_per_sample, rows.shape[-1])
    full = full.index_copy(1, torch.tensor([binding.bag], device=rows.device), rows.view(n, 1, -1))
    emb = {binding.group: full}
    dense = rows.new_zeros(n, len(model.dense_columns))
    values: dict[str, torch.Tensor] = {}
    for step in model.steps:
        if step.name in binding.item_steps:
            values[step.name] = model.run_step(step, [model._slot_value(s, dense, emb, values) for s in step.slots], {})
    return flat_rows(model._slot_value(binding.item_slot, dense, emb, values))


def lookup_items(model: Any, binding: RetrievalBinding, items: torch.Tensor) -> torch.Tensor:
    """Pooled item-bag rows of `items` through the group's own lookup (no gradient).  # (N, D)"""
    grown = GroupIds(*item_samples(torch.empty(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), items,
                                   binding.bag, binding.bags, binding.row_offset))
    module = model.embeddings[binding.group]
    if getattr(module, "takes_group_ids", False):  # a cache module reads its staged rows
        rows = module.forward_group(grown)
    else:
        device = module.weight.device
        rows = module(grown.ids.to(device), grown.offsets.to(device), None)
    dense_device = model.device if model.device.type != "meta" else rows.device  # export: mapped tables
    return rows[:, binding.bag].to(dense_device)


@torch.no_grad()
def catalogue_vectors(model: Any, binding: RetrievalBinding) -> torch.Tensor:
    """Item-tower vectors of every catalogue item, row r - 1 for item r (1 .. vocab), in eval mode
    (no dropout; batch norm reads its running statistics and leaves them unchanged), whatever mode
    the model is in: training's evaluations and export rank the catalogue the model serves.  # (V, Dv)"""
    with eval_mode(model):
        out = []
        for lo in range(1, binding.vocab + 1, CATALOGUE_CHUNK):
            items = torch.arange(lo, min(lo + CATALOGUE_CHUNK, binding.vocab + 1))
            out.append(item_vectors(model, binding, lookup_items(model, binding, items)).float())
        return torch.cat(out)


def item_counts(source: Any, feature: str) -> np.ndarray:
    """How often each item row occurs in a training source's item-id column.  # (rows,) int64"""
    return read_items(source, feature)[0]


def read_items(source: Any, item: str, user: str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """One pass over a training source's item-id column (and `user`'s column): how often each item
    row occurs, and with `user` the distinct (user, item) pairs, sorted.  # (rows,) int64, (P, 2) int64 | None"""
    counts = np.zeros(0, np.int64)
    pairs = []
    for i in range(len(source.partition_rows())):
        table = source.submit(i, [item] if user is None else [user, item]).result()
        col = table.column(item).to_numpy().astype(np.int64)
        more = np.bincount(col)
        counts = np.pad(counts, (0, max(0, len(more) - len(counts))))
        counts[: len(more)] += more
        if user is not None:
            pairs.append(np.unique(np.stack([table.column(user).to_numpy().astype(np.int64), col], 1), axis=0))
    if user is None:
        return counts, None
    return counts, (np.unique(np.concatenate(pairs), axis=0) if pairs else np.zeros((0, 2), np.int64))


def head_items(model: Any, binding: RetrievalBinding, logits: torch.Tensor, labels: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The item-tower vectors and item ids of the rows of a step.  # (B, Dv), (B,) int64"""
    out = model.loss.split(logits)[binding.head]  # (B, Dq + Dv)
    return out[:, out.shape[1] // 2:], labels[:, binding.head].long()


def split_negatives(binding: RetrievalBinding, size: int, emb: dict[str, torch.Tensor]
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The batch's own lookups and the sampled items' item-bag rows: with sampled negatives the
    item group's lookup holds B + N samples.  # {group: (B, S, D)}, (N, D)"""
    rows = emb[binding.group]
    return {**emb, binding.group: rows[:size]}, rows[size:, binding.bag]


def embed_step(model: Any, binding: RetrievalBinding | None, batch: Batch
               ) -> tuple[Batch, dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """The sparse stage of a training step: (the batch, its lookups, the sampled negatives, their
    item-bag rows). A sampled head's negatives (staged by the data stage, drawn here otherwise)
    are looked up in the item group's one lookup, after the batch's samples, and split off."""
    if binding is not None and binding.sampled:
        batch = with_negatives(binding, model, batch)
        emb, rows = split_negatives(binding, batch.size, model.embed(batch))
        return batch, emb, batch.negatives, rows
    return batch, model.embed(batch), None, None


def candidates(model: Any, binding: RetrievalBinding | None, negatives: torch.Tensor | None,
               rows: torch.Tensor | None) -> Candidates | None:
    """The loss's candidates: logQ, and the sampled items' ids and item-tower vectors."""
    if binding is None:
        return None
    if negatives is None or rows is None:
        return Candidates(log_q=binding.log_q)
    vectors = item_vectors(model, binding, rows)
    return Candidates(vectors, negatives.to(vectors.device), binding.log_q, int(binding.attrs["num_negatives"]))
