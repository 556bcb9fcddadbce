"""The JSON-lines metrics log of a run (and its TensorBoard mirror). The metrics themselves live in
`flowrec.runtime.evaluation.metrics` (re-exported here: `auc`, `logloss`, `mse`).

Example:
    >>> log = MetricsLog(Path("runs/x/metrics.jsonl"))  # doctest: +SKIP
    >>> log.write({"event": "train", "step": 1, "loss": 0.69})  # doctest: +SKIP
"""
from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path
from flowrec.spec.json_doc import parse_json_text
from typing import Any

import numpy as np

from flowrec.runtime.atomic import atomic_write
from flowrec.runtime.evaluation.metrics import auc, logloss, mse

__all__ = ["MetricsError", "MetricsLog", "auc", "jsonable", "logloss", "mse", "read_records", "trim_metrics"]


class MetricsError(OSError):
    """metrics.jsonl cannot be written (disk full, permissions); the message is one line."""


class MetricsLog:
    """Appends one JSON object per line to `metrics.jsonl`, and to TensorBoard when installed.

    Each record is one `write` of a whole line; if it fails (disk full), the file is cut back to
    its last complete line, so the log is never torn.

    Args:
        path: the JSON-lines file (its folder must exist).
        tensorboard: also write TensorBoard scalars if `torch.utils.tensorboard` imports.
        keep_through_step: first drop every record of a later step (and any torn line), atomically
            (a resumed run logs the steps after its checkpoint again, so each step stays once).
    """

    def __init__(self, path: Path, tensorboard: bool = True, keep_through_step: int | None = None) -> None:
        self.path = Path(path)
        if keep_through_step is not None:
            trim_metrics(self.path, keep_through_step)
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise MetricsError(f"cannot write {self.path}: {exc.strerror}") from None
        self._tb = _tensorboard_writer(self.path.parent) if tensorboard else None

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: jsonable(v) for k, v in record.items()}
        _append_line(self._fd, self.path, (json.dumps(clean, sort_keys=True) + "\n").encode())
        if "step" in record:
            self.scalars(record["step"], dict(tensorboard_scalars(clean)))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """TensorBoard-only scalars (tag -> value) at `step`; nothing without TensorBoard."""
        if self._tb is None:
            return
        for tag, value in values.items():
            self._tb.add_scalar(tag, value, step)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._tb is not None:
            self._tb.close()


def _append_line(fd: int, path: Path, line: bytes) -> None:
    """Append `line` whole, or cut the file back to where it was and raise MetricsError."""
    size = os.fstat(fd).st_size
    try:
        written = os.write(fd, line)
        if written != len(line):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as exc:
        try:
            os.ftruncate(fd, size)
        except OSError:
            pass
        raise MetricsError(f"cannot write {path}: {exc.strerror or exc}") from None


def read_records(path: Path) -> list[dict[str, Any]]:
    """The complete records of a metrics log (a torn last line is skipped)."""
    if not Path(path).is_file():
        return []
    records = []
    for line in Path(path).read_bytes().split(b"\n"):
        try:
            record = parse_json_text(line.decode('utf-8', 'replace'), str(path))
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def trim_metrics(path: Path, step: int) -> None:
    """Keep the records up to `step` (each step once after a resume): new file, then rename."""
    path = Path(path)
    if not path.is_file():
        return
    kept = [r for r in read_records(path) if isinstance(r.get("step"), int) and r["step"] <= step]
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept)
    try:
        atomic_write(path, text.encode())
    except OSError as exc:
        raise MetricsError(f"cannot rewrite {path}: {exc.strerror or exc}") from None


def tensorboard_scalars(record: dict[str, Any]) -> list[tuple[str, float]]:
    """TensorBoard tags of a log record: `train/loss`, `train/lr_dense`, `train/lr_sparse` for a
    step, `eval/<head>/<metric>` for an evaluation, `<event>/<key>` for other numbers."""
    event = record.get("event", "train")
    if event == "eval":
        return [(f"eval/{head}/{name}", value) for head, metrics in (record.get("metrics") or {}).items()
                for name, value in metrics.items() if name != "samples" and _number(value)]
    skip = ("step", "epoch")
    return [(f"{event}/{key}", value) for key, value in record.items() if key not in skip and _number(value)]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def tensorboard_available() -> bool:
    """TensorBoard's writer imports (`pip install flowrec[tensorboard]`)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True


def jsonable(v: Any) -> Any:
    """`v` with non-finite floats as None and numpy scalars as Python numbers (nested dicts, lists
    and tuples too: a list of records)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (np.floating, np.integer)):
        return jsonable(v.item())
    if isinstance(v, dict):
        return {k: jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    return v


def _tensorboard_writer(folder: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    # absolute: its writer thread opens the file at every flush, and a custom module's forward that moves
    # the working folder (put back after the call) moved a relative one from under it for that while
    return SummaryWriter(log_dir=os.path.abspath(folder / "tensorboard"))
