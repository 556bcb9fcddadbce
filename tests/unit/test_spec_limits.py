"""Every number in a spec is bounded: the schema's ranges, the value walk, seeds and byte sizes."""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from flowrec.spec.errors import SpecError
from flowrec.spec.read import MAX_DEPTH, parse_json, parse_yaml
from flowrec.spec.schemas import MODEL_SPEC_SCHEMA, load_schema
from flowrec.spec.units import MAX_BYTES, MAX_SEED, check_seed, parse_bytes
from flowrec.spec.validate import validate_document
from flowrec.spec.values import value_issues

DLRM = yaml.safe_load((Path(__file__).resolve().parents[2] / "specs" / "dlrm_criteo.yaml").read_text())


def _numeric_schemas(node: Any, where: str = "") -> Iterator[tuple[str, dict]]:
    if isinstance(node, dict):
        if node.get("type") in ("number", "integer"):
            yield where, node
        for key, sub in node.items():
            yield from _numeric_schemas(sub, f"{where}/{key}")
    elif isinstance(node, list):
        for i, sub in enumerate(node):
            yield from _numeric_schemas(sub, f"{where}/{i}")


def test_every_schema_number_has_both_bounds():
    found = list(_numeric_schemas(load_schema(MODEL_SPEC_SCHEMA)))
    assert len(found) > 40
    for where, node in found:
        assert {"minimum", "exclusiveMinimum"} & set(node), where
        assert {"maximum", "exclusiveMaximum"} & set(node), where


def test_schema_seed_bound_is_the_cli_bound():
    seed = load_schema(MODEL_SPEC_SCHEMA)["properties"]["training"]["properties"]["seed"]
    assert (seed["minimum"], seed["maximum"]) == (0, MAX_SEED)


@pytest.mark.parametrize("value,ok", [
    (0, True), (MAX_SEED, True), ("42", True), (" 7 ", True),
    (-1, False), (MAX_SEED + 1, False), (2**64, False), (True, False), (1.0, False), ("1e3", False),
    ("-3", False), ("", False), (None, False), (float("nan"), False),
])
def test_check_seed(value, ok):
    message = check_seed(value)
    assert (message is None) == ok
    if not ok:
        assert message.startswith(f"must be an integer in 0..{MAX_SEED} (got ")


@pytest.mark.parametrize("text,expected", [("4GiB", 4 * 2**30), ("1.5 KB", 1500), (1024, 1024), (0, 0),
                                           ("1024TiB", MAX_BYTES), (MAX_BYTES, MAX_BYTES),
                                           ("1PiB", MAX_BYTES), ("0.5 PiB", MAX_BYTES // 2), ("1 PB", 10**15)])
def test_parse_bytes_in_range(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["9" * 400 + "TiB", "1025TiB", MAX_BYTES + 1, -1, float("inf"), float("nan"), True])
def test_parse_bytes_out_of_range(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["1.5", "2.5 B", 0.5, 1e3 + 0.25])
def test_a_fraction_of_a_byte_is_a_unit_left_out(text):
    """`--device-budget 1.5` (GiB meant) planned with a budget of 1 byte, every table on the host."""
    with pytest.raises(ValueError, match="fraction of a byte; give its unit"):
        parse_bytes(text)
    doc = copy.deepcopy(DLRM)
    doc.setdefault("plan", {})["device_budget"] = text
    issues = validate_document(doc)
    assert [i.path for i in issues] == ["plan.device_budget"]
    assert "fraction of a byte" in issues[0].message or not isinstance(text, str)


@pytest.mark.parametrize("text,expected", [("1.0", 1), (2.0, 2), ("0.5KiB", 512), ("1.5 KB", 1500)])
def test_a_whole_number_of_bytes_with_a_point_or_a_unit_is_taken(text, expected):
    assert parse_bytes(text) == expected


def test_a_size_over_the_limit_is_out_of_range_in_the_unit_the_limit_is_said_in():
    """'2PiB' was 'not a byte size' while the limit reads '(0 .. 1 PiB)', and a spec's
    plan.device_budget '1PiB' was refused by the schema's pattern."""
    with pytest.raises(ValueError, match="out of range"):
        parse_bytes("2PiB")
    doc = copy.deepcopy(DLRM)
    doc.setdefault("plan", {})["device_budget"] = "1PiB"
    assert validate_document(doc) == []
    doc["plan"]["device_budget"] = "2PiB"
    assert [i.path for i in validate_document(doc)] == ["plan.device_budget"]


@pytest.mark.parametrize("value,message", [
    (math.nan, "must be a finite number, not nan"),
    (-math.inf, "must be a finite number, not -inf"),
    (2**63, "must be an integer within 64 bits (-2^63 .. 2^63-1)"),
    (-(2**63) - 1, "must be an integer within 64 bits (-2^63 .. 2^63-1)"),
    (b"x", "must be text, a number, true / false, null, a list or a mapping (got binary data; quote text)"),
    ({1, 2}, "must be text, a number, true / false, null, a list or a mapping (got a set; quote text)"),
    ("a\udc80", "must be valid Unicode text (lone surrogate U+DC80)"),
])
def test_value_walk_names_the_path(value, message):
    doc = copy.deepcopy(DLRM)
    doc["optimizer"]["sparse"]["lr"] = value
    issues = value_issues(doc)
    assert [(i.path, i.message) for i in issues] == [("optimizer.sparse.lr", message)]
    assert [(i.path, i.message) for i in validate_document(doc)] == [("optimizer.sparse.lr", message)]


def test_extremes_pass():
    doc = copy.deepcopy(DLRM)
    doc["optimizer"]["sparse"]["lr"] = 1000
    doc["training"] = {"seed": MAX_SEED, "batch_size": 2**24, "epochs": 10**6}
    doc["features"][0]["fill"] = -1e30
    assert validate_document(doc) == []


def test_depth_bound_in_documents():
    deep: Any = 1
    for _ in range(MAX_DEPTH - 2):  # spec -> data -> options -> MAX_DEPTH - 2 lists: one level too many
        deep = [deep]
    doc = copy.deepcopy(DLRM)
    doc["data"] = {"format": "csv", "path": "x.csv", "options": {"names": deep}}  # a known option (plan15)
    issues = validate_document(doc)
    assert len(issues) == 1 and issues[0].message == f"nests deeper than {MAX_DEPTH} levels"
    doc["data"]["options"]["names"] = deep[0]
    assert validate_document(doc) == []


def test_every_problem_at_once():
    doc = copy.deepcopy(DLRM)
    doc["optimizer"]["sparse"]["lr"] = math.nan
    doc["optimizer"]["dense"]["lr"] = 1e300
    doc["training"] = {"seed": -1}
    assert sorted(str(i) for i in validate_document(doc)) == [
        "optimizer.dense.lr: must be <= 1000",
        "optimizer.sparse.lr: must be a finite number, not nan",
        "training.seed: must be >= 0",
    ]


@pytest.mark.parametrize("parse", [parse_yaml, parse_json], ids=["yaml", "json"])
def test_read_depth_boundary(parse):
    assert parse("[" * MAX_DEPTH + "]" * MAX_DEPTH) == _nested(MAX_DEPTH)
    with pytest.raises(SpecError, match=f"nests deeper than {MAX_DEPTH} levels"):
        parse("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_aliases_within_bounds_load():
    doc = parse_yaml("d: &d {name: adam, lr: 0.001}\nx: [*d, *d]\ny: {<<: *d, lr: 0.5}\n")
    assert doc["x"] == [doc["d"], doc["d"]] and doc["y"] == {"name": "adam", "lr": 0.5}


def test_alias_expansion_boundary():
    n = 1000  # a: 1 + n values; aliased n - 3 times the whole document has 999,002 values, n times 1,002,005
    base = "a: &a [" + ", ".join(["0"] * n) + "]\n"
    assert len(parse_yaml(base + "b: [" + ", ".join(["*a"] * (n - 3)) + "]\n")["b"]) == n - 3
    with pytest.raises(SpecError, match="expands to more than 1,000,000 values"):
        parse_yaml(base + "b: [" + ", ".join(["*a"] * n) + "]\n")
