"""A plan that cannot fit its memory: `flowrec plan` says so, `flowrec train` and `flowrec.train`
refuse it in one line before anything is built or written; plans of the example specs are not
warned; the margin; the host memory reading; `--device ""` in flowrec's words.

Fast tier: the refused runs allocate nothing (the process's memory high-water mark barely moves).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.cli.plan_cmd import memory_warning
from flowrec.data.hostmemory import available_memory_bytes
from flowrec.planner.fit import FIT_MARGIN, misfit, plan_need
from flowrec.planner.manager import make_plan
from flowrec.runs.errors import RunError
from flowrec.spec import load_spec

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
HUGE = """
name: huge_moe
features:
  - {name: user_id, type: categorical, vocab: 943, dim: 16}
  - {name: item_id, type: categorical, vocab: 1682, dim: 16}
  - {name: genres, type: categorical, vocab: 19, dim: 16, max_len: 6, pooling: mean}
modules:
  - {name: experts, kind: moe, inputs: ["@sparse"], experts: 1024, expert_layers: [65536, 65536], heads: [like]}
  - {name: like_tower, kind: mlp, inputs: [experts.like], layers: [32]}
heads:
  - {name: like, input: like_tower, task: binary, loss: bce, label: label}
optimizer:
  dense: {name: adam, lr: 0.001}
  sparse: {name: adam, lr: 0.001}
training: {batch_size: 1024, epochs: 1, seed: 0}
"""
MiB = 2**20


def high_water() -> int:
    """This process's peak resident memory so far (bytes)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.fixture
def huge(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text(HUGE)
    return path


def test_plan_warns_in_text_and_with_json(huge):
    r = runner.invoke(app, ["plan", str(huge)])
    assert r.exit_code == 0, r.output
    warning = r.output.splitlines()[1]
    assert warning.startswith("warning: plan huge_moe needs about 64.") and "TiB at its peak" in warning
    assert "host memory available on this machine" in warning
    assert "largest: module experts: 64." in warning and "of dense parameters" in warning
    r = runner.invoke(app, ["plan", str(huge), "--json", "-"])
    assert r.exit_code == 0
    assert json.loads(r.stdout)["spec"] == "huge_moe"  # the document stays the plan, unchanged
    assert "warning: plan huge_moe needs about 64." in r.stderr
    r = runner.invoke(app, ["plan", str(huge), "--target", "h100"])
    assert "of device budget on h100" in r.output.splitlines()[1]


def test_train_refuses_before_building_or_writing(huge, tmp_path):
    before = high_water()
    r = runner.invoke(app, ["train", str(huge), "--out", str(tmp_path / "run"), "--device", "cpu", "--max-steps", "1"])
    assert r.exit_code == 2, r.output
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines[-1].startswith("error: plan huge_moe needs about 64.") and "host memory available" in lines[-1]
    assert "module experts: 64." in lines[-1] and "Traceback" not in r.output
    assert not (tmp_path / "run").exists()
    assert high_water() - before < 200 * MiB  # nothing of the model was allocated


def test_api_refuses_with_a_run_error(huge, tmp_path):
    import flowrec

    before = high_water()
    with pytest.raises(RunError, match=r"needs about 64\.\d TiB at its peak, more than the .* of host memory"):
        flowrec.train(huge, out=tmp_path / "run", device="cpu", max_steps=1)
    assert not (tmp_path / "run").exists()
    assert high_water() - before < 200 * MiB


@pytest.mark.parametrize("spec", sorted(p.name for p in (REPO / "specs").glob("*.yaml")))
def test_example_specs_are_not_warned(spec):
    plan = make_plan(load_spec(REPO / "specs" / spec))
    assert memory_warning(plan) is None
    assert misfit(replace(plan, target="h100"), 76 * 2**30, "device budget") is None


def test_the_margin_and_the_contributors(huge):
    plan = make_plan(load_spec(huge))
    need, parts = plan_need(plan, host_is_device=True)
    assert need == sum(b for _, b in parts) == plan.cost.peak_memory_bytes  # cpu target: every group resident
    assert parts[0][0].startswith("module experts") and parts[0][1] > 0.99 * need
    assert misfit(plan, int(need / FIT_MARGIN) + 1, "x", True) is None  # within the margin: runs may fit
    line = misfit(plan, int(need / FIT_MARGIN) - 1, "x", True)
    assert line is not None and line.count("; ") == 2  # the three largest contributors


def test_host_rows_count_where_the_host_is_the_device(repo):
    plan = make_plan(load_spec(repo / "specs" / "dlrm_criteo.yaml"), target="cpu", device_budget="64MiB")
    hosted = sum(g.bytes_per_rank for g in plan.meta.groups if g.placement != "device")
    assert hosted > 0
    assert plan_need(plan, True)[0] - plan_need(plan, False)[0] == hosted


def test_available_memory_reads_meminfo_and_the_cgroup_limits(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("0::/job\n4:memory:/job\n")
    root = tmp_path / "fs"
    (root / "job").mkdir(parents=True)
    assert available_memory_bytes(meminfo, root, cgroup) == 20000000 * 1024  # no limit files: meminfo
    (root / "job" / "memory.max").write_text("8589934592\n")
    (root / "job" / "memory.current").write_text("1073741824\n")
    assert available_memory_bytes(meminfo, root, cgroup) == 7 * 2**30  # v2 limit minus usage
    (root / "memory" / "job").mkdir(parents=True)
    (root / "memory" / "job" / "memory.limit_in_bytes").write_text(str(4 * 2**30))
    (root / "memory" / "job" / "memory.usage_in_bytes").write_text(str(3 * 2**30))
    assert available_memory_bytes(meminfo, root, cgroup) == 2**30  # v1, tighter
    (root / "job" / "memory.max").write_text("max\n")
    (root / "memory" / "job" / "memory.limit_in_bytes").write_text("9223372036854771712")
    assert available_memory_bytes(meminfo, root, cgroup) == 20000000 * 1024
    assert available_memory_bytes(tmp_path / "absent", root, tmp_path / "absent") is None


@pytest.mark.parametrize("device", ["", " ", "nowhere"])
def test_a_bad_device_is_one_flowrec_line(device, tmp_path):
    for args in (["eval", str(tmp_path / "run"), "--data", str(tmp_path / "data")], ["train", str(REPO / "specs" / "movielens.yaml")]):
        r = runner.invoke(app, [*args, "--device", device])
        assert r.exit_code == 2, r.output
        says = ("error: --device is empty" if device == "" else  # an empty value of any option (2e52a41)
                "error: --device must be auto, cpu or cuda[:N], not ")
        assert r.stderr.strip().splitlines()[-1].startswith(says)
        assert "Device string" not in r.output and "Expected one of" not in r.output


def test_a_cuda_run_is_checked_against_the_device_free_memory(huge, repo, monkeypatch):
    import torch

    from flowrec.runs.start import check_plan_fits

    plan = make_plan(load_spec(huge), target="h100")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * 2**30, 80 * 2**30))
    with pytest.raises(RunError, match=r"more than the 70\.0 GiB of free memory on cuda \(largest: module experts"):
        check_plan_fits(plan, torch.device("cuda"))
    check_plan_fits(make_plan(load_spec(repo / "specs" / "dlrm_criteo.yaml"), target="h100"), torch.device("cuda"))


def test_a_cuda_run_checks_the_rows_it_keeps_on_the_host(repo, monkeypatch):
    import torch

    import flowrec.runs.start as start

    plan = make_plan(load_spec(repo / "specs" / "dlrm_criteo.yaml"), target="h100", device_budget="64MiB")
    hosted = sum(g.bytes_per_rank for g in plan.meta.groups if g.placement != "device")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * 2**30, 80 * 2**30))
    monkeypatch.setattr(start, "available_memory_bytes", lambda: hosted // 2)
    with pytest.raises(RunError, match=r"keeps about 2\.\d GiB of embedding rows on the host, more than .* host memory "
                                       r"available on this machine \(largest: group g0_d16"):
        start.check_plan_fits(plan, torch.device("cuda"))
    monkeypatch.setattr(start, "available_memory_bytes", lambda: hosted)
    start.check_plan_fits(plan, torch.device("cuda"))


def test_reclaimable_page_cache_is_room_and_garbage_limits_say_nothing(tmp_path):
    """The cgroup's usage counts its page cache: its inactive file pages (memory.stat) are room, as
    the kernel reclaims them before refusing memory; a negative limit or MemAvailable, or files that
    are not text, say nothing (they never make every run refused, nor raise)."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:   20000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("0::/job\n4:memory:/job\n")
    root = tmp_path / "fs"
    job, v1 = root / "job", root / "memory" / "job"
    job.mkdir(parents=True)
    v1.mkdir(parents=True)
    (job / "memory.max").write_text(str(8 * 2**30))
    (job / "memory.current").write_text(str(7 * 2**30))  # 5 GiB of it cached file pages, 3 inactive
    (job / "memory.stat").write_text(f"anon {2 * 2**30}\nfile {5 * 2**30}\nactive_file {2 * 2**30}\n"
                                     f"inactive_file {3 * 2**30}\n")
    assert available_memory_bytes(meminfo, root, cgroup) == 4 * 2**30
    (job / "memory.stat").write_text(f"inactive_file {9 * 2**30}\n")  # never more than the usage
    assert available_memory_bytes(meminfo, root, cgroup) == 8 * 2**30
    (job / "memory.stat").write_bytes(b"\xff\xfe inactive_file 5")
    assert available_memory_bytes(meminfo, root, cgroup) == 2**30
    (v1 / "memory.limit_in_bytes").write_text(str(6 * 2**30))
    (v1 / "memory.usage_in_bytes").write_text(str(6 * 2**30))
    (v1 / "memory.stat").write_text(f"cache {2**30}\ninactive_file 1\ntotal_inactive_file {2**29}\n")
    assert available_memory_bytes(meminfo, root, cgroup) == 2**29  # v1: the hierarchy's total
    for limit in ("-1", "", "lots", "1.5e9"):
        (v1 / "memory.limit_in_bytes").write_text(limit)
        (job / "memory.max").write_text(limit)
        assert available_memory_bytes(meminfo, root, cgroup) == 20000000 * 1024, limit
    (job / "memory.max").write_bytes(b"\xff\x00")
    assert available_memory_bytes(meminfo, root, cgroup) == 20000000 * 1024
    meminfo.write_text("MemAvailable:   -5 kB\n")
    assert available_memory_bytes(meminfo, root, cgroup) is None
    cgroup.write_bytes(b"\xff\xfe0::/job\n")
    assert available_memory_bytes(meminfo, root, cgroup) is None


def _two_rank_plan_and_room(repo):
    """A 2-rank plan of dlrm_criteo on the cpu target and host memory that holds one rank's peak
    (with the margin) but not two: 1.5 times the need."""
    plan = make_plan(load_spec(repo / "specs" / "dlrm_criteo.yaml"), target="cpu", world_size=2)
    need = plan_need(plan, host_is_device=True)[0]
    assert need > 0
    return plan, int(need * 1.5)


def test_plan_for_ranks_checks_each_rank_against_its_share_of_the_host(repo, monkeypatch):
    """`flowrec plan --world-size 2` divides this machine's host memory by the ranks on it, as
    `flowrec train --nproc 2` does (it compared each rank's need with all of it)."""
    import flowrec.data.hostmemory as hostmemory

    plan, room = _two_rank_plan_and_room(repo)
    monkeypatch.setattr(hostmemory, "available_memory_bytes", lambda: room)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    spec = str(repo / "specs" / "dlrm_criteo.yaml")
    r = runner.invoke(app, ["plan", spec, "--target", "cpu", "--world-size", "2"])
    assert r.exit_code == 0, r.output
    warning = r.output.splitlines()[1]
    assert warning.startswith("warning: plan dlrm_criteo needs about "), warning
    assert "host memory available to each of 2 ranks on this machine" in warning, warning
    for args, env in ((["--local-ranks", "1"], None), ([], "1")):  # one of the 2 ranks on this machine: it fits
        if env is not None:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", env)
        r = runner.invoke(app, ["plan", spec, "--target", "cpu", "--world-size", "2", *args])
        assert r.exit_code == 0 and "warning" not in r.output, (args, env, r.output)
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    r = runner.invoke(app, ["plan", spec, "--world-size", "2", "--local-ranks", "3"])
    assert r.exit_code == 2 and "--local-ranks 3: more than the 2 ranks planned for" in r.stderr, r.output


def test_train_ranks_and_plan_apply_one_rule(repo, monkeypatch):
    """A rank of `flowrec train --nproc 2` (LOCAL_WORLD_SIZE 2) refuses the plan that `flowrec
    plan --world-size 2` warns about, in the same words and against the same share."""
    import torch

    import flowrec.data.hostmemory as hostmemory
    import flowrec.runs.start as start

    plan, room = _two_rank_plan_and_room(repo)
    monkeypatch.setattr(hostmemory, "available_memory_bytes", lambda: room)
    monkeypatch.setattr(start, "available_memory_bytes", lambda: room)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    warning = memory_warning(plan, 2)
    assert warning is not None and warning.startswith("warning: ")
    with pytest.raises(RunError) as refused:
        start.check_plan_fits(plan, torch.device("cpu"), world=object())
    assert str(refused.value).startswith(warning.removeprefix("warning: ").split(": it cannot run there")[0] + "; ")
    start.check_plan_fits(plan, torch.device("cpu"))  # one process: all of the memory, it fits
    assert memory_warning(plan, 1) is None


def test_cuda_ranks_share_the_host_for_the_rows_they_keep_there(repo, monkeypatch):
    """Two CUDA ranks of one machine each keep their host rows in the same host memory: each is
    checked against half of it (it was checked against all of it)."""
    import torch

    import flowrec.runs.start as start

    plan = make_plan(load_spec(repo / "specs" / "dlrm_criteo.yaml"), target="h100", device_budget="64MiB")
    hosted = sum(g.bytes_per_rank for g in plan.meta.groups if g.placement != "device")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * 2**30, 80 * 2**30))
    monkeypatch.setattr(start, "available_memory_bytes", lambda: int(hosted * 1.5))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    start.check_plan_fits(plan, torch.device("cuda"))  # one process: 1.5x its host rows
    with pytest.raises(RunError, match=r"keeps about 2\.\d GiB of embedding rows on the host, more than the .* of host "
                                       r"memory available to each of 2 ranks on this machine \(.* in all\)"):
        start.check_plan_fits(plan, torch.device("cuda"), world=object())


LONG_SEQUENCE = """
name: long_history
features:
  - {name: item_id, type: categorical, table: items}
  - {name: history, type: sequence, table: items, max_len: 20000, pooling: none}
tables:
  - {name: items, hash_buckets: 5000, dim: 16}
modules:
  - {name: encoder, kind: self_attention, inputs: [history], num_heads: 2, num_layers: 2}
  - {name: top, kind: mlp, inputs: [encoder, item_id], layers: [8]}
heads:
  - {name: click, input: top}
training: {batch_size: 512, precision: PRECISION}
"""


@pytest.mark.parametrize("precision,size", [("fp32", 4), ("bf16", 2)])
def test_attention_masks_count_in_the_activations_and_refuse_a_sequence_too_long(tmp_path, precision, size):
    """A 20,000-long history at batch 512 planned at a few MiB of activations and died allocating
    torch's (B, 1, L, L) attention mask (819 GB, a traceback). Its masks, one a layer, now count."""
    path = tmp_path / "long.yaml"
    path.write_text(LONG_SEQUENCE.replace("PRECISION", precision))
    plan = make_plan(load_spec(path), target="cpu")
    masks = 2 * 512 * 20000 * 20000 * size  # two layers
    activations = dict(plan.cost.memory)["activations"]
    assert masks < activations < masks + 2 * 2**30  # + the (B, L, D) sequence and outputs
    line = misfit(plan, 64 * 2**30, "host memory", True)
    assert line is not None and "encoder's 20,000 x 20,000 attention mask" in line
    before = high_water()
    done = runner.invoke(app, ["train", str(path), "--rows", "100", "--out", str(tmp_path / "run"), "-q"])
    assert done.exit_code == 2 and "attention mask" in done.output, done.output
    assert not (tmp_path / "run").exists() and high_water() - before < 256 * MiB


def test_a_budget_leaves_the_attention_masks_room(repo):
    """At a device budget the tables get what dense state and activations (masks included) leave."""
    from flowrec.planner.cost import activation_bytes, attention_mask_bytes, dense_memory_bytes
    from flowrec.graph.build import build_graph

    spec = load_spec(repo / "specs" / "bst_taobao.yaml")
    masks = attention_mask_bytes(build_graph(spec), spec.training.batch_size)
    assert masks == 2 * 1024 * 51 * 51 * 4  # two layers; 50 history items and the target
    plan = make_plan(spec, target="cpu", device_budget="64MiB")
    group = plan.meta.groups[0]
    fixed = dense_memory_bytes(plan.graph, spec) + activation_bytes(plan.graph, spec.training.batch_size)
    assert group.placement == "static_hot" and masks < fixed
    assert 0 < group.cache_rows * group.row_bytes() <= 64 * MiB - fixed


def test_a_retrieval_softmax_counts_its_logits_against_every_candidate(repo, tmp_path):
    """1,000,000 sampled negatives at batch 1,024 planned at 2 MiB; the step's logits alone are
    about 4 GB a copy."""
    text = (repo / "specs" / "two_tower_movielens.yaml").read_text()
    assert "negatives: {kind: in_batch}" in text
    path = tmp_path / "many_negatives.yaml"
    path.write_text(text.replace("negatives: {kind: in_batch}", "negatives: {kind: sampled, num: 1000000}"))
    spec = load_spec(path)
    plan = make_plan(spec, target="cpu")
    logits = 3 * spec.training.batch_size * 1_000_001 * 4
    activations = dict(plan.cost.memory)["activations"]
    assert logits < activations < logits + 64 * MiB
    line = misfit(plan, 2**30, "host memory", True)
    assert line is not None and "retrieval head retrieve's logits against 1,000,001 candidates" in line
    in_batch = make_plan(load_spec(repo / "specs" / "two_tower_movielens.yaml"), target="cpu")
    assert dict(in_batch.cost.memory)["activations"] > 3 * 1024 * 1024 * 4  # B x B logits
