"""Turn jsonschema errors into one-line `SpecIssue`s in plain words.

Each jsonschema validator keyword has a translator (a registry, not an if/elif chain); a schema
may override the wording of a keyword with an ``errorMessage`` annotation (a string, or a mapping
keyword -> message, as in ajv-errors).

Example:
    >>> from jsonschema import Draft202012Validator
    >>> err = next(Draft202012Validator({"properties": {"dim": {"minimum": 1}}}).iter_errors({"dim": 0}))
    >>> str(schema_issues(err)[0])
    'dim: must be >= 1'
"""
from __future__ import annotations

import difflib
import re
from typing import Any, Callable, Iterable

from jsonschema.exceptions import ValidationError

from flowrec.spec.errors import SpecIssue

MAX_KNOWN_KEYS = 24
CLOSE = 0.6  # difflib's ratio a did-you-mean needs (get_close_matches' default cutoff)
SUGGESTED = 10  # unknown names of one check whose line has a did-you-mean (each has a line)
MAX_VALUE_CHARS = 40  # longest value quoted back in a message
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_JSON_TYPES = {
    "object": "a mapping", "array": "a list", "string": "a string", "integer": "an integer",
    "number": "a number", "boolean": "true or false", "null": "null",
}


# what a word means where difflib finds a look-alike ('gpu' -> 'cpu') or none ('seperator', data.options' sep)
SYNONYMS = {"gpu": "cuda", "separator": "sep", "seperator": "sep", "delimiter": "sep"}
NAME_PATTERN = "^[A-Za-z0-9_][A-Za-z0-9_.:-]*$"  # the schema's pattern of names (features, modules, ...)
NAME_CHAR = "[A-Za-z0-9_.:-]"
OUTPUT_PATTERN = "^[A-Za-z0-9_][A-Za-z0-9_:-]*$"  # a moe / ple output: a name without '.' (read as 'module.output')
# each name pattern's characters: its message names the first character outside them
NAME_CHARS = {NAME_PATTERN: NAME_CHAR, OUTPUT_PATTERN: "[A-Za-z0-9_:-]"}


def format_path(parts: Iterable[Any]) -> str:
    """``["features", 3, "dim"]`` -> ``features[3].dim``."""
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif _IDENT.match(str(p)):
            out += f".{p}" if out else str(p)
        else:
            out += f"[{str(p)!r}]"
    return out


def did_you_mean(word: Any, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or ``""``."""
    if not isinstance(word, str):
        return ""
    names = sorted(set(candidates))
    same = [n for n in names if n.lower() == word.lower()]  # `A100` is a100, which difflib ties with h100
    meant = [n for n in names if n == SYNONYMS.get(word.lower())]  # a GPU is cuda, not the cpu it looks like
    if word.lower() in SYNONYMS and not same and not meant:
        return ""  # `--target gpu` (cpu, a100, h100): none means a GPU the way it reads, the cpu least
    close = same or meant or _closest(word, names)
    if not close:  # batch_norm -> norm, dropout_rate -> dropout: a known name as one of its words
        words = set(re.split(r"[_\-\s]+", word.lower()))
        close = [n for n in names if n.lower() in words]
    return f" (did you mean {close[0]!r}?)" if close else ""


class UnknownNames:
    """The unknown names of one check: each its own line at its path, as every error is (DESIGN:
    every error at once, each with its path); the first `SUGGESTED` with a did-you-mean (`hint`),
    the rest without, in the same words otherwise. A generated spec of 4,000 misspelt names searched
    every known name 4,000 times: minutes before the first line.

    Example:
        >>> unknown = UnknownNames()
        >>> lines = [i for n in range(12) for i in unknown.issue(f"features[{n}].table", f"tabl{n}",
        ...          lambda t: f"unknown table {t!r}{unknown.hint(t, [f'table{n}'])}")]
        >>> [str(i) for i in lines[SUGGESTED - 1:]]
        ["features[9].table: unknown table 'tabl9' (did you mean 'table9'?)", "features[10].table: unknown table 'tabl10'", "features[11].table: unknown table 'tabl11'"]
    """

    def __init__(self) -> None:
        self.found = 0

    def issue(self, path: str, name: str, line: Callable[[str], str]) -> list[SpecIssue]:
        """The line of one unknown name (`line`, whose did-you-mean is `hint`'s)."""
        self.found += 1
        return [SpecIssue(path, line(name))]

    def hint(self, word: Any, candidates: Iterable[str]) -> str:
        """`did_you_mean` for the first `SUGGESTED` unknown names of the check, "" past them."""
        return did_you_mean(word, candidates) if self.found <= SUGGESTED else ""


def _closest(word: str, names: list[str]) -> list[str]:
    """difflib's closest name (ratio >= 0.6); of names it finds as close as each other, the one
    fewest typing slips away (`slips`): `mpl` is `mlp` with two letters swapped, where difflib's
    tie went to `ple`.

    The names difflib's `get_close_matches` would find, without its full ratio of every name: a
    name's quick ratio (letters in common, whatever their order) bounds its ratio, so names are
    scored from the highest bound down, and stop where the bound falls below the best ratio found
    (4,000 names each scored in full were a quarter of a second per unknown name).

    >>> _closest("mpl", ["mlp", "ple", "moe"]), _closest("corss", ["cross", "dot"]), _closest("xyz", ["mlp"])
    (['mlp'], ['cross'], [])
    """
    matcher = difflib.SequenceMatcher(b=word)
    bounded = []
    for name in names:
        matcher.set_seq1(name)
        if matcher.real_quick_ratio() >= CLOSE and (bound := matcher.quick_ratio()) >= CLOSE:
            bounded.append((bound, name))
    best, tied = CLOSE, []
    for bound, name in sorted(bounded, reverse=True):
        if bound < best:
            break
        matcher.set_seq1(name)
        ratio = matcher.ratio()
        if ratio > best:
            best, tied = ratio, [name]
        elif ratio == best:
            tied.append(name)
    # difflib's order among equal ratios (the greater name first), then the fewest slips
    return sorted(sorted(tied, reverse=True), key=lambda name: slips(word, name))[:1]


def slips(a: str, b: str) -> int:
    """Optimal string alignment distance: the fewest insertions, deletions, substitutions and swaps
    of two neighbouring letters from `a` to `b`.

    >>> slips("mpl", "mlp"), slips("mpl", "ple"), slips("adagard", "adagrad")
    (1, 2, 1)
    """
    rows = [list(range(len(b) + 1))]
    for i, ca in enumerate(a, 1):
        row = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            row[j] = min(rows[-1][j] + 1, row[j - 1] + 1, rows[-1][j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], rows[-2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


def show(value: Any) -> str:
    """A short quoted rendering of a document value."""
    text = repr(value)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."


def schema_issues(error: ValidationError) -> list[SpecIssue]:
    """The issues one jsonschema error stands for (one per unknown or missing key)."""
    path = format_path(error.absolute_path)
    custom = _custom_message(error)
    if custom is not None:
        allowed = NAME_CHARS.get(error.validator_value) if error.validator == "pattern" else None
        if allowed is not None and isinstance(error.instance, str):  # which name, which character
            bad = next((c for c in error.instance if not re.fullmatch(allowed, c)), None)
            custom += f" (got {show(error.instance)}" + (f": {bad!r} is not allowed)" if bad is not None else ")")
        return [SpecIssue(path, custom)]
    translate = _TRANSLATORS.get(str(error.validator), _fallback)
    messages = translate(error)
    if not path:
        messages = [f"the spec {m}" if m.startswith("must") else m for m in messages]
    return [SpecIssue(path, m) for m in messages]


def _custom_message(error: ValidationError) -> str | None:
    schema = error.schema if isinstance(error.schema, dict) else {}
    custom = schema.get("errorMessage")
    if isinstance(custom, dict):
        custom = custom.get(str(error.validator))
    return custom if isinstance(custom, str) else None


def _additional(error: ValidationError) -> list[str]:
    known = list(error.schema.get("properties", {}))
    extra = [k for k in error.instance if k not in known] if isinstance(error.instance, dict) else []
    return [f"unknown key {show(k)}{did_you_mean(k, known) or _known(known)}" for k in extra]


def _known(known: list[str]) -> str:
    """`` (known keys: ...)`` where there are few enough to read on one line, else ``""``."""
    return f" (known keys: {', '.join(sorted(known))})" if 0 < len(known) <= MAX_KNOWN_KEYS else ""


def _required(error: ValidationError) -> list[str]:
    inst = error.instance if isinstance(error.instance, dict) else {}
    return [f"missing required key {k!r}" for k in error.validator_value if k not in inst]


def _dependent_required(error: ValidationError) -> list[str]:
    inst = error.instance if isinstance(error.instance, dict) else {}
    return [f"missing required key {k!r} (needed with {given!r})" for given, keys in error.validator_value.items()
            if given in inst for k in keys if k not in inst]


def _enum(error: ValidationError) -> list[str]:
    allowed = ", ".join(str(v) for v in error.validator_value)
    hint = did_you_mean(error.instance, [str(v) for v in error.validator_value])
    return [f"must be one of {allowed} (got {show(error.instance)}){hint}"]


def _type(error: ValidationError) -> list[str]:
    wanted = error.validator_value if isinstance(error.validator_value, list) else [error.validator_value]
    words = " or ".join(_JSON_TYPES.get(t, t) for t in wanted)
    hint = ""
    if isinstance(error.instance, str) and {"number", "integer"} & set(wanted) and _is_float(error.instance) \
            and "e" in error.instance.lower() and "inf" not in error.instance.lower():  # "3" quoted: no exponent
        hint = "; YAML reads exponents without a dot as text: write e.g. 1.0e-3"
    elif isinstance(error.instance, bool) and "boolean" not in wanted:  # `name: no`, `dim: on`
        hint = "; YAML reads yes, no, on, off, true and false as true / false" + (
            ": quote text ('no')" if "string" in wanted else "")
    elif isinstance(error.instance, (int, float)) and "string" in wanted:  # `name: 1:30` is 5400 in YAML 1.1
        hint = "; quote it to keep it as text"
    return [f"must be {words} (got {show(error.instance)}){hint}"]


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _bound(op: str) -> Callable[[ValidationError], list[str]]:
    return lambda e: [f"must be {op} {e.validator_value}"]


def _min_items(error: ValidationError) -> list[str]:
    n = error.validator_value
    return ["must not be empty" if n == 1 else f"must have at least {n} items"]


def _fallback(error: ValidationError) -> list[str]:
    return [error.message]


_TRANSLATORS: dict[str, Callable[[ValidationError], list[str]]] = {
    "additionalProperties": _additional,
    "required": _required,
    "dependentRequired": _dependent_required,
    "enum": _enum,
    "const": lambda e: [f"must be {show(e.validator_value)} (got {show(e.instance)})"],
    "type": _type,
    "minimum": _bound(">="),
    "exclusiveMinimum": _bound(">"),
    "maximum": _bound("<="),
    "exclusiveMaximum": _bound("<"),
    "minItems": _min_items,
    "maxItems": lambda e: [f"must have at most {e.validator_value} items"],
    "uniqueItems": lambda e: ["must not repeat items"],
    "minLength": lambda e: ["must not be empty"],
    "pattern": lambda e: [f"must match the pattern {e.validator_value} (got {show(e.instance)})"],
    "oneOf": lambda e: ["must match exactly one of the allowed forms"],
    "anyOf": lambda e: ["must match one of the allowed forms"],
}
