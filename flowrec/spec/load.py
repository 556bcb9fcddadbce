"""Load, convert and dump specs: YAML/JSON document <-> `ModelSpec`.

Documents are read by `flowrec.spec.read` (hostile input refused). `load_spec` validates the
document first (schema, then semantic checks) and raises `SpecError` carrying every problem at
once. `to_dict` gives the canonical document: every table listed under `tables`, every feature
naming its table, so that ``spec_from_dict(to_dict(s)) == s``.

Example:
    >>> spec = load_spec("specs/movielens.yaml")
    >>> spec_from_dict(to_dict(spec)) == spec
    True
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from flowrec.spec.errors import SpecError
from flowrec.spec.model import (
    FORMAT_ALIASES,
    DataSpec,
    DenseFeature,
    EarlyStoppingSpec,
    FrozenMapping,
    HeadSpec,
    ManagedSpec,
    ModelSpec,
    ModuleSpec,
    Negatives,
    OptimizerSpec,
    PlanHints,
    RetrievalSpec,
    ScheduleSpec,
    SparseFeature,
    TableSpec,
    TrainedWhere,
    TrainingSpec,
    thaw,
)
from flowrec.spec.read import flowrec_format, not_a_spec, read_document
from flowrec.spec.retrieval_checks import head_top_k
from flowrec.spec.tasks import TASKS
from flowrec.spec.units import parse_bytes
from flowrec.spec.validate import validate_document
from flowrec.spec.values import nonfinite_issues, python_values
from flowrec.spec.view import DocView

MODULE_KEYS = ("name", "kind", "inputs")
OPTIMIZER_KEYS = ("name", "lr")
# the optimizers of a spec that names none (docs/spec.md "Optimizers"); written out in spec.json
DEFAULT_DENSE_OPTIMIZER = {"name": "adam", "lr": 0.001}
DEFAULT_SPARSE_OPTIMIZER = {"name": "rowwise_adagrad", "lr": 0.05}
OPTIONAL_TRAINING = ("eval_group_by", "clip_grad_norm", "schedule", "early_stopping")


def load_spec(path: str | Path) -> ModelSpec:
    """Read, validate and convert a spec file.

    Raises:
        SpecError: with every schema and semantic problem, each with its path.
    """
    doc = read_document(path)
    own = flowrec_format(doc)  # a plan.json given as the spec: one line, not every key it lacks
    issues = [not_a_spec(own)] if own is not None else validate_document(doc)
    if issues:
        raise SpecError(issues, str(path))
    return spec_from_dict(doc, base_dir=Path(path).parent)


def spec_from_dict(doc: dict[str, Any], base_dir: Path | None = None) -> ModelSpec:
    """Convert a *validated* document to a `ModelSpec` (inline tables become named tables).

    Args:
        doc: the document (assumed to have passed `validate_document`).
        base_dir: folder that relative `data.path` entries are kept relative to (unchanged here;
            resolved by the data stage).

    Raises:
        SpecError: a document that cannot be converted, with every problem `validate_document`
            finds in it (not the KeyError or TypeError of the first missing or mistyped value), or
            that holds a number that is not finite (NaN, inf), each named by its path. A numpy
            integer, float or bool (`np.int64(8)`) is taken as its Python value.
    """
    del base_dir  # paths are resolved where they are used, relative to the spec file
    doc = python_values(doc)  # np.int64(8) where a file says 8: a spec built in Python from arrays
    nonfinite = nonfinite_issues(doc)  # a NaN batch_size or an infinite lr was taken, and refused by train()
    if nonfinite:
        raise SpecError(nonfinite, "document")
    try:
        return _spec_from_dict(doc)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError):
        issues = validate_document(doc)
        if issues:
            raise SpecError(issues, "document") from None
        raise


def _spec_from_dict(doc: dict[str, Any]) -> ModelSpec:
    optimizers = doc.get("optimizer", {})
    sparse_opt = _optimizer(optimizers.get("sparse", DEFAULT_SPARSE_OPTIMIZER))
    tables: dict[str, TableSpec] = {}
    for t in doc.get("tables", []):
        tables[t["name"]] = _table(t["name"], t)
    features = []
    for f in doc["features"]:
        tags = tuple(f.get("tags", ()))
        if f["type"] == "dense":
            features.append(
                DenseFeature(f["name"], f.get("transform", "none"), float(f.get("fill", 0.0)), tags)
            )
            continue
        table = f.get("table", f["name"])
        if "table" not in f:
            tables[table] = _table(table, f)
        kind = f["type"]
        max_len = int(f.get("max_len", 1))
        pooling = f.get("pooling", "sum")
        features.append(SparseFeature(f["name"], table, max_len, pooling, tags, kind, f.get("truncate", "first")))
    modules = tuple(
        ModuleSpec(
            m["name"],
            m["kind"],
            tuple(m["inputs"]),
            tuple(sorted((k, _freeze(v)) for k, v in m.items() if k not in MODULE_KEYS)),
        )
        for m in doc["modules"]
    )
    view = DocView.of(doc, frozenset())
    heads = tuple(
        _head(h, head_top_k(view, view.by_name("heads")[h["name"]])) for h in doc["heads"]
    )
    return ModelSpec(
        name=doc["name"],
        description=doc.get("description", ""),
        features=tuple(features),
        tables=tuple(tables.values()),
        modules=modules,
        heads=heads,
        dense_optimizer=_optimizer(optimizers.get("dense", DEFAULT_DENSE_OPTIMIZER)),
        sparse_optimizer=sparse_opt,
        training=_training(doc.get("training", {})),
        data=_data(doc["data"]) if doc.get("data") else None,
        plan=_plan(doc.get("plan", {})),
    )


def _head(h: dict[str, Any], top_k: Any) -> HeadSpec:
    """A head; `top_k` its retrieval cut-offs, written or the default for its catalogue."""
    task = h.get("task", "binary")
    where = h.get("trained_where")
    return HeadSpec(
        h["name"], h["input"], task, h.get("loss", TASKS[task].losses[0]), float(h.get("weight", 1.0)),
        h.get("label"), h.get("sample_weight"),
        TrainedWhere(where["label"], float(where["equals"])) if where is not None else None,
        h.get("num_classes"), _retrieval(h, top_k) if TASKS[task].ranks else None,
    )


def _retrieval(h: dict[str, Any], top_k: Any) -> RetrievalSpec:
    neg = h.get("negatives", {})
    negatives = Negatives(neg.get("kind", "in_batch"), int(neg.get("num", 0)), neg.get("distribution", "uniform"))
    return RetrievalSpec(negatives, bool(h.get("logq_correction", False)),
                         tuple(sorted(set(int(k) for k in top_k))),
                         bool(h.get("exclude_seen", False)))


def _table(name: str, t: dict[str, Any]) -> TableSpec:
    if "managed" in t:
        managed = _managed(t["managed"])
        return TableSpec(name=name, rows=managed.rows, dim=int(t["dim"]), hashed=False,
                         optimizer=_optimizer(t["optimizer"]) if t.get("optimizer") else None,
                         dtype=t.get("dtype", "fp32"), managed=managed)
    hashed = "hash_buckets" in t
    spare = int(t.get("vocab_spare", 0))
    rows = int(t["hash_buckets"]) if hashed else int(t["vocab"]) + 1 + spare  # row 0: missing / unknown
    return TableSpec(
        name=name,
        rows=rows,
        dim=int(t["dim"]),
        hashed=hashed,
        optimizer=_optimizer(t["optimizer"]) if t.get("optimizer") else None,
        dtype=t.get("dtype", "fp32"),
        min_freq=int(t.get("min_freq", 1)),
        vocab_spare=spare,
        l2=float(t.get("l2", 0.0)),
    )


def _managed(m: dict[str, Any]) -> ManagedSpec:
    ttl = m.get("ttl_steps")
    return ManagedSpec(rows=int(m["rows"]), admit_min_count=int(m.get("admit_min_count", 1)),
                       evict=m.get("evict", "lfu"), decay=float(m.get("decay", 0.5)),
                       every_steps=int(m.get("every_steps", 1000)), ttl_steps=None if ttl is None else int(ttl),
                       shards=int(m.get("shards", 1)))


def _optimizer(o: dict[str, Any]) -> OptimizerSpec:
    params = tuple(sorted((k, float(v)) for k, v in o.items() if k not in OPTIMIZER_KEYS))
    return OptimizerSpec(o["name"], float(o["lr"]), params)


def _data(d: dict[str, Any]) -> DataSpec:
    columns = tuple(sorted(d.get("columns", {}).items()))
    options = tuple(sorted((k, _freeze(v)) for k, v in d.get("options", {}).items()))
    path = str(d["path"]) if d.get("path") is not None else None
    fmt = d.get("format")
    return DataSpec(FORMAT_ALIASES.get(fmt, fmt), path, d.get("label", "label"), columns, options)


def _training(t: dict[str, Any]) -> TrainingSpec:
    t = dict(t)
    schedule, stopping = t.pop("schedule", None), t.pop("early_stopping", None)
    if t.get("clip_grad_norm") is not None:
        t["clip_grad_norm"] = float(t["clip_grad_norm"])
    if schedule is not None:
        schedule = dict(schedule)
        for key in ("min_lr_ratio", "gamma"):
            if key in schedule:
                schedule[key] = float(schedule[key])
        schedule = ScheduleSpec(**schedule)
    if stopping is not None:
        stopping = dict(stopping)
        if "min_delta" in stopping:
            stopping["min_delta"] = float(stopping["min_delta"])
        stopping = EarlyStoppingSpec(**stopping)
    return TrainingSpec(**t, schedule=schedule, early_stopping=stopping)


def _training_doc(t: TrainingSpec) -> dict[str, Any]:
    """The training section; the optional settings appear only when set (older documents stay as they were)."""
    doc = {k: v for k, v in vars(t).items() if k not in OPTIONAL_TRAINING}
    for key in OPTIONAL_TRAINING:
        value = getattr(t, key)
        if value is not None:
            doc[key] = value if not hasattr(value, "__dataclass_fields__") else \
                {k: v for k, v in vars(value).items() if v is not None}
    return doc


def _plan(p: dict[str, Any]) -> PlanHints:
    p = dict(p)
    budget = p.pop("device_budget", None)
    return PlanHints(**p, device_budget_bytes=parse_bytes(budget) if budget is not None else None)


def _freeze(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return FrozenMapping(sorted((k, _freeze(x)) for k, x in v.items()))
    return v


_thaw = thaw


def to_dict(spec: ModelSpec) -> dict[str, Any]:
    """The canonical document of a spec (tables listed, features naming their tables)."""
    doc: dict[str, Any] = {"name": spec.name}
    if spec.description:
        doc["description"] = spec.description
    doc["features"] = [_feature_doc(f, spec) for f in spec.features]
    doc["tables"] = [_table_doc(t) for t in spec.tables]
    doc["modules"] = [
        {"name": m.name, "kind": m.kind, "inputs": list(m.inputs), **{k: _thaw(v) for k, v in m.params}}
        for m in spec.modules
    ]
    doc["heads"] = [_head_doc(h) for h in spec.heads]
    doc["optimizer"] = {
        "dense": _optimizer_doc(spec.dense_optimizer),
        "sparse": _optimizer_doc(spec.sparse_optimizer),
    }
    doc["training"] = _training_doc(spec.training)
    if spec.data is not None:
        d = spec.data
        doc["data"] = {**({"format": d.format} if d.format is not None else {}),
                       **({"path": d.path} if d.path is not None else {}), "label": d.label}
        if d.columns:
            doc["data"]["columns"] = dict(d.columns)
        if d.options:
            doc["data"]["options"] = {k: _thaw(v) for k, v in d.options}
    plan = dict(vars(spec.plan))
    budget = plan.pop("device_budget_bytes")
    if budget is not None:
        plan["device_budget"] = budget
    if plan["target"] is None:
        del plan["target"]
    doc["plan"] = plan
    return doc


def _feature_doc(f: DenseFeature | SparseFeature, spec: ModelSpec) -> dict[str, Any]:
    if isinstance(f, DenseFeature):
        out: dict[str, Any] = {"name": f.name, "type": "dense", "transform": f.transform}
        if f.fill:
            out["fill"] = f.fill
    else:
        out = {"name": f.name, "type": f.kind, "table": f.table}
        if f.kind == "sequence" or f.max_len != 1:
            out["max_len"] = f.max_len
        if f.truncate != "first":  # the default is left out: dumps of existing specs are unchanged
            out["truncate"] = f.truncate
        out["pooling"] = f.pooling
    if f.tags:
        out["tags"] = list(f.tags)
    return out


def _table_doc(t: TableSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": t.name, "dim": t.dim}
    if t.managed is not None:
        out["managed"] = _managed_doc(t.managed)
    elif t.hashed:
        out["hash_buckets"] = t.rows
    else:
        out["vocab"] = t.vocab_size
        if t.min_freq != 1:
            out["min_freq"] = t.min_freq
        if t.vocab_spare:
            out["vocab_spare"] = t.vocab_spare
    if t.dtype != "fp32":
        out["dtype"] = t.dtype
    if t.optimizer is not None:
        out["optimizer"] = _optimizer_doc(t.optimizer)
    if t.l2:
        out["l2"] = t.l2
    return out


def _managed_doc(m: ManagedSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"rows": m.rows, "admit_min_count": m.admit_min_count, "evict": m.evict}
    if m.evict == "decayed_lfu":
        out["decay"] = m.decay
    out["every_steps"] = m.every_steps
    if m.ttl_steps is not None:
        out["ttl_steps"] = m.ttl_steps
    if m.shards != 1:
        out["shards"] = m.shards
    return out


def _head_doc(h: HeadSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": h.name, "input": h.input, "task": h.task, "loss": h.loss}
    if h.weight != 1.0:
        out["weight"] = h.weight
    if h.label is not None:
        out["label"] = h.label
    if h.sample_weight is not None:
        out["sample_weight"] = h.sample_weight
    if h.trained_where is not None:
        out["trained_where"] = {"label": h.trained_where.label, "equals": h.trained_where.equals}
    if h.num_classes is not None:
        out["num_classes"] = h.num_classes
    if h.retrieval is not None:
        neg = h.retrieval.negatives
        out["negatives"] = {"kind": neg.kind, **({"num": neg.num, "distribution": neg.distribution}
                                                 if neg.kind == "sampled" else {})}
        out["logq_correction"] = h.retrieval.logq_correction
        out["top_k"] = list(h.retrieval.top_k)
        if h.retrieval.exclude_seen:
            out["exclude_seen"] = True
    return out


def _optimizer_doc(o: OptimizerSpec) -> dict[str, Any]:
    return {"name": o.name, "lr": o.lr, **dict(o.params)}


def dump_spec(spec: ModelSpec, fmt: str = "yaml") -> str:
    """Serialise a spec canonically as YAML or JSON text."""
    doc = to_dict(spec)
    if fmt == "json":
        return json.dumps(doc, indent=2) + "\n"
    return yaml.safe_dump(doc, sort_keys=False)
