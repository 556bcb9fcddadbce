"""The settings a run was started with (run.json): recorded at its start, restored by --resume.

A flag given again on --resume overrides the recorded value, and the user is told so; every
restored value is listed, so the printed resume command visibly continues the same run.

Example:
    >>> settings, notes = merge_settings({"epochs": None}, {"epochs": 3}, {})   # doctest: +SKIP
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flowrec.data.rowcache import parse_cache_data
from flowrec.runtime.nonfinite import NAN_POLICIES
from flowrec.spec.class_paths import DIGESTS_KEY, class_file_digests, digests_problem
from flowrec.spec.json_doc import read_json_document
from flowrec.spec.read import RUN_SETTINGS_KEYS
from flowrec.runtime.rundir import RUN_FILE, RunFolderError, write_text
from flowrec.spec.units import MAX_SEED  # seeds are 0..2^63-1 (numpy and torch generators take 64-bit seeds)

# run.json key -> the option that sets it, and its value for a new run (None: decided from the spec)
SETTINGS: dict[str, tuple[str, Any]] = {
    "data": ("--data", None),
    "eval_data": ("--eval-data", None),
    "rows": ("--rows", 400_000),
    "seed": ("--seed", None),
    "device": ("--device", "auto"),
    "device_budget": ("--device-budget", None),
    "dask": ("--dask", None),
    "cache": ("--cache", None),
    "plan": ("--plan", None),
    "profile": ("--profile", None),
    "target": ("--target", None),
    "epochs": ("--epochs", None),
    "max_steps": ("--max-steps", None),
    "eval_every": ("--eval-every", None),
    "checkpoint_every": ("--checkpoint-every", 0),
    "checkpoint_full_every": ("--checkpoint-full-every", 0),  # 0: auto (Checkpointer's AUTO)
    "interleave": ("--interleave/--no-interleave", True),
    "compile": ("--compile/--no-compile", False),
    "nan_policy": ("--nan-policy", "stop"),
    "cache_data": ("--cache-data", "auto"),
}

INT_SETTINGS = ("rows", "seed", "epochs", "max_steps", "eval_every", "checkpoint_every", "checkpoint_full_every")
KINDS: dict[str, type] = {**{k: str for k in SETTINGS}, **{k: int for k in INT_SETTINGS}, "interleave": bool,
                           "compile": bool,
                           # what run.json records beside the flags: an edited one turned the check of the
                           # data a resume reads off (train_rows "x"), or named --init-from (init_from 5)
                           "train_rows": int, "init_from": str, "fresh_optimizer": bool, "split_rule": int}
REQUIRED = RUN_SETTINGS_KEYS  # every run.json holds
# them (flowrec train and flowrec.train write them); without one, --resume would silently train
# something else (the spec's bound data instead of the run's --data, another length)
CACHE_POLICIES = ("auto", "none", "static_hot", "lookahead")
CHOICES = {"cache": CACHE_POLICIES, "nan_policy": NAN_POLICIES}


def read_run_file(folder: Path) -> dict[str, Any] | None:
    """The recorded settings of a run folder, None when it has no run.json."""
    path = Path(folder) / RUN_FILE
    if not path.is_file():
        return None
    try:
        recorded = read_json_document(path)
    except ValueError as exc:
        raise RunFolderError(f"{path} is damaged ({exc}); it records how the run was "
                             f"started, so the run cannot be resumed") from None
    if not isinstance(recorded, dict):
        raise RunFolderError(f"{path} is damaged (not a JSON object)")
    for key, value in recorded.items():
        problem = given_problem(key, value)  # the flags' bounds too: max_steps 0 would train nothing
        if problem is not None:
            raise RunFolderError(f"{path} is damaged: {key} {problem}")
    missing = [key for key in REQUIRED if key not in recorded]
    if missing:
        raise RunFolderError(f"{path} is damaged: it lacks the setting {missing[0]} ({len(missing)} of "
                             f"{len(REQUIRED)} missing), so the run cannot be resumed as it was started")
    return recorded


def setting_problem(key: str, value: Any) -> str | None:
    """Why a recorded setting cannot be used, or None (unknown keys of later versions pass)."""
    if key == DIGESTS_KEY and value is not None:  # a check of a moved run's class file, not silently off
        return digests_problem(value)
    if value is None or key not in KINDS:
        return None
    kind = KINDS[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        return f"must be a non-negative integer, not {value!r}"
    if kind is bool and not isinstance(value, bool):
        return f"must be true or false, not {value!r}"
    if kind is str and not isinstance(value, str):
        return f"must be a string, not {value!r}"
    if key in CHOICES and value not in CHOICES[key]:
        return f"must be one of {', '.join(CHOICES[key])}, not {value!r}"
    if key == "seed" and value > MAX_SEED:
        return f"must be in 0..{MAX_SEED}"
    if key == "cache_data":
        try:
            parse_cache_data(value)
        except ValueError:
            return f"must be auto, on, off or a byte size such as 2GiB, not {value!r}"
    if key == "device_budget":  # `flowrec.train(device_budget="xx")` said "not a byte size", naming no argument
        from flowrec.spec.units import parse_bytes

        try:
            parse_bytes(value)
        except ValueError:
            return f"must be a byte size such as 4GiB, not {value!r}"
    return None


# the smallest value a given setting takes (`flowrec train`'s option bounds; the API checks the same)
GIVEN_MIN = {"rows": 1, "seed": 0, "epochs": 1, "max_steps": 1, "eval_every": 0, "checkpoint_every": 0,
             "checkpoint_full_every": 0}  # 0: auto


def given_problem(key: str, value: Any) -> str | None:
    """Why a value given for a new run (an API argument) cannot be used, or None: the recorded
    settings' kinds and choices, and the command line's bounds (no bool for a number)."""
    problem = setting_problem(key, value)
    if problem is None and key in GIVEN_MIN and value is not None and value < GIVEN_MIN[key]:
        problem = f"must be at least {GIVEN_MIN[key]}, not {value!r}"
    return problem


PATH_SETTINGS = ("data", "eval_data", "plan", "profile", "init_from")  # recorded absolute (see below)


def write_run_file(folder: Path, settings: dict[str, Any], spec: Any = None) -> None:
    """Record a run's settings in FOLDER/run.json. A path given relative to the working folder
    is recorded absolute, so `--resume`, `flowrec eval RUN` and `flowrec export` find the run's
    data from any folder (the settings dict itself is left as given). With the run's `spec`, the
    sha256 of each custom module's class file is recorded too (`class_files`), so that a run moved
    with its file checks the file it finds in its new place (`flowrec.spec.class_paths.run_class_files`)."""
    recorded = dict(settings)
    digests = class_file_digests(spec) if spec is not None else {}
    if digests:
        recorded[DIGESTS_KEY] = digests
    for key in PATH_SETTINGS:
        value = recorded.get(key)
        if isinstance(value, str) and value and not Path(value).is_absolute() and Path(value).exists():
            recorded[key] = str(Path(value).resolve())
    write_text(Path(folder) / RUN_FILE, json.dumps(recorded, indent=2, sort_keys=True) + "\n")


def lost_relative_path(folder: Path, recorded: dict[str, Any] | None, key: str, how: str | None = None) -> str | None:
    """Why a path setting of RUN/run.json cannot be found, or None: a relative path, which only a
    flowrec of before 2026-11-29 recorded (relative to the folder it was run from; paths are
    recorded absolute since), that names nothing in the working folder. `how`: the way to give the
    path instead (default: the setting's flag with its path). Without this, such a run read 'its
    data data_ml is gone' from elsewhere, though the data was where it had been.

    >>> lost_relative_path(Path("runs/a"), {"data": "no/such/data"}, "data")  # doctest: +ELLIPSIS
    'runs/a/run.json records --data no/such/data relative to the folder ... or give --data with its path'
    """
    value = (recorded or {}).get(key)
    if key not in PATH_SETTINGS or not isinstance(value, str) or not value or Path(value).is_absolute():
        return None
    if Path(value).exists():
        return None
    flag = SETTINGS[key][0] if key in SETTINGS else "--" + key.replace("_", "-")
    return (f"{Path(folder) / RUN_FILE} records {flag} {value} relative to the folder the run was started from "
            f"(an older flowrec recorded paths so; they are recorded absolute now), and {value} is not in the "
            f"working folder: run the command from that folder, or give {how or flag + ' with its path'}")


def merge_settings(given: dict[str, Any], recorded: dict[str, Any] | None,
                   spec_defaults: dict[str, Any], bound_data: bool = False) -> tuple[dict[str, Any], list[str]]:
    """The run's settings: a given flag, else the recorded value, else the default.

    Args:
        given: option values from the command line (None: not given).
        recorded: run.json of the run being resumed (None: a new run).
        spec_defaults: defaults that come from the spec (epochs, eval_every).
        bound_data: the spec binds its data, so a run without --data trains on it, not on
            synthetic rows.

    Returns:
        (settings, notes): notes say what was restored and which flags override the record.
    """
    settings, restored, overridden = {}, [], []
    for key, (flag, default) in SETTINGS.items():
        value = given.get(key)
        if recorded is not None and key in recorded:
            if value is None:
                value = recorded[key]
                if value is not None:
                    restored.append(_described(flag, value))
            elif not same_setting(key, value, recorded[key]):
                was = (_described(flag, recorded[key]) if recorded[key] is not None
                       else f"default (it was started without {flag.split('/')[0]})")
                overridden.append(f"{_described(flag, value)} overrides the run's {was}")
        if value is None:
            value = spec_defaults.get(key, default)
        settings[key] = value
    ignored = None
    if settings["data"] or bound_data:  # real data: the synthetic row count is recorded, not used
        flag = SETTINGS["rows"][0]
        restored = [note for note in restored if not note.startswith(f"{flag} ")]
        if given.get("rows") is not None:  # trained on all the data's rows, not on --rows of them
            overridden = [note for note in overridden if not note.startswith(f"{flag} ")]
            data = f"--data {settings['data']}" if settings["data"] else "the data the spec binds"
            ignored = (f"{flag} {given['rows']} is ignored: it sets the rows of synthetic data, and this run trains "
                       f"on every row of {data} (--max-steps N stops it sooner)")
    elif given.get("dask") is not None:  # synthetic rows are made in memory: there are no partitions to read
        ignored = (f"{SETTINGS['dask'][0]} {given['dask']} is ignored: it reads the partitions of a dataset, and "
                   f"this run trains on synthetic rows made in memory (give --data DIR to read one through Dask)")
    notes = []
    if restored:
        notes.append("restored from run.json: " + ", ".join(restored))
    notes.extend(overridden)
    if ignored is not None:
        notes.append(ignored)
    return settings, notes


def recorded_train_rows(given: dict[str, Any], recorded: dict[str, Any] | None, synthetic: bool) -> int | None:
    """The rows of training data a resumed run started on (run.json's `train_rows`, written by
    `flowrec train` once its data is read), to check that the data it goes on with is that data;
    None when run.json has none (a run of before) or --data (or --rows, for `synthetic` rows) given
    again names other data.

    Example:
        >>> recorded_train_rows({"data": None, "rows": 9}, {"data": "/d", "rows": 400000, "train_rows": 5000}, False)
        5000
    """
    rows = (recorded or {}).get("train_rows")
    if not isinstance(rows, int) or isinstance(rows, bool):
        return None
    for key in ("data", "rows") if synthetic else ("data",):
        value = given.get(key)
        if value is not None and value != recorded.get(key) and not _same_path(key, value, recorded.get(key)):
            return None
    return rows


PLAN_FLAGS = (("plan", "--plan"), ("device_budget", "--device-budget"), ("cache", "--cache"),
              ("profile", "--profile"), ("target", "--target"))  # settings that make the plan a run starts with


def same_setting(key: str, given: Any, recorded: Any) -> bool:
    """A setting given again as recorded (a path relative where run.json holds it absolute)."""
    return given == recorded or _same_path(key, given, recorded) or _same_bytes(key, given, recorded)


def _same_bytes(key: str, given: Any, recorded: Any) -> bool:
    """A byte size given again in another spelling (`--device-budget 1024MiB` for a run recorded
    with 1GiB) is no change (it was refused on --resume as a new plan flag)."""
    from flowrec.spec.units import parse_bytes

    if key != "device_budget" or not isinstance(given, str) or not isinstance(recorded, str):
        return False
    try:
        return parse_bytes(given) == parse_bytes(recorded)
    except ValueError:
        return False


def _same_path(key: str, given: Any, recorded: Any) -> bool:
    """A path setting given again, relative where run.json holds it absolute, is no override."""
    if key not in PATH_SETTINGS or not isinstance(given, str) or not isinstance(recorded, str):
        return False
    return Path(given).resolve() == Path(recorded).resolve()


def _described(flag: str, value: Any) -> str:
    """`--epochs 3`, or `--no-interleave` for a switch."""
    if "/" in flag:
        on, off = flag.split("/")
        return on if value else off
    if flag == "--checkpoint-full-every" and value == 0:
        return f"{flag} auto"
    return f"{flag} {value}"
