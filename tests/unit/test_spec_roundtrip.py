"""Every example spec is valid and round-trips (YAML and JSON); the schemas are valid 2020-12."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator

from flowrec.spec import dump_spec, load_spec, spec_from_dict, to_dict
from flowrec.spec.load import read_document
from flowrec.spec.schemas import MODEL_SPEC_SCHEMA, load_schema, schema_dir
from flowrec.spec.units import parse_bytes
from flowrec.spec.files import validate_file
from flowrec.spec.validate import validate_document

REPO = Path(__file__).resolve().parents[2]
SPEC_FILES = sorted((REPO / "specs").glob("*.yaml"))
SPEC_IDS = [p.name for p in SPEC_FILES]


def test_examples_present():
    names = {p.stem for p in SPEC_FILES}
    expected = {"wide_deep", "dlrm_criteo", "deepfm_criteo", "dcn_v2", "din_taobao", "two_task", "movielens",
                "wide_1000", "avazu"}
    assert expected <= names


@pytest.mark.parametrize("path", SPEC_FILES, ids=SPEC_IDS)
def test_example_spec_valid(path):
    assert validate_file(path) == []
    assert path.read_text(encoding="utf-8").startswith("#"), "each example starts with a header comment"
    assert path.stat().st_size < 1_000_000


@pytest.mark.parametrize("fmt", ["yaml", "json"])
@pytest.mark.parametrize("path", SPEC_FILES, ids=SPEC_IDS)
def test_round_trip(path, fmt, tmp_path):
    spec = load_spec(path)
    out = tmp_path / f"spec.{fmt}"
    out.write_text(dump_spec(spec, fmt), encoding="utf-8")
    assert validate_file(out) == []
    again = load_spec(out)
    assert again == spec
    assert spec_from_dict(to_dict(again)) == spec


@pytest.mark.parametrize("path", sorted(schema_dir().glob("*.json")), ids=lambda p: p.name)
def test_schemas_are_valid_2020_12(path):
    schema = json.loads(path.read_text(encoding="utf-8"))
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def _properties(node, where=""):
    """Every property schema in the model-spec schema, with where it sits."""
    if isinstance(node, dict):
        for key, sub in node.get("properties", {}).items():
            yield f"{where}.{key}", sub
        for key, sub in node.items():
            yield from _properties(sub, f"{where}/{key}")
    elif isinstance(node, list):
        for i, sub in enumerate(node):
            yield from _properties(sub, f"{where}[{i}]")


def test_schema_documents_every_property():
    schema = load_schema(MODEL_SPEC_SCHEMA)
    undocumented = [w for w, sub in _properties(schema) if "/if" not in w and isinstance(sub, dict) and sub
                    and "$ref" not in sub
                    and "description" not in sub and not set(sub) <= {"minItems", "maxItems", "errorMessage"}]
    assert undocumented == []
    objects = [n for _, n in _properties(schema) if isinstance(n, dict) and n.get("type") == "object"]
    assert all("additionalProperties" in o or "allOf" in o for o in objects)


@pytest.mark.parametrize("text", ["4GiB", "512MB", "1 kib", "10b", "1.5 GB", " 7 ", "3TiB"])
def test_byte_size_pattern_matches_parser(text):
    pattern = load_schema(MODEL_SPEC_SCHEMA)["properties"]["plan"]["properties"]["device_budget"]["anyOf"][0]["pattern"]
    assert re.match(pattern, text)
    assert parse_bytes(text) >= 0


@pytest.mark.parametrize("text", ["4G", "lots", "-1GB", "4 GiBs", "1e9"])
def test_byte_size_pattern_rejects(text):
    pattern = load_schema(MODEL_SPEC_SCHEMA)["properties"]["plan"]["properties"]["device_budget"]["anyOf"][0]["pattern"]
    assert not re.match(pattern, text)
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_device_budget_loads_as_bytes(tmp_path):
    doc = yaml.safe_load((REPO / "specs" / "dlrm_criteo.yaml").read_text())
    doc["plan"]["device_budget"] = "4GiB"
    assert validate_document(doc) == []
    assert spec_from_dict(doc).plan.device_budget_bytes == 4 * 2**30


def test_exponent_without_dot_reads_as_number(tmp_path):
    path = tmp_path / "s.yaml"
    text = (REPO / "specs" / "dlrm_criteo.yaml").read_text().replace("lr: 0.001", "lr: 1e-3")
    path.write_text(text)
    assert read_document(path)["optimizer"]["dense"]["lr"] == pytest.approx(1e-3)
    assert load_spec(path).dense_optimizer.lr == pytest.approx(1e-3)


@pytest.mark.parametrize("path", SPEC_FILES, ids=SPEC_IDS)
def test_data_binding_points_at_shared_data(path, shared_data):
    spec = load_spec(path)
    if spec.data is None:
        pytest.skip("no data binding")
    target = (path.parent / spec.data.path).resolve()
    assert target.exists(), target
    assert shared_data.resolve() in target.parents
