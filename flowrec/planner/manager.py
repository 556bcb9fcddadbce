"""The pass pipeline `built -> packed -> sharded -> cached -> interleaved` and `make_plan`, the public entry.

Example:
    >>> from flowrec.spec import load_spec
    >>> plan = make_plan(load_spec("specs/dlrm_criteo.yaml"), until="packed")
    >>> plan.stage, [p.name for p in plan.meta.passes]
    ('packed', ['pack'])
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from flowrec.graph.build import build_graph
from flowrec.graph.plan_io import model_fingerprint
from flowrec.graph.types import OpGraph, PassContext, PassRecord, PassResult, Plan
from flowrec.graph.verify import verify
from flowrec.planner.cost import access_description, default_budget, device_profile, predict
from flowrec.planner.passes.cache import cache
from flowrec.planner.passes.meta import plan_meta
from flowrec.planner.passes.interleave import interleave
from flowrec.planner.passes.pack import pack
from flowrec.planner.passes.shard import shard
from flowrec.planner.targets import resolve_target
from flowrec.spec.json_doc import read_json_document, version_problem
from flowrec.spec.schema_errors import schema_issues
from flowrec.spec.schemas import ACCESS_PROFILE_SCHEMA, load_schema
from flowrec.spec.model import ModelSpec
from flowrec.spec.units import parse_bytes

PassFn = Callable[[OpGraph, PassContext], PassResult]
STAGES: tuple[str, ...] = ("built", "packed", "sharded", "cached", "interleaved")
PIPELINE: tuple[tuple[str, str, PassFn], ...] = (  # (pass name, stage it produces, pass)
    ("pack", "packed", pack),
    ("shard", "sharded", shard),
    ("cache", "cached", cache),
    ("interleave", "interleaved", interleave),
)


class PassFailure(RuntimeError):
    """A pass raised or broke the graph; names it and the passes that ran before it."""

    def __init__(self, name: str, done: tuple[str, ...], problem: str) -> None:
        self.name, self.done, self.problem = name, done, problem
        before = ", ".join(done) if done else "none"
        super().__init__(f"pass {name!r} failed (passes before it: {before}): {problem}")


@dataclass(frozen=True)
class PassManager:
    """Runs a named pipeline of passes up to a stage, optionally verifying after every pass.

    Example:
        >>> PassManager(verify=True).stages
        ('built', 'packed', 'sharded', 'cached', 'interleaved')
    """

    pipeline: tuple[tuple[str, str, PassFn], ...] = PIPELINE
    verify: bool = False

    @property
    def stages(self) -> tuple[str, ...]:
        return ("built",) + tuple(stage for _, stage, _ in self.pipeline)

    def run_until(self, graph: OpGraph, ctx: PassContext, stage: str) -> tuple[OpGraph, tuple[PassRecord, ...]]:
        """Run the passes up to and including the one producing `stage`.

        Raises:
            ValueError: for an unknown stage.
            PassFailure: when a pass raises or (with verify) leaves a broken graph.
        """
        if stage not in self.stages:
            raise ValueError(f"unknown stage {stage!r} (known: {', '.join(self.stages)})")
        records: list[PassRecord] = []
        for name, produces, fn in self.pipeline[: self.stages.index(stage)]:
            done = tuple(r.name for r in records)
            try:
                result = fn(graph, ctx)
            except Exception as exc:  # reported with the pass's name and history
                raise PassFailure(name, done, f"{type(exc).__name__}: {exc}") from exc
            if self.verify:
                problems = verify(result.graph)
                if problems:
                    raise PassFailure(name, done, "; ".join(problems[:10]))
            records.append(PassRecord(name, result.modified, result.notes))
            graph = result.graph
        return graph, tuple(records)


GIVEN_AS = "given_as"  # key of an access profile read from a file: the file (for the plan's record)
GIVEN_DIGEST = "given_sha256"  # and the SHA-256 of its bytes (the plan records its first 16 hex digits)
_GIVEN = re.compile(r"given (?P<path>.+) \([\d,]+ sampled rows\)(?: sha256 (?P<digest>[0-9a-f]{16}))?(?:;.*)?")


def profile_digest(path: str | Path) -> str | None:
    """The SHA-256 of the file `path` (None when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def recorded_profile(access: str) -> tuple[str, str | None] | None:
    """(file, first 16 hex digits of its SHA-256, None for a plan of an earlier flowrec) of the
    access profile a plan's `cost.access_profile` says it was priced from, None when it was not
    given one (`flowrec plan --profile FILE`).

    >>> recorded_profile("given /p/prof.json (2,000 sampled rows) sha256 0123456789abcdef")
    ('/p/prof.json', '0123456789abcdef')
    >>> recorded_profile("none (Zipf model per table)") is None
    True
    """
    found = _GIVEN.fullmatch(access) if isinstance(access, str) else None
    return (found["path"], found["digest"]) if found else None


def load_profile(path: str | Path | None, spec: ModelSpec | None = None) -> dict[str, Any] | None:
    """Read an access profile (`flowrec data profile` output) into the record `make_plan` takes;
    it remembers the file it came from. Raises ValueError if malformed: not JSON (NaN included), or
    figures the planner reads that break schemas/access-profile.schema.json, in one line naming the
    first such field; or, with `spec`, when it counts none of the spec's tables (a profile of
    another spec: the plan said it was priced from the file and priced every table by the Zipf
    model)."""
    if path is None:
        return None
    redo = "write it again with `flowrec data profile SPEC DATA --json FILE`"
    try:
        doc = read_json_document(path, finite=True)
    except ValueError as exc:
        raise ValueError(f"{exc} ({redo})") from None
    if not isinstance(doc, dict) or doc.get("format") != "flowrec-access-profile":
        raise ValueError(f"{path}: not a flowrec-access-profile version 1 document")
    if problem := version_problem(doc.get("version"), 1):
        raise ValueError(f"{path}: access profile {problem} ({redo})")
    from jsonschema import Draft202012Validator

    errors = sorted(Draft202012Validator(load_schema(ACCESS_PROFILE_SCHEMA)).iter_errors(doc),
                    key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        issue = schema_issues(errors[0])[0]
        raise ValueError(f"{path}: {issue.path} {issue.message} ({redo})")
    if doc.get("samples") == 0:  # a profile of no sampled row counts nothing to plan from
        raise ValueError(f"{path}: the access profile sampled no rows (sample rate {doc.get('sample_rate')!r}): "
                         f"it counts nothing to plan from ({redo}, with a larger --sample-rate)")
    names = [t.name for t in spec.tables] if spec is not None else []
    if names and not any(name in (doc.get("tables") or {}) for name in names):
        of = f" (of spec {doc['spec']!r})" if isinstance(doc.get("spec"), str) else ""
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise ValueError(f"{path}: the access profile{of} counts none of the tables of spec {spec.name!r} "
                         f"({shown}); profile this spec's data: `flowrec data profile SPEC DATA --json FILE`")
    return {**doc, GIVEN_AS: str(Path(path).absolute()), GIVEN_DIGEST: profile_digest(path)}


def make_plan(spec: ModelSpec, *, until: str = "interleaved", device_budget: int | str | None = None,
              target: str | None = None, profile: dict[str, Any] | None = None,
              verify_passes: bool = False, world_size: int = 1) -> Plan:
    """Build the graph of `spec` and run the pass pipeline up to `until`.

    Args:
        spec: a `ModelSpec`.
        until: last stage: built, packed, cached or interleaved.
        device_budget: bytes or a size like "4GiB" (default: the spec's hint, else the target's
            memory minus a reserve).
        target: cost-model device (cpu, a100, h100; default from the spec).
        profile: an access profile record: sampled by the caller, or read from a file with
            `load_profile` (planning reads no files); the prediction records which
            (`CostPrediction.access_profile`).
        verify_passes: run the graph verifier after every pass.
        world_size: ranks the plan is for (`shard` pass); predictions are per rank.
    """
    name = resolve_target(spec, target)
    if profile is not None and not isinstance(profile, dict):
        raise TypeError(f"make_plan takes an access profile record, not {type(profile).__name__}; "
                        f"read a file with load_profile")
    given = profile.get(GIVEN_AS) if profile is not None else None
    budget = parse_bytes(device_budget) if device_budget is not None else spec.plan.device_budget_bytes
    ctx = PassContext(spec=spec, target=name, device_budget_bytes=budget, profile=profile, world_size=world_size)
    graph, records = PassManager(verify=verify_passes).run_until(build_graph(spec), ctx, until)
    graph = graph.copy()
    graph.graph["plan"] = replace(plan_meta(graph), passes=records)
    device = device_profile(name)
    cost = predict(graph, spec, device, micro_batches=plan_meta(graph).micro_batches, profile=profile,
                   access=access_description(profile, given))
    return Plan(spec_name=spec.name, stage=until, target=name, graph=graph, cost=cost,
                device_budget_bytes=budget if budget is not None else default_budget(device),
                spec_fingerprint=model_fingerprint(spec))
