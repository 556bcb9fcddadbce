"""Spec language: load, validate and type flowrec model specs (no torch, no dask)."""
from flowrec.spec.errors import SpecError, SpecIssue
from flowrec.spec.load import dump_spec, load_spec, read_document, spec_from_dict, to_dict
from flowrec.spec.model import ModelSpec

__all__ = [
    "ModelSpec", "SpecError", "SpecIssue", "dump_spec", "load_spec", "read_document",
    "spec_from_dict", "to_dict",
]
