"""The id-form check of all features at once (`sample_forms`) against the check of one feature at
a time it replaced (`written_form`, `narrowest_id`, `_widths` of `id_texts`): the same forms,
examples, narrowest ids and widths, on fresh random skewed samples of every form the check tells
apart, in every Arrow type a raw column holds ids in. A one-row predict of a 1,000-field hashed
package spent about 260 ms asking the check a feature at a time.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from flowrec.data.encode import Encoder
from flowrec.data.id_forms import FORM_SAMPLE, ZEROS, IdForms, _widths, narrowest_id, sample_forms, written_form
from flowrec.data.layout import is_multi
from flowrec.spec import spec_from_dict


def _one_by_one(values: pa.Array) -> tuple[str, str, str, tuple[int, int]] | None:
    """The check of one feature's sample as `IdForms.observe` made it before."""
    found = written_form(values)
    return None if found is None else (*found, narrowest_id(values), _widths(values))


def _ids(rng: np.random.Generator, n: int) -> np.ndarray:
    """Skewed ids: a few of them most of the rows."""
    return rng.zipf(1.4, n) % 90_000 + int(rng.integers(0, 50))


def _texts(rng: np.random.Generator, kind: str, n: int) -> list[Any]:
    ids = _ids(rng, n)
    width = int(rng.integers(5, 9))
    made = {
        "ints": [str(i) for i in ids],
        "negative": [str(-i if rng.random() < 0.3 else i) for i in ids],
        "zero-padded": [str(i).zfill(width) for i in ids],
        "padded-some": [str(i).zfill(width) if rng.random() < 0.2 else str(i) for i in ids],
        "floats": [f"{i}.0" if rng.random() < 0.5 else str(i) for i in ids],
        "fractions": [f"{i}.5" for i in ids],
        "text": [f"u{i}x" for i in ids],
        "spaces": [f" {i} " if rng.random() < 0.7 else str(i) for i in ids],
        "bools": [["true", "false", "True", "TRUE"][int(rng.integers(0, 4 if rng.random() < 0.1 else 2))]
                  for _ in ids],
        "dates": [f"20{10 + i % 15}-0{1 + i % 9}-1{i % 10}" for i in ids],
        "times": [f"2024-01-0{1 + i % 9} 1{i % 10}:00:0{i % 10}" for i in ids],
        "fraction times": [f"2024-01-0{1 + i % 9}T1{i % 10}:00:0{i % 10}.{i % 1000}Z" for i in ids],
        "mixed": [[str(i), f"{i}.0", f"v{i}", " ", "", None, str(i).zfill(7)][int(rng.integers(0, 7))] for i in ids],
        "blanks": [[" ", "", None, "  "][int(rng.integers(0, 4))] for _ in ids],
    }[kind]
    holes = rng.random(n) < rng.choice([0.0, 0.1, 0.5])
    return [None if hole else value for hole, value in zip(holes, made)]


KINDS = ("ints", "negative", "zero-padded", "padded-some", "floats", "fractions", "text", "spaces", "bools",
         "dates", "times", "fraction times", "mixed", "blanks")


def _sample(rng: np.random.Generator) -> pa.Array:
    """A feature's raw ids in a random form, length and Arrow type (text, integers, floats with
    NaN, bools, dictionary text)."""
    n = int(rng.choice([1, 2, 7, 300, FORM_SAMPLE + int(rng.integers(1, 3000))]))
    typed = rng.random()
    if typed < 0.15:
        return pa.array(_ids(rng, n) * (1 - 2 * (rng.random(n) < 0.1)), pa.int64())
    if typed < 0.25:
        values = _ids(rng, n).astype(float)
        values[rng.random(n) < 0.2] = np.nan
        values[rng.random(n) < 0.1] += 0.25
        return pa.array(values)
    if typed < 0.3:
        return pa.array(rng.random(n) < 0.5)
    texts = pa.array(_texts(rng, KINDS[int(rng.integers(0, len(KINDS)))], n), pa.string())
    if typed < 0.4:
        return texts.dictionary_encode()
    return texts.cast(pa.large_string()) if typed < 0.45 else texts


def test_all_features_at_once_answer_as_one_at_a_time() -> None:
    rng = np.random.default_rng()
    for _ in range(40):
        samples = [_sample(rng) for _ in range(int(rng.integers(1, 30)))]
        assert sample_forms(samples) == [_one_by_one(s) for s in samples]


def test_each_form_is_told_apart_in_one_call() -> None:
    """One call over every form: each feature's own answer (the comparison above could pass on a
    mix-up of features only if every feature answered alike)."""
    rng = np.random.default_rng()
    samples = [pa.array(_texts(rng, kind, int(rng.integers(20, 400))), pa.string()) for kind in KINDS]
    answers = sample_forms(samples)
    assert answers == [_one_by_one(s) for s in samples]
    forms = {kind: (None if answer is None else answer[0]) for kind, answer in zip(KINDS, answers)}
    assert forms["zero-padded"] == ZEROS and forms["text"] == "text" and forms["blanks"] is None
    assert forms["floats"] == "integral floats" and forms["spaces"].startswith("space-padded")
    assert len({forms[k] for k in ("ints", "zero-padded", "floats", "text", "dates", "times", "fraction times")}) == 7


def _spec(fields: int) -> Any:
    features = [{"name": "price", "type": "dense"}]
    features += [{"name": f"f{i}", "type": "categorical", "hash_buckets": 97, "dim": 4} for i in range(fields)]
    features += [{"name": "tags", "type": "categorical", "hash_buckets": 50, "dim": 4, "max_len": 4,
                  "pooling": "mean"}]
    return spec_from_dict({
        "name": "forms_many", "features": features,
        "modules": [{"name": "top", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
        "heads": [{"name": "ctr", "input": "top"}],
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}}})


def _observed_one_by_one(encoder: Encoder, raw: pa.Table) -> IdForms:
    """`IdForms.observe` as it was: each feature's sample checked on its own."""
    forms = IdForms()
    for f in encoder.spec.sparse_features:
        forms.types.setdefault(f.name, str(raw.column(f.name).type))
        values = encoder.sparse_values(f, raw)
        flat = pc.list_flatten(values) if is_multi(f) else values
        found = _one_by_one(flat)
        if found is None:
            continue
        form, example, narrowest, widths = found
        mine = forms.seen.setdefault(f.name, {}).setdefault(form, [example, 0])
        mine[1] += min(len(flat), FORM_SAMPLE)
        if form == "integers":
            forms._narrow(f.name, narrowest)
        if form in ("integers", ZEROS):
            forms._widen(f.name, widths)
    return forms


@pytest.mark.parametrize("rows", [1, 40, 900])
def test_observe_of_many_features_records_what_one_at_a_time_did(rows: int) -> None:
    rng = np.random.default_rng()
    fields = int(rng.integers(5, 40))
    spec = _spec(fields)
    encoder = Encoder(spec, {}, {}, {}, "^", {f.name: {"form": "integers"} for f in spec.sparse_features})
    columns = {"price": pa.array(rng.lognormal(1.0, 1.5, rows))}
    for i in range(fields):
        columns[f"f{i}"] = pa.array(_texts(rng, KINDS[int(rng.integers(0, len(KINDS)))], rows), pa.string())
    columns["tags"] = pa.array(["^".join(str(t) for t in _ids(rng, int(rng.integers(0, 5)))) for _ in range(rows)])
    raw = pa.table(columns)
    forms = IdForms()
    forms.observe(encoder, raw)
    assert forms == _observed_one_by_one(encoder, raw)
    assert forms.seen and set(forms.seen) <= {f.name for f in spec.sparse_features}
