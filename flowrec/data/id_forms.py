"""The written form of the ids of hashed and managed tables, recorded at training, checked after.

A hashed table's row is the hash of an id's text and a managed table's raw id is its 64-bit hash
(`flowrec.data.raw_ids`): neither has a vocabulary to look an id up in, so ids written in another
form than the training rows wrote them (pandas writes an integer column with a missing value as
floats, `12.0`; a bool as `True` where Arrow writes `true`; a time with or without its fraction of
a second; a CSV written with ", " between fields keeps the space; pandas reads 00123 as 123) hashed
to other rows, or became new ids of a managed table, without a word. Conversion records each such
feature's form (`record`: its name, an example and the Arrow type its column was read as) with the
encoder; `flowrec predict`, `data convert --encoder-from` and `--init-from` / `--follow` compare
the form of new rows with it (`other_form`; with ids the training rows zero-padded, only where one
is narrower than theirs, `unpadded`) and say so in one line per feature (`lines`). Ids are never
merged: `012` stays another id than `12`. Only a sample of each chunk is looked at (`FORM_SAMPLE`
ids spread over the chunk, its first and last included: padded ids in its later rows only are
seen): a column is written one way throughout. Zero padding is judged over every sample: integers
of one width in all of them, some starting with 0, are zero-padded, and a record of integers
carries its narrowest id, what `unpadded` compares.

Example:
    >>> written_form(pa.array(["12.0", None, "7.0"]))
    ('integral floats', '12.0')
    >>> other_form("integers", "integral floats"), other_form("text", "integers")
    (True, False)
    >>> written_form(pa.array(["00123", "45678"]))
    ('zero-padded integers', '00123')
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flowrec.data.layout import is_multi
from flowrec.data.raw_ids import as_strings

FORM_SAMPLE = 1024  # ids of a chunk (or of a call's rows) whose form is looked at
TEXT = "text"  # ids of no form below: any text (no other form is told from it)
PADDED = "space-padded "  # before the form of ids most of which are written with spaces around them
_DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
_CLOCK = r"[ T][0-9]{2}:[0-9]{2}:[0-9]{2}"
ZEROS = "zero-padded integers"  # integers of one width, some written with leading zeros (00123)
FORMS = (  # (form, what every id of it matches), the first form that every id of a sample matches
    ("integers", r"^-?[0-9]+$"),
    ("integral floats", r"^-?[0-9]+(\.0+)?$"),  # (not all integers: some written 12.0)
    ("true/false", r"^(true|false)$"),  # Arrow's, Spark's, DuckDB's
    ("True/False", r"^(True|False)$"),  # pandas'
    ("TRUE/FALSE", r"^(TRUE|FALSE)$"),  # R's
    ("dates", rf"^{_DATE}$"),
    ("times", rf"^{_DATE}{_CLOCK}Z?$"),
    ("times with a fraction of a second", rf"^{_DATE}{_CLOCK}\.[0-9]+Z?$"),
)
KINDS = {  # forms one writer's ids take in another's: (the kind, how writers differ)
    "integers": "numbers", "integral floats": "numbers", ZEROS: "numbers",
    "true/false": "booleans", "True/False": "booleans", "TRUE/FALSE": "booleans",
    "dates": "times", "times": "times", "times with a fraction of a second": "times",
}
WHY = {
    "numbers": "pandas writes an integer column with a missing value as floats, 12.0; its nullable dtype "
               "\"Int64\" keeps integers beside missing values",
    "booleans": "pandas writes True, Arrow, Spark and DuckDB true, R TRUE",
    "times": "Arrow writes a time with its fraction of a second, pandas' CSV without it and a column of "
             "midnights as dates; write times as text, say",
    "spaces": "a CSV written with ', ' between fields keeps the space in each field's text",
    "zeros": "pandas' read_csv reads ids such as 00123 as the number 123, as a spreadsheet does, unless told "
             "to read them as text (dtype=\"string\")",
}


def spread(rows: int) -> np.ndarray:
    """The rows of a sample of `FORM_SAMPLE` of `rows` rows, spread evenly over them (the first and
    the last included), in order.

    >>> spread(5).tolist(), spread(10_000)[[0, 1, -1]].tolist(), len(spread(10_000))
    ([0, 1, 2, 3, 4], [0, 10, 9999], 1024)
    """
    if rows <= FORM_SAMPLE:
        return np.arange(rows)
    return np.unique(np.linspace(0, rows - 1, FORM_SAMPLE).round().astype(np.int64))


def _sample(values: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    return values if len(values) <= FORM_SAMPLE else values.take(pa.array(spread(len(values))))


def id_texts(values: pa.Array) -> tuple[pa.Array, pa.Array]:
    """The ids of a sample as they are hashed (`as_strings`), nulls and blanks ('  ': no id, so no
    form, width or narrowest id of one) dropped, and the same trimmed of spaces: what
    `written_form`, `narrowest_id` and `_widths` read. Those three answer of one sample what
    `sample_forms` answers of every feature's at once (the check `IdForms.observe` makes): they are
    its plain reference, which the tests compare it with."""
    texts = as_strings(_sample(values)).drop_null()
    trimmed = pc.utf8_trim_whitespace(texts)
    named = pc.not_equal(trimmed, "")
    return texts.filter(named), trimmed.filter(named)


def written_form(values: pa.Array) -> tuple[str, str] | None:
    """The form of a sample of ids (`FORMS`, else `TEXT`; `PADDED` before it where most are written
    with spaces around them) and an example of it, as the ids are hashed (`as_strings`: a float
    3.0 is the id "3"); None where the sample holds no id."""
    texts, trimmed = id_texts(values)
    if not len(texts):
        return None
    padded = pc.sum(pc.not_equal(texts, trimmed)).as_py() * 2 > len(texts)
    form = next((name for name, pattern in FORMS if pc.all(pc.match_substring_regex(trimmed, pattern)).as_py()),
                TEXT)
    zeros = pc.match_substring_regex(trimmed, "^-?0[0-9]") if form == "integers" else None
    if zeros is not None and pc.any(zeros).as_py() and _one_width(trimmed):  # (several: padded and plain mixed)
        form = ZEROS
        example = texts.filter(zeros)[0].as_py()  # a padded one: what the rows write otherwise than integers
    elif form == "integral floats":  # an example of a float: what the rows write otherwise than integers
        example = texts.filter(pc.match_substring(trimmed, "."))[0].as_py()
    else:
        example = texts[0].as_py()
    return (PADDED if padded else "") + form, example


def narrowest_id(values: pa.Array) -> str:
    """The narrowest id (its text, spaces trimmed) of a sample of ids holding one (`written_form`'s).

    >>> narrowest_id(pa.array(["12", "  ", "345", None]))
    '12'
    """
    trimmed = id_texts(values)[1]
    lengths = pc.utf8_length(trimmed)
    return trimmed[pc.index(lengths, pc.min(lengths)).as_py()].as_py()


def _widths(values: pa.Array) -> tuple[int, int]:
    """The fewest and most characters of a sample's ids (spaces trimmed), of one holding an id.

    >>> _widths(pa.array(["012", "  ", "345", None]))
    (3, 3)
    """
    widths = pc.min_max(pc.utf8_length(id_texts(values)[1]))
    return widths["min"].as_py(), widths["max"].as_py()


def _one_width(texts: pa.Array) -> bool:
    widths = pc.min_max(pc.utf8_length(texts))
    return widths["min"].as_py() == widths["max"].as_py()


GROUPED = (pa.types.is_string, pa.types.is_large_string, pa.types.is_integer, pa.types.is_floating,
           pa.types.is_boolean)  # Arrow types whose samples are made text together, one call a type


def sample_forms(samples: list[pa.Array]) -> list[tuple[str, str, str, tuple[int, int]] | None]:
    """`written_form`, `narrowest_id` and `_widths` of each sample of ids (of a feature each):
    (form, example, narrowest id, widths), None where a sample holds no id. The same answers as
    those functions give each sample, made over one array of every sample's texts (`id_texts`'s,
    in sample order): a few Arrow calls in all instead of about 20 per sample (a one-row predict
    of 1,000 hashed fields spent 260 ms asking them a feature at a time).

    >>> sample_forms([pa.array(["12", "7", None]), pa.array(["00123", " "]), pa.array([None], pa.string())])
    [('integers', '12', '7', (1, 2)), ('zero-padded integers', '00123', '00123', (5, 5)), None]
    """
    texts, owner = _all_texts([_sample(values) for values in samples])
    trimmed = pc.utf8_trim_whitespace(texts)
    named = pc.and_(texts.is_valid(), pc.not_equal(trimmed, "")).fill_null(False)
    keep = named.to_numpy(zero_copy_only=False)
    texts, trimmed, owner = texts.filter(named), trimmed.filter(named), owner[keep]
    n = len(samples)
    ids = np.bincount(owner, minlength=n)
    padded = np.bincount(owner, _bools(pc.not_equal(texts, trimmed)), minlength=n) * 2 > ids
    form = np.full(n, len(FORMS))  # index into FORMS; len(FORMS): TEXT
    undecided = ids > 0
    for k, (_, pattern) in enumerate(FORMS):  # the first form every id of a sample matches, each
        rows = undecided[owner]  # form asked of the ids of samples of no form yet only
        if not rows.any():
            break
        misses = np.bincount(owner[rows], ~_matches(trimmed, rows, pattern)[rows], minlength=n)
        form[undecided & (misses == 0)] = k
        undecided &= misses > 0
    lengths = pc.utf8_length(trimmed).to_numpy(zero_copy_only=False)
    held = ids > 0
    fewest, most = np.zeros(n, np.int64), np.zeros(n, np.int64)
    starts = np.concatenate([[0], np.cumsum(ids)[:-1]])[held]
    fewest[held], most[held] = np.minimum.reduceat(lengths, starts), np.maximum.reduceat(lengths, starts)
    names = [name for name, _ in FORMS] + [TEXT]
    first_zero = _first(owner, _matches(trimmed, (form == names.index("integers"))[owner], "^-?0[0-9]"), n)
    first_float = _first(owner, _matches(trimmed, (form == names.index("integral floats"))[owner], r"\."), n)
    at = np.concatenate([[0], np.cumsum(ids)[:-1]])  # the example: the sample's first id, but
    zeros_ = (form == names.index("integers")) & (first_zero >= 0) & (fewest == most)
    at[zeros_] = first_zero[zeros_]  # a padded one: what the rows write otherwise than integers
    floats = form == names.index("integral floats")
    at[floats] = first_float[floats]  # a float: what the rows write otherwise than integers
    examples = iter(texts.take(pa.array(at[held])).to_pylist())  # (one call each, not two a sample)
    narrowest = iter(trimmed.take(pa.array(_first(owner, lengths == fewest[owner], n)[held])).to_pylist())
    return [((PADDED if padded[i] else "") + (ZEROS if zeros_[i] else names[form[i]]), next(examples),
             next(narrowest), (int(fewest[i]), int(most[i]))) if held[i] else None for i in range(n)]


def _all_texts(samples: list[pa.Array]) -> tuple[pa.Array, np.ndarray]:
    """Every sample's ids as they are hashed (`as_strings`), one after another in sample order,
    and the sample (its index) of each: samples of a `GROUPED` type made text in one call per
    type (`as_strings` is value by value), others one by one."""
    made: list[tuple[np.ndarray, pa.Array]] = []
    by_type: dict[pa.DataType, list[int]] = {}
    for i, values in enumerate(samples):
        if any(kind(values.type) for kind in GROUPED):
            by_type.setdefault(values.type, []).append(i)
        else:
            made.append((np.full(len(values), i), as_strings(values)))
    for kind, members in by_type.items():
        joined = pa.concat_arrays([samples[i].combine_chunks() if isinstance(samples[i], pa.ChunkedArray)
                                   else samples[i] for i in members])
        made.append((np.repeat(members, [len(samples[i]) for i in members]), as_strings(joined)))
    if not made:
        return pa.array([], pa.large_string()), np.zeros(0, np.int64)
    owner = np.concatenate([o for o, _ in made]).astype(np.int64)
    texts = pa.concat_arrays([t.cast(pa.large_string()) for _, t in made])
    if np.all(owner[1:] >= owner[:-1]):  # (one type: in sample order already)
        return texts, owner
    order = np.argsort(owner, kind="stable")  # sample order, each sample's ids in their own order
    return texts.take(pa.array(order)), owner[order]


def _matches(texts: pa.Array, rows: np.ndarray, pattern: str) -> np.ndarray:
    """Whether each of `texts` matches regular expression `pattern`, asked of `rows` only (False
    elsewhere)."""
    out = np.zeros(len(texts), bool)
    if rows.all():
        out[:] = _bools(pc.match_substring_regex(texts, pattern))
    elif rows.any():
        out[rows] = _bools(pc.match_substring_regex(texts.filter(pa.array(rows)), pattern))
    return out


def _bools(mask: pa.Array) -> np.ndarray:
    return mask.fill_null(False).to_numpy(zero_copy_only=False)


def _first(owner: np.ndarray, mask: np.ndarray, n: int) -> np.ndarray:
    """Per sample, the index of its first value where `mask` holds (-1 where none does)."""
    out = np.full(n, -1, np.int64)
    where = np.flatnonzero(mask)
    samples, at = np.unique(owner[where], return_index=True)
    out[samples] = where[at]
    return out


def other_form(trained: str, seen: str) -> bool:
    """Whether ids written in form `seen` are clearly written otherwise than the training rows'
    (form `trained`): of one kind (numbers, booleans, times) in another of its forms, or the same
    form with spaces around the ids where training had none (or the reverse). Text and ids of
    other kinds may be new ids, not others' forms of the training ids."""
    if trained == seen:
        return False
    base, other = trained.removeprefix(PADDED), seen.removeprefix(PADDED)
    if base == "integers" and other == ZEROS:  # (training rows of plain ids pad none: a run recorded before
        return False  # padded ids were told from others wrote them as integers)
    return base == other or (base in KINDS and KINDS.get(other) == KINDS[base])


def unpadded(rule: dict[str, str], seen: str, example: str) -> bool:
    """Whether ids of form `seen` (`example`: one of them) are clearly ids the training rows
    (`rule`) wrote zero-padded, their zeros lost (as pandas reads 00123): integers one of which is
    shorter than the padded ones. Padded ids none of which happens to start with a zero (a few
    rows of wide ids) are integers as wide as the training rows': not told from them."""
    if rule["form"].removeprefix(PADDED) != ZEROS or seen.removeprefix(PADDED) != "integers":
        return True  # (not such a pair: `other_form` alone decides)
    return len(example.strip()) < len(rule.get("example", "").strip())


@dataclass
class IdForms:
    """The forms (`written_form`) of the ids of the hashed and managed features of raw chunks.

    Args:
        seen: feature -> form -> [an example, ids of the samples of that form].
        types: feature -> the Arrow type its raw column was first read as (every sparse feature's:
            `column_types`; a hashed or managed feature's also in its `record`).
        narrowest: feature -> its narrowest id of the samples written as integers (`unpadded`
            tells ids that lost the zeros of zero-padded training ids by it, in whichever sample;
            `lines` shows it, `record` records it).
        widths: feature -> [fewest, most] characters of the ids of its samples written as integers,
            zero-padded or not (`record`: padded in some samples, of one width in all, is padded).
    """

    seen: dict[str, dict[str, list]] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)
    narrowest: dict[str, str] = field(default_factory=dict)
    widths: dict[str, list[int]] = field(default_factory=dict)

    def observe(self, encoder: Any, raw: pa.Table, features: Any = None) -> None:
        """Look at a sample of each hashed or managed feature's ids in `raw` (of `features`, a
        collection of names, where given), read as `encoder` (an `Encoder`) reads them."""
        sample = raw.take(pa.array(spread(raw.num_rows))) if raw.num_rows > FORM_SAMPLE else raw
        present = set(raw.column_names)  # (once, not per feature: a 1,000-field model spent 130 ms a call here)
        names, flats = [], []
        for f in encoder.spec.sparse_features:
            table = encoder.spec.table(f.table)
            source = encoder.source(f.name)
            if source not in present or (features is not None and f.name not in features):
                continue
            self.types.setdefault(f.name, str(raw.column(source).type))
            if not (table.hashed or table.managed is not None):
                continue
            values = encoder.sparse_values(f, sample)
            names.append(f.name)
            flats.append(pc.list_flatten(values) if is_multi(f) else values)
        for name, flat, found in zip(names, flats, sample_forms(flats)):
            if found is None:
                continue
            form, example, narrowest, widths = found
            mine = self.seen.setdefault(name, {}).setdefault(form, [example, 0])
            mine[1] += min(len(flat), FORM_SAMPLE)
            if form == "integers":
                self._narrow(name, narrowest)
            if form in ("integers", ZEROS):
                self._widen(name, widths)

    def add(self, other: "IdForms") -> None:
        """Count `other`'s forms too (a call's, into a model's running count)."""
        for name, forms in other.seen.items():
            mine = self.seen.setdefault(name, {})
            for form, (example, count) in forms.items():
                mine.setdefault(form, [example, 0])[1] += count
        for name, kind in other.types.items():
            self.types.setdefault(name, kind)
        for name, text in other.narrowest.items():
            self._narrow(name, text)
        for name, widths in other.widths.items():
            self._widen(name, tuple(widths))

    def _narrow(self, name: str, text: str) -> None:
        if len(text) < len(self.narrowest.get(name, text + " ")):
            self.narrowest[name] = text

    def _widen(self, name: str, widths: tuple[int, int]) -> None:
        mine = self.widths.setdefault(name, list(widths))
        mine[:] = [min(mine[0], widths[0]), max(mine[1], widths[1])]

    def record(self) -> dict[str, dict[str, str]]:
        """feature -> {"form", "example", "type"}, for each feature whose ids were of one form
        throughout (a feature of several forms records none: nothing is told from it). Integers
        zero-padded in some samples and not in others are zero-padded where every sample's ids
        are of one width (the others happen to start with no 0), else integers; the example of
        integers is their narrowest id (what `unpadded` tells lost zeros by), not the first."""
        out = {}
        for name, forms in self.seen.items():
            if set(forms) == {ZEROS, "integers"}:
                fewest, most = self.widths.get(name, (0, 1))
                forms = {ZEROS: forms[ZEROS]} if fewest == most else {"integers": forms["integers"]}
            if len(forms) == 1:
                (form, (example, _)), = forms.items()
                if form == "integers":
                    example = self.narrowest.get(name, example)
                out[name] = {"form": form, "example": example, "type": self.types.get(name, "")}
        return out

    def column_types(self) -> dict[str, str]:
        """feature -> the Arrow type its raw column was first read as, for every sparse feature
        seen: how a typed source (Parquet) held the ids, which a vocabulary (text) no longer
        tells (`checked_types`; a retrieval package gives its items back in it)."""
        return dict(self.types)

    def lines(self, encoder: Any, trained: dict[str, dict[str, str]]) -> list[str]:
        """A line per feature whose ids are written in another form (`other_form`) than `trained`
        (`record`'s of the training rows) records: the column, an example, what it does, the fix."""
        out = []
        for name, forms in self.seen.items():
            rule = trained.get(name)
            if rule is None:
                continue
            differing = []
            for form, (example, count) in forms.items():
                shown = self.narrowest.get(name, example) if form == "integers" else example
                if other_form(rule["form"], form) and unpadded(rule, form, shown):
                    differing.append((count, form, shown))
            if differing:
                _, form, example = max(differing)
                table = next(encoder.spec.table(f.table) for f in encoder.spec.sparse_features if f.name == name)
                out.append(form_line(encoder.source(name), name, table, rule, form, example))
        return out


def form_line(source: str, name: str, table: Any, rule: dict[str, str], form: str, example: str) -> str:
    """The warning of feature `name`'s ids (raw column `source`, of `table`, a TableSpec) written as
    `form` (`example`) where the training rows (`rule`) wrote them otherwise."""
    base, trained = form.removeprefix(PADDED), rule["form"].removeprefix(PADDED)
    why = (WHY["spaces"] if base == trained else WHY["zeros"] if {base, trained} == {ZEROS, "integers"}
           else WHY[KINDS[base]])
    if table.managed is not None:
        what = (f"managed table {table.name!r} holds a row per id's text, so each is a new id there, not the trained "
                "one (training on such rows gives the same id a second row)")
    else:
        what = (f"hashed table {table.name!r} hashes an id's text, so each lands in another row than in training "
                "(scored as an id never seen)")
    read = f", read as {rule['type']}" if rule.get("type") else ""
    return (f"column {source}: the ids of feature {name} are written as {form} ({example!r}), the training rows "
            f"wrote them as {rule['form']} ({rule.get('example')!r}{read}): {what}; ids are not merged ('012' stays "
            f"another id than '12'): write column {source} as the training rows did ({why})")


def checked_forms(value: Any) -> dict[str, dict[str, str]]:
    """A recorded `IdForms.record` as read from a file: the features whose record is a form's
    name (text) with an example and type; anything else (a hand-edited record) is left out, so a
    record that tells nothing warns of nothing (nor does a run recorded before forms were)."""
    if not isinstance(value, dict):
        return {}
    return {name: {k: rule[k] for k in ("form", "example", "type") if isinstance(rule.get(k), str)}
            for name, rule in value.items()
            if isinstance(name, str) and isinstance(rule, dict) and isinstance(rule.get("form"), str)}


def checked_types(value: Any) -> dict[str, str]:
    """A recorded `IdForms.column_types` as read from a file: feature -> Arrow type, each a text;
    anything else (a hand-edited record) is left out, as a record without types is.

    >>> checked_types({"item": "string", "user": 7, 3: "int64"}), checked_types(None)
    ({'item': 'string'}, {})
    """
    if not isinstance(value, dict):
        return {}
    return {name: kind for name, kind in value.items() if isinstance(name, str) and isinstance(kind, str)}


def changed_forms(spec: Any, columns: dict[str, str], trained: dict[str, dict[str, str]],
                  seen: dict[str, dict[str, str]]) -> list[str]:
    """A line (`form_line`) per hashed or managed feature of `spec` whose ids a dataset's record
    (`seen`) writes in another form (`other_form`) than a run's (`trained`): a day of a stream
    (`--follow`, `--init-from`) that pandas wrote with a missing id trained every id of it as a new
    one. `columns`: feature -> raw column."""
    out = []
    for f in spec.sparse_features:
        mine, theirs = trained.get(f.name), seen.get(f.name)
        if mine and theirs and other_form(mine["form"], theirs["form"]) and \
                unpadded(mine, theirs["form"], theirs.get("example", "")):
            out.append(form_line(columns.get(f.name, f.name), f.name, spec.table(f.table), mine, theirs["form"],
                                 theirs.get("example", "")))
    return out
