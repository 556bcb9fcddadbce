"""`flowrec train --init-from RUN`: start a new run from a trained run's parameters.

The new run takes RUN's tables and dense parameters and, unless `--fresh-optimizer`, its optimizer
state (the dense optimizer and the per-row sparse state stored next to each table); it starts at
step 0 with its own settings, trains RUN's plan (the same model and table layout), and must be
given data encoded with RUN's encoder (`flowrec.runs.encoder`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from flowrec.runtime.caches.base import MASTER_KEYS

SPARSE_STATE = MASTER_KEYS[1]  # the key of a table's per-row optimizer state in a checkpoint


def starting_state(parent: dict[str, Any], model_state: dict[str, Any], fresh_optimizer_state: dict[str, Any] | None
                   ) -> dict[str, Any]:
    """The checkpoint a run started from `parent` loads: its parameters (and optimizer state), at step 0,
    with a loop of its own (the learning-rate schedule's length from its own epochs, early stopping
    with no evaluation seen yet).

    Args:
        parent: the parent run's checkpoint.
        model_state: the new model's state dict (its fresh sparse optimizer state is used with a
            fresh optimizer).
        fresh_optimizer_state: the new dense optimizer's state dict to start from, or None to keep
            the parent's optimizer state.
    """
    # the run's own loop: its schedule's length from its own epochs, early stopping from no evaluation
    # (the parent's state stopped a child of an early-stopped run at step 0, training nothing)
    state = dict(parent, position={"epoch": 0, "batch": 0, "step": 0, "samples": 0}, skipped_batches=0,
                 schedule={"horizon_steps": None}, early_stopping=None)
    if fresh_optimizer_state is not None:
        state["model"] = {k: (model_state[k] if k.rsplit(".", 1)[-1] == SPARSE_STATE else v)
                          for k, v in parent["model"].items()}
        state["dense_optimizer"] = fresh_optimizer_state
    return state


def parent_folder(path: Path) -> Path:
    """The run folder of a run folder or checkpoint file."""
    return Path(path).parent if Path(path).is_file() else Path(path)
