"""The cost model's FAE traffic (`flowrec.planner.fae_traffic`) against the static_hot counters:
cold rows in and gradients out of cold batches, hot rows written back at hot/cold switches."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.profile import profile_access
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.graph.types import DTYPE_BYTES
from flowrec.planner.cost import INDEX_BYTES, epoch_batches, group_access, ids_per_sample
from flowrec.planner.fae_traffic import hot_cold_bytes
from flowrec.runtime.caches import StaticHotEmbedding, hottest_rows
from flowrec.runtime.caches.fae_batches import HotColdBatcher
from flowrec.testing.caches import CPU, cache_spec, groups_of, head_weights, loss_of, staged

BATCH = 64
ROWS = BATCH * 80


@pytest.mark.parametrize("share", [0.1, 0.3, 0.6])
def test_predicted_fae_bytes_per_sample_match_the_counters(share: float):
    spec = cache_spec("rowwise_adagrad")
    spec = replace(spec, training=replace(spec.training, batch_size=BATCH))
    batches = staged(spec, rows=ROWS, window=1)
    table = synth_table(spec, ROWS, SynthConfig(seed=11, alpha=1.2))  # the rows `staged` reads
    profile = profile_access(spec, MemorySource(split_table(table, 3)), sample_rate=1.0)
    groups = groups_of(spec, "fp32")
    for group in groups:
        ids = torch.cat([b.groups[group.name].ids for b in batches])
        cap = int(group.rows * share)
        module = StaticHotEmbedding(replace(group, cache_rows=cap), seed=3, device=CPU)
        module.set_hot_rows(hottest_rows(torch.bincount(ids, minlength=group.rows), cap))
        w = head_weights(group)
        for batch in HotColdBatcher(batches, {group.name: module.is_hot()}, groups, BATCH):
            loss_of(module.forward_group(batch.groups[group.name]), w).backward()
        snap = module.counters.snapshot()
        measured = (snap["h2d_bytes"] + snap["d2h_bytes"]) / snap["samples"] * BATCH
        n = ids_per_sample(group, profile)
        index = (BATCH * n + BATCH * group.bags_per_sample + 1) * INDEX_BYTES
        rows = hot_cold_bytes(group_access(group, profile), cap, BATCH * n, n,
                              group.dim * DTYPE_BYTES[group.dtype], group.row_bytes(), epoch_batches(profile, BATCH))
        predicted = index + rows
        assert rows > 0 and snap["outside_bytes"] > 0
        assert abs(predicted / measured - 1) <= 0.2, (group.name, share, predicted, measured)
