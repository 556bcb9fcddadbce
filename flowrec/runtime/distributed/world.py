"""The ranks of a distributed run: process groups with timeouts, and the per-step agreement.

`join_world` initializes torch.distributed from the launch environment (`torchrun` /
`python -m torch.distributed.run` set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): gloo on CPU,
nccl on CUDA, every collective bounded by `timeout_s`, so a dead or hung rank fails the others
instead of hanging them. The default group carries DDP's gradient all-reduces and the per-step
agreement; the embedding exchanges run on their own group (`groups.embedding_group`).

Every step the ranks agree, in one small all-reduce, on the global loss, on whether any rank saw a
non-finite loss and on whether any rank was asked to stop (Ctrl-C, a callback): every rank then
takes the same decision after the same step, and no collective waits for a rank that left.

Example (on every rank of a `torchrun` launch):
    >>> world = join_world(2, rank, timeout_s=300, device=torch.device("cpu"))  # doctest: +SKIP
    >>> world.rank, world.size  # doctest: +SKIP
    (0, 2)
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from flowrec.runtime.distributed.groups import embedding_group
from flowrec.runtime.messages import first_line
from operators.device import select_device

DEFAULT_TIMEOUT_S = 300.0  # --dist-timeout default: a dead or hung rank fails the others within it
START_TIMEOUT_S = 300.0  # the ranks' start waits at least this for all of them (`join_world`)


class WorldError(RuntimeError):
    """A distributed launch that cannot run (bad environment, a rank that failed); one line."""


class LaunchEnvError(WorldError):
    """The launch environment is incomplete or wrong (a usage error, not a failed rank)."""


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed on after a step's loss: the global loss (the mean over the global
    batch), whether any rank's loss was non-finite, and each flag (e.g. asked to stop) OR-ed over
    the ranks."""

    loss: float
    non_finite: bool
    flags: tuple[bool, ...]


@dataclass
class World:
    """This process's place among the ranks of a run.

    Args:
        size: W, the number of ranks.
        rank: this rank (0 .. W-1); rank 0 writes the run folder's shared files.
        embedding_group: the process group of the embedding exchanges.
        timeout_s: seconds a collective waits for the other ranks.
        device: the device the collectives' tensors live on (cpu for gloo, cuda for nccl).
        data_groups: two gloo groups of every rank for the data stages' managed remap (training,
            evaluation), so they never interleave with each other or with training's collectives.
        checkpoint_group: a gloo group of every rank used only by the checkpoint writer threads
            (`flowrec.runtime.checkpoint.ranks`: each checkpoint's commit, in checkpoint order),
            beside training's collectives; None: checkpoints are committed on the training thread.
    """

    size: int
    rank: int
    embedding_group: dist.ProcessGroup | None
    timeout_s: float
    device: torch.device
    data_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None  # gloo: the training and the
    # evaluation data stage's managed remap (`flowrec.runtime.managed_owner`), beside training's collectives
    checkpoint_group: dist.ProcessGroup | None = None  # gloo: the checkpoint writers' commits

    @property
    def lead(self) -> bool:
        """Rank 0, which writes the run's shared files and reports."""
        return self.rank == 0

    def agree(self, loss_share: torch.Tensor, flags: tuple[bool, ...] = ()) -> Agreement:
        """Sum this rank's share of the global loss and OR the non-finite flag and `flags` over
        every rank (one all-reduce on the default group; every rank passes as many flags)."""
        value = float(loss_share.detach())
        finite = math.isfinite(value)
        values = torch.tensor([value if finite else 0.0, 0.0 if finite else 1.0, *map(float, flags)],
                              dtype=torch.float64, device=self.device)
        dist.all_reduce(values)
        total, bad, *rest = values.tolist()
        return Agreement(total, bad > 0, tuple(v > 0 for v in rest))

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any."""
        t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return bool(t.item() > 0)

    def stopped_rank(self) -> tuple[int, int] | None:
        """(rank, exit status) of the lowest other rank that recorded stopping on its own error
        (`record_stop`), without waiting; None when none did (or no store answers)."""
        try:
            store = dist.distributed_c10d._get_default_store()
            for other in range(self.size):
                if other != self.rank and store.check([f"{STOP_KEY}{other}"]):
                    text = store.get(f"{STOP_KEY}{other}").decode()
                    return other, int(text) if text.isdigit() else 1
        except Exception:  # no store: as if none did
            pass
        return None

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (picklable), in rank order, on every rank: what the ranks saw when
        they agree on a step's outcome (which parameter of which rank is not finite)."""
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, value)
        return gathered


def join_world(size: int, rank: int, timeout_s: float, device: torch.device) -> World:
    """Initialize torch.distributed (the rendezvous from MASTER_ADDR / MASTER_PORT) and make the
    embedding group.

    The ranks first wait for each other in the rendezvous store for `timeout_s` or
    START_TIMEOUT_S, whichever is longer: ranks that start seconds apart (their imports on a loaded
    machine; rank 1 started 10 s after rank 0) failed a short `--dist-timeout 8` as "could not
    join the other rank(s)" though none was dead or hung. Once all have come, every collective and
    the store are bounded by `timeout_s`, so a rank that dies or hangs later still fails the
    others within it.

    Args:
        size: W, the ranks of the launch (WORLD_SIZE).
        rank: this rank (RANK).
        timeout_s: seconds every collective waits for the other ranks.
        device: the run's device: gloo for cpu, nccl for cuda (each rank on cuda:LOCAL_RANK).
    """
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise LaunchEnvError(f"WORLD_SIZE is {size} but {name} is not set: launch the ranks with "
                             f"`flowrec train --nproc N` or torchrun")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        select_device(device)
    start_s = max(timeout_s, START_TIMEOUT_S)
    try:
        store = _attempt_store(size, rank, start_s)
        _wait_for_ranks(store, size, start_s)
        store.set_timeout(timedelta(seconds=timeout_s))  # (a store read after a rank hangs waits no longer)
        dist.init_process_group(backend=backend, store=store,
                                timeout=timedelta(seconds=timeout_s), world_size=size, rank=rank)
    except (RuntimeError, ValueError) as exc:
        waited = start_s if isinstance(exc, _NotAllStarted) else timeout_s
        raise WorldError(f"could not join the other {size - 1} rank(s) within {waited:g} s "
                         f"({first_line(exc)})") from None
    embedding = embedding_group(timeout_s)
    data = tuple(dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) for _ in range(2))
    commits = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return World(size, rank, embedding, timeout_s, device, data, commits)



def _attempt_store(size: int, rank: int, timeout_s: float) -> dist.Store:
    """The rendezvous store of this launch attempt: torchrun's agent store (or rank 0's own, without
    an agent) under a prefix naming the attempt. A restarted job (--max-restarts) reuses the agent's
    store, and without the prefix its process groups could read the addresses the ranks of the
    failed attempt left there and wait for them until the timeout."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size,
                          is_master=rank == 0 and not agent, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"flowrec/attempt{attempt}/", store)


class _NotAllStarted(RuntimeError):
    """Not every rank of the launch reached `join_world` within the start's wait."""


def _wait_for_ranks(store: dist.Store, size: int, wait_s: float) -> None:
    """Count this rank in at the store and wait until all `size` ranks have, polling, for at most
    `wait_s` (`_NotAllStarted` saying how many started)."""
    import time

    arrived = store.add(STARTED_KEY, 1)
    deadline = time.monotonic() + wait_s
    while arrived < size:
        if time.monotonic() > deadline:
            raise _NotAllStarted(f"{arrived} of {size} ranks started")
        time.sleep(0.05)
        arrived = store.add(STARTED_KEY, 0)


STARTED_KEY = "flowrec-started"  # the ranks of this attempt that reached `join_world`
STOP_KEY = "flowrec-stopped/"  # + rank: the exit status a rank stopped with on its own error


def record_stop(rank: int, status: int) -> None:
    """Record in the rendezvous store that rank `rank` stops on an error of its own with exit
    status `status` (bad input: 2; out of memory: 3), before it leaves: the ranks that lose it then
    (a closed connection) stop as it does (`World.stopped_rank`), with its status, not as after a lost
    rank (4) with the collective's words. Best effort: no process group, or a store that cannot be
    reached, leaves the others' status 4."""
    try:
        if dist.is_available() and dist.is_initialized():
            dist.distributed_c10d._get_default_store().set(f"{STOP_KEY}{rank}", str(status))
    except Exception:  # the store is gone with rank 0: nothing to tell
        pass


def lost_peer(exc: BaseException) -> bool:
    """Whether `exc` is a collective that failed because another rank is gone or did not answer:
    torch's distributed errors, and the RuntimeError gloo raises with its transport's words (a
    closed or reset connection, a timeout)."""
    if isinstance(exc, dist.DistError):
        return True
    text = first_line(exc).lower()
    return "gloo" in text or "nccl" in text or any(
        words in text for words in ("connection closed", "connection reset", "timed out", "timeout"))


def leave_world() -> None:
    """Destroy the process groups (idempotent)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
