"""Sampled negatives of a retrieval head, drawn and packed in the data stage.

Each step's N items are drawn (with replacement, by the head's distribution over table rows) from a
generator seeded by (seed, epoch, batch index), so a resumed run, every rank of a global batch and
a one-process run all draw the same items. They are appended to the batch's lookups of the item
table's packed group as N extra samples, only the item bag of each filled, before the lookahead
window and the casting are computed: the caches (lookahead scratchpad, FAE's hot rows), the casted
backward and the sharded exchange see them like any id, and one fused sparse update per step
trains the batch's rows and the drawn ones. The batch keeps the drawn rows (`Batch.negatives`); its
other groups, its labels and its `size` describe its own B samples only.

Example:
    >>> sampler = NegativeSampler("g0", bag=1, bags=2, row_offset=10, num=3, probs=torch.ones(5) / 5, seed=0)
    >>> items = sampler.draw(epoch=0, index=4)
    >>> ids, offsets = sampler.append(torch.tensor([3, 12]), torch.tensor([0, 1, 2]), items)
    >>> offsets.tolist(), items.shape
    ([0, 1, 2, 2, 3, 3, 4, 4, 5], torch.Size([3]))
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from flowrec.data.lookahead import batch_extras, union_sorted

SAMPLE_MIX = 1_000_003  # a prime mixing (seed, epoch, batch) into the negatives' generator seed


@dataclass(frozen=True)
class NegativeSampler:
    """Where a retrieval head's drawn items go and how they are drawn.

    Args:
        group: the item table's packed group.
        bag: the item feature's bag within a sample's bags of that group.
        bags: bags per sample of the group (S).
        row_offset: the item table's first packed row.
        num: items drawn per step (N).
        probs: probability of each table row (row 0 and rows never drawn: 0).  # (rows,) float64
        seed: the run's model seed.
    """

    group: str
    bag: int
    bags: int
    row_offset: int
    num: int
    probs: torch.Tensor
    seed: int

    def draw(self, epoch: int, index: int) -> torch.Tensor:
        """The items (table rows) of batch `index` of `epoch`.  # (N,) int64"""
        # modulo 2^64 (torch takes an unsigned 64-bit seed): every seed of the spec's range
        # (0 .. 2^63-1) draws; the seeds below about 1.8e7, the only ones that drew before, are unchanged
        gen = torch.Generator().manual_seed(((self.seed * SAMPLE_MIX + epoch) * SAMPLE_MIX + index) % (1 << 64))
        return torch.multinomial(self.probs.float(), self.num, replacement=True, generator=gen)

    def append(self, ids: torch.Tensor, offsets: torch.Tensor, items: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """A group's packed ids and offsets with one extra sample per item (`item_samples`)."""
        return item_samples(ids, offsets, items, self.bag, self.bags, self.row_offset)

    def attach(self, batch: Any, group: Any) -> Any:
        """A staged batch (`flowrec.data.batches.Batch`) with its items drawn and appended to the
        item group, that group's casting and unique rows recomputed (and its window widened by
        them): for batches formed after packing (FAE's hot and cold batches) and batches staged
        without a sampler."""
        items = self.draw(batch.epoch, batch.index)
        gids = batch.groups[self.group]
        ids, offsets = self.append(gids.ids.cpu(), gids.offsets.cpu(), items)
        grown = replace(gids, ids=ids, offsets=offsets, casting=None, unique=None)
        if gids.casting is not None or gids.unique is not None:
            casting, unique = batch_extras(group, ids, offsets, gids.casting is not None)
            window = unique if gids.window_unique is None else union_sorted([unique, gids.window_unique.cpu()])
            grown = replace(grown, casting=casting, unique=unique, window_unique=window)
        return replace(batch, groups={**batch.groups, self.group: grown}, negatives=items)


def item_samples(ids: torch.Tensor, offsets: torch.Tensor, items: torch.Tensor, bag: int, bags: int,
                 row_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ids and offsets of a group with one extra sample per item, only bag `bag` of its
    `bags` filled (with the item's packed row).  # (nnz,), (B*S + 1,) -> (nnz + N,), ((B + N)*S + 1,)"""
    lengths = torch.zeros(len(items), bags, dtype=torch.int64)
    lengths[:, bag] = 1
    extra = offsets[-1] + torch.cumsum(lengths.reshape(-1), 0).to(offsets.device)
    rows = (items + row_offset).to(ids.device, ids.dtype)
    return torch.cat([ids, rows]), torch.cat([offsets, extra.to(offsets.dtype)])
