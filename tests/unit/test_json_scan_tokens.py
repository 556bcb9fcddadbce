"""`flowrec.spec.json_scan.scan_json` reads only the tokens it needs (strings, brackets, the
NaN / Infinity words), the rest skipped by its regular expression: a package's model.json of a
1,000-field model (8.5 MB) took 0.9 s to scan token by token. The same depth, duplicate keys,
constants and lines as the scan of every token it replaced, on fresh random texts, JSON or not.
"""
from __future__ import annotations

import json
import re

import numpy as np

from flowrec.spec.json_scan import JsonScan, _note_key, scan_json

_EVERY_TOKEN = re.compile(
    r'(?P<string>"[^"\\]*(?:\\.[^"\\]*)*")(?P<colon>\s*:)?'
    r"|(?P<open>[{\[])|(?P<close>[}\]])"
    r'|(?P<word>[^\s{}\[\]:,"]+)'
    r"|(?P<other>\s+|.)",
    re.DOTALL,
)


def _scan_every_token(text: str, max_depth: int) -> JsonScan:
    """The scan as it was: a step of the loop per token, whitespace and punctuation included."""
    scan = JsonScan()
    stack: list = []
    line = 1
    for m in _EVERY_TOKEN.finditer(text):
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
        elif kind == "word" and token in ("NaN", "Infinity", "-Infinity"):
            scan.constants += 1
            scan.problems.append(f"line {line}: {token} is not a JSON number (JSON has no NaN or Infinity)")
        line += m.group(0).count("\n")
    return scan


PIECES = ['{', '}', '[', ']', ':', ',', ' ', '\n', '\t', ' : ', '"a"', '"b"', '"a"', '"k\\"q"', '"x\ny"', '"', '\\',
          'NaN', '-NaN', 'Infinity', '-Infinity', 'NaNx', 'xNaN', '12', '-1.5e3', 'true', 'null', '"NaN"', 'é', '"é"',
          '"\\u00e9"']


def _document(rng: np.random.Generator, depth: int = 0):
    """A random JSON value: skewed toward small objects, some keys repeated, some NaN."""
    kind = rng.integers(0, 5 if depth < 6 else 2)
    if kind == 0:
        return float("nan") if rng.random() < 0.05 else float(rng.lognormal())
    if kind == 1:
        return str(rng.zipf(1.5))
    if kind == 2:
        return [_document(rng, depth + 1) for _ in range(rng.integers(0, 4))]
    return {f"k{rng.zipf(1.6) % 7}": _document(rng, depth + 1) for _ in range(rng.integers(0, 5))}


def _text(rng: np.random.Generator) -> str:
    if rng.random() < 0.5:  # a JSON document, sometimes with a key repeated by hand
        text = json.dumps(_document(rng), indent=int(rng.integers(0, 3)) or None)
        if rng.random() < 0.5 and '{"' in text:
            text = text.replace('{"', '{"k1": 1,\n "k1": 2, "', 1)
        return text
    return "".join(PIECES[i] for i in rng.integers(0, len(PIECES), int(rng.integers(0, 300))))


def test_the_scan_of_its_tokens_finds_what_the_scan_of_every_token_found() -> None:
    rng = np.random.default_rng()
    found = 0
    for _ in range(3000):
        text, depth = _text(rng), int(rng.integers(1, 8))
        mine, theirs = scan_json(text, depth), _scan_every_token(text, depth)
        assert (mine.too_deep, mine.problems, mine.constants) == (theirs.too_deep, theirs.problems,
                                                                  theirs.constants), (text, depth)
        found += bool(mine.problems) + (mine.too_deep is not None)
    assert found > 100  # (the texts hold duplicate keys, constants and deep nests often)


def test_the_scan_steps_over_numbers_punctuation_and_spaces() -> None:
    """Its loop sees strings, brackets and NaN / Infinity only (it saw every number, ',', ':' and
    run of spaces: most of a program's JSON)."""
    from flowrec.spec.json_scan import _TOKEN

    rng = np.random.default_rng()
    text = json.dumps([{"k": float(v), "n": [int(v), -int(v)]} for v in rng.lognormal(3, 2, 50)], indent=1)
    read = [m.group(0) for m in _TOKEN.finditer(text)]
    assert read and all(t[0] in '"{}[]' for t in read), read[:20]
    assert len(read) == text.count('"') // 2 + sum(text.count(c) for c in "{}[]")
