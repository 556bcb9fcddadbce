"""`flowrec train --init-from RUN`: start a new run from a trained run's parameters.

The new run takes RUN's tables and dense parameters and, unless `--fresh-optimizer`, its optimizer
state (the dense optimizer and the per-row sparse state stored next to each table); it starts at
step 0 with its own settings, trains RUN's plan (the same model and table layout), and must be
given data encoded with RUN's encoder (`flowrec.runs.encoder`).

Fine-tuning: the spec may differ from RUN's in its training settings (`training_view`): the
optimizers (kind, lr, hyper-parameters), the dropout rates of built-in modules, batch size and
precision (epochs, seed, schedule, evaluation and early stopping are outside the model anyway).
The weights' layout must be RUN's: the spec with RUN's training settings put back is RUN's model
(`model_fingerprint`), and its plan packs the same tables into the same groups (`group_differences`).
An optimizer of the same kind keeps RUN's state (with the spec's hyper-parameters); one of another
kind starts with a fresh state (`optimizer_kinds`).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from flowrec.spec.model import ModelSpec

from flowrec.runtime.caches.base import MASTER_KEYS

SPARSE_STATE = MASTER_KEYS[1]  # the key of a table's per-row optimizer state in a checkpoint


def starting_state(parent: dict[str, Any], model_state: dict[str, Any], fresh_optimizer_state: dict[str, Any] | None,
                   own_optimizer_state: dict[str, Any] | None = None,
                   fresh_sparse: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """The checkpoint a run started from `parent` loads: its parameters (and optimizer state), at step 0,
    with a loop of its own (the learning-rate schedule's length from its own epochs, early stopping
    with no evaluation seen yet).

    Args:
        parent: the parent run's checkpoint.
        model_state: the new model's state dict (its fresh sparse optimizer state is used with a
            fresh optimizer).
        fresh_optimizer_state: the new dense optimizer's state dict to start from, or None to keep
            the parent's optimizer state.
        own_optimizer_state: the new dense optimizer's state dict, whose hyper-parameters (lr, betas,
            weight decay: the spec's) go with the parent's per-parameter state it keeps; torch's
            `load_state_dict` would otherwise set the parent's.
        fresh_sparse: whether a model state key (a group's sparse optimizer state) starts fresh (its
            optimizer kind changed), where the parent's optimizer state is kept otherwise.
    """
    # the run's own loop: its schedule's length from its own epochs, early stopping from no evaluation
    # (the parent's state stopped a child of an early-stopped run at step 0, training nothing)
    state = dict(parent, position={"epoch": 0, "batch": 0, "step": 0, "samples": 0}, skipped_batches=0,
                 schedule={"horizon_steps": None}, early_stopping=None)
    state["model"] = _dropout_count(parent["model"], model_state)
    if fresh_optimizer_state is not None:
        state["model"] = {k: (model_state[k] if k.rsplit(".", 1)[-1] == SPARSE_STATE else v)
                          for k, v in state["model"].items()}
        state["dense_optimizer"] = fresh_optimizer_state
        return state
    if own_optimizer_state is not None:
        saved = parent["dense_optimizer"]
        state["dense_optimizer"] = {"state": saved.get("state"), "param_groups": [
            {**own, "params": theirs.get("params", own["params"]) if isinstance(theirs, dict) else own["params"]}
            for own, theirs in zip(own_optimizer_state["param_groups"], saved.get("param_groups") or [])]
            if len(own_optimizer_state["param_groups"]) == len(saved.get("param_groups") or []) else
            saved.get("param_groups")}
    if fresh_sparse is not None:
        state["model"] = {k: (model_state[k] if k.rsplit(".", 1)[-1] == SPARSE_STATE and fresh_sparse(k) else v)
                          for k, v in state["model"].items()}
    return state


NOISE_STEPS = "noise_steps"  # the dropout step count a model with dropout holds (`LoweredModel._bind_noise`)


def _dropout_count(parent: dict[str, Any], model_state: dict[str, Any]) -> dict[str, Any]:
    """The parent's model state with the dropout step count of the new model: a run with dropout
    started from one without (or the other way) has the count on one side only (it refused the run
    as 'model missing noise_steps')."""
    if (NOISE_STEPS in parent) == (NOISE_STEPS in model_state):
        return parent
    out = {k: v for k, v in parent.items() if k != NOISE_STEPS}
    if NOISE_STEPS in model_state:
        out[NOISE_STEPS] = model_state[NOISE_STEPS]
    return out


def training_view(old: ModelSpec, new: ModelSpec) -> ModelSpec:
    """`new` with the training settings of `old` (the run's spec) put back: its optimizers (dense,
    sparse, each table's own), the `dropout` of its built-in modules, batch size and precision.
    Where its `model_fingerprint` is `old`'s, the two differ in training settings alone.

    Example:
        >>> training_view(run_spec, replace(run_spec, dense_optimizer=half_lr)) == run_spec  # doctest: +SKIP
        True
    """
    tables = {t.name: t for t in old.tables}
    modules = {m.name: m for m in old.modules}

    def module(m):
        o = modules.get(m.name)
        if o is None or o.kind != m.kind or m.kind == "custom":  # a custom module's params are its own code's
            return m
        mine = {k: v for k, v in m.params if k != "dropout"}
        mine.update((k, v) for k, v in o.params if k == "dropout")
        return replace(m, params=tuple(sorted(mine.items())))

    training = replace(new.training, batch_size=old.training.batch_size, precision=old.training.precision)
    return replace(new, dense_optimizer=old.dense_optimizer, sparse_optimizer=old.sparse_optimizer,
                   tables=tuple(_table(t, tables[t.name]) if t.name in tables else t for t in new.tables),
                   modules=tuple(module(m) for m in new.modules), training=training)


MANAGED_RULES = ("admit_min_count", "evict", "decay", "every_steps", "ttl_steps")  # not the layout (shards, rows)


def _table(new, old):
    """Table `new` with `old`'s optimizer and, both managed, `old`'s map rules (which ids hold rows:
    training settings, not the layout that `flowrec.runs.changes.LAYOUT_FIELDS` names)."""
    managed = new.managed if new.managed is None or old.managed is None else \
        replace(new.managed, **{f: getattr(old.managed, f) for f in MANAGED_RULES})
    return replace(new, optimizer=old.optimizer, managed=managed)


def group_differences(stored: Any, planned: Any) -> list[str]:
    """How the packed groups of `planned` (the spec's plan) differ from `stored` (the run's) in the
    weights' layout (names, dims, dtypes, rows, member tables and offsets), in words; empty when
    the run's checkpoint fits them."""
    def layout(plan):
        return {g.name: (g.dim, g.dtype, g.rows, tuple((t.table, t.rows, t.row_offset) for t in g.tables))
                for g in plan.meta.groups}

    before, after = layout(stored), layout(planned)
    if before == after:
        return []
    members = {name: ", ".join(t for t, _, _ in v[3]) for name, v in {**after, **before}.items()}
    out = [f"embedding group {n} ({members[n]}) {'not in the spec' if n not in after else 'not in the run' if n not in before else 'packed otherwise'}"
           for n in [*before, *(n for n in after if n not in before)] if before.get(n) != after.get(n)]
    return out


def optimizer_kinds(old: ModelSpec, new: ModelSpec) -> tuple[bool, set[str]]:
    """(whether the dense optimizer's kind changed, the tables whose sparse optimizer's kind changed)."""
    def sparse(spec: ModelSpec) -> dict[str, str]:
        return {t.name: (t.optimizer or spec.sparse_optimizer).name for t in spec.tables}

    before, after = sparse(old), sparse(new)
    return (old.dense_optimizer.name != new.dense_optimizer.name,
            {t for t, kind in after.items() if before.get(t, kind) != kind})


def parent_folder(path: Path) -> Path:
    """The run folder of a run folder or checkpoint file."""
    return Path(path).parent if Path(path).is_file() else Path(path)
