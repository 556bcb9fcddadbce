"""Checks of retrieval heads (`task: retrieval`): what they read and the fields only they have.

A retrieval head reads a `similarity` module of two towers: the first input is the query tower,
the second the item tower. The item tower must depend on exactly one feature, a one-id
categorical feature of a vocabulary table (the item id): the whole catalogue is then that
table's rows, and negatives and catalogue vectors are the item tower applied to rows of it.

Example:
    >>> from flowrec.spec.view import DocView
    >>> check_retrieval(DocView.of({"heads": [{"name": "h", "input": "m", "top_k": [5]}]}, bad=frozenset()))[0].message
    'only a retrieval head has top_k (task binary)'
"""
from __future__ import annotations

from typing import Any

from flowrec.spec.errors import SpecIssue
from flowrec.spec.module_checks import SIMILARITY, output_ref
from flowrec.spec.model import SELECTOR_PREFIX
from flowrec.spec.tasks import TASKS, default_top_k
from flowrec.spec.view import DocView, Item

# fields only a retrieval head may set
RETRIEVAL_FIELDS = ("negatives", "logq_correction", "top_k", "exclude_seen")
TOP_K_COLUMNS = ("items", "scores")  # what predict --top-k writes before the heads beside the retrieval head


def check_retrieval(view: DocView) -> list[SpecIssue]:
    """Retrieval heads read a similarity of a query tower and an item tower over one item-id
    feature; their negatives are complete; other heads set none of their fields; one at most."""
    issues: list[SpecIssue] = []
    ranking = []
    for h in view.items("heads"):
        if not h.clean:
            continue
        task = h.body.get("task", "binary")
        if not TASKS[task].ranks:
            issues += [SpecIssue(f"{h.path}.{key}", f"only a retrieval head has {key} (task {task})")
                       for key in RETRIEVAL_FIELDS if key in h.body]
            continue
        ranking.append(h)
        users = (view.section("training") or {}).get("eval_group_by")
        if h.body.get("exclude_seen") and not isinstance(users, str):
            issues.append(SpecIssue(f"{h.path}.exclude_seen", "exclude_seen needs training.eval_group_by (the user "
                                                              "feature whose training items are left out)"))
        elif h.body.get("exclude_seen") and users == _item_feature(view, h):
            issues.append(SpecIssue(f"{h.path}.exclude_seen", f"exclude_seen groups by the user: "
                                                              f"training.eval_group_by {users!r} is the item id"))
        issues += _negatives(h)
        issues += _towers(view, h)
    if len(ranking) > 1:
        issues.append(SpecIssue(f"{ranking[1].path}.task", f"one retrieval head per model (also {ranking[0].name!r})"))
    if ranking:  # predict --top-k writes items and scores, then a column per head beside the retrieval head
        issues += [SpecIssue(f"{h.path}.name", f"a head beside retrieval head {ranking[0].name!r} cannot be named "
                                               f"{h.name!r}: predict --top-k writes that column (each row's top K "
                                               f"{h.name}), then one per such head")
                   for h in view.items("heads") if h.clean and h.name in TOP_K_COLUMNS
                   and not TASKS[h.body.get("task", "binary")].ranks]
    return issues


def _negatives(h: Item) -> list[SpecIssue]:
    neg = h.body.get("negatives") or {}
    path = f"{h.path}.negatives"
    if neg.get("kind", "in_batch") == "sampled":
        return [] if "num" in neg else [SpecIssue(f"{path}.num", "sampled negatives need num (items drawn per step)")]
    return [SpecIssue(f"{path}.{key}", f"{key} is for sampled negatives (kind in_batch)")
            for key in ("num", "distribution") if key in neg]


def _towers(view: DocView, h: Item) -> list[SpecIssue]:
    """The head reads a similarity module whose item tower depends on one item-id feature."""
    path = f"{h.path}.input"
    found = output_ref(view, h.body.get("input", ""))
    if found is None or found[0].body.get("kind") != SIMILARITY:
        return [SpecIssue(path, "a retrieval head reads a similarity module (inputs: [query tower, item tower])")]
    inputs = found[0].inputs or ()
    if len(inputs) != 2:
        return []  # the similarity's own check reports it
    features, problem = item_features(view, inputs[1])
    if problem is not None:
        return [SpecIssue(path, f"item tower {inputs[1]!r}: {problem}")]
    if len(features) != 1:
        return [SpecIssue(path, f"item tower {inputs[1]!r} must read exactly one feature, the item id "
                                f"(reads {', '.join(sorted(features)) or 'none'})")]
    item = view.by_name("features")[next(iter(features))]
    if (why := _item_problem(view, item)) is not None:
        return [SpecIssue(path, f"item tower {inputs[1]!r}: {why}")]
    if (why := _top_k_problem(view, h, item)) is not None:
        return [SpecIssue(f"{h.path}.top_k", why)]
    if _reads(view, inputs[0], item.name or ""):
        return [SpecIssue(path, f"query tower {inputs[0]!r} reads the item id {item.name!r}: a query must not see "
                                "the item it is scored against (training would learn the answer, and serving "
                                "has no item)")]
    return []


def catalogue_size(view: DocView, item: Item) -> int | None:
    """The most items a retrieval head's catalogue holds: the item table's `vocab` plus its
    `vocab_spare` rows (spare rows take new items); None when the spec does not say (a managed
    table, a hashed one, a value of the wrong kind: its own check reports that)."""
    table = _item_table(view, item)
    vocab = table.body.get("vocab") if table is not None else None
    spare = table.body.get("vocab_spare", 0) if table is not None else 0
    return vocab + spare if type(vocab) is int and type(spare) is int else None


def _item_table(view: DocView, item: Item) -> Item | None:
    """The table of the item-id feature (the feature itself when its table is inline)."""
    name = item.body.get("table")
    return view.by_name("tables").get(name) if isinstance(name, str) else item


def head_top_k(view: DocView, h: Item) -> Any:
    """A retrieval head's cut-offs: its `top_k` as written, or the default for its catalogue
    (`default_top_k`: the Ks of [10, 100] below the catalogue's size)."""
    if "top_k" in h.body:
        return h.body["top_k"]
    feature = _item_feature(view, h)
    item = view.by_name("features").get(feature) if feature is not None else None
    return list(default_top_k(catalogue_size(view, item) if item is not None else None))


def _top_k_problem(view: DocView, h: Item, item: Item) -> str | None:
    """Why a head's `top_k` does not fit the catalogue (None: it does): the catalogue holds at most
    the item table's `vocab` items, and with K at least that every item is in the top K, so hr@K
    and recall@K are 1.0 for any model (they were reported so without a word). The default's Ks
    are those below the catalogue's size, so only a written K, or a catalogue of one item, fails."""
    vocab = catalogue_size(view, item)
    top_k = head_top_k(view, h)
    if vocab is None or not isinstance(top_k, list):
        return None
    spare = _item_table(view, item).body.get("vocab_spare", 0)  # a table: catalogue_size found it
    big = sorted(k for k in top_k if type(k) is int and k >= vocab)
    if not big:
        return None
    return (f"K {big[0]} is not below the catalogue's {vocab} item{'s' if vocab > 1 else ''} (the vocab{' and spare rows' if spare else ''} "
            f"of item id {item.name!r}): every "
            f"item is in the top {big[0]}, so hr@{big[0]} and recall@{big[0]} would be 1.0 for any model; "
            + (f"give top_k with Ks below {vocab}" if vocab > 1 else "a catalogue of one item has nothing to rank"))


def _reads(view: DocView, token: str, feature: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether a module input depends on `feature` (directly, through a selector or a module)."""
    if token.startswith(SELECTOR_PREFIX):
        return any(f.name == feature for f in view.selector_features(token))
    if token in view.by_name("features"):
        return token == feature
    found = output_ref(view, token)
    if found is None or found[0].name in seen:
        return False
    return any(_reads(view, inner, feature, seen | {found[0].name or ""}) for inner in found[0].inputs or ())


def _item_feature(view: DocView, h: Item) -> str | None:
    """The item-id feature of a retrieval head's item tower (None when it has not exactly one)."""
    found = output_ref(view, h.body.get("input", ""))
    inputs = (found[0].inputs or ()) if found is not None else ()
    features = item_features(view, inputs[1])[0] if len(inputs) == 2 else set()
    return next(iter(features)) if len(features) == 1 else None


def item_features(view: DocView, token: str, seen: frozenset[str] = frozenset()) -> tuple[set[str], str | None]:
    """The features a module input depends on, through modules (and a problem, if any)."""
    features = view.by_name("features")
    if token.startswith(SELECTOR_PREFIX):
        return set(), f"reads the selector {token!r}; name the item id feature"
    if token in features:
        return {token}, None
    found = output_ref(view, token)
    if found is None or found[0].name in seen:
        return set(), None  # unknown names and cycles are reported by the module checks
    out: set[str] = set()
    for inner in found[0].inputs or ():
        more, problem = item_features(view, inner, seen | {found[0].name or ""})
        if problem is not None:
            return out, problem
        out |= more
    return out, None


def _item_problem(view: DocView, item: Item) -> str | None:
    """Why a feature cannot be the item id (None: it can)."""
    if item.body.get("type") != "categorical" or item.body.get("max_len", 1) != 1:
        return f"feature {item.name!r} must be a one-id categorical feature (the item id)"
    name = item.body.get("table")
    table = view.by_name("tables").get(name) if isinstance(name, str) else item
    if table is not None and ("hash_buckets" in table.body or "managed" in table.body):
        return (f"feature {item.name!r} must use a vocabulary table (the catalogue is its rows), "
                "not a hashed or managed one")
    return None
