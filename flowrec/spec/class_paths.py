"""What `flowrec validate` can tell of a custom module's class path without running the user's code.

A `kind: custom` module names its class as `path/to/file.py:Class` (relative to the working
folder) or `package.module:Class`. Importing it runs the module's top-level code, so `flowrec
validate` never imports it (docs/spec.md); `plan` and `train` do, and say there what the class
does wrong (a constructor or forward that fails, an output of the wrong shape). Some problems need
no running, and a user who validates expects to hear of them: the file is missing, it does not
parse (Python's own parser, `ast.parse`, executes nothing), it binds no top-level name `Class`
(a `class`, `def`, assignment or import, at the top level or under a top-level `if`/`try`/`with`;
a star import or a module `__getattr__` could give anything, so they pass), or the package of a dotted path cannot be
found (`importlib.util.find_spec` of its first name, which runs no code). Each is one issue at
`modules[i].class`.

Only the file-based validation (`flowrec.spec.files`) runs these: a spec loaded elsewhere (a run's
spec.json read by eval, export or predict from another folder) is not tied to the working folder.

Example:
    >>> [str(i) for i in class_path_issues({"modules": [{"kind": "custom", "class": "nope.py:X"}]})][0][:71]
    'modules[0].class: no Python file at nope.py (relative to the working fo'
    >>> [str(i) for i in class_path_issues({"modules": [{"kind": "custom", "class": "/nope/x.py:X"}]})]
    ['modules[0].class: no Python file at /nope/x.py']
"""
from __future__ import annotations

import ast
import hashlib
import re
import importlib.util
from pathlib import Path
from typing import Any

from flowrec.spec.errors import SpecIssue
from flowrec.spec.schema_errors import did_you_mean

CLASS_PATH = r"[^:]+:[A-Za-z_][A-Za-z0-9_]*"  # the schema's pattern of `class`
RUN_SETTINGS_FILE = "run.json"  # a run's settings (flowrec.data.run_paths.RUN_FILE; the spec layer imports no runtime)
DIGESTS_KEY = "class_files"  # run.json: each absolute class file -> the sha256 of its bytes when the run ran
MAX_SOURCE_BYTES = 16 << 20  # a class file larger than this is left to the import
SHA256_HEX = r"[0-9a-fA-F]{64}"  # a sha256 as hex digits, as run.json records it


def class_path_issues(doc: Any) -> list[SpecIssue]:
    """An issue per custom module whose class path cannot import, found without running it.

    Args:
        doc: a spec document (dict); anything else, or a malformed module, gives no issue here
            (the schema reports it).

    Returns:
        `modules[i].class` issues, in module order.
    """
    modules = doc.get("modules") if isinstance(doc, dict) else None
    issues = []
    for i, module in enumerate(modules if isinstance(modules, list) else []):
        if not isinstance(module, dict) or module.get("kind") != "custom":
            continue
        path = module.get("class")
        if not isinstance(path, str) or not re.fullmatch(CLASS_PATH, path):
            continue  # the schema's one line says how to write it
        problem = _problem(*path.split(":"))
        if problem is not None:
            issues.append(SpecIssue(f"modules[{i}].class", problem))
    return issues


def _problem(source: str, name: str) -> str | None:
    if not source or not name:
        return None
    if source.endswith(".py"):
        return _file_problem(Path(source), name)
    top = source.split(".")[0]
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        found = None
    if found is None:
        return f"no module {top!r} can be imported here (for {source}:{name}; a file is written path/to/file.py:{name})"
    return None


def _file_problem(file: Path, name: str) -> str | None:
    if not file.is_file():
        where = "" if file.is_absolute() else f" (relative to the working folder {Path.cwd()})"
        return f"no Python file at {file}{where}"
    try:
        if file.stat().st_size > MAX_SOURCE_BYTES:
            return None
        tree = ast.parse(file.read_bytes(), filename=str(file))
    except SyntaxError as exc:
        return f"{file} does not parse: SyntaxError: {exc.msg} (line {exc.lineno})"
    except (OSError, ValueError) as exc:  # unreadable, or a NUL byte in the source
        return f"cannot read {file}: {getattr(exc, 'strerror', None) or exc}"
    bound, star = _top_level_names(tree.body)
    if name in bound or star or "__getattr__" in bound:  # a module __getattr__ may give any name
        return None
    shown = ", ".join(sorted(bound)[:8]) or "nothing"
    return f"{file} defines no top-level {name!r}{did_you_mean(name, bound)} (it defines {shown})"


def _top_level_names(body: list[ast.stmt]) -> tuple[set[str], bool]:
    """Names a module body binds at its top level (under if/try/with too), and whether it star-imports."""
    names: set[str] = set()
    star = False
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                star = star or alias.name == "*"
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            blocks += [h.body for h in getattr(node, "handlers", [])]
            for block in blocks:
                inner, inner_star = _top_level_names(block)
                names |= inner
                star = star or inner_star
    return names, star


def found_class_file(path: str, folders: "list[Path] | None" = None) -> str:
    """`path` (a class path) with its `file.py` written absolute: resolved in the first of `folders`
    (default: the working folder) that holds the file. A dotted path, an absolute file, or a
    relative one that no folder holds is returned as it is (importing it says what is missing).

    A run records its custom modules' files so (`absolute_class_files`), as it records its data
    paths, so that `flowrec eval RUN`, `export` and `--resume` work from any folder.

    >>> found_class_file("torch.nn:Linear")
    'torch.nn:Linear'
    """
    source, colon, name = path.rpartition(":")
    if not colon or not source.endswith(".py") or Path(source).is_absolute():
        return path
    for folder in folders if folders is not None else [Path.cwd()]:
        if (Path(folder) / source).is_file():
            return f"{(Path(folder) / source).resolve()}:{name}"
    return path


def absolute_class_files(spec: Any, folders: "list[Path] | None" = None) -> Any:
    """A `ModelSpec` whose custom modules' `file.py` class paths are absolute (`found_class_file`,
    relative paths found in `folders`, default the working folder): the spec a run records, so
    that its spec.json, plan.json and checkpoint name the file from any folder, and two spellings
    of one file (`blocks.py:X`, `./blocks.py:X`, its absolute path) are one model."""
    from dataclasses import replace

    modules = list(spec.modules)
    for i, module in enumerate(modules):
        path = module.param("class")
        if module.kind != "custom" or not isinstance(path, str):
            continue
        found = found_class_file(path, folders)
        if found != path:
            modules[i] = module.with_param("class", found)
    return replace(spec, modules=tuple(modules)) if modules != list(spec.modules) else spec


def run_class_folders(run_folder: Path) -> list[Path]:
    """Where a run that recorded a relative class file (a flowrec of before 2026-12-06, which wrote
    the path as given, relative to the folder training ran in) may find it: the working folder,
    then each folder above the run folder (a run is usually made under the folder it ran in)."""
    return [Path.cwd(), *Path(run_folder).resolve().parents]


def class_file_digests(spec: Any) -> dict[str, str]:
    """The sha256 of each custom module's absolute `file.py` (as `absolute_class_files` writes it),
    by file: what run.json records (`DIGESTS_KEY`), so that a run moved with its class file can tell
    the file it finds elsewhere is the one it trained (`run_class_files`). Unreadable files are left out."""
    digests = {}
    for module in spec.modules:
        path = module.param("class")
        source = path.rpartition(":")[0] if module.kind == "custom" and isinstance(path, str) else ""
        if source.endswith(".py") and Path(source).is_absolute():
            digest = file_digest(Path(source))
            if digest is not None:
                digests[source] = digest
    return digests


def file_digest(path: Path) -> str | None:
    """The sha256 (hex) of a file's bytes, None when it cannot be read."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def moved_file(source: Path, folders: "list[Path]") -> Path | None:
    """The file an absolute path that is gone names, looked for in `folders` in order, in each under
    the path's trailing names, the longest first (/old/work/lib/blocks.py: work/lib/blocks.py,
    lib/blocks.py, then blocks.py), or None.

    >>> moved_file(Path("/no/such/folder/nothing_here.py"), [])
    """
    parts = Path(source).parts[1:]  # the names below the root
    for folder in folders:
        for start in range(len(parts)):
            candidate = Path(folder).joinpath(*parts[start:])
            if candidate.is_file():
                return candidate.resolve()
    return None


def digests_problem(value: Any) -> str | None:
    """Why a recorded `class_files` value is no record of digests, or None: it must map each class
    file (a string) to the sha256 of its bytes (64 hex digits). `--resume` (`flowrec.runs.settings`)
    and `recorded_digests` (eval, export, --init-from) refuse the same values in the same words.

    >>> digests_problem({"/a/blocks.py": "ab" * 32}) is None, digests_problem(["/a/blocks.py"]) is None
    (True, False)
    """
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) and re.fullmatch(SHA256_HEX, v)
                                              for k, v in value.items()):
        return "must map each class file to the sha256 of its bytes (64 hex digits)"
    return None


def recorded_digests(run_folder: Path) -> dict[str, str]:
    """The class file digests RUN/run.json records (`DIGESTS_KEY`), lower case; none for a run
    without run.json or one that recorded none (a flowrec of before 2026-12-06, a model without
    class files).

    Raises:
        ValueError: run.json cannot be read, or its record is damaged (`digests_problem`): one line,
            as `--resume` says it (a check of a moved run's class file is never silently off).
    """
    from flowrec.spec.json_doc import read_json_document

    path = Path(run_folder) / RUN_SETTINGS_FILE
    if not path.is_file():
        return {}
    try:  # size- and depth-bounded, as every JSON document flowrec reads
        recorded = read_json_document(path)
    except ValueError as exc:
        raise ValueError(f"{path} is damaged ({exc}); it records the sha256 of the run's class files") from None
    if not isinstance(recorded, dict):
        raise ValueError(f"{path} is damaged (not a JSON object)")
    recorded = recorded.get(DIGESTS_KEY)
    if recorded is None:
        return {}
    problem = digests_problem(recorded)
    if problem is not None:
        raise ValueError(f"{path} is damaged: {DIGESTS_KEY} {problem}")
    return {k: v.lower() for k, v in recorded.items()}


def run_class_files(spec: Any, run_folder: Path) -> "tuple[Any, list[str]]":
    """A run's spec (its checkpoint's or spec.json) whose custom modules' class files are found from
    any folder: a relative file (a flowrec of before 2026-12-06) in `run_class_folders`; an absolute
    one that is gone (the run folder moved, its class file with it: `rsync -a runs/ other:`) by its
    trailing names (`moved_file`) in the run folder, each folder above it, then the working folder,
    checked against the digest run.json records where it records one.

    Returns:
        The spec, and one line per moved file naming the file used.

    Raises:
        ValueError: a file found in place of a gone one, or the file in place, whose bytes differ from
            the digest recorded (one line): `train --resume` of a run whose class file was edited
            since trained on other code without a word, and so did eval, export and --init-from.
    """
    from dataclasses import replace

    run = Path(run_folder).resolve()
    spec = absolute_class_files(spec, run_class_folders(run))
    digests: dict[str, str] | None = None  # run.json's record, read at the first class file met
    modules, notes, used, checked = list(spec.modules), [], {}, set()  # checked: files in place, hashed once
    for i, module in enumerate(modules):
        path = module.param("class")
        source, _, name = path.rpartition(":") if module.kind == "custom" and isinstance(path, str) else ("", "", "")
        if not source.endswith(".py") or not Path(source).is_absolute():
            continue
        if Path(source).is_file():  # in place: the file the run trained, unless it was edited since
            if source in checked:
                continue
            checked.add(source)
            digests = recorded_digests(run) if digests is None else digests
            digest = digests.get(source)
            if digest is not None and file_digest(Path(source)) != digest:
                raise ValueError(f"module {module.name!r}: its class file {source} was changed since the run "
                                 f"trained (its sha256 differs from the one {run / RUN_SETTINGS_FILE} records), "
                                 f"so the run's weights would be used by other code: put back the file the run "
                                 f"trained")
            continue
        if source not in used:
            found = moved_file(Path(source), [run, *run.parents, Path.cwd()])
            if found is None:
                continue  # importing it says that the file is gone
            digests = recorded_digests(run) if digests is None else digests
            digest = digests.get(source)
            if digest is not None and file_digest(found) != digest:
                raise ValueError(f"module {module.name!r}: its class file {source} is gone, and {found}, found in "
                                 f"its place, is not the file the run trained (its sha256 differs from the one "
                                 f"{run / RUN_SETTINGS_FILE} records): put the file the run trained there")
            checked = "the file the run trained, by its sha256" if digest else "unchecked: run.json records no digest"
            notes.append(f"module {module.name!r}: its class file {source} is gone; using {found} ({checked})")
            used[source] = found
        modules[i] = module.with_param("class", f"{used[source]}:{name}")
    return (replace(spec, modules=tuple(modules)) if used else spec), notes


def same_content_class_files(old: Any, new: Any, digests: "dict[str, str]") -> "tuple[Any, list[str]]":
    """A run's spec `old` whose custom modules name the class files of `new` (the spec given to
    `--resume` or `--init-from`) where a module of `new` names the same class of a file with the
    same content by another path (a copy of the file, the file moved): a class file is the model by
    its content (sha256) and its class, not by its path. The file the run trained is known by the
    sha256 run.json records (`digests`, by its path), else by the file as it is now; a file whose
    content differs stays another model (the line that says the model changed names both paths).

    Returns:
        The spec, and one line per module whose class file is so known by its content.
    """
    from dataclasses import replace

    given = {m.name: m.param("class") for m in new.modules if m.kind == "custom"}
    modules, notes = list(old.modules), []
    for i, module in enumerate(modules):
        ours, theirs = module.param("class"), given.get(module.name)
        if module.kind != "custom" or not isinstance(ours, str) or not isinstance(theirs, str) or ours == theirs:
            continue
        (source, _, name), (other, _, other_name) = ours.rpartition(":"), theirs.rpartition(":")
        if name != other_name or not source.endswith(".py") or not other.endswith(".py"):
            continue
        trained = digests.get(source) or file_digest(Path(source))
        if trained is None or file_digest(Path(other)) != trained:
            continue
        modules[i] = module.with_param("class", theirs)
        notes.append(f"module {module.name!r}: its class file {other} has the content of {source}, the file the run "
                     f"trained (their sha256 are equal): using {other}")
    return (replace(old, modules=tuple(modules)) if notes else old), notes
