"""Progress bars on stderr (rich), silent when disabled: training (samples/s, loss and ETA),
reading the data for the plan (`reading_bar`) and rows of a stream of unknown length
(`rows_spinner`: data convert, predict)."""
from __future__ import annotations

import sys
import time
from contextlib import AbstractContextManager, contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column

from flowrec.runtime.messages import number_cell


class TrainProgress:
    """A progress bar over training steps showing samples/s and the running loss.

    Args:
        total_steps: steps planned for the run (None if unknown).
        enabled: False gives a no-op bar (tests, `--quiet`).
        initial: steps already done (resumed runs).
    """

    def __init__(self, total_steps: int | None, enabled: bool = True, initial: int = 0) -> None:
        self.enabled = enabled
        self._start = time.perf_counter()
        self._samples = 0
        if not enabled:
            return
        console = Console(file=sys.stderr)
        def whole() -> Column:  # the bar gives way, never the figures: at 80 columns (a log's width)
            return Column(no_wrap=True)  # the step count read '412/281…' for 412/28125

        self._bar = Progress(
            TextColumn("[bold]train", table_column=whole()),
            BarColumn(bar_width=None, table_column=Column(ratio=1)),
            MofNCompleteColumn(table_column=whole()),
            TextColumn("{task.fields[rate]:>9} samples/s", table_column=whole()),
            TextColumn("loss {task.fields[loss]}", table_column=whole()),
            TimeElapsedColumn(table_column=whole()),
            TextColumn("eta", table_column=whole()),
            TimeRemainingColumn(table_column=whole()),
            console=console,
            transient=False,
        )
        self._task = self._bar.add_task("train", total=total_steps, completed=initial, rate="-", loss="-")
        self._bar.start()

    def samples_per_s(self) -> float:
        """Samples per second since the bar started."""
        return self._samples / max(time.perf_counter() - self._start, 1e-9)

    def update(self, samples: int, loss: float | None) -> None:
        self._samples += samples
        if not self.enabled:
            return
        rate = self.samples_per_s()
        fields = {"rate": f"{rate:,.0f}"}
        if loss is not None:
            fields["loss"] = number_cell(loss)  # 3e-06 is not 0.0000, as in the metrics table
        self._bar.update(self._task, advance=1, **fields)

    def close(self) -> None:
        if self.enabled:
            self._bar.stop()


def reading_bar(enabled: bool) -> Callable[[str, int], AbstractContextManager[Callable[[int], None]]]:
    """A `flowrec.runs.plan.Progress`: the bar shown while the data is read for the plan's access
    profile, rows read of the rows to read. On stderr where it is a terminal, gone once read (the
    status line after it says what was sampled); nothing when not `enabled` (`--quiet`, ranks but
    the first)."""

    @contextmanager
    def bar(description: str, total: int) -> Iterator[Callable[[int], None]]:
        console = Console(file=sys.stderr)
        with Progress(TextColumn("{task.description}"), BarColumn(bar_width=24),
                      TextColumn("{task.completed:,}/{task.total:,} rows"), TimeElapsedColumn(), TextColumn("eta"),
                      TimeRemainingColumn(), console=console, transient=True,
                      disable=not enabled or not console.is_terminal) as shown:
            task = shown.add_task(description, total=total)
            yield lambda rows: shown.advance(task, rows)

    return bar


@contextmanager
def rows_spinner(description: str, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A spinner with rows done so far and the time taken, for work whose rows are not known
    ahead (`flowrec data convert`, `flowrec predict`); yields `advance(rows)`. On stderr where it is
    a terminal only: a log or a pipe gets the command's own closing line, not a spinner's last frame.

    Example:
        >>> with rows_spinner("scoring day1.csv", enabled=False) as advance:
        ...     advance(1024)
    """
    console = Console(file=sys.stderr)
    with Progress(SpinnerColumn(), TextColumn("{task.description} {task.completed:,} rows"), TimeElapsedColumn(),
                  console=console, disable=not enabled or not console.is_terminal) as shown:
        task = shown.add_task(description, total=None)
        yield lambda rows: shown.advance(task, rows)
