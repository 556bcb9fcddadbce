"""A linear pre-scan of JSON text: nesting depth, duplicate keys and NaN / Infinity, with lines.

Python's JSON parser accepts NaN and Infinity, keeps the last of duplicate keys and recurses once
per nesting level; this scan finds all three, by line, before (depth) or after (the rest) parsing.
It never fails: text that is not JSON is left to the parser to report.

Example:
    >>> scan_json('{"a": 1,\\n "a": NaN}', max_depth=64).problems
    ["line 2: duplicate key 'a' (first at line 1)", 'line 2: NaN is not a JSON number (JSON has no NaN or Infinity)']
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

CONSTANTS = ("NaN", "Infinity", "-Infinity")
MAX_KEY_CHARS = 40  # longest key quoted back in a message
_TOKEN = re.compile(  # the tokens the scan reads; what lies between them (numbers, words, ',', ':',
    # spaces) is skipped by the regular expression, not a token each (a 1,000-field model.json's
    # scan took 0.9 s of a package's load, most of it in the loop over such tokens)
    r'(?P<string>"[^"\\]*(?:\\.[^"\\]*)*")(?P<colon>\s*:)?'  # a string; a key when a ':' follows
    r"|(?P<open>[{\[])|(?P<close>[}\]])"
    r'|(?<![^\s{}\[\]:,"])(?P<word>NaN|Infinity|-Infinity)(?![^\s{}\[\]:,"])',  # a whole word, a constant
    re.DOTALL,
)


@dataclass
class JsonScan:
    """What the scan found.

    Args:
        too_deep: the line where nesting first exceeds the limit (None: within it).
        problems: one line per duplicate key and per NaN / Infinity literal.
        constants: how many NaN / Infinity literals were found.
    """

    too_deep: int | None = None
    problems: list[str] = field(default_factory=list)
    constants: int = 0


def scan_json(text: str, max_depth: int) -> JsonScan:
    """Scan `text` once; stop at the first nesting level beyond `max_depth`."""
    scan = JsonScan()
    stack: list[dict[str, int] | None] = []  # per open container: keys seen (object) or None (array)
    line, at = 1, 0
    for m in _TOKEN.finditer(text):
        line += text.count("\n", at, m.start())  # (the line of the token's start)
        at = m.start()
        kind = m.lastgroup if m.lastgroup != "colon" else "string"
        token = m.group(kind)
        if kind == "open":
            stack.append({} if token == "{" else None)
            if len(stack) > max_depth:
                scan.too_deep = line
                return scan
        elif kind == "close" and stack:
            stack.pop()
        elif kind == "string" and m.group("colon") and stack and stack[-1] is not None:
            _note_key(scan, stack[-1], token, line)
        elif kind == "word" and token in CONSTANTS:
            scan.constants += 1
            scan.problems.append(f"line {line}: {token} is not a JSON number (JSON has no NaN or Infinity)")
    return scan


_PLAIN = re.compile(r'"[^"\\\x00-\x1f]*"')  # a string of no escape and no control character: its text


def _note_key(scan: JsonScan, seen: dict[str, int], token: str, line: int) -> None:
    try:
        key = token[1:-1] if _PLAIN.fullmatch(token) else json.loads(token)  # (json.loads: 240,900 keys, 0.4 s)
    except ValueError:
        return  # a malformed string: the parser reports it
    if key in seen:
        shown = repr(key) if len(repr(key)) <= MAX_KEY_CHARS else repr(key)[: MAX_KEY_CHARS - 3] + "..."
        scan.problems.append(f"line {line}: duplicate key {shown} (first at line {seen[key]})")
    seen.setdefault(key, line)
