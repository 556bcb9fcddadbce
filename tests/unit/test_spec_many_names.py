"""Large, wrong specs are checked in work that grows with the spec, not with its square.

A generated spec of 4,000 module inputs naming unknown fields took 199 s to refuse: every unknown
name ran difflib's did-you-mean against every known name (and the per-tag selector checks rescanned
every feature per tag). Every unknown name keeps its line at its path; the first `SUGGESTED` of a
check keep their did-you-mean, exactly as before, the rest are said without one. The tests count
the matcher's work and the features' tag reads, never time.
"""
from __future__ import annotations

import difflib
import random
from typing import Any

import pytest

from flowrec.spec import schema_errors
from flowrec.spec.schema_errors import SUGGESTED, did_you_mean
from flowrec.spec.validate import validate_document
from flowrec.spec.view import Item

FIELDS = 2000  # known names: the old code scored each unknown name against all of them (4M ratios)


def _spec(fields: int = FIELDS, inputs: tuple[str, ...] = (), tags: bool = False) -> dict[str, Any]:
    features = [{"name": f"field_{i:05d}", "type": "categorical", "hash_buckets": 100, "dim": 8,
                 **({"tags": [f"tag{i}"]} if tags else {})} for i in range(fields)]
    reads = [f"@tag{i}" for i in range(fields)] if tags else ["@sparse"]
    return {"name": "m", "features": features,
            "modules": [{"name": "deep", "kind": "mlp", "inputs": [*reads, *inputs], "layers": [8, 1]}],
            "heads": [{"name": "ctr", "input": "deep"}]}


def _lines(doc: dict) -> list[str]:
    return [str(i) for i in validate_document(doc)]


class _Budget:
    """Counts calls and fails the test past `limit` (so the old code fails at once, not in minutes)."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit, self.what, self.calls = limit, what, 0

    def spend(self) -> None:
        self.calls += 1
        if self.calls > self.limit:
            pytest.fail(f"more than {self.limit:,} {self.what}: the work grows with the square of the spec")


@pytest.fixture
def matcher_budget(monkeypatch):
    """Counts difflib's ratio computations (full and quick) of every SequenceMatcher made."""
    budget = _Budget(40 * FIELDS, "difflib ratio computations")  # 10 names x 2 name lists x 2,000: 40,000

    class Counting(difflib.SequenceMatcher):
        def ratio(self):
            budget.spend()
            return super().ratio()

        def quick_ratio(self):
            budget.spend()
            return super().quick_ratio()

    monkeypatch.setattr(difflib, "SequenceMatcher", Counting)
    return budget


def test_thousands_of_unknown_inputs_cost_a_few_searches_of_the_known_names(matcher_budget):
    lines = _lines(_spec(inputs=tuple(f"fild_{i:05d}q" for i in range(FIELDS))))
    assert len(lines) == FIELDS  # every one its line
    assert matcher_budget.calls > 0  # the first names were still searched


def test_thousands_of_unknown_tables_cost_a_few_searches_of_the_known_names(matcher_budget):
    doc = _spec()
    doc["tables"] = [{"name": f"tab_{i:05d}", "dim": 8, "hash_buckets": 10} for i in range(FIELDS)]
    doc["features"] = [{"name": f"field_{i:05d}", "type": "categorical", "table": f"tbl_{i:05d}x"} for i in range(FIELDS)]
    lines = [line for line in _lines(doc) if ".table:" in line]
    assert len(lines) == FIELDS
    assert lines[0] == "features[0].table: unknown table 'tbl_00000x' (did you mean 'tab_00000'?)"
    assert lines[SUGGESTED:] == [f"features[{i}].table: unknown table 'tbl_{i:05d}x'" for i in range(SUGGESTED, FIELDS)]


def test_a_tag_per_feature_is_one_pass_over_the_features(monkeypatch):
    """2,000 features of a tag each, read by 2,000 selectors: each selector rescanned every feature."""
    budget = _Budget(20 * FIELDS, "reads of a feature's tags")
    tags = Item.tags
    monkeypatch.setattr(Item, "tags", property(lambda item: (budget.spend(), tags.fget(item))[1]))
    assert _lines(_spec(tags=True)) == []
    assert budget.calls >= FIELDS  # every feature's tags were read


def test_many_unknown_names_each_have_their_line_and_the_first_few_their_hint():
    lines = _lines(_spec(fields=50, inputs=tuple(f"fild_{i:05d}q" for i in range(40))))
    assert lines[:SUGGESTED] == [f"modules[0].inputs[{i + 1}]: unknown feature 'fild_{i:05d}q' "
                                 f"(did you mean 'field_{i:05d}'?)" for i in range(SUGGESTED)]
    assert lines[SUGGESTED:] == [f"modules[0].inputs[{i + 1}]: unknown feature or module 'fild_{i:05d}q'"
                                 for i in range(SUGGESTED, 40)]


def test_up_to_the_first_few_unknown_names_each_keep_their_line():
    inputs = tuple(f"fild_{i:05d}q" for i in range(SUGGESTED))
    assert _lines(_spec(fields=50, inputs=inputs)) == [
        f"modules[0].inputs[{i + 1}]: unknown feature 'fild_{i:05d}q' (did you mean 'field_{i:05d}'?)"
        for i in range(SUGGESTED)]
    one_more = _lines(_spec(fields=50, inputs=(*inputs, "fild_00010q")))
    assert one_more[SUGGESTED:] == ["modules[0].inputs[11]: unknown feature or module 'fild_00010q'"]


@pytest.mark.parametrize("mutate, hinted, plain, count", [
    (lambda d: d.update(heads=[{"name": f"h{i}", "input": f"dep{i}", "label": f"l{i}"} for i in range(12)]),
     "heads[9].input: unknown module 'dep9' (did you mean 'deep'?)", "heads[10].input: unknown module 'dep10'", 12),
    (lambda d: d.update(data={"columns": {f"fld_{i}": f"c{i}" for i in range(14)}}),
     "data.columns.fld_9: unknown feature 'fld_9' (did you mean 'field_00019'?)",
     "data.columns.fld_10: unknown feature 'fld_10'", 14),
    (lambda d: d["modules"][0]["inputs"].extend(f"@tga{i}" for i in range(11)),
     "modules[0].inputs[29]: selector '@tga9' matches nothing (no feature has the tag 'tga9') (did you mean '@tag9'?)",
     "modules[0].inputs[30]: selector '@tga10' matches nothing (no feature has the tag 'tga10')", 11),
])
def test_every_check_of_names_gives_each_its_line_and_a_hint_to_the_first_few(mutate, hinted, plain, count):
    doc = _spec(fields=20, tags=True)
    mutate(doc)
    lines = _lines(doc)
    assert hinted in lines and plain in lines, lines
    section = plain.split(".")[0].split("[")[0]
    assert len([line for line in lines if line.startswith(section)]) == count


def _old_did_you_mean(word: str, names: list[str]) -> str:
    """The did-you-mean of before (difflib's get_close_matches of every name, re-scored), for the
    names a plain word can take."""
    names = sorted(set(names))
    close = [n for n in names if n.lower() == word.lower()]
    if not close:
        matcher, scored = difflib.SequenceMatcher(b=word), []
        for name in difflib.get_close_matches(word, names, n=max(len(names), 1), cutoff=0.6):
            matcher.set_seq1(name)
            scored.append((matcher.ratio(), name))
        best = [name for ratio, name in scored if ratio == scored[0][0]] if scored else []
        close = sorted(best, key=lambda name: schema_errors.slips(word, name))[:1]
    if not close:
        words = set(word.lower().replace("-", "_").split("_"))
        close = [n for n in names if n.lower() in words]
    return f" (did you mean {close[0]!r}?)" if close else ""


def test_the_did_you_mean_is_the_one_difflib_scored_every_name_for():
    rnd = random.Random(17)
    letters = "abcde_1"
    for _ in range(3000):
        names = [''.join(rnd.choice(letters) for _ in range(rnd.randint(1, 7))) for _ in range(rnd.randint(1, 30))]
        word = ''.join(rnd.choice(letters) for _ in range(rnd.randint(1, 7)))
        assert did_you_mean(word, names) == _old_did_you_mean(word, names), (word, names)


def test_the_outputs_of_many_moe_modules_are_looked_up_not_searched():
    """2,000 moe modules, each output read by one concat: check_outputs_read looked each module
    and output up in a list of every read (the square of the modules in name comparisons)."""
    # each dict lookup that meets the name compares it once: 74,000 in all here (37 a module);
    # a list of the 4,000 reads, searched once per module and once per output: millions
    budget = _Budget(100 * FIELDS, "comparisons of module names")

    class Name(str):  # a module name that counts its comparisons
        __hash__ = str.__hash__

        def __eq__(self, other):
            budget.spend()
            return str.__eq__(self, other)

    doc = _spec()
    doc["modules"] = [{"name": Name(f"mix_{i:05d}"), "kind": "moe", "inputs": [f"field_{i:05d}"], "heads": ["a", "b"],
                       "experts": 2, "expert_layers": [4]} for i in range(FIELDS)]
    doc["modules"].append({"name": "top", "kind": "concat", "inputs": [f"mix_{i:05d}.{o}" for i in range(FIELDS) for o in "ab"]})
    doc["heads"] = [{"name": "ctr", "input": "top"}]
    assert _lines(doc) == []
    doc["modules"][-1]["inputs"].pop()  # mix_01999.b is read by nobody
    assert _lines(doc) == ["modules[1999].heads[1]: output 'b' of module 'mix_01999' is read by no module or head "
                           "(its gate would train for nothing): read it as mix_01999.b, or remove it"]


def test_dense_and_sparse_selectors_of_many_modules_are_one_pass_over_the_features(monkeypatch):
    """2,000 modules reading '@dense' (2 dense features among 2,000): each read rescanned every
    feature, in every check that resolves inputs."""
    budget = _Budget(20 * FIELDS, "reads of whether a feature is dense")
    dense = Item.is_dense
    monkeypatch.setattr(Item, "is_dense", property(lambda item: (budget.spend(), dense.fget(item))[1]))
    doc = _spec()
    doc["features"] += [{"name": "d0", "type": "dense"}, {"name": "d1", "type": "dense"}]
    doc["modules"] = [{"name": f"tower_{i:05d}", "kind": "mlp", "inputs": ["@dense"], "layers": [4]} for i in range(FIELDS)]
    doc["modules"].append({"name": "top", "kind": "concat", "inputs": ["@sparse", *(m["name"] for m in doc["modules"])]})
    doc["heads"] = [{"name": "ctr", "input": "top"}]
    assert _lines(doc) == []
    assert budget.calls >= FIELDS  # every feature was looked at
