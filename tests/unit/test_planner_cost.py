"""Cost model sanity: monotone in batch, budget, device and precision; memory parts add up."""
from __future__ import annotations

from dataclasses import replace

import pytest

from flowrec.planner.cost import DEVICES, default_budget, device_profile, predict
from flowrec.planner.manager import make_plan
from flowrec.spec import load_spec


@pytest.fixture
def dlrm(repo):
    return load_spec(repo / "specs" / "dlrm_criteo.yaml")


def with_batch(spec, batch):
    return replace(spec, training=replace(spec.training, batch_size=batch))


def test_step_time_grows_with_batch(dlrm):
    times = [make_plan(with_batch(dlrm, b), target="a100").cost.step_ms_serial for b in (512, 2048, 8192)]
    assert times == sorted(times) and times[0] < times[-1]


def test_faster_device_is_faster(dlrm):
    plan = make_plan(dlrm, target="a100")
    a100 = predict(plan.graph, dlrm, DEVICES["a100"])
    h100 = predict(plan.graph, dlrm, DEVICES["h100"])
    cpu = predict(plan.graph, dlrm, DEVICES["cpu"])
    assert dict(h100.stage_ms)["dense"] < dict(a100.stage_ms)["dense"] < dict(cpu.stage_ms)["dense"]
    assert cpu.h2d_bytes_per_step == 0 and a100.h2d_bytes_per_step > 0


def test_bf16_dense_is_faster(dlrm):
    bf16 = replace(dlrm, training=replace(dlrm.training, precision="bf16"))
    fp32_plan, bf16_plan = make_plan(dlrm, target="h100"), make_plan(bf16, target="h100")
    assert dict(bf16_plan.cost.stage_ms)["dense"] < dict(fp32_plan.cost.stage_ms)["dense"]


def test_smaller_budget_moves_more_bytes_and_uses_less_memory(dlrm):
    roomy = make_plan(dlrm, target="h100")
    tight = make_plan(dlrm, target="h100", device_budget="1GiB")
    assert tight.cost.h2d_bytes_per_step > roomy.cost.h2d_bytes_per_step
    assert tight.cost.peak_memory_bytes < roomy.cost.peak_memory_bytes
    assert tight.cost.peak_memory_bytes <= 2**30
    host = make_plan(replace(dlrm, plan=replace(dlrm.plan, cache="none")), target="h100", device_budget="1GiB")
    assert host.cost.h2d_bytes_per_step > tight.cost.h2d_bytes_per_step


def test_overlap_never_slower_and_memory_adds_up(dlrm):
    for target in DEVICES:
        c = make_plan(dlrm, target=target).cost
        assert c.step_ms_overlap <= c.step_ms_serial + 1e-9
        assert c.peak_memory_bytes == sum(b for _, b in c.memory)
        assert c.samples_per_s == pytest.approx(c.batch_size / (c.step_ms_overlap / 1e3), rel=1e-3)


def test_profiles():
    assert default_budget(DEVICES["h100"]) < DEVICES["h100"].memory_bytes
    with pytest.raises(ValueError, match="known: cpu, a100, h100"):
        device_profile("tpu")


SAMPLED_TOWERS = {
    "name": "towers_sampled",
    "features": [
        {"name": "user_id", "type": "categorical", "vocab": 943, "dim": 32},
        {"name": "age", "type": "dense"},
        {"name": "item_id", "type": "categorical", "vocab": 1682, "dim": 32},
    ],
    "modules": [
        {"name": "user_tower", "kind": "mlp", "inputs": ["user_id", "age"], "layers": [256, 64]},
        {"name": "item_tower", "kind": "mlp", "inputs": ["item_id"], "layers": [256, 64]},
        {"name": "score", "kind": "similarity", "inputs": ["user_tower", "item_tower"], "metric": "cosine"},
    ],
    "heads": [{"name": "retrieve", "input": "score", "task": "retrieval",
               "negatives": {"kind": "sampled", "num": 4096}, "label": "label"}],
    "training": {"batch_size": 512},
}


def _loss(graph):
    return next(graph.nodes[n]["op"] for n in graph if graph.nodes[n]["op"].kind == "loss")


def test_sampled_negatives_go_through_the_item_tower_in_the_step_and_its_memory():
    """A step runs the item tower on the N drawn items too (`runtime.retrieval.item_vectors`):
    the dense time and the activations price it at N more rows, the query tower not; the same
    towers with in-batch negatives differ by that and by the softmax's candidates alone."""
    from flowrec.planner.cost import (ACTIVATION_COPIES, activation_bytes, dense_seconds, kernel_seconds,
                                      retrieval_work, sampled_item_tower)
    from flowrec.planner.op_work import op_work
    from flowrec.spec import spec_from_dict

    device = device_profile("cpu")
    graph = make_plan(spec_from_dict(SAMPLED_TOWERS), target="cpu").graph
    head = dict(SAMPLED_TOWERS["heads"][0], negatives={"kind": "in_batch"})
    in_batch = make_plan(spec_from_dict(dict(SAMPLED_TOWERS, heads=[head])), target="cpu").graph
    tower, drawn = sampled_item_tower(graph)
    assert tower == {"item_tower"} and drawn == 4096
    assert sampled_item_tower(in_batch) == (frozenset(), 0)

    def seconds(work):
        return kernel_seconds(work.forward, device), kernel_seconds(work.backward, device, backward=True)

    item = graph.nodes["item_tower"]["op"]
    extra = seconds(op_work(item, drawn, graph.in_degree("item_tower")))
    softmax = [seconds(retrieval_work(g, _loss(g), 512)) for g in (graph, in_batch)]
    base = dense_seconds(in_batch, device, 512)
    for way, (total, plain) in enumerate(zip(dense_seconds(graph, device, 512), base)):
        assert extra[way] > 0
        assert total == pytest.approx(plain + extra[way] + softmax[0][way] - softmax[1][way], rel=1e-9)
    logits = 3 * 512 * (1 + drawn - 512) * 4  # (B, 1 + N) against (B, B)
    assert activation_bytes(graph, 512) - activation_bytes(in_batch, 512) == \
        item.out_bytes * drawn * ACTIVATION_COPIES + logits
