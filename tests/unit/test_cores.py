"""The cores a process may use: affinity capped by a cgroup CPU quota (v2 `cpu.max`, v1
`cpu.cfs_quota_us`), read from a fake cgroup tree; threads sized from them."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from flowrec.data.cores import cgroup_quota, thread_budget, usable_cores
from flowrec.testing.processes import run_bounded


def _v2(tmp_path: Path, limits: dict[str, str], member: str = "/user.slice/job") -> tuple[Path, Path]:
    """A cgroup v2 tree with `cpu.max` files ({relative folder: content}) and the membership file."""
    root = tmp_path / "cgroup"
    for folder, text in limits.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "cpu.max").write_text(text)
    (root / member.strip("/")).mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(f"0::{member}\n")
    return root, proc


@pytest.mark.parametrize("cpu_max, affinity, expected", [
    ("150000 100000\n", set(range(8)), 1),   # 1.5 cores of quota: one whole core
    ("250000 100000\n", set(range(8)), 2),
    ("400000 100000\n", {0, 3}, 2),           # the affinity is tighter
    ("max 100000\n", set(range(6)), 6),       # no quota
    ("50000 100000\n", {0, 1}, 1),            # half a core: still one thread
])
def test_a_cgroup_v2_quota_caps_the_affinity(tmp_path: Path, cpu_max: str, affinity: set[int], expected: int):
    root, proc = _v2(tmp_path, {"user.slice/job": cpu_max})
    assert usable_cores(affinity, root, proc) == expected


def test_the_tightest_quota_of_the_cgroup_and_its_parents_wins(tmp_path: Path):
    root, proc = _v2(tmp_path, {"user.slice": "300000 100000", "user.slice/job": "max 100000"})
    assert cgroup_quota(root, proc) == pytest.approx(3.0)
    assert usable_cores(set(range(16)), root, proc) == 3
    (root / "user.slice" / "job" / "cpu.max").write_text("120000 50000")  # 2.4 cores
    assert cgroup_quota(root, proc) == pytest.approx(2.4) and usable_cores(set(range(16)), root, proc) == 2


def test_a_cgroup_v1_quota(tmp_path: Path):
    root = tmp_path / "cgroup"
    folder = root / "cpu,cpuacct" / "docker" / "abc"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("200000\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text("5:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cgroup_quota(root, proc) == pytest.approx(2.0)
    assert usable_cores(set(range(4)), root, proc) == 2
    (folder / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert cgroup_quota(root, proc) is None and usable_cores(set(range(4)), root, proc) == 4


def test_no_cgroup_files_means_the_affinity(tmp_path: Path):
    assert cgroup_quota(tmp_path / "none", tmp_path / "missing") is None
    assert usable_cores({2, 5, 7}, tmp_path / "none", tmp_path / "missing") == 3
    root, proc = _v2(tmp_path, {"x": "garbage"}, member="/x")
    assert cgroup_quota(root, proc) is None


def test_cgroup_files_that_are_not_text_are_no_quota(tmp_path: Path):
    """Bytes that do not decode (in cpu.max, the v1 quota or /proc/self/cgroup) read as no quota,
    never a traceback at the start of every command."""
    root, proc = _v2(tmp_path, {"x": "garbage"}, member="/x")
    (root / "x" / "cpu.max").write_bytes(b"\xff\xfe 100000")
    assert cgroup_quota(root, proc) is None and usable_cores({0, 1, 2}, root, proc) == 3
    folder = root / "cpu" / "x"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_bytes(b"\xff")
    (folder / "cpu.cfs_period_us").write_text("100000")
    proc.write_text("3:cpu:/x\n")
    assert cgroup_quota(root, proc) is None
    (folder / "cpu.cfs_quota_us").write_text("100000")
    assert cgroup_quota(root, proc) == pytest.approx(1.0)  # the same tree with a readable quota
    proc.write_bytes(b"\xff\xfe3:cpu:/x\n")
    assert cgroup_quota(root, proc) is None and usable_cores({0, 1}, root, proc) == 2


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no affinity on this platform")
def test_the_default_reads_this_process_affinity():
    assert 1 <= usable_cores() <= len(os.sched_getaffinity(0))


def test_threads_fit_the_cores_and_the_ranks():
    assert thread_budget(1, 1) == thread_budget(1, 4)
    one = thread_budget(1, 1)
    assert (one.workers, one.readers, one.compute) == (1, 1, 1)
    many = thread_budget(16, 1)
    assert (many.workers, many.readers, many.compute) == (2, 2, 16)
    shared = thread_budget(8, 4)
    assert (shared.workers, shared.readers, shared.compute) == (2, 2, 2)
    assert thread_budget(3, 2).compute == 1


def test_a_users_omp_threads_survive_the_first_sparse_update(tmp_path):
    """`OMP_NUM_THREADS=1 flowrec train`: numba's OpenMP layer, started by the first sparse update,
    set the OpenMP threads of the thread that started it to all the cores, so torch ran two-thread
    kernels from then on. The update now starts the pool and puts torch's count back, without
    setting numba's (numba refuses a change once its threads run)."""
    import sys

    code = (
        "import os, torch\n"
        "from operators.sparse_optim import make_optimizer\n"
        "before = torch.get_num_threads()\n"
        "g = torch.Generator().manual_seed(3)\n"
        "w = torch.randn(64, 4, generator=g); opt = make_optimizer(('adagrad', 0.1, {}))\n"
        "s = opt.initial_state(64, 4, torch.float32)\n"
        "ids = torch.randint(0, 64, (40,), generator=g) ** 2 % 64\n"
        "opt.step(w, s, ids.unique(), torch.randn(ids.unique().numel(), 4, generator=g))\n"
        "import numba\n"
        "print(before, torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS, os.environ.get('NUMBA_NUM_THREADS'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    out = run_bounded([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout_s=180,
                      cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    before, after, pool, numba_env = out.stdout.split()
    assert (before, after, numba_env) == ("1", "1", "None")  # numba's own count left unset
    if int(pool) == 1:
        pytest.skip("numba's pool has one thread here: its start could not change torch's count")


@pytest.mark.parametrize("given, expected", [("3", 3), (" 1 ", 1), ("0", None), ("two", None), (None, None)])
def test_a_runs_compute_threads_are_the_users_else_the_share(monkeypatch, given, expected):
    from flowrec.data import cores

    monkeypatch.setattr(cores, "usable_cores", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    if given is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", given)
    assert cores.run_threads() == (4 if expected is None else expected)  # 8 cores, 2 ranks: 4 each
