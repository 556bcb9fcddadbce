"""The `interleave` pass (PICASSO D- and K-interleaving): stages, micro-batches, group order.

Needs: a packed graph; placements from `cache` (a graph without them is treated as all-device).

Changes:
    * every op gets the stage of its kind (`flowrec.graph.kinds.OP_KINDS`): inputs ``staging`` (CPU workers), ids
      ``transfer``, lookups ``sparse``, modules and heads ``dense``, the loss ``backward``;
    * micro-batches per step: 1 with a retrieval head (training runs its softmax over the whole
      batch), else the spec's integer hint (capped at the batch size), else (``auto``)
      1 where sparse and dense work cannot overlap (cpu), otherwise the count in `MICRO_BATCH_CHOICES` with at least
      `MIN_MICRO_BATCH` samples each that the cost model prices lowest (more micro-batches pay
      off when sparse and dense times are comparable and the batch is large);
    * prefetch depth from the spec's hint;
    * group order: groups with host traffic (host, static_hot, lookahead) first, largest
      transfer first, then device groups largest first, so one group's transfer overlaps
      another's gather.

Afterwards every op has a stage and ``graph.graph["plan"]`` carries micro_batches, prefetch and
group_order; a second run changes nothing.
"""
from __future__ import annotations

from dataclasses import replace

from flowrec.graph.kinds import OP_KINDS, PLACEMENTS
from flowrec.graph.types import OpGraph, PassContext, PassResult
from flowrec.planner.cost import device_profile, predict
from flowrec.planner.passes.meta import plan_meta
from flowrec.spec.tasks import TASKS

MICRO_BATCH_CHOICES = (1, 2, 4, 8)
MIN_MICRO_BATCH = 512  # samples; smaller micro-batches waste kernel launches


def interleave(graph: OpGraph, ctx: PassContext) -> PassResult:
    """Assign stages, micro-batches, prefetch and group order (see the module docstring)."""
    g = graph.copy()
    changed = []
    for node in g:
        op = g.nodes[node]["op"]
        stage = OP_KINDS[op.kind].stage
        if op.stage != stage:
            g.nodes[node]["op"] = replace(op, stage=stage)
            changed.append(node)
    meta = plan_meta(g)
    micro, why = _micro_batches(g, ctx)
    placed = sorted(meta.groups, key=lambda gr: (not PLACEMENTS[gr.placement].host_side, -_traffic(gr), -gr.bytes,
                                                 gr.name))
    new_meta = replace(meta, micro_batches=micro, prefetch=ctx.spec.plan.prefetch,
                       group_order=tuple(gr.name for gr in placed))
    notes = [f"stages assigned to {len(changed)} op(s)" if changed else "stages already assigned",
             f"micro-batches {micro}: {why}", f"prefetch depth {new_meta.prefetch} batch(es)"]
    if new_meta.group_order:
        notes.append("group order: " + ", ".join(new_meta.group_order[:8])
                     + (" ..." if len(new_meta.group_order) > 8 else ""))
    if not changed and new_meta == meta:
        return PassResult(graph, False, tuple(notes))
    g.graph["plan"] = new_meta
    return PassResult(g, True, tuple(notes))


def _traffic(group) -> float:
    """Relative host traffic of a group: bytes it cannot serve from device memory."""
    return 0.0 if not PLACEMENTS[group.placement].host_side else (1.0 - group.expected_hit_rate + 0.01) * group.bytes


def _micro_batches(g: OpGraph, ctx: PassContext) -> tuple[int, str]:
    hint = ctx.spec.plan.micro_batches
    batch = ctx.spec.training.batch_size
    retrieval = next((h.name for h in ctx.spec.heads if TASKS[h.task].ranks), None)
    if retrieval is not None:  # its softmax's candidates are the whole batch (in-batch, or shared sampled items)
        return 1, f"retrieval head {retrieval!r}: one softmax over the batch, one micro-batch"
    if isinstance(hint, int) and hint > batch:  # training splits a batch into at most one sample each
        return batch, f"the plan hint {hint}, capped at the batch size {batch}"
    if isinstance(hint, int):
        return hint, "from the plan hint"
    device = device_profile(ctx.target)
    if not device.overlaps:
        return 1, f"{device.name}: sparse and dense share the cores, nothing to overlap"
    choices = [m for m in MICRO_BATCH_CHOICES if m == 1 or batch // m >= MIN_MICRO_BATCH]
    times = {m: predict(g, ctx.spec, device, micro_batches=m, profile=ctx.profile).step_ms_overlap
             for m in choices}
    best = min(choices, key=lambda m: (times[m], m))
    priced = ", ".join(f"{m}: {t:.3f} ms" for m, t in times.items())
    return best, f"auto, cost model step time per count ({priced})"
