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
    as the launcher names it, in the words of `flowrec.train`: `python_words`), `lines` the ranks'
    last output lines as they wrote them (also the error's note), `code`
    the launcher's exit status (a status of the CLI: 2 bad input, 3 out of memory, 4 a lost rank)."""

    def __init__(self, nproc: int, status: int, lines: list[str]) -> None:
        said = error_line(lines)  # the ranks' words (`--max-steps`), as the call that started them says them
        said = python_words(said) if said is not None else "no rank said why (its last lines are in this error's note)"
        how = f"exit status {status}" if status > 0 else f"the launcher was killed by signal {-status}"
        super().__init__(f"training on {nproc} ranks failed ({how}): {said}", code=status if status > 0 else 128 - status)
        self.lines = lines
        if lines and hasattr(self, "add_note"):  # Python 3.11+ shows notes under the traceback
            self.add_note("the ranks' last lines:\n" + "\n".join(lines))


def run_launch(nproc: int, max_restarts: int, args: list[str], echo: Callable[[str], Any] | None = None,
               stop_wait_s: float | None = None) -> Launch:
    """Run `flowrec train ARGS` on `nproc` local ranks to its end; their output (stdout and stderr)
    goes to `echo` as it comes (None: kept for the failure's lines only).

    A KeyboardInterrupt in this process (Ctrl-C, a notebook's interrupt; SIGTERM and SIGHUP raise
    one here too) is sent on to the launcher, which sends it to every rank: they checkpoint after
    their step and exit. Past `stop_wait_s` (None: STOP_WAIT_S, read at the interrupt), or on a
    second interrupt, the launcher and its ranks are killed (a rank that ignores SIGTERM too).
    Either way no process of the launch is left when this returns (`Launch.interrupt` holds the
    interrupt; the caller raises it again)."""
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
                _stop(launcher, signal.SIGINT, STOP_WAIT_S if stop_wait_s is None else stop_wait_s)
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
    from flowrec.runtime.proctree import kill_tree, running

    launch = kill_tree(launcher.pid)
    launcher.wait()
    deadline = time.monotonic() + 30  # SIGKILL cannot be caught: the kernel ends them at once
    while any(running(pid) for pid in launch[1:]) and time.monotonic() < deadline:
        time.sleep(0.05)


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


# the `flowrec train` flags that the ranks of `flowrec.train(..., nproc=N)` are given, and its keywords
OPTION_FLAGS = {"data": "--data", "eval_data": "--eval-data", "epochs": "--epochs", "max_steps": "--max-steps",
                "eval_every": "--eval-every", "checkpoint_every": "--checkpoint-every", "device": "--device",
                "device_budget": "--device-budget", "rows": "--rows", "seed": "--seed",
                "cache_data": "--cache-data"}  # train()'s options, each passed on as its flag
FLAG_KEYWORDS = {**{flag: key for key, flag in OPTION_FLAGS.items()}, "--out": "out", "--resume": "resume",
                 "--overwrite": "overwrite", "--nproc": "nproc", "--max-restarts": "max_restarts"}
_PLACEHOLDER = r"[A-Z]+"  # N, DIR, RUN, PATH: a value the line leaves to the reader
_NUMBER = r"\d+(?:,\d{3})*"  # 10, 400,000
_PATH = r"'[^']*'|[^\s,;()`'\"]*[^\s,;:.()`'\"]"  # shell-quoted, or a word that does not end the sentence
_VALUES = {**dict.fromkeys(("epochs", "max_steps", "eval_every", "checkpoint_every", "rows", "seed", "nproc",
                            "max_restarts"), _NUMBER),
           **dict.fromkeys(("data", "eval_data", "out", "resume"), _PATH),
           "device": r"auto|cpu|cuda(?::\d+)?", "device_budget": r"\d[\w.]*", "cache_data": r"auto|on|off|\d[\w.]*"}
_WORDS = {"a", "an", "and", "or", "the", "to", "of", "on", "in", "is", "it", "its", "with", "which", "that", "for",
          "only", "given", "too", "as", "again", "instead", "alone", "before", "after", "at", "be", "are"}
_FLAG = re.compile(r"(?<![\w-])(?:" + "|".join(map(re.escape, sorted(FLAG_KEYWORDS, key=len, reverse=True)))
                   + r")(?![\w-])")
_COMMAND = re.compile(r"`flowrec train ([^`]*)`|(?<=continue with  )flowrec train (.*)$")
_TWICE = [(re.compile(r"\b(\w+)=(\S*) \(\1=\)"), r"\1=\2"),  # '--eval-data DIR (eval_data=)'
          (re.compile(r"\b(\w+)=(\S+), or \1=\2 in Python"), r"\1=\2"),  # '--data DIR, or data=DIR in Python'
          (re.compile(r"\b(\w+)=, \1=, "), r"\1=, "),  # '(--data, data=, or data bound in the spec)'
          (re.compile(rf"\b((?:{'|'.join(FLAG_KEYWORDS.values())})=[^\s,;()]*) (?=(?:{'|'.join(FLAG_KEYWORDS.values())})=)"),
           r"\1, ")]  # '--out runs/x --overwrite': out='runs/x', overwrite=True


def python_words(line: str) -> str:
    """A line of the ranks of `flowrec.train(..., nproc=N)` (an error, a warning) in the words of the
    Python call that started them, as one process words it: each `flowrec train` flag that the call
    passes on as the keyword it stands for (`--max-steps 10`: `max_steps=10`; without its value:
    `max_steps=`; `--overwrite`: `overwrite=True`), a `flowrec train` command of those flags alone as
    the call that does the same, an undefined metric as the returned metrics hold it (NaN). A line
    without them is unchanged, and so is a command of other flags (`flowrec data convert ...
    --on-error skip`, typed in a shell) and a flag no keyword stands for (`--nan-policy`).

    >>> python_words("give --max-steps 10, or --eval-data DIR (eval_data=); --dist-timeout 300 s")
    'give max_steps=10, or eval_data=DIR; --dist-timeout 300 s'
    >>> python_words("start over with --out runs/x --overwrite")
    "start over with out='runs/x', overwrite=True"
    >>> python_words("interrupted at step 4; continue with  flowrec train s.yaml --resume runs/a --nproc 2")
    "interrupted at step 4; continue with  `flowrec.train('s.yaml', resume='runs/a', nproc=2)`"
    >>> python_words("convert them with `flowrec data convert csv x DIR --on-error skip`: --data DIR, or data=DIR in Python")
    'convert them with `flowrec data convert csv x DIR --on-error skip`: data=DIR'
    """
    from flowrec.runtime.evaluation.undefined import PYTHON, TABLE

    line = _COMMAND.sub(lambda found: _python_call(found.group(1) or found.group(2) or "") or found.group(),
                        line.replace(TABLE, PYTHON))
    parts = line.split("`")  # the odd parts are in backticks: commands and calls, kept as written (flags alone,
    # `--max-steps N`, said as keywords)
    line = "`".join(_keywords(part) if not i % 2 or part.startswith("--") else part for i, part in enumerate(parts))
    for pattern, once in _TWICE:
        line = pattern.sub(once, line)
    return line


def _keywords(text: str) -> str:
    """`text` with each flag of FLAG_KEYWORDS (and its value, where one follows) as its keyword."""
    out, at = [], 0
    for found in _FLAG.finditer(text):
        key = FLAG_KEYWORDS[found.group()]
        value = re.match(rf"[= ]({_PLACEHOLDER}|{_VALUES.get(key, '(?!)')})(?![\w/-])", text[found.end():])
        out.append(text[at:found.start()])
        at = found.end()
        if key == "overwrite":
            out.append("overwrite=True")
        elif value is None or value.group(1) in _WORDS:
            out.append(f"{key}=")
        else:
            out.append(f"{key}={_python_value(value.group(1))}")
            at += value.end()
    return "".join(out) + text[at:]


def _python_value(value: str) -> str:
    """A flag's value as a Python call writes it: a number or a placeholder as it is, text quoted.

    >>> _python_value("400,000"), _python_value("DIR"), _python_value("runs/a"), _python_value("'my runs'")
    ('400_000', 'DIR', "'runs/a'", "'my runs'")
    """
    import shlex

    return _literal(shlex.split(value)[0] if value.startswith("'") else value)


def _literal(value: str) -> str:
    """An argument's value (unquoted) as a Python call writes it: a number or a placeholder as it
    is, text quoted."""
    return value.replace(",", "_") if re.fullmatch(f"{_PLACEHOLDER}|{_NUMBER}", value) else repr(value)


def _python_call(args: str) -> str | None:
    """The `flowrec.train(...)` call (in backticks) that does what `flowrec train ARGS` does, None
    where ARGS hold a flag no keyword of the call stands for (or cannot be read as a shell does).

    >>> _python_call("SPEC --resume runs/b --max-steps=8"), _python_call("s.yaml --follow days --out r")
    ("`flowrec.train(SPEC, resume='runs/b', max_steps=8)`", None)
    """
    import shlex

    try:
        words = shlex.split(args)
    except ValueError:
        return None
    if not words or words[0].startswith("-"):
        return None
    given, words = [_literal(words[0])], words[1:]
    while words:
        flag, _, value = words.pop(0).partition("=")
        key = FLAG_KEYWORDS.get(flag)
        if key is None:
            return None
        if key == "overwrite":
            given.append("overwrite=True")
            continue
        if not value:
            if not words:
                return None
            value = words.pop(0)
        given.append(f"{key}={_literal(value)}")
    return f"`flowrec.train({', '.join(given)})`"


_LAUNCHER_LINE = re.compile(r"training failed: rank\(s\) [\d, ]+ exited; the first, rank (\d+), with status \d+"
                            r"(?:: (.*)| \(its message is above\))")  # `flowrec.cli.ranks.run_launcher`'s


def error_line(lines: list[str]) -> str | None:
    """The last `error:` line of a launch's output, without its `error: ` and `rank R: ` prefixes;
    where that is the launcher's line naming the first failed rank, that rank's own line (the
    launcher's words around it, 'training failed: rank(s) 0, 1 exited; the first, rank 1, with
    status 2: ', said the failure again after `RanksFailed`'s own 'training on 2 ranks failed').

    >>> error_line(["error: rank 1: a failed", "error: rank 0: stopped: rank 1 stopped first",
    ...             "error: training failed: rank(s) 0, 1 exited; the first, rank 1, with status 2: a failed"])
    'a failed'
    >>> error_line(["error: rank 1: b", "error: training failed: rank(s) 1 exited; the first, rank 1, with status 2 "
    ...             "(its message is above)"])
    'b'
    """
    said = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    if not said:
        return None
    if (launcher := _LAUNCHER_LINE.fullmatch(said[-1])) is not None:
        if launcher.group(2):
            return launcher.group(2)
        own = [line for line in said if line.startswith(f"rank {launcher.group(1)}: ")]
        if own:
            said = own
    return re.sub(r"^rank \d+: ", "", said[-1])
