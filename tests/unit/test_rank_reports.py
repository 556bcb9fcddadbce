"""The launcher of `flowrec train --nproc N` names the rank whose own error stopped the run, with
that error's line (`flowrec.cli.rank_reports.report_stop`, read back from torch's per-rank error files),
not a rank that lost it in the same second (a closed connection), whatever its rank number."""
from __future__ import annotations

import random
from pathlib import Path

import pytest


def _failures(monkeypatch, tmp_path: Path, stops: list[tuple[int, int, str, bool]]) -> dict:
    """torch's ProcessFailure of each (rank, status, line, follows), in that order of time, each
    from the error file `report_stop` wrote for it, all seen in one poll (the same second)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from flowrec.cli import rank_reports

    clock = [1_700_000_000.25]

    def tick() -> float:
        clock[0] += random.uniform(1e-4, 0.2)  # within the same second: torch's whole-second stamps tie
        return clock[0]

    monkeypatch.setattr(rank_reports.time, "time", tick)
    failures = {}
    for rank, status, line, follows in stops:
        path = tmp_path / f"rank{rank}" / "error.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        rank_reports.report_stop(line, status, follows)
        failures[rank] = ProcessFailure(rank, 4240 + rank, status, str(path))
    return failures


def _launch(monkeypatch, failures: dict) -> int:
    import torch.distributed.run as torch_run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from flowrec.cli import ranks

    def failing(args):
        raise ChildFailedError("flowrec", failures)

    monkeypatch.setattr(torch_run, "run", failing)
    return ranks.run_launcher(["--nproc-per-node=2", "-m", "flowrec", "train", "s.yaml"])


@pytest.mark.parametrize("origin", [0, 1])
def test_the_launcher_names_the_rank_whose_own_error_stopped_the_others(monkeypatch, capsys, tmp_path: Path,
                                                                        origin: int) -> None:
    # rank 1's custom module raised (status 2); rank 0 lost it in a collective and stopped with the
    # same status 2 in the same second: the launcher named rank 0 ("the first, rank 0, with status 2
    # (its message is above)"), whose line only said that another rank stopped
    other = 1 - origin
    own = f"at step {random.randrange(2, 90)}: custom module 'mine' raised KeyError: 'u{random.randrange(10**6)}'"
    status = random.choice([2, 3])
    follower = (other, status, f"rank {origin} stopped first (its line says why)", True)
    stops = [follower, (origin, status, own, False)] if random.random() < 0.5 or origin == 1 else \
        [(origin, status, own, False), follower]
    failures = _failures(monkeypatch, tmp_path, stops)
    for failure in failures.values():
        failure.timestamp = 1_700_000_000  # one poll of the launcher
    assert _launch(monkeypatch, failures) == status
    err = capsys.readouterr().err
    # rank 0's own line is the run's one line (printed by rank 0): the launcher said it a second time
    said = f"error: training failed: rank(s) 0, 1 exited; the first, rank 1, with status {status}: {own}\n"
    assert err == (said if origin == 1 else "")


def test_of_two_ranks_with_errors_of_their_own_the_earlier_is_named(monkeypatch, capsys, tmp_path: Path) -> None:
    lines = [f"d/part-0000{r}.parquet: row group {random.randrange(1, 9)} cannot be read" for r in range(2)]
    failures = _failures(monkeypatch, tmp_path, [(1, 2, lines[1], False), (0, 2, lines[0], False)])
    assert _launch(monkeypatch, failures) == 2
    assert f"the first, rank 1, with status 2: {lines[1]}\n" in capsys.readouterr().err


def test_a_follower_status_4_is_never_named_before_a_rank_killed_by_a_signal(monkeypatch, capsys,
                                                                            tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failures = _failures(monkeypatch, tmp_path, [(0, 4, "another rank failed (Connection closed by peer)", False)])
    failures[1] = ProcessFailure(1, 4242, -9, str(tmp_path / "none.json"))
    for failure in failures.values():
        failure.timestamp = 1_700_000_000
    assert _launch(monkeypatch, failures) == 137
    assert "the first, rank 1, was killed by signal 9" in capsys.readouterr().err


def test_a_rank_that_said_its_line_and_was_stopped_exiting_keeps_its_status(monkeypatch, capsys, tmp_path: Path) -> None:
    # rank 1 could not write its final shard and said so (status 2); rank 0 followed and exited first,
    # and the launcher's SIGTERM to the ranks left ended rank 1 as it was exiting: the launch said
    # "the first, rank 1, was killed by signal 15 (SIGTERM) and wrote no message" and exited 143
    line = f"could not write checkpoint run/checkpoint.shards/step{random.randrange(10**9):09d}-rank1-of2.pt: Is a directory"
    failures = _failures(monkeypatch, tmp_path, [(1, 2, line, False), (0, 2, f"rank 1 stopped first: {line}", True)])
    failures[1].exitcode = -15
    assert _launch(monkeypatch, failures) == 2
    assert capsys.readouterr().err.endswith(f"the first, rank 1, with status 2: {line}\n")


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_a_rank_the_launcher_stopped_after_another_was_killed_is_not_named(monkeypatch, capsys, tmp_path: Path,
                                                                          signal_name: str) -> None:
    # rank 1 killed by the out-of-memory killer while loading its data: the launcher stopped rank 0
    # (SIGTERM: 'interrupted (SIGTERM) before training started', status 130), and named rank 0 with that line
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    line = f"interrupted ({signal_name}) before training started; nothing was trained"
    failures = _failures(monkeypatch, tmp_path, [(0, 130, line, False)])
    failures[1] = ProcessFailure(1, 4242, -9, str(tmp_path / "none.json"))
    for failure in failures.values():
        failure.timestamp = 1_700_000_000
    assert _launch(monkeypatch, failures) == 137
    assert "the first, rank 1, was killed by signal 9 (SIGKILL) and wrote no message" in capsys.readouterr().err


def test_the_launchers_line_after_a_signal_is_the_one_rank_0_left(capsys) -> None:
    # `flowrec.cli.ranks._stopped`: what `flowrec train --nproc N` says and exits with once a signal asked it to stop
    from flowrec.cli.ranks import _stopped

    sig = random.choice([1, 2, 15])
    command = f"flowrec train s.yaml --resume run{random.randrange(100)} --nproc 2"
    name = {1: "SIGHUP", 2: "SIGINT", 15: "SIGTERM"}[sig]
    assert _stopped(sig, 128 + sig, None, command) == 128 + sig  # before training: the launcher's line
    assert capsys.readouterr().err == (f"error: interrupted ({name}) before training started; nothing was trained; "
                                       f"the run is as it was: continue with  {command}\n")
    whole = f"interrupted after the run finished: run{random.randrange(100)} holds all of it, ..."
    assert _stopped(sig, random.choice([130, 143]), whole, None) == 128 + sig  # after it: rank 0's words
    assert capsys.readouterr().err == whole + "\n"
    assert _stopped(sig, 130, "", command) == 130 and _stopped(sig, -sig, "", None) == 128 + sig  # rank 0 said it
    assert _stopped(sig, 0, "", command) == 0  # the ranks ended whole before the signal reached them
    assert _stopped(sig, 2, None, command) == 2  # a rank's own failure: its line is out
    assert capsys.readouterr().err == ""
