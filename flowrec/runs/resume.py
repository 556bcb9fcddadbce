"""Resuming a run where it stopped, the same checks for `flowrec train --resume RUN` and
`flowrec.train(spec, resume=RUN)`: the seed it keeps, the spec it was trained with, the plan it
trains (its checkpoint's), the data and device it recorded, and whether it is finished already.

Each check raises `RunError` (one line) and prints nothing; its words name the caller's options,
the command line's flags (`--seed 3`) or the Python call's arguments (`seed=3`): `python=True`.

Example:
    >>> option("max_steps", python=False), option("max_steps", python=True)
    ('--max-steps', 'max_steps=')
    >>> given("data", "/d", python=False), given("data", "/d", python=True)
    ('--data /d', "data='/d'")
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from flowrec.runs.errors import RunError


def option(key: str, python: bool) -> str:
    """An option as the caller names it: `--eval-data` on the command line, `eval_data=` in Python."""
    return f"{key}=" if python else "--" + key.replace("_", "-")


def given(key: str, value: Any, python: bool) -> str:
    """An option with its value as the caller writes it: `--seed 3`, `seed=3`."""
    return f"{key}={value!r}" if python else f"{option(key, False)} {value}"


def seed_problem(seed: int | None, state: dict[str, Any], folder: Path, python: bool = False) -> str | None:
    """Why a resumed run cannot take `seed` (another seed than it was trained with: its data order,
    synthetic rows and dropout follow from it), or None."""
    if seed is None:
        return None
    try:
        trained = json.loads(state["spec"])["training"]["seed"]
    except (ValueError, TypeError, KeyError):
        return None  # the spec check names a damaged record
    if seed == trained:
        return None
    return (f"{given('seed', seed, python)} differs from the seed the run in {folder} was trained with ({trained}); "
            f"a resumed run keeps its seed: leave {option('seed', python)} out, or start a new run "
            f"(another {option('out', python)}) with it")


def spec_changed_line(spec_path: Path | str, folder: Path, state: dict[str, Any], spec: Any,
                      python: bool = False) -> str:
    """The one line refusing to resume a run with a spec that differs outside the model (its seed,
    epochs, schedule, evaluation, description...): what differs, and the option that does it where one does."""
    from flowrec.runs.changes import document_differences, listed
    from flowrec.spec.load import to_dict
    from flowrec.spec.model import identity_doc

    line = f"{spec_path} differs from the spec the run in {folder} was trained with"
    try:
        found = document_differences(identity_doc(json.loads(state["spec"])), identity_doc(to_dict(spec)))
    except (ValueError, TypeError):
        found = []
    if found:
        line += f": {listed(found)}"
    flags = [option(key, python) for key in ("epochs", "eval_every")
             if any(f.startswith(f"training.{key} ") for f in found)]
    where = "to flowrec.train" if python else "on the command line"
    hint = f"; to change that, keep the spec as it was and give {' and '.join(flags)} {where}" if flags else ""
    return f"{line} (see {folder}/spec.json){hint}"


def plan_options_problem(given_settings: dict[str, Any], recorded: dict[str, Any] | None,
                         parent: Path | str | None, python: bool = False) -> str | None:
    """A run resumed from its checkpoint (`recorded`: its run.json) trains the plan it was trained
    with, one started from a `parent` run trains the parent's: an option that makes a plan would
    change nothing. The line naming them, or None; on resume, an option given as recorded is no change."""
    from flowrec.runs.settings import PLAN_FLAGS, same_setting

    if recorded is None and parent is None:
        return None
    flags = [flag if not python else option(key, True) for key, flag in PLAN_FLAGS
             if given_settings.get(key) is not None
             and not (recorded is not None and same_setting(key, given_settings[key], recorded.get(key)))]
    if not flags:
        return None
    them = 'it' if len(flags) == 1 else 'them'
    if recorded is not None:
        return (f"{option('resume', python)} continues the run with the plan it was trained with (its plan.json): "
                f"{', '.join(flags)} would not change it; leave {them} out, or start a new run")
    return (f"--init-from {parent} trains that run's plan: {', '.join(flags)} would not change it; leave "
            f"{them} out, or start a new run without --init-from")


def recorded_data_problem(given_settings: dict[str, Any], settings: dict[str, Any], folder: Path,
                          python: bool = False) -> str | None:
    """Why a resumed run cannot read the data or evaluation data its run.json records (gone: moved
    or removed, where the caller did not give it again), or None."""
    for key in ("data", "eval_data"):
        if given_settings.get(key) is None and settings.get(key) and not Path(settings[key]).exists():
            return (f"{folder} was trained with {given(key, settings[key], python)}, which is gone (moved or "
                    f"removed): give {given(key, 'DIR', False) if not python else option(key, True) + 'DIR'}, "
                    f"that dataset where it is now")
    return None


def resumed_device(given_device: str | None, spec: Any, settings: dict[str, Any], folder: Path,
                   python: bool = False) -> Any:
    """The device a resumed run goes on training on. One its run.json records that this machine
    cannot give (a run trained on a GPU machine, resumed on another) is refused naming the run's
    record, not an option the caller never gave."""
    from flowrec.runs.plan import device_for_run

    try:
        return device_for_run(spec, settings["device"] or "auto")
    except RunError as exc:
        recorded = settings.get("device")
        if given_device is not None or recorded in (None, "auto"):
            raise
        # (in Python device="auto" is the default, which keeps the run's recorded device: "cpu" alone goes on)
        cpu = 'device="cpu"' if python else "--device cpu or auto"
        raise RunError(f"{folder} was trained with {given('device', recorded, python)} (its run.json records it), "
                       f"which this machine cannot give; give {cpu} to continue it here (`flowrec doctor` "
                       f"shows the devices it finds)", exc.code) from None


def stream_folder_problem(folder: Path, spec_word: str) -> str | None:
    """Why `folder` cannot be resumed as a run: a `--follow` stream folder (each day a run of its own,
    no checkpoint of its own), continued by the command that follows it; None for any other folder.
    `spec_word`: the spec as the command line writes it."""
    from flowrec.data.owners import is_stream_folder
    from flowrec.runtime.messages import shell_word

    if not is_stream_folder(folder):
        return None
    return (f"{folder} is a --follow stream folder: continue it with the command that follows it, "
            f"flowrec train {spec_word} --follow DAYS --out {shell_word(str(folder))} (it resumes a day cut short)")


def older_split_problem(spec: Any, folder: Path, python: bool = False) -> str | None:
    """Why a run of an older flowrec (its run.json records no `train_rows`, written since 2026-12-05) on
    its spec's bound data split by a seed, whose RUN/data is gone, cannot go on, or None: encoding that
    data again may split it otherwise than the older flowrec did (`flowrec.data.convert.SPLIT_RULE`),
    so the checkpoint's epoch and batch would go on in other rows and its evaluations score rows it
    trained on, without a word."""
    from flowrec.data.convert import seeded_split
    from flowrec.data.layout import META_FILE

    data = folder / "data"
    if (data / META_FILE).is_file() or (data / "train" / META_FILE).is_file():
        return None  # its encoding is there: resumed as it is (a lost part is named when it is read)
    if not seeded_split(dict(spec.data.options)):
        return None  # no seeded split: encoding the data again gives the same rows
    from flowrec.runs.folder import out_again

    return (f"{data} is gone, and the run in {folder} was trained by a flowrec of before 2026-12-05 (its run.json "
            f"records no train_rows) on the spec's data split into train and test by a seed, which this flowrec "
            f"splits otherwise: encoding it again would continue the run on other rows and evaluate it on rows it "
            f"trained on; put {data} back, or start over with {out_again(folder, python)}")


def split_since_problem(data: Path, folder: Path, python: bool = False) -> str | None:
    """Why a run of a flowrec of before 2026-12-05 (no `train_rows` in its run.json) cannot go on with
    its data folder, split since by this flowrec (its record names the split rule, written since
    2026-12-06), or None: the folder was converted again after the run started, with another draw of
    the test rows, so the run would go on in other rows and evaluate on rows it trained on."""
    from flowrec.data.layout import META_FILE
    from flowrec.runs.recorded import resplit_since_start

    split = resplit_since_start(folder, data)
    if split is None:
        return None
    new = "out=NEW" if python else "--out NEW"
    return (f"{data} was converted again since the run in {folder} started: its train/test split is this "
            f"flowrec's (its train/{META_FILE} names split rule {split.get('split_rule')}), and the flowrec of "
            f"before 2026-12-05 that trained the run (its run.json records no train_rows) drew the test rows "
            f"otherwise, so the run would go on in other rows and evaluate on rows it trained on; put the data it "
            f"trained on back, or start a new run on this data ({new})")


def changed_data_line(settings: dict[str, Any], rows: int, folder: Path, state: dict[str, Any],
                      python: bool = False) -> str:
    """The line refusing a resumed run whose training data holds other rows than it started on."""
    data, at = settings["data"] or "the spec's data", state.get("position") or {}
    new = (f"`flowrec train SPEC --init-from {folder} --out NEW`" if python else f"--init-from {folder} --out NEW")
    return (f"the training data of the run in {folder} changed since it started: {data} holds {rows:,} rows, the "
            f"run started on {settings['train_rows']:,} (its checkpoint's position, epoch {at.get('epoch')} batch "
            f"{at.get('batch')}, is a place in those); put that data back to continue, or train on this data in a "
            f"new run from this one: {new}")


def finished_line(folder: Path, pos: Any, epochs: int, settings: dict[str, Any], stopper: Any = None,
                  python: bool = False) -> str:
    """The line of a run at its end: `pos` its position, `epochs` those it trains, `stopper` its
    early stopper (None without early stopping)."""
    if stopper is not None and stopper.state.stopped:
        return (f"{folder} stopped early at step {pos.step} ({stopper.watched} did not improve); "
                f"its best checkpoint (step {stopper.state.best_step}) is in {folder / 'best'}")
    limit = (f", {given('max_steps', settings['max_steps'], python)}" if settings["max_steps"] is not None else "")
    # the limit it reached is the one to raise: a larger --epochs alone trained nothing past --max-steps
    by_steps = settings["max_steps"] is not None and pos.step >= settings["max_steps"]
    by_epochs = pos.epoch >= epochs
    raise_ = " and ".join(option(key, python) for key, reached in (("epochs", by_epochs), ("max_steps", by_steps))
                          if reached)
    either = f"{option('epochs', python)} or {option('max_steps', python)}"
    return (f"{folder} is finished: step {pos.step}, epoch {pos.epoch} of {epochs}{limit}; "
            f"nothing to train (give a larger {raise_ or either} to train further)")


def finished_from_checkpoint(state: dict[str, Any], spec: Any, plan: Any, settings: dict[str, Any],
                             folder: Path) -> Any:
    """The `FinishedRun` of a resumed run whose checkpoint shows it at its end (`flowrec.runs.finished`:
    its position and its fit to the model, checked on the meta device), its mapped tensors released;
    None where the run must be loaded to tell (a checkpoint that does not fit says so there)."""
    from flowrec.planner.contract import PlanError, resharded
    from flowrec.runs.finished import finished_run
    from flowrec.runtime.checkpoint.store import CHECKPOINT_NAME

    if plan.meta.world_size != 1:  # a run of N ranks told on one process's model
        try:
            plan = resharded(plan, spec, 1)
        except PlanError:
            return None
    done = finished_run(state, spec, plan, settings, folder / CHECKPOINT_NAME)
    if done is not None:
        state.clear()  # release the checkpoint's (memory-mapped) tensors
    return done


def stored_run_plan(state: dict[str, Any], folder: Path, spec: Any, starting_from: bool = False,
                    note: Callable[[str], None] = lambda _: None, python: bool = False) -> Any:
    """The plan a run was trained with (its checkpoint's), checked against the spec's model; a
    changed model is a `RunError` naming the managed settings that differ (`flowrec.runs.changes`).
    `starting_from`: the run is --init-from's, not a resume's."""
    from dataclasses import replace

    from flowrec.graph.plan_io import model_fingerprint as model_id, with_class_files
    from flowrec.runs.changes import changed_model_line
    from flowrec.runtime.checkpoint.store import CheckpointError
    from flowrec.serving.trained import stored_plan

    try:
        stored = stored_plan(state, str(folder / "checkpoint.pt"))
    except CheckpointError as exc:
        raise RunError(str(exc), cause=exc) from None
    if stored.spec_fingerprint != model_id(spec) and not same_class_files(state, folder, spec, note=note):
        raise RunError(changed_model_line(str(folder), state, spec, starting_from, python))
    # the plan goes on naming the spec's class files (not an older run's relative ones), with its fingerprint
    return replace(with_class_files(stored, spec), spec_fingerprint=model_id(spec))


def same_class_files(state: dict[str, Any], folder: Path, spec: Any, whole: bool = False,
                     note: Callable[[str], None] = lambda _: None) -> bool:
    """The run's model (`whole`: its whole spec) is the spec's once the run's custom class files are
    resolved where the run finds them (`run_class_files`: a relative one, as a flowrec of before
    2026-12-06 recorded them, or an absolute one gone with the moved run): the same file written
    otherwise (`./blocks.py:X`, its absolute path, its new place) is the same model, and so is a file
    of the same content by another path (a copy: `same_content_class_files`, said by `note`). A file
    found in place of a gone one that is not the file the run trained is a `RunError`."""
    from flowrec.graph.plan_io import model_fingerprint as model_id
    from flowrec.spec.load import to_dict
    from flowrec.spec.model import identity_doc

    old, notes = run_spec_class_files(state, folder, spec)
    if old is None or not any(m.kind == "custom" for m in old.modules):
        return False
    if whole:  # the notes were said once, by the model's check before it
        return identity_doc(to_dict(old)) == identity_doc(to_dict(spec))
    for line in notes:
        note(line)
    return model_id(old) == model_id(spec)


def spec_matches_run(state: dict[str, Any], folder: Path, spec: Any) -> bool:
    """Whether `spec` is the spec the run in `folder` was trained with (its checkpoint's), outside
    what a resume may change (`identity_doc`), its custom class files resolved as the run finds them."""
    from flowrec.spec.load import to_dict
    from flowrec.spec.model import identity_doc

    return identity_doc(json.loads(state["spec"])) == identity_doc(to_dict(spec)) \
        or same_class_files(state, folder, spec, whole=True)


def run_spec_class_files(state: dict[str, Any], folder: Path, spec: Any) -> tuple[Any, list[str]]:
    """The run's recorded spec (None where it recorded none) with its custom class files resolved
    as `same_class_files` says, and the notes saying so."""
    from flowrec.runs.changes import recorded_spec
    from flowrec.runtime.rundir import run_folder_of
    from flowrec.spec.class_paths import recorded_digests, run_class_files, same_content_class_files

    old = recorded_spec(state)
    if old is None or not any(m.kind == "custom" for m in old.modules):
        return old, []
    try:
        run = run_folder_of(folder)  # --init-from may name a checkpoint file
        old = run_class_files(old, run)[0]
        # a copy of the class file, or the file moved, with the content the run trained is the same model
        return same_content_class_files(old, spec, recorded_digests(run))
    except ValueError as exc:
        raise RunError(str(exc)) from None



def finished_looking_read_only(folder: Path, given_settings: dict[str, Any], spec: Any) -> bool:
    """Whether `folder` is a run folder this process cannot write (an archived run, a read-only mount,
    whose lock cannot be made there) holding a run whose checkpoint looks finished (`looks_finished`):
    one a resume may tell finished without the lock, writing nothing (nobody writes in a read-only
    folder meanwhile). False where the folder is writable or holds no run.json: the lock's line stands."""
    import os

    from flowrec.runs.finished import looks_finished
    from flowrec.runtime.rundir import RUN_FILE

    return (not os.access(folder, os.W_OK) and (folder / RUN_FILE).is_file()
            and looks_finished(folder, given_settings, spec))

def init_from_unstarted_line(folder: Path, parent: str, python: bool) -> str:
    """The refusal of a resume of a run started from another (`--init-from`) that stopped before its
    first checkpoint: it has nothing of its own to go on from, and only `flowrec train --resume`
    starts it from that run again (`flowrec.train` takes no init_from=: `python` says so).

    >>> init_from_unstarted_line(Path("runs/b"), "runs/a", python=False)
    'runs/b was started from the run in runs/a and stopped before its first checkpoint: start it again with `flowrec train SPEC --resume runs/b`, which starts it from that run again'
    >>> init_from_unstarted_line(Path("runs/b"), "runs/a", python=True)
    "resume='runs/b': that run was started from the run in runs/a (`flowrec train --init-from`) and stopped before its first checkpoint, so it has nothing of its own to continue, and flowrec.train does not start a run from another (it takes no init_from=); start it again from that run on the command line: `flowrec train SPEC --resume runs/b`"
    """
    if not python:
        return (f"{folder} was started from the run in {parent} and stopped before its first checkpoint: start it "
                f"again with `flowrec train SPEC --resume {folder}`, which starts it from that run again")
    return (f"resume={str(folder)!r}: that run was started from the run in {parent} (`flowrec train --init-from`) "
            "and stopped before its first checkpoint, so it has nothing of its own to continue, and flowrec.train "
            "does not start a run from another (it takes no init_from=); start it again from that run on the "
            f"command line: `flowrec train SPEC --resume {folder}`")


@dataclass
class Resumption:
    """A run to go on with, read from its folder (`read_resumption`): its settings (run.json's, given
    options over them), its checkpoint (None: the run was stopped before its first one, and starts again
    from step 0 with its recorded settings), the plan it trains (None without a checkpoint: planned
    anew), `finished` (a `FinishedRun`) where the checkpoint shows it at its end already, and its
    run.json as read (`recorded`, None where the run has none)."""

    folder: Path
    spec: Any
    settings: dict[str, Any]
    state: dict[str, Any] | None
    plan: Any = None
    finished: Any = None
    recorded: dict[str, Any] | None = None


def read_resumption(folder: Path, given_settings: dict[str, Any], spec: Any, spec_label: str,
                    python: bool = True) -> Resumption:
    """The run in `folder` (claimed by this process: `claim_run_folder`), checked to go on with
    `spec` in one process: its run.json and checkpoint read, the options that cannot change a resumed
    run (the plan's, another seed, another spec) refused, its plan the checkpoint's (resharded for one
    process where a run of N ranks saved it). Raises `RunFolderError` or `CheckpointError` for a
    damaged run.json or checkpoint, `RunError` (one line) for the rest; nothing is written."""
    from dataclasses import replace

    from flowrec.planner.contract import PlanError, resharded
    from flowrec.runs.settings import lost_relative_path, read_run_file, recorded_train_rows, same_setting
    from flowrec.runs.start import run_settings
    from flowrec.runtime.checkpoint.store import CHECKPOINT_NAME, load_checkpoint

    recorded = read_run_file(folder)
    state = load_checkpoint(folder / CHECKPOINT_NAME, mmap=True) if (folder / CHECKPOINT_NAME).is_file() else None
    for key in ("data", "eval_data"):
        if given_settings.get(key) is None and (problem := lost_relative_path(folder, recorded, key,
                                                                               option(key, python) + "PATH")):
            raise RunError(problem)
    if state is None and (recorded or {}).get("init_from"):
        raise RunError(init_from_unstarted_line(folder, recorded["init_from"], python))
    if (problem := plan_options_problem(given_settings, recorded if state is not None else None, None, python)):
        raise RunError(problem)
    settings, _ = run_settings(given_settings, spec, recorded, None, bool((recorded or {}).get("fresh_optimizer")))
    if settings["cache"] is not None:
        spec = replace(spec, plan=replace(spec.plan, cache=settings["cache"]))
    if state is None:
        if (problem := recorded_data_problem(given_settings, settings, folder, python)) is not None:
            raise RunError(problem)
        return Resumption(folder, spec, settings, None, recorded=recorded)
    if (problem := seed_problem(settings["seed"], state, folder, python)) is not None:
        raise RunError(problem)
    bound = spec.data is not None and spec.data.bound
    settings["train_rows"] = recorded_train_rows(given_settings, recorded, not settings["data"] and not bound)
    if "train_rows" not in (recorded or {}):  # a run of before 2026-12-05: its data must be the rows it trained
        problem = None
        if bound and not settings["data"]:
            problem = older_split_problem(spec, folder, python)
        elif settings["data"] and same_setting("data", settings["data"], (recorded or {}).get("data")):
            problem = split_since_problem(Path(settings["data"]), folder, python)
        if problem is not None:
            raise RunError(problem)
    plan = stored_run_plan(state, folder, spec, python=python)
    if plan.meta.world_size != 1:  # a run of N ranks (`--nproc N`) goes on in this one process
        try:
            plan = resharded(plan, spec, 1)
        except PlanError as exc:
            raise RunError(str(exc)) from None
    trained = spec if settings["seed"] is None else replace(spec, training=replace(spec.training,
                                                                                     seed=settings["seed"]))
    if not spec_matches_run(state, folder, trained):
        raise RunError(spec_changed_line(spec_label, folder, state, trained, python))
    finished = finished_from_checkpoint(state, spec, plan, settings, folder)
    if finished is None and (problem := recorded_data_problem(given_settings, settings, folder, python)):
        raise RunError(problem)
    return Resumption(folder, spec, settings, state, plan, finished, recorded)
