"""Transfer stage of the training pipeline: a thread moving staged batches to the device.

Data staging (`flowrec.data.batches`, its own worker threads and bounded queue) feeds this stage;
this stage moves dense features, labels and the ids of device-placed groups to the device
(`operators.device`'s `upload`: on CUDA a copy this thread waits for, from pageable memory; pinning
each tensor first slowed the step on the compute thread) and hands them to compute through a bounded queue
of `depth` batches, so staging and transfer overlap compute. On a CPU device it is a pass-through,
unless asked to run the batches' iterator on its thread (`background`: batches formed after
staging, FAE's hot/cold batches and their lookahead windows, are formed there, beside the steps,
not in the step's).

Example:
    >>> with TransferStage(batches, torch.device("cpu"), depth=2) as staged:  # doctest: +SKIP
    ...     for batch in staged: ...
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Any, Iterable, Iterator

import torch

from operators.casting import Casting
from operators.device import runtime_for

POLL_S = 0.05  # seconds between stop-flag checks
JOIN_S = 10.0  # seconds `close` waits for the thread (it sees the stop flag within POLL_S)
_END = object()


class TransferStage:
    """Moves batches to `device` in a background thread, `depth` batches ahead.

    Args:
        batches: staged batches (an iterator; closed with this stage when it has `close`).
        device: the compute device.
        depth: bounded queue size (the plan's prefetch depth).
        host_groups: groups whose ids stay on the host (host placement).
        background: on a CPU device too, iterate `batches` on the stage's thread (they stay on the host).
    """

    def __init__(self, batches: Iterable[Any], device: torch.device, depth: int = 2,
                 host_groups: frozenset[str] = frozenset(), background: bool = False) -> None:
        self.device = device
        self.host_groups = host_groups
        self.runtime = runtime_for(device)
        self.wait_s = 0.0  # compute time spent waiting for a batch (stall)
        self.delivered_bytes = 0  # bytes copied to the device of the batches handed to compute
        self._sizes: deque[tuple[int, int]] = deque()  # (bytes, copies) of each moved batch, in queue order
        self._moved_bytes = self._moved_copies = 0  # of the batch being moved
        self._source = batches
        self._passthrough = device.type == "cpu" and not background
        if self._passthrough:
            self._iter = iter(batches)
            return
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flowrec-transfer", daemon=True)
        self._thread.start()

    def _send(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device (`DeviceRuntime.upload`: on CUDA copied by this thread)."""
        self._moved_bytes += tensor.numel() * tensor.element_size()
        self._moved_copies += 1
        return self.runtime.upload(tensor)

    def _send_casting(self, casting: Casting) -> Casting:
        """A staged casting on the device, every tensor sent."""
        scale = casting.sorted_scale
        return replace(casting, unique_ids=self._send(casting.unique_ids), counts=self._send(casting.counts),
                       unique_offsets=self._send(casting.unique_offsets),
                       sorted_bags=self._send(casting.sorted_bags),
                       sorted_scale=None if scale is None else self._send(scale))

    def _move(self, batch: Any) -> Any:
        """`batch` with every tensor the step reads on the device sent (`_send`); the bytes copied
        are queued for `delivered_bytes`, counted once compute takes the batch."""
        self._moved_bytes = self._moved_copies = 0
        groups = {
            name: ids if name in self.host_groups else replace(
                ids,
                ids=self._send(ids.ids),
                offsets=self._send(ids.offsets),
                casting=self._send_casting(ids.casting) if ids.casting is not None else None,
            )
            for name, ids in batch.groups.items()
        }
        moved = replace(batch, dense=self._send(batch.dense), labels=self._send(batch.labels), groups=groups)
        self._sizes.append((self._moved_bytes, self._moved_copies))
        return moved

    def _put(self, item: Any) -> bool:
        """Queue `item` for the consumer; False when the stage was stopped first. Every put polls
        the stop flag: a consumer that stopped early (max_steps mid-epoch) leaves the queue full,
        and a blocking put of the end marker held the thread until `close` gave up on it."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for batch in self._source:
                item = batch if self.device.type == "cpu" else self._move(batch)  # CPU: formed here, not moved
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as exc:  # handed to the consumer
            self._put(exc)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        try:
            if self._passthrough:
                return next(self._iter)
            item = self._queue.get()
        finally:
            self.wait_s += time.perf_counter() - start
        if item is _END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        if self._sizes:  # a moved batch (on CPU with `background`, batches pass unmoved)
            self.delivered_bytes += self._sizes.popleft()[0]
        return item

    def close(self) -> None:
        if not self._passthrough:
            self._stop.set()
            self._thread.join(timeout=JOIN_S)
            while True:  # the batches still queued (on the device too) are not kept alive by the stage
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
        close = getattr(self._source, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "TransferStage":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
