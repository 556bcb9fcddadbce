"""Which partitions already passed the data checks, so each part file is checked once, not per epoch.

Checking a partition (`flowrec.data.checks`) is one pass over every column, about as costly as a
tenth of staging it; done every epoch it would cost several percent of staging throughput. So a
source remembers the partitions that passed, per set of rules (`rules_key`): in memory for the
life of the source, and for a Parquet dataset also in ``_flowrec_checked.json`` in its folder, so
later runs on the same files skip the pass as well.

A part file is known by its fingerprint: its size, its modification time (ns) and a SHA-256 of
its Parquet footer (which holds the offsets, sizes and statistics of every column chunk, so a
rewritten file gets another one). A file whose fingerprint differs from the record is checked
again. The record is written atomically (temp file, then rename) and only as a cache: when the
folder is read-only or the record is unreadable, the partitions are simply checked again.

Example:
    >>> record = CheckRecord(Path("data/criteo"), files)  # doctest: +SKIP
    >>> record.passed(0, key) or record.add(0, key)  # doctest: +SKIP
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from flowrec.spec.json_doc import read_json_document
from typing import Sequence

from flowrec.data.checks import ColumnRule

RECORD_FILE = "_flowrec_checked.json"
RECORD_FORMAT = "flowrec-checked"
FOOTER_TAIL = 8  # bytes: footer length (4, little endian) + b"PAR1"
SAVE_EVERY = 64  # newly passed partitions between two saves (and when every partition passed)


def rules_key(rules: Sequence[ColumnRule]) -> str:
    """A short hash of what was checked (columns, kinds, table rows)."""
    return hashlib.sha256(repr(tuple(rules)).encode()).hexdigest()[:16]


def fingerprint(path: str | Path) -> str:
    """size:mtime_ns:sha256(footer) of a Parquet file ("" when it cannot be read)."""
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            if st.st_size < FOOTER_TAIL:
                return ""
            fh.seek(-FOOTER_TAIL, os.SEEK_END)
            tail = fh.read(FOOTER_TAIL)
            length = int.from_bytes(tail[:4], "little")
            if tail[4:] != b"PAR1" or length > st.st_size - FOOTER_TAIL:
                return ""
            fh.seek(-FOOTER_TAIL - length, os.SEEK_END)
            footer = hashlib.sha256(fh.read(length)).hexdigest()[:32]
    except OSError:
        return ""
    return f"{st.st_size}:{st.st_mtime_ns}:{footer}"


class CheckRecord:
    """Partitions (part files) of a dataset folder that passed the checks, per rules key.

    Args:
        folder: the dataset folder (holds the record file).
        files: its part files, in partition order.
    """

    def __init__(self, folder: Path, files: Sequence[str]):
        self.path = Path(folder) / RECORD_FILE
        self.files = [str(f) for f in files]
        self._names = [os.path.relpath(f, folder) for f in self.files]
        self._lock = threading.Lock()
        self._saved: dict[str, dict[str, list[str]]] = self._load()
        self._passed: dict[str, set[int]] = {}  # rules key -> partitions
        self._unsaved = 0

    def _load(self) -> dict[str, dict[str, list[str]]]:
        try:
            doc = read_json_document(self.path)
        except (OSError, ValueError):
            return {}
        parts = doc.get("parts") if isinstance(doc, dict) and doc.get("format") == RECORD_FORMAT else None
        return parts if isinstance(parts, dict) else {}

    def passed(self, index: int, key: str) -> bool:
        """True if partition `index` passed the checks of `key`, in this process or recorded for
        its current fingerprint."""
        with self._lock:
            if index in self._passed.get(key, ()):
                return True
            entry = self._saved.get(self._names[index])
        if not isinstance(entry, dict) or key not in entry.get("rules", ()):
            return False
        if entry.get("fingerprint") != fingerprint(self.files[index]) or not entry["fingerprint"]:
            return False
        with self._lock:
            self._passed.setdefault(key, set()).add(index)
        return True

    def forget(self, index: int) -> None:
        """Forget that partition `index` passed in this process (its file changed): `passed` then
        asks the saved record, whose fingerprint no longer matches, so it is checked again."""
        with self._lock:
            for passed in self._passed.values():
                passed.discard(index)

    def add(self, index: int, key: str) -> None:
        """Remember that partition `index` passed the checks of `key`; the record is saved every
        SAVE_EVERY new partitions and once all partitions passed `key`."""
        current = fingerprint(self.files[index])
        with self._lock:
            self._passed.setdefault(key, set()).add(index)
            if not current:
                return
            entry = self._saved.get(self._names[index])
            same = isinstance(entry, dict) and entry.get("fingerprint") == current
            rules = entry.get("rules", []) if same else []
            self._saved[self._names[index]] = {"fingerprint": current, "rules": sorted({*rules, key})}
            self._unsaved += 1
            done = len(self._passed[key]) == len(self.files)
            due = self._unsaved >= SAVE_EVERY or done
        if due:
            self.save()

    def save(self) -> None:
        """Write the record atomically; a folder that cannot be written keeps no record."""
        with self._lock:
            if not self._unsaved:
                return
            doc = json.dumps({"format": RECORD_FORMAT, "version": 1, "parts": self._saved}, sort_keys=True)
            self._unsaved = 0
        from flowrec.data.output_guard import atomic_output

        try:  # a temp file named with this process and machine, as every output's: the next save
            # removes one that a kill -9 left (`remove_leftovers`), where `._flowrec_checked.json.PID-X`
            # stayed in the dataset folder for good
            with atomic_output(self.path) as tmp:
                tmp.write_text(doc + "\n")
        except OSError:
            return

