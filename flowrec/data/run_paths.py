"""The names of a run folder that the data layer reads, and how a checkpoint finds its run.

They live here, not in `flowrec.runtime.rundir` (which re-exports them), so that `flowrec.data`
finds a run's encoder (`--encoder-from RUN/best`) without importing the training runtime.

Example:
    >>> run_folder_of(Path("runs/exp1/best"))  # doctest: +SKIP
    PosixPath('runs/exp1')
"""
from __future__ import annotations

from pathlib import Path

CHECKPOINT_NAME = "checkpoint.pt"
RUN_FILE = "run.json"  # the settings a run was started with; --resume restores them
BEST_DIR = "best"  # the checkpoint of the best evaluation (early stopping)


def run_folder_of(path: Path) -> Path:
    """The run folder of a run folder, of its RUN/best, or of a checkpoint file in either: the
    folder whose run.json, encoder/ and metrics.jsonl the checkpoint's model goes with. RUN/best is
    a folder named best without a run.json of its own, in a run folder; a run folder that is itself
    named best (`--out runs/best`) is its own.
    """
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    above = folder.parent
    if folder.name == BEST_DIR and not (folder / RUN_FILE).is_file() and (
            (above / RUN_FILE).is_file() or (above / CHECKPOINT_NAME).is_file()):
        return above
    return folder
