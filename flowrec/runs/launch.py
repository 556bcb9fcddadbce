"""N local ranks of a run through torch.distributed's launcher, for `flowrec train --nproc N` and
`flowrec.train(spec, nproc=N)`: the checks made before any rank starts, the launcher's command line
and environment, and (for the API) the launch run to its end, stopped with every rank on an interrupt.

The ranks are `flowrec train` processes (`python -m flowrec train ARGS` under the launcher module
`flowrec.cli.ranks`), so a launch from Python trains exactly as the command line does. Each check
raises `RunError` (one line) in the caller's words: `--nproc 2` on the command line, `nproc=2` in
Python (`python=True`); nothing here prints.

Example:
    >>> launcher_command(2, 0, ["s.yaml", "-q"])[1:6]
    ['-m', 'flowrec.cli.ranks', '--standalone', '--nproc-per-node=2', '--max-restarts=0']
    >>> error_line(["note: x", "error: rank 1: the data moved", "more"])
    'the data moved'
"""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from flowrec.runs.errors import RunError

LAUNCHER_MODULE = "flowrec.cli.ranks"  # torch.distributed.run with flowrec's one-line failures
NPROC_ENV = "FLOWREC_NPROC"  # set for the ranks of a local launch: their resume command says --nproc N
LAUNCH_NOTE_ENV = "FLOWREC_LAUNCH_NOTE"  # a file of the launch: rank 0's note of where a signal stopped it
STOP_WAIT_S = 120.0  # after an interrupt: the launcher's 30 s shutdown and the ranks' checkpoints, at most
TAIL_LINES = 40  # the ranks' last output lines kept for a failure's message
MAX_WARNINGS = 100  # the ranks' warning lines kept (each becomes a UserWarning of `flowrec.train`)


def nproc_flag(nproc: int, python: bool) -> str:
    """The caller's words for N ranks.

    >>> nproc_flag(2, False), nproc_flag(2, True)
    ('--nproc 2', 'nproc=2')
    """
    return f"nproc={nproc}" if python else f"--nproc {nproc}"


def check_ranks_fit(nproc: int, python: bool = False) -> None:
    """`RunError` when `nproc` ranks cannot all start here: each is a process of this program, as big
    as this one is now (torch imported) before it reads any data. `--nproc 1000000` had torch's
    launcher make a log folder per rank for minutes, deaf to SIGTERM, before any rank started.
    Where that refuses, the size of a fresh process that imports what a rank imports is measured
    (`fresh_process_bytes`) and taken where smaller: `flowrec.train(..., nproc=2)` called from a
    notebook that holds gigabytes of its own data was refused for ranks that never hold them."""
    from flowrec.data.hostmemory import available_memory_bytes

    each = own_process_bytes()
    room = available_memory_bytes()
    if room is None or nproc * each <= room:
        return
    each = min(each, fresh_process_bytes() or each)
    if nproc * each > room:
        raise RunError(f"{nproc_flag(nproc, python)}: {nproc:,} ranks of {each / 2**20:,.0f} MiB each (a "
                       f"process of this program's size, before any data) need more than the "
                       f"{room / 2**30:,.1f} GiB of memory available here; give fewer ranks")


FRESH_TIMEOUT_S = 120.0  # a fresh process importing torch and flowrec's trainer, on a loaded machine
FRESH_IMPORTS = "import resource, torch, flowrec.cli.train_cmds, flowrec.runtime.trainer"


def own_process_bytes() -> int:
    """The peak resident size of this process (Linux reports it in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def fresh_process_bytes() -> int | None:
    """The peak resident size of a fresh Python process that imports what a rank imports before it
    reads data (torch, the trainer); None where it cannot be measured (it failed, or took longer
    than FRESH_TIMEOUT_S: it is then killed; it starts no process of its own)."""
    code = f"{FRESH_IMPORTS}, sys; sys.stdout.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))"
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True) as child:
        try:
            out, _ = child.communicate(timeout=FRESH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate(timeout=FRESH_TIMEOUT_S)
            return None
    try:
        return int(out.strip().splitlines()[-1]) if child.returncode == 0 else None
    except (ValueError, IndexError):
        return None


def check_ranks_data(spec: Any, given: dict[str, Any]) -> None:
    """`RunError` (its `cause` the `DataError`) when a given data or eval_data folder is no dataset,
    or one encoded for another spec, before the launch: each rank found it after starting (16-37 s)
    and said the same line, then the launcher a third time. Only the folder's record is read."""
    from flowrec.data.layout import DataError, check_spec, read_meta, train_part

    for key in ("data", "eval_data"):
        value = given.get(key)
        if value is None:
            continue
        part = train_part(value) if key == "data" else Path(value)
        try:
            check_spec(read_meta(part), spec, part)
        except DataError as exc:
            raise RunError(str(exc), cause=exc) from None


def check_ranks_have_gpus(spec: Any, device: str | None, nproc: int, python: bool = False) -> None:
    """`RunError` when the run is on CUDA and this machine has fewer GPUs than `nproc` ranks, before
    the launch (each rank took a GPU of its own and the ranks past the last one failed, after starting)."""
    from flowrec.runs.plan import device_for_run

    check_one_gpu_per_rank(nproc, device_for_run(spec, device or "auto").type, nproc_flag(nproc, python))


def check_one_gpu_per_rank(nproc: int, device_type: str, flag: str) -> None:
    """`RunError` when `nproc` local processes on CUDA would not each have a GPU (`flag`: how the
    caller names the ranks), before any is started."""
    if device_type == "cuda" and nproc > 1:
        import torch

        if nproc > (count := torch.cuda.device_count()):
            raise RunError(f"{flag} with CUDA needs one GPU per process; this machine has {count}")


def check_ranks_cache(spec: Any, cache: str | None, nproc: int, python: bool = False) -> None:
    """`RunError` when a new run's cache policy (`cache`, the command line's --cache, else the spec's
    plan.cache) cannot be planned for `nproc` ranks, before the launch: every rank planned the run and
    refused it in a line of its own, after the ranks had started. (A resumed run, one started from
    another or from a plan file trains a plan whose check is its own: the caller leaves those out.)"""
    from flowrec.planner.passes.cache import sharded_cache_refusal

    refusal = sharded_cache_refusal(cache or spec.plan.cache, nproc)
    if refusal is not None:
        named = "--cache" if cache is not None else "the spec's plan.cache"
        raise RunError(f"{nproc_flag(nproc, python)} with {named}: {refusal}")


def launcher_command(nproc: int, max_restarts: int, args: list[str]) -> list[str]:
    """The command line of torch's launcher running `flowrec train ARGS` on `nproc` local ranks."""
    return [sys.executable, "-m", LAUNCHER_MODULE, "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.5", "-m", "flowrec", "train", *args]


def launcher_env(nproc: int, tmp: Path, note: Path) -> dict[str, str]:
    """The launcher's environment: the usable cores shared out among the ranks (a value the user set
    kept), torch's loggers quiet (failures are one line of flowrec's), `tmp` its temp folder (the
    launcher's torchelastic_* logs and the ranks' temp files go with it), `note` rank 0's note.
    Raises `RunError` for a LOGLEVEL that is no logging level (torch's launcher reads it)."""
    if not isinstance(logging.getLevelName(os.environ.get("LOGLEVEL", "ERROR").upper()), int):
        raise RunError(f"LOGLEVEL={os.environ['LOGLEVEL']!r} is not a logging level (DEBUG, INFO, WARNING, ERROR, "
                       "CRITICAL); torch.distributed's launcher reads it")
    from flowrec.data.cores import thread_budget

    threads = str(thread_budget(ranks=nproc).compute)  # torch (OpenMP), numba: the usable cores shared out
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads),
            "NUMBA_NUM_THREADS": os.environ.get("NUMBA_NUM_THREADS", threads),
            "LOGLEVEL": os.environ.get("LOGLEVEL", "CRITICAL").upper(),
            "TMPDIR": str(tmp), NPROC_ENV: str(nproc), LAUNCH_NOTE_ENV: str(note)}


@dataclass
class Launch:
    """How a launch of `run_launch` ended: the launcher's exit `status`, the ranks' last output
    lines (`lines`), rank 0's note (`note`: None where the ranks had not begun training when a
    signal stopped them), and the interrupt that stopped it (`interrupt`, None when none did)."""

    status: int
    lines: list[str] = field(default_factory=list)
    note: str | None = None
    interrupt: KeyboardInterrupt | None = None
    warnings: list[str] = field(default_factory=list)  # the ranks' `warning: ...` lines, without the prefix


class RanksFailed(RunError):
    """A launch of N ranks that failed: `str(error)` is one line (the first failed rank's error line,
    as the launcher names it), `lines` the ranks' last output lines (also the error's note), `code`
    the launcher's exit status (a status of the CLI: 2 bad input, 3 out of memory, 4 a lost rank)."""

    def __init__(self, nproc: int, status: int, lines: list[str]) -> None:
        said = error_line(lines) or "no rank said why (its last lines are in this error's note)"
        how = f"exit status {status}" if status > 0 else f"the launcher was killed by signal {-status}"
        super().__init__(f"training on {nproc} ranks failed ({how}): {said}", code=status if status > 0 else 128 - status)
        self.lines = lines
        if lines and hasattr(self, "add_note"):  # Python 3.11+ shows notes under the traceback
            self.add_note("the ranks' last lines:\n" + "\n".join(lines))


def run_launch(nproc: int, max_restarts: int, args: list[str], echo: Callable[[str], Any] | None = None,
               stop_wait_s: float = STOP_WAIT_S) -> Launch:
    """Run `flowrec train ARGS` on `nproc` local ranks to its end; their output (stdout and stderr)
    goes to `echo` as it comes (None: kept for the failure's lines only).

    A KeyboardInterrupt in this process (Ctrl-C, a notebook's interrupt; SIGTERM and SIGHUP raise
    one here too) is sent on to the launcher, which sends it to every rank: they checkpoint after
    their step and exit. Past `stop_wait_s`, or on a second interrupt, the launcher and its ranks
    are killed. Either way no process of the launch is left when this returns (`Launch.interrupt`
    holds the interrupt; the caller raises it again)."""
    from flowrec.runtime.signals import terminated_as_interrupted

    with tempfile.TemporaryDirectory(prefix="flowrec-ranks-", ignore_cleanup_errors=True) as tmp:
        note = Path(tmp) / "rank0-note"
        env = launcher_env(nproc, Path(tmp), note)
        with terminated_as_interrupted():
            # its own session: a terminal's Ctrl-C reaches it once, through this process
            launcher = subprocess.Popen(launcher_command(nproc, max_restarts, args), env=env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            reader = _OutputReader(launcher.stdout, echo)
            interrupt = None
            try:
                launcher.wait()
            except KeyboardInterrupt as exc:
                interrupt = exc
                _stop(launcher, signal.SIGINT, stop_wait_s)
            finally:
                if launcher.poll() is None:  # anything else out of the wait: nothing is left running
                    _kill_launch(launcher)
            reader.join()
        said = _read_note(note)
    return Launch(launcher.returncode, reader.lines(), said, interrupt, reader.warnings)


def _stop(launcher: subprocess.Popen, sig: int, wait_s: float) -> None:
    """Ask the launcher to stop (`sig`, sent on to the ranks) and wait for it `wait_s`; kill the
    launch past that or on a second interrupt."""
    try:
        launcher.send_signal(sig)
        launcher.wait(timeout=wait_s)
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        _kill_launch(launcher)


def _kill_launch(launcher: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process under it (the ranks, in sessions of their own;
    `proctree.kill_tree`: each stopped first, so none starts another, a restart under max_restarts,
    before the kill), and wait until all are gone (the launcher reaped; its orphaned ranks reaped by
    init)."""
    from flowrec.runtime.proctree import kill_tree

    launch = kill_tree(launcher.pid)
    launcher.wait()
    deadline = time.monotonic() + 30  # SIGKILL cannot be caught: the kernel ends them at once
    while any(_running(pid) for pid in launch[1:]) and time.monotonic() < deadline:
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its parent counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _read_note(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


class _OutputReader:
    """Reads a launch's output on a thread: each chunk to `echo` as it comes, the last lines kept."""

    def __init__(self, stream: Any, echo: Callable[[str], Any] | None) -> None:
        self.stream, self.echo = stream, echo
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.warnings: list[str] = []
        self.partial = ""
        self.thread = threading.Thread(target=self._read, name="flowrec-ranks-output", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.stream.fileno(), 65536)
            except (OSError, ValueError):  # closed by `join` past its wait
                return
            if not chunk:
                return
            text = chunk.decode("utf-8", "replace")
            if self.echo is not None:
                try:
                    self.echo(text)
                except (OSError, ValueError):  # a closed stream: the lines are still kept
                    pass
            lines = re.split(r"[\r\n]", self.partial + text)  # a progress bar's \r ends a line too
            self.partial = lines.pop()
            self.tail.extend(line for line in lines if line.strip())
            self.warnings += [line.removeprefix("warning: ") for line in lines
                              if line.startswith("warning: ") and len(self.warnings) < MAX_WARNINGS]

    def join(self) -> None:
        """Wait for the end of the output (a rank left holding it open: 10 s at most)."""
        self.thread.join(timeout=10)
        self.stream.close()

    def lines(self) -> list[str]:
        return [*self.tail, *([self.partial] if self.partial.strip() else [])]


def error_line(lines: list[str]) -> str | None:
    """The last `error:` line of a launch's output, without its `error: ` and `rank R: ` prefixes."""
    for line in reversed(lines):
        if line.startswith("error: "):
            return re.sub(r"^rank \d+: ", "", line.removeprefix("error: "))
    return None
