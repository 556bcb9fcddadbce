"""Fault injection for the ranks of `flowrec train` and their launcher in tests (this folder is put
on PYTHONPATH only by tests/integration/test_dist_checkpoint_background.py, test_nproc_rank_stops.py
and test_nproc_signals.py; Python imports this module at start-up).

FLOWREC_TEST_HOLD_CHECKPOINT="RANK:STEP:DIR" makes rank RANK's checkpoint writer thread, at the
checkpoint of step STEP (before its shard of a full checkpoint is streamed, or before its delta
shard is written), write its process id to DIR/held-rank<RANK>-step<STEP> and wait until
DIR/release exists (at most HOLD_S seconds), while training goes on.

FLOWREC_TEST_HOLD_END="DIR" makes rank 0, once its run has finished (before its closing lines),
write its process id to DIR/held-end and wait until DIR/release exists (at most HOLD_S seconds).

FLOWREC_TEST_HOLD_LAUNCHER="DIR" makes torch's launcher of `flowrec train --nproc N`, once its ranks
have exited (the run over, before it returns), write its process id to DIR/held-launcher and wait
until DIR/release exists (at most HOLD_S seconds).

FLOWREC_TEST_HOLD_START="DIR" makes every rank, as it starts loading the run's data, write its
process id to DIR/held-start-rank<RANK> and wait until DIR/release exists (at most HOLD_S seconds).

FLOWREC_TEST_DATA_ERROR="RANK" makes rank RANK's loading of the run's data raise the DataError a
damaged file that only this rank reads would raise; "RANK:kill" kills the rank there instead, after
KILL_AFTER_S seconds (SIGKILL, as the out-of-memory killer does). Without the variables (or in a process that is
not a rank) nothing is changed.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

HOLD_S = 120.0
KILL_AFTER_S = 3.0


def _install(setting: str) -> None:
    from flowrec.runtime.checkpoint.ranks import RankCheckpointer

    rank, step, folder = setting.split(":", 2)
    if os.environ.get("RANK") != rank:
        return

    def hold(at: int) -> None:
        if at != int(step):
            return
        (Path(folder) / f"held-rank{rank}-step{at}").write_text(str(os.getpid()))
        deadline = time.monotonic() + HOLD_S
        while not (Path(folder) / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    stream, delta = RankCheckpointer._stream_shard, RankCheckpointer._write_delta

    def held_stream(self, folder_, at, *args, **kwargs):
        hold(at)
        return stream(self, folder_, at, *args, **kwargs)

    def held_delta(self, folder_, at, *args, **kwargs):
        hold(at)
        return delta(self, folder_, at, *args, **kwargs)

    RankCheckpointer._stream_shard, RankCheckpointer._write_delta = held_stream, held_delta


if os.environ.get("FLOWREC_TEST_HOLD_CHECKPOINT") and "RANK" in os.environ:
    _install(os.environ["FLOWREC_TEST_HOLD_CHECKPOINT"])


def _install_data_error(setting: str) -> None:
    rank, _, how = setting.partition(":")
    if os.environ.get("RANK") != rank:
        return
    import signal

    import flowrec.runs.start as start
    from flowrec.data.layout import DataError

    def damaged(*args, **kwargs):
        if how == "kill":  # once the other ranks wait for it in a collective
            time.sleep(KILL_AFTER_S)
            os.kill(os.getpid(), signal.SIGKILL)
        raise DataError(f"part-00000.parquet: row group 1 cannot be read on rank {rank} (injected)")

    start.prepare = damaged


if os.environ.get("FLOWREC_TEST_DATA_ERROR") and "RANK" in os.environ:
    _install_data_error(os.environ["FLOWREC_TEST_DATA_ERROR"])


def _install_end_hold(folder: str) -> None:
    if os.environ.get("RANK") != "0":
        return
    import flowrec.cli.train_cmds as train_cmds

    report = train_cmds._report

    def held_report(*args, **kwargs):
        (Path(folder) / "held-end").write_text(str(os.getpid()))
        deadline = time.monotonic() + HOLD_S
        while not (Path(folder) / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return report(*args, **kwargs)

    train_cmds._report = held_report


if os.environ.get("FLOWREC_TEST_HOLD_END") and "RANK" in os.environ:
    _install_end_hold(os.environ["FLOWREC_TEST_HOLD_END"])


def _install_launcher_hold(folder: str) -> None:
    import torch.distributed.run as torch_run

    run = torch_run.run

    def held_run(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        finally:
            (Path(folder) / "held-launcher").write_text(str(os.getpid()))
            deadline = time.monotonic() + HOLD_S
            while not (Path(folder) / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.05)

    torch_run.run = held_run


if os.environ.get("FLOWREC_TEST_HOLD_LAUNCHER") and "RANK" not in os.environ:
    _install_launcher_hold(os.environ["FLOWREC_TEST_HOLD_LAUNCHER"])


def _install_start_hold(folder: str) -> None:
    import flowrec.runs.start as start

    prepare = start.prepare

    def held_prepare(*args, **kwargs):
        (Path(folder) / f"held-start-rank{os.environ['RANK']}").write_text(str(os.getpid()))
        deadline = time.monotonic() + HOLD_S
        while not (Path(folder) / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return prepare(*args, **kwargs)

    start.prepare = held_prepare


if os.environ.get("FLOWREC_TEST_HOLD_START") and "RANK" in os.environ:
    _install_start_hold(os.environ["FLOWREC_TEST_HOLD_START"])
