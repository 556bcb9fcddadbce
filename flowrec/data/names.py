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
    root = Path(folder).resolve()
    if not path.resolve().is_relative_to(root):
        raise DataError(f"{what}: {relative!r} leads outside {folder} (a link?)")
    return path
