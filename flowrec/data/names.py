"""Names read from files, made paths only when they stay inside their folder.

A dataset's ``_flowrec.json`` names its tables and vocabulary files, an ``encoder.json`` its
vocabulary files, a package manifest its files. Those files may come from anyone: a name such
as ``../../home/u/.ssh/id_rsa`` or ``/etc/passwd`` must never make flowrec read (and copy into a
package) or write a file outside the folder. `plain_name` accepts one path component;
`inside` a relative path of plain components whose resolved location (symlinks followed) is
still inside the folder.

Example:
    >>> plain_name("user", "table")
    'user'
    >>> plain_name("../x", "table")
    Traceback (most recent call last):
    ...
    flowrec.data.layout.DataError: table '../x' is not a plain name (one file name: no slashes, no '..', no control characters)
"""
from __future__ import annotations

import re
from pathlib import Path

from flowrec.data.layout import DataError

_UNSAFE = re.compile(r"[/\\\x00-\x1f\x7f]")
MAX_NAME_CHARS = 255  # one path component on common file systems


def plain_name(name: object, what: str) -> str:
    """`name` if it is one plain path component (what a table or file name must be), else DataError."""
    if (not isinstance(name, str) or not name or name in (".", "..") or _UNSAFE.search(name)
            or len(name) > MAX_NAME_CHARS):
        raise DataError(f"{what} {str(name)[:80]!r} is not a plain name (one file name: no slashes, no '..', "
                        "no control characters)")
    return name


def inside(folder: Path, relative: object, what: str) -> Path:
    """`folder / relative` when `relative` is a relative path of plain names that resolves (symlinks
    followed) to a place inside `folder`; DataError otherwise."""
    if not isinstance(relative, str) or not relative or relative.startswith("/"):
        raise DataError(f"{what}: {str(relative)[:80]!r} is not a relative path inside {folder}")
    for part in relative.split("/"):
        plain_name(part, what)
    path = Path(folder) / relative
    try:
        root, target = Path(folder).resolve(), path.resolve()
    except (RuntimeError, OSError):  # a link loop: Python's RuntimeError (an OSError from 3.13), a traceback
        raise DataError(f"{what}: {relative!r} is a link loop (its links lead back to themselves)") from None
    if not target.is_relative_to(root):
        raise DataError(f"{what}: {relative!r} leads outside {folder} (a link?)")
    return path


MAX_FOLDERS = 100_000  # folders of a dataset walked looking for a link loop


def check_folder_links(path: Path) -> None:
    """Raise DataError when a link inside the folder `path` leads to a folder the walk has already
    been through, or to one above `path` (`loop -> .`, `up -> ..`, two links to one day): pyarrow's
    dataset discovery follows links, so a loop read every file once per level until the path was
    too long (41 times for `loop -> .`), and two loops made it run without end, its memory growing,
    deaf to SIGTERM. Links to other folders (a day partition on another disk) are followed as before.

    >>> import os, tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     os.symlink(".", os.path.join(d, "loop"))
    ...     check_folder_links(Path(d))
    Traceback (most recent call last):
    flowrec.data.layout.DataError: ...loop is a link back to a folder above it or already in the dataset (a link loop, or a second link to one folder): remove the link
    """
    import os

    root = Path(path)
    if not root.is_dir():
        return
    top = root.resolve()
    seen = {top}
    stack = [root]
    while stack and len(seen) < MAX_FOLDERS:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue  # pyarrow names an unreadable folder
        for entry in entries:
            try:
                if not entry.is_dir():
                    continue
            except OSError:
                continue
            target = Path(entry.path).resolve()
            if target in seen or top.is_relative_to(target):
                raise DataError(f"{entry.path} is a link back to a folder above it or already in the dataset (a "
                                "link loop, or a second link to one folder): remove the link")
            seen.add(target)
            stack.append(Path(entry.path))
