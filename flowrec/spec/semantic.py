"""Semantic checks a JSON Schema cannot express: names, tables, heads, data, labels, sizes.

Each check is ``check(view) -> list[SpecIssue]`` over the schema-clean parts of the document;
`SEMANTIC_CHECKS` lists them all, module-graph checks included.

Example:
    >>> from flowrec.spec.view import DocView
    >>> doc = {"features": [{"name": "a", "type": "dense"}, {"name": "a", "type": "dense"}]}
    >>> [str(i) for i in check_duplicates(DocView.of(doc, frozenset()))]
    ["features[1].name: duplicate feature name 'a' (first at features[0])"]
"""
from __future__ import annotations

import re
from typing import Any

from flowrec.spec.errors import SpecIssue
from flowrec.spec.model import HISTORY_COLUMN, NAMED_OUTPUT_KINDS
from flowrec.spec.module_checks import MODULE_CHECKS, output_problem, output_ref
from flowrec.spec.retrieval_checks import check_retrieval, head_top_k
from flowrec.spec.schema_errors import NAME_PATTERN, UnknownNames, did_you_mean, show
from flowrec.spec.tasks import AUC_MAX_CLASSES, TASKS, retrieval_metric_names
from flowrec.spec.units import parse_bytes
from flowrec.spec.view import DocView, Item

INLINE_TABLE_KEYS = ("vocab", "hash_buckets")
TABLE_ONLY_KEYS = ("dtype", "optimizer", "min_freq", "vocab_spare")  # settings of a table, not of a feature reading one
DEFAULT_LABEL = "label"
SINGULAR = {"features": "feature", "tables": "table", "modules": "module", "heads": "head"}


def check_duplicates(view: DocView) -> list[SpecIssue]:
    """Names are unique per section, and no module shares a name with a feature or table clash."""
    issues = []
    for section, noun in SINGULAR.items():
        first = view.by_name(section)
        for item in view.items(section):
            if item.name is not None and first[item.name] is not item:
                issues.append(SpecIssue(f"{item.path}.name", f"duplicate {noun} name {item.name!r} "
                                                             f"(first at {first[item.name].path})"))
    features, tables = view.by_name("features"), view.by_name("tables")
    for m in view.items("modules"):
        if m.name in features:
            issues.append(SpecIssue(f"{m.path}.name", f"module name {m.name!r} is also a feature "
                                                      f"({features[m.name].path}); inputs naming it would be ambiguous"))
    outputs = {f"{m.name}.{name}": m for m in view.items("modules")
               for name in m.get(NAMED_OUTPUT_KINDS.get(m.get("kind", str, ""), ""), list, []) if isinstance(name, str)}
    for item in (*view.items("features"), *view.items("modules")):
        if item.name in outputs:
            owner = outputs[item.name]
            issues.append(SpecIssue(f"{item.path}.name", f"{SINGULAR[item.section]} name {item.name!r} is also an "
                                                         f"output of module {owner.name!r} ({owner.path}); inputs "
                                                         "naming it would be ambiguous"))
    for f in view.items("features"):
        if f.is_sparse and "table" not in f.body and f.name in tables:
            issues.append(SpecIssue(f"{f.path}.name", f"the inline table of feature {f.name!r} clashes with "
                                                      f"{tables[f.name].path}; write 'table: {f.name}' to share "
                                                      "it, or rename one"))
    return issues


# Names of the nodes `flowrec.graph.build` and the `pack` pass make beside the modules': a module
# so named would be another node of the same name (tests/unit/test_spec_validate.py builds every
# spec in specs/ and checks that each of its node names is refused as a module name).
BUILT_NODES = {"input_dense": "the dense input", "input_labels": "the labels", "loss": "the loss"}
FEATURE_NODES = ("ids", "lookup", "pool")  # <prefix>_<feature>
GROUP_NODE = re.compile(r"(ids|emb)_g\d+_d\d+(_.+)?")  # a packed group's ids and lookup: <prefix>_g<i>_d<dim>[_<table>]
PACKED_MLP_NODE = re.compile(r"packed_(.+)_x\d+")  # MLPs packed into one kernel: packed_<first member>_x<count>


def check_reserved_names(view: DocView) -> list[SpecIssue]:
    """No module takes the name of a node the graph builds for something else."""
    features, heads, modules = view.by_name("features"), view.by_name("heads"), view.by_name("modules")
    issues = []
    for m in view.items("modules"):
        name = m.name
        if name is None:
            continue
        what = BUILT_NODES.get(name)
        prefix, _, rest = name.partition("_")
        if what is None and prefix in FEATURE_NODES and rest in features:
            what = f"the {prefix} node of feature {rest!r}"
        elif what is None and prefix == "head" and rest in heads:
            what = f"the node of head {rest!r}"
        elif what is None and GROUP_NODE.fullmatch(name):
            what = "a packed embedding group's node"
        elif what is None and (packed := PACKED_MLP_NODE.fullmatch(name)) and packed.group(1) in modules:
            what = f"the kernel that packs module {packed.group(1)!r} with MLPs of its shape"
        if what is not None:
            issues.append(SpecIssue(f"{m.path}.name", f"module name {name!r} is the name of {what} in the "
                                                      "operator graph; rename the module"))
    return issues


def check_tables(view: DocView) -> list[SpecIssue]:
    """Table references exist, agree on dim, carry no inline table; every shared table is used."""
    tables = view.by_name("tables")
    unknown = UnknownNames()
    issues = []
    used: set[str] = set()
    for f in view.items("features"):
        name = f.get("table", str)
        if not f.is_sparse or name is None:
            continue
        used.add(name)
        for key in INLINE_TABLE_KEYS:
            if key in f.body:
                issues.append(SpecIssue(f"{f.path}.{key}", f"feature {f.name!r} has both 'table' and an inline "
                                                           f"{key!r}; use one of them"))
        for key in TABLE_ONLY_KEYS:
            if key in f.body:
                issues.append(SpecIssue(f"{f.path}.{key}", f"{key!r} belongs on the shared table {name!r}, "
                                                           "not on a feature reading it"))
        table = tables.get(name)
        if table is None:
            issues += unknown.issue(f"{f.path}.table", name, lambda t: f"unknown table {t!r}{unknown.hint(t, tables)}"
                                    + ("" if tables else " (no tables are declared under 'tables')"))
            continue
        dim, table_dim = f.get("dim", int), table.get("dim", int)
        if f.clean and table.clean and dim is not None and table_dim is not None and dim != table_dim:
            issues.append(SpecIssue(f"{f.path}.dim", f"feature {f.name!r} says dim {dim} but table "
                                                     f"{name!r} has dim {table_dim}"))
    if "features" not in view.bad_sections and all(f.clean for f in view.items("features")):
        issues += [SpecIssue(t.path, f"table {t.name!r} is not used by any feature")
                   for t in view.items("tables") if t.name is not None and t.name not in used]
    return issues


# Managed shards of all tables together (a table without `shards` counts 1). Every shard steps at
# every batch, with ids or without, in the data stage and again in the model's replay: measured
# 16 to 19 us a shard on an empty batch, 24 to 33 us with 4,096 Zipf ids (tools/bench_managed_shards.py,
# bench/results/managed_shard_step_cpu.json, 2 CPU cores), so 4,096 shards are about 0.1 s of map
# work a batch, the order of a whole DLRM step, and 1,000 tables of 4,096 shards (what the per-table
# bound alone allowed) about 100 s. The bound equals the per-table one: one table may use it all.
MAX_MANAGED_SHARDS = 4096


def check_managed(view: DocView) -> list[SpecIssue]:
    """A managed table's `decay` goes with `evict: decayed_lfu`; its `shards` are at most its rows;
    the shards of all managed tables together are at most `MAX_MANAGED_SHARDS`."""
    issues = []
    shards: list[tuple[int, Item]] = []
    for t in view.items("tables"):
        managed = t.body.get("managed") if t.clean else None
        if isinstance(managed, dict) and "decay" in managed and managed.get("evict") != "decayed_lfu":
            issues.append(SpecIssue(f"{t.path}.managed.decay", "'decay' applies to evict: decayed_lfu "
                                                               f"(this table evicts by {managed.get('evict', 'lfu')})"))
        if isinstance(managed, dict) and isinstance(managed.get("shards"), int) and isinstance(managed.get("rows"), int) \
                and managed["shards"] > managed["rows"]:
            issues.append(SpecIssue(f"{t.path}.managed.shards", f"must be <= rows ({managed['rows']}): every shard "
                                                                "manages at least one row"))
        if isinstance(managed, dict):
            count = managed.get("shards", 1)
            shards.append((count if isinstance(count, int) and not isinstance(count, bool) else 1, t))
    total = sum(n for n, _ in shards)
    if total > MAX_MANAGED_SHARDS:
        most, where = max(shards, key=lambda p: p[0])
        issues.append(SpecIssue("tables", f"the {len(shards):,} managed tables have {total:,} shards in all "
                                          f"(managed.shards summed, 1 where not given), more than {MAX_MANAGED_SHARDS:,}: "
                                          "every shard steps at every batch, about 20 to 30 us each even "
                                          "without ids, so the maps would cost about "
                                          f"{total * 25e-6:,.1f} s a batch; give fewer shards (the most: "
                                          f"{where.path}.managed.shards, {most:,})"))
    return issues


def check_pooling(view: DocView) -> list[SpecIssue]:
    """Pooling none is for sequence features only; truncate for lists only."""
    return [
        SpecIssue(f"{f.path}.pooling", "pooling 'none' is only for sequence features (type: sequence)")
        for f in view.items("features") if f.clean and f.body["type"] == "categorical" and f.unpooled
    ] + [
        SpecIssue(f"{f.path}.truncate", "truncate picks which ids of a list a feature keeps: only for lists "
                                        "(max_len > 1 or type: sequence), not a one-id feature")
        for f in view.items("features") if f.clean and f.body["type"] == "categorical" and "truncate" in f.body
        and f.get("max_len", int, 1) == 1
    ]


def check_heads(view: DocView) -> list[SpecIssue]:
    """Heads read known modules; the loss fits the task."""
    modules, features = view.by_name("modules"), view.by_name("features")
    unknown = UnknownNames()
    issues = []
    for h in view.items("heads"):
        name = h.get("input", str)
        if name is not None and not re.fullmatch(NAME_PATTERN, name):
            name = None  # no name ('@sparse', '', 'like tower'): the schema's one line says so
        found = output_ref(view, name) if name is not None else None
        if name is not None and found is None:
            issues += unknown.issue(f"{h.path}.input", name, lambda n: (
                f"{n!r} is a feature; a head reads a module's output" if n in features
                else f"unknown module {n!r}") + unknown.hint(n, modules))
        elif found is not None and (problem := output_problem(*found)) is not None:
            issues.append(SpecIssue(f"{h.path}.input", problem))
        if h.clean:
            issues += _head_task(h)
    return issues + _task_spaces(view)


def _head_task(h: Item) -> list[SpecIssue]:
    """The loss is one of the task's; num_classes is given exactly for multiclass heads."""
    task = TASKS[h.body.get("task", "binary")]
    issues = []
    loss = h.body.get("loss")
    if loss is not None and loss not in task.losses:
        owner = next(t for t in TASKS.values() if loss in t.losses)
        issues.append(SpecIssue(f"{h.path}.loss", f"loss {loss!r} needs task {owner.name} (use "
                                                   f"{' or '.join(task.losses)} for {task.name})"))
    if task.classes and "num_classes" not in h.body:
        issues.append(SpecIssue(f"{h.path}.num_classes", f"a {task.name} head needs num_classes"))
    if not task.classes and "num_classes" in h.body:
        issues.append(SpecIssue(f"{h.path}.num_classes", f"only a multiclass head has classes (task {task.name})"))
    return issues


def _task_spaces(view: DocView) -> list[SpecIssue]:
    """trained_where names the label of another head and a value it can hold (0 or 1 for a binary
    head, a class index for a multiclass one). Every head lends its label, also one with a problem
    elsewhere, so that one problem is reported once."""
    default = (view.section("data") or {}).get("label", DEFAULT_LABEL)
    labels: dict[str, Item] = {}
    for h in view.items("heads"):
        labels.setdefault(h.get("label", str, default), h)
    issues = []
    for h in view.items("heads"):
        where = h.body.get("trained_where")
        if not h.clean or where is None:
            continue
        other = labels.get(where["label"])
        if other is None or other is h:
            known = sorted(set(labels) - {h.get("label", str, default)})
            issues.append(SpecIssue(f"{h.path}.trained_where.label",
                                    f"{where['label']!r} is not the label of another head "
                                    f"(labels of the other heads: {', '.join(known) or 'none'})"))
        elif (problem := _space_value(other, where["label"], where["equals"])) is not None:
            issues.append(SpecIssue(f"{h.path}.trained_where.equals", problem))
    return issues


def _space_value(other: Item, label: str, equals: float) -> str | None:
    """Why no row of `other`'s label can equal `equals` (None: some can)."""
    task = TASKS.get(other.body.get("task", "binary"))
    if task is None:
        return None
    if task.labels == "binary" and equals not in (0, 1):
        return (f"head {other.name!r} is binary: its label {label!r} holds 0 or 1, never {equals!r} "
                "(the task space would be empty)")
    classes = other.body.get("num_classes")
    if task.labels == "class" and isinstance(classes, int) and not (
            float(equals).is_integer() and 0 <= equals < classes):
        return (f"head {other.name!r} has {classes} classes: its label {label!r} holds a class index "
                f"0 .. {classes - 1}, never {equals!r} (the task space would be empty)")
    return None


def check_data(view: DocView) -> list[SpecIssue]:
    """data.columns keys name features; a feature reading next-item histories keeps them whole."""
    data = view.section("data")
    columns = data.get("columns", {}) if data else {}
    features = view.by_name("features")
    unknown = UnknownNames()
    issues = [i for key in columns if key not in features
              for i in unknown.issue(f"data.columns.{key}", key, lambda k: f"unknown feature {k!r}{unknown.hint(k, features)}")]
    return issues + _history_lengths(view, data or {}, columns if isinstance(columns, dict) else {})


def _history_lengths(view: DocView, data: dict, columns: dict) -> list[SpecIssue]:
    """The data option `sequence: {max_len: L}` writes up to L previous items, oldest first, and a
    feature keeps the first max_len of a list (unless `truncate: last`): a shorter feature would
    drop the most recent items."""
    options = data.get("options")
    sequence = options.get("sequence") if isinstance(options, dict) else None
    length = sequence.get("max_len") if isinstance(sequence, dict) else None
    if type(length) is not int:
        return []  # malformed options are the data reader's one-line errors
    issues = []
    for f in view.items("features"):
        kept = f.get("max_len", int, 1)
        last = f.get("truncate", str, "first") == "last"
        if f.is_sparse and columns.get(f.name, f.name) == HISTORY_COLUMN and kept < length and not last:
            issues.append(SpecIssue(f"{f.path}.max_len", f"feature {f.name!r} keeps the first {kept} of the up to "
                                                         f"{length} previous items (oldest first) that data option "
                                                         f"sequence.max_len gives, dropping the most recent ones: "
                                                         f"make them equal, or keep the last {kept} with "
                                                         f"truncate: last"))
    return issues


def check_labels(view: DocView) -> list[SpecIssue]:
    """Heads of a multi-task model train on distinct labels; no feature is named as a label or
    sample-weight column."""
    heads = view.items("heads")
    issues = _features_named_as_label_columns(view) + _weighted_by_own_label(view)
    if len(heads) < 2:
        return issues
    data = view.section("data") or {}
    default = data.get("label", DEFAULT_LABEL)
    owner: dict[str, str] = {}
    for h in heads:
        if not h.clean:
            continue
        label = h.get("label", str, default)
        if label in owner:
            issues.append(SpecIssue(f"{h.path}.label", f"heads {owner[label]!r} and {h.name!r} both train on "
                                                       f"label {label!r}; give each head its own 'label'"))
        owner.setdefault(label, h.name or "")
    return issues


def _weighted_by_own_label(view: DocView) -> list[SpecIssue]:
    """A binary or multiclass head whose sample weight is its own label column weighs every row of
    label 0 (the negatives, class 0) at 0: it trained on the other rows alone and learned to score
    every row as one of them, with exit 0."""
    default = (view.section("data") or {}).get("label", DEFAULT_LABEL)
    issues = []
    for h in view.items("heads"):
        task = TASKS.get(h.body.get("task", "binary")) if h.clean else None
        label = h.get("label", str, default)
        if task is not None and task.labels in ("binary", "class") and h.get("sample_weight", str) == label:
            zero = "negative (label 0)" if task.labels == "binary" else "row of class 0"
            issues.append(SpecIssue(f"{h.path}.sample_weight", f"sample_weight {label!r} is the head's own label: "
                                                               f"every {zero} would weigh 0 and train nothing; weigh "
                                                               "the rows by another column, or leave it out"))
    return issues


def _features_named_as_label_columns(view: DocView) -> list[SpecIssue]:
    """An encoded dataset holds each feature under its name beside the heads' label and sample-weight
    columns: a feature named as one of them (a dense `label`) was a traceback when data was converted.
    A feature may read such a column under another name (data.columns)."""
    data = view.section("data") or {}
    default = data.get("label", DEFAULT_LABEL)
    columns: dict[str, str] = {}
    for h in view.items("heads"):
        if h.clean:
            for key, column in (("label", h.get("label", str, default)), ("sample_weight", h.get("sample_weight", str))):
                if column is not None:
                    columns.setdefault(column, f"the {key.replace('_', '-')} column of head {h.name!r}")
    return [SpecIssue(f"{f.path}.name", f"feature {f.name!r} has the name of {columns[f.name]}; rename the feature "
                                        f"(data.columns can still map it to the column {f.name!r})")
            for f in view.items("features") if f.name in columns]


def check_budget(view: DocView) -> list[SpecIssue]:
    """plan.device_budget written as a size ("4GiB") is within 0 .. 1 PiB, as its integer form is."""
    budget = (view.section("plan") or {}).get("device_budget")
    if not isinstance(budget, str):
        return []
    try:
        parse_bytes(budget)
    except ValueError as exc:
        if "fraction of a byte" in str(exc):  # "1.5": a unit left out
            return [SpecIssue("plan.device_budget", f"{show(budget)} is a fraction of a byte: give its unit "
                                                    f"(e.g. {budget.strip()}GiB)")]
        return [SpecIssue("plan.device_budget", f"must be at most 1 PiB (got {show(budget)})")]
    return []


METRICS_BY_TASK = {name: task.metrics for name, task in TASKS.items()}


def check_group_by(view: DocView) -> list[SpecIssue]:
    """training.eval_group_by names a one-id categorical feature."""
    group_by = (view.section("training") or {}).get("eval_group_by")
    if not isinstance(group_by, str):
        return []
    features = view.by_name("features")
    item = features.get(group_by)
    if item is None:
        return [SpecIssue("training.eval_group_by", f"unknown feature {group_by!r}{did_you_mean(group_by, features)}")]
    if not is_one_id_categorical(item.body):
        return [SpecIssue("training.eval_group_by", f"feature {group_by!r} is not a one-id categorical feature; "
                                                    "group by one (e.g. a user id)")]
    return []


def is_one_id_categorical(feature: Any) -> bool:
    """Whether a spec document's feature (its mapping) is a categorical feature of one id per
    sample: the only kind evaluation can be grouped by (gAUC), not dense, multi-hot or a sequence.

    >>> is_one_id_categorical({"name": "user", "type": "categorical"})
    True
    >>> is_one_id_categorical({"name": "genres", "type": "categorical", "max_len": 4})
    False
    """
    return isinstance(feature, dict) and feature.get("type") == "categorical" and feature.get("max_len", 1) == 1


def check_early_stopping(view: DocView) -> list[SpecIssue]:
    """training.early_stopping watches a known head and a metric that head reports (gAUC only with
    training.eval_group_by)."""
    training = view.section("training") or {}
    stopping = training.get("early_stopping")
    if not isinstance(stopping, dict) or not isinstance(stopping.get("metric"), str):
        return []
    heads = view.by_name("heads")
    name = stopping.get("head")
    head = heads.get(name) if isinstance(name, str) else next(iter(heads.values()), None)
    if isinstance(name, str) and head is None:
        return [SpecIssue("training.early_stopping.head", f"unknown head {name!r}{did_you_mean(name, heads)}")]
    metric, where = stopping["metric"], "training.early_stopping.metric"
    task = head.body.get("task", "binary") if head is not None else "binary"
    reported = METRICS_BY_TASK.get(task, ())
    if isinstance(task, str) and task in TASKS and TASKS[task].ranks:
        top_k = head_top_k(view, head)
        whole = isinstance(top_k, list | tuple) and all(type(k) is int for k in top_k)
        reported = retrieval_metric_names(tuple(sorted(set(top_k)))) if whole else ()
    if head is not None and metric not in reported:
        return [SpecIssue(where, f"head {head.name!r} is a {task} head; it reports {', '.join(reported)}")]
    classes = head.body.get("num_classes") if head is not None else None
    if metric == "auc" and task == "multiclass" and isinstance(classes, int) and classes > AUC_MAX_CLASSES:
        return [SpecIssue(where, f"head {head.name!r} has {classes} classes: its auc is reported up to "
                                 f"{AUC_MAX_CLASSES} classes; watch accuracy, accuracy_at_k or logloss")]
    if metric == "gauc" and not isinstance(training.get("eval_group_by"), str):
        return [SpecIssue(where, "gauc needs training.eval_group_by (the feature whose values are the groups)")]
    return []


SEMANTIC_CHECKS = (
    check_duplicates, check_reserved_names, check_tables, check_managed, check_pooling, *MODULE_CHECKS, check_heads, check_data, check_labels,
    check_budget, check_group_by, check_early_stopping, check_retrieval,
)
