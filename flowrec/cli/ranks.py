"""`flowrec train --nproc N`: N local ranks through torch.distributed's launcher, and what each
rank of a launch (`--nproc`, or `torchrun ... -m flowrec train` on many nodes) does first.

`--nproc N` re-runs the same command line under `python -m torch.distributed.run --standalone`
(a free port chosen by the launcher's rendezvous), with the run folder fixed up front so that
every rank writes to the same one. Under `--max-restarts K` the launcher restarts all ranks after
a failure; a restarted rank 0 finds the run's checkpoint and continues it (`train_cmds._restarted`).

Example:
    >>> strip_options(["s.yaml", "--nproc", "2", "-q"], {"--nproc"})
    ['s.yaml', '-q']
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from flowrec.cli.common import fail
from flowrec.cli.rank_reports import launcher_note, report_of
from flowrec.runs.errors import EXIT_INTERRUPTED, EXIT_RANK_FAILED
from flowrec.runs.launch import NPROC_ENV

LAUNCHER_OPTIONS = {"--nproc", "--max-restarts"}  # ours, not the ranks' (each takes a value)


def strip_options(args: list[str], options: set[str]) -> list[str]:
    """`args` without the given options, each with its value (`--opt V` and `--opt=V` forms)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg.split("=", 1)[0] in options:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def command_args(argv: list[str]) -> list[str]:
    """The arguments after the `train` command word of this process's command line."""
    args = argv[1:]
    if "train" not in args:
        fail("--nproc: cannot find the train command in this command line; launch the ranks with torchrun")
    return args[args.index("train") + 1:]


def launch_ranks(nproc: int, max_restarts: int, folder: Path | None, resume_command: str | None = None) -> int:
    """Run this `flowrec train` command line on `nproc` local ranks; the launcher's exit status.

    Args:
        nproc: local processes (ranks).
        max_restarts: restarts of every rank after a failure (from the last checkpoint).
        folder: the run folder to pass as --out when the command names none.
        resume_command: what continues the run named by --resume (None: a new run), for the one
            line a signal before training gets.
    """
    from flowrec.runs.errors import RunError
    from flowrec.runs.launch import launcher_command, launcher_env

    args = strip_options(command_args(sys.argv), LAUNCHER_OPTIONS)
    if folder is not None:
        args += ["--out", str(folder)]
    # the launcher leaves a torchelastic_* log folder per run in the temp folder: give it (and the
    # ranks' temp files) a folder of this launch, removed when it ends
    with tempfile.TemporaryDirectory(prefix="flowrec-ranks-", ignore_cleanup_errors=True) as tmp, \
            forwarded_signals() as forwarder:
        note = Path(tmp) / "rank0-note"  # what rank 0 leaves this process to say after a signal
        try:
            env = launcher_env(nproc, Path(tmp), note)
        except RunError as exc:
            fail(str(exc))
        # its own session: a terminal's Ctrl-C reaches it once, through this process, not twice
        launcher = subprocess.Popen(launcher_command(nproc, max_restarts, args), env=env, start_new_session=True)
        forwarder.attach(launcher)
        status = launcher.wait()
        said = launcher_note(note)
    if forwarder.signum is not None:  # the launch was asked to stop: one line of what was kept
        return _stopped(forwarder.signum, status, said, resume_command)
    if status < 0:  # `kill -9` of its pid: its ranks get SIGTERM from the kernel (`stop_with_launcher`)
        print(f"error: torch's launcher (pid {launcher.pid}) was killed by {_signal_name(-status)}; the ranks it "
              f"started stop after their step, each with its checkpoint line", file=sys.stderr)
        return 128 - status
    return status


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _stopped(sig: int, status: int, said: str | None, resume_command: str | None) -> int:
    """The exit status of a launch that signal `sig` asked to stop (its launcher's `status`), after
    its one line: rank 0's own where it said one (`said` is "": it trained, and its line says where
    it stopped and how to continue; else the launcher's status and line stand), else this
    process's: before training (no note: the ranks said nothing, each rank's 'interrupted ... before
    training started' was a line per rank, and a rank stopped before its handlers were in place
    left none) nothing was trained and a resumed run is as it was; after the run finished (rank 0's
    note: its closing lines are out, the launcher was stopped as it wound up with no line and
    status 130 or 143) the run is whole, and the status is the signal's all the same, as a signal
    to one process as its run finishes ends it with 130 (docs/distributed.md)."""
    if said == "":  # 0: the ranks ended whole before the signal could reach them
        return 128 + sig if status < 0 else status
    if 0 < status <= 128:  # a rank's own failure (its line, and the launcher's, are out)
        return status
    if said is None:
        kept = f"; the run is as it was: continue with  {resume_command}" if resume_command else ""
        print(f"error: interrupted ({_signal_name(sig)}) before training started; nothing was trained{kept}",
              file=sys.stderr)
    else:
        print(said, file=sys.stderr)
    return 128 + sig


class SignalForwarder:
    """Sends the first SIGTERM, SIGHUP or SIGINT this process gets to its child (torch's launcher,
    which sends it on to every rank, waits for them to checkpoint and exit, and kills the ones still
    running after its shutdown timeout), once the child exists. Later signals are not sent on: a
    second one would cut the launcher's shutdown short."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self.signum: int | None = None
        self.sent = False

    def __call__(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
            self._send()

    def attach(self, child: subprocess.Popen) -> None:
        self.child = child
        self._send()

    def _send(self) -> None:
        if self.child is not None and self.signum is not None and not self.sent and self.child.poll() is None:
            self.sent = True
            self.child.send_signal(self.signum)


@contextmanager
def forwarded_signals() -> Iterator[SignalForwarder]:
    """While the block runs, SIGTERM, SIGINT and SIGHUP (a closed terminal; not where ignored, as
    under `nohup`) do not end this process (which would leave the launcher and the ranks, in their
    own session, running as orphans) but go to the child given to the forwarder."""
    from flowrec.data.interrupts import stop_signals

    forwarder = SignalForwarder()
    previous = {sig: signal.signal(sig, forwarder) for sig in (signal.SIGINT, *stop_signals())}
    try:
        yield forwarder
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


PR_SET_PDEATHSIG = 1  # Linux prctl: the signal this process gets when the thread that started it ends


def stop_with_launcher() -> None:
    """Ask the kernel for SIGTERM when torch's launcher (this rank's parent) ends without stopping
    it: a launcher killed by `kill -9` (or the out-of-memory killer) left its ranks training on as
    orphans, holding the run folder. SIGTERM is a rank's first Ctrl-C: the ranks agree to stop
    after the step, checkpoint and exit (docs/distributed.md). Linux only; a no-op elsewhere and
    outside torch's launcher."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it ended before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


def launched_nproc() -> int | None:
    """N of the `flowrec train --nproc N` launch this rank belongs to (None: not launched that way)."""
    text = os.environ.get(NPROC_ENV, "")
    return int(text) if text.isdigit() else None


def share_cores() -> None:
    """Size the compute threads to this process's share of the cores it may use (affinity and
    cgroup CPU quota, `flowrec.data.cores`), shared out among the ranks of a launch on this
    machine (LOCAL_WORLD_SIZE): NUMBA_NUM_THREADS for the numba sparse update (read when numba is
    imported, so this runs first) and torch's intra-op threads (torchrun already sets
    OMP_NUM_THREADS for ranks). Oversubscribed, two ranks on two cores trained MovieLens 3.5x
    slower; a process held to one core by a quota ran two-thread parallel regions at the speed of
    one thread that waits. A value set by the user is kept."""
    from flowrec.data.cores import thread_budget

    compute = thread_budget().compute
    if "NUMBA_NUM_THREADS" not in os.environ and compute < (os.cpu_count() or 1):
        os.environ["NUMBA_NUM_THREADS"] = str(compute)
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        if torch.get_num_threads() > compute:  # `flowrec.data.cores.run_threads` without OMP_NUM_THREADS
            torch.set_num_threads(compute)


def _status(failure: Any) -> int | None:
    """A failed rank's exit status: the one it reported with its line (`rank_reports.report_stop`), where the
    launcher's SIGTERM to the ranks left after a failure ended it as it was exiting (its line out,
    its status -15 said 'was killed by signal 15 and wrote no message'), else its exit code."""
    reported = report_of(failure).get("status")
    return reported if isinstance(reported, int) and reported > 0 else failure.exitcode


def restart_count() -> int:
    """How often the launcher restarted the ranks of this job (0: the first attempt)."""
    text = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(text) if text.isdigit() else 0


def run_launcher(argv: list[str]) -> int:
    """torch.distributed.run with `argv`, its failures as one line and an exit status: the first
    failed rank's (its own message is above; 128 + the signal that killed it), or 128 + the signal
    that stopped the launcher. Where the first is rank 0 stopping on an error of its own, its line
    is the run's one line (as one process says it) and the launcher adds none."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # its own loggers name every failure again (with a timestamped prefix): ours is the one line
    logging.getLogger("torch.distributed.elastic").setLevel(os.environ.get("LOGLEVEL", "CRITICAL").upper())
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        if all(_status(failure) == EXIT_INTERRUPTED for failure in exc.failures.values()):
            return EXIT_INTERRUPTED  # a signal to a rank (not to this launcher): rank 0 said where it stopped
        rank, failure = first_failure(exc.failures)
        failed = ", ".join(str(r) for r in sorted(exc.failures))
        status = _status(failure)
        if rank == 0 and report_of(failure).get("line"):  # rank 0's own line is the run's, as one process's:
            return status  # the same words again ('the first, rank 0, with status 2: ...') said it twice
        print(f"error: training failed: rank(s) {failed} exited; the first, rank {rank}, "
              f"{_how_it_ended(status, report_of(failure).get('line'))}", file=sys.stderr)
        if status is not None and status < 0:
            return 128 - status  # a shell's status of a process its signal stopped
        return status if status else 1
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


def first_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """The rank whose failure made the others stop, and its failure: the earliest, and among those
    the launcher saw in one poll, one that did not stop because of another rank. torch's own
    `get_first_failure` takes the earliest timestamp, in whole seconds, which a rank without an
    error file (every flowrec rank: its line is its report) gets when the launcher sees it exit: a
    rank that `kill -9` stopped and the rank that lost it at once (status 4) tied, and the lower
    rank was named. A rank that lost a collective (status 4) or that the launcher stopped in that
    poll (SIGTERM; 130 or 143 when handled) comes after any other failure of its second; a rank the
    launcher killed later (a hung rank, SIGKILL after its shutdown timeout) stays after the rank
    that timed out waiting for it. Before all of these: a rank that reported stopping on an error
    of its own (`rank_reports.report_stop`), the earliest of them to the microsecond (the rank that lost it
    exits in the same second, with the same status 2 when it learned the cause)."""
    def key(rank: int) -> tuple[bool, float, float, bool, int]:
        code, report = _status(failures[rank]), report_of(failures[rank])
        own = bool(report)  # an error of its own, as the rank said (`rank_reports.report_stop`)
        followed = code in (EXIT_RANK_FAILED, -signal.SIGTERM, 128 + signal.SIGTERM, EXIT_INTERRUPTED)
        return not own, float(report.get("time", 0)) if own else 0.0, failures[rank].timestamp, followed, rank

    rank = min(failures, key=key)
    return rank, failures[rank]


def _how_it_ended(exitcode: int | None, line: str | None = None) -> str:
    """How a failed rank ended, in words: a status and its own line where it reported one
    (`rank_reports.report_stop`), else that its message is above, or a signal, which leaves no message (a
    SIGKILL: the kernel's out-of-memory killer, `kill -9`, a scheduler)."""
    if exitcode is not None and exitcode < 0:
        try:
            name = f" ({signal.Signals(-exitcode).name})"
        except ValueError:
            name = ""
        return f"was killed by signal {-exitcode}{name} and wrote no message"
    return f"with status {exitcode}: {line}" if line else f"with status {exitcode} (its message is above)"


if __name__ == "__main__":  # the launcher process of `flowrec train --nproc N`
    sys.exit(run_launcher(sys.argv[1:]))
