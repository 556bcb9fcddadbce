"""What a spec changes in the model of a run it would resume or start from, in words.

A run resumes (`--resume`) or starts from another (`--init-from`) only with the model it was
trained with (`flowrec.graph.plan_io.model_fingerprint`). When the fingerprints differ, the
generic line ("the spec's model differs") leaves the user to diff the specs; for the settings of
managed tables this module names the table, the field and both values, and says whether the
change alters the checkpoint's layout:

- `managed.shards`: the checkpoint holds one map per shard (`managed.<table>.shard<s>.*`) and an
  id's shard and row follow from S (`shard_of(id) % S`, rows `r % S == s`): another S is another
  set of keys, and another contest for every id. No conversion exists: start a new run, or keep
  the old S.
- `managed.rows`: the table's rows (the embedding rows and optimizer state) and every shard's
  capacity and free rows.
- a table managed in one spec and not in the other: map keys on one side only.
- the map's rules (`admit_min_count`, `evict`, `decay`, `every_steps`, `ttl_steps`) keep the
  layout but change the model a run continues (which ids hold rows), so they are named too.

Example:
    >>> [c.phrase() for c in managed_changes(old_spec, new_spec)]  # doctest: +SKIP
    ["table 'users': managed.shards 4 in the run, 8 in the spec (it changes the checkpoint's layout: ...)"]
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from typing import Any

from flowrec.spec.model import ManagedSpec, ModelSpec

LAYOUT_FIELDS = {
    "shards": "it changes the checkpoint's layout: one map per shard, managed.{table}.shard<s>.*, and each id's "
              "shard and row follow from the count",
    "rows": "it changes the checkpoint's layout: the table's rows and optimizer state, and every map's capacity",
}


def recorded_spec(state: dict[str, Any]) -> ModelSpec | None:
    """The spec a checkpoint recorded (its `spec` entry), or None when it cannot be read as one."""
    from flowrec.spec.load import spec_from_dict

    try:
        return spec_from_dict(json.loads(state["spec"]))
    except Exception:  # any damage: the caller falls back to its generic line
        return None


@dataclass(frozen=True)
class Change:
    """One managed setting of one table that differs. `field` None: the table is managed on one
    side only (`old` / `new`: whether it is managed in the run / the spec)."""

    table: str
    field: str | None
    old: Any
    new: Any

    def phrase(self) -> str:
        """E.g. "table 'users': managed.shards 4 in the run, 8 in the spec (it changes the checkpoint's layout: ...)"."""
        if self.field is None:
            where, other = ("the run", "the spec") if self.old else ("the spec", "the run")
            return (f"table {self.table!r} is managed in {where}, not in {other} (it changes the checkpoint's "
                    "layout: the map's arrays are on one side only)")
        why = LAYOUT_FIELDS.get(self.field)
        return (f"table {self.table!r}: managed.{self.field} {_value(self.old)} in the run, {_value(self.new)} in "
                "the spec" + (f" ({why.format(table=self.table)})" if why else " (it changes which ids hold rows)"))

    def keep(self) -> str:
        """What to leave as the run had it, e.g. "shards: 4 in table 'users'"."""
        if self.field is None:
            return f"table {self.table!r} {'managed' if self.old else 'not managed'}"
        return f"{self.field}: {_value(self.old)} in table {self.table!r}"


def managed_changes(old: ModelSpec, new: ModelSpec) -> list[Change]:
    """Every managed setting that differs between `old` (the run's spec) and `new` (the spec
    given), in table order of `old` then of tables only `new` has; empty when none does.

    Args:
        old: the spec the run was trained with.
        new: the spec given to resume it or start from it.

    Returns:
        The changes (`Change.phrase` says each in words).
    """
    before = {t.name: t.managed for t in old.tables}
    after = {t.name: t.managed for t in new.tables}
    out: list[Change] = []
    for name in [*before, *(n for n in after if n not in before)]:
        a, b = before.get(name), after.get(name)
        if a is None and b is None:
            continue
        if (a is None) != (b is None):
            out.append(Change(name, None, a is not None, b is not None))
            continue
        out += [Change(name, f.name, getattr(a, f.name), getattr(b, f.name))
                for f in fields(ManagedSpec) if getattr(a, f.name) != getattr(b, f.name)]
    return out


def _value(value: Any) -> str:
    return "not set" if value is None else f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) \
        else str(value)


def changed_model_line(folder: str, state: dict[str, Any], spec: ModelSpec, starting_from: bool,
                       python: bool = False) -> str:
    """The one line refusing `spec` for the run in `folder` (whose checkpoint is `state`): the
    managed settings that differ, with what to do, or the generic line when none does.

    Args:
        folder: the run folder (or checkpoint) resumed or started from.
        state: its checkpoint (the `spec` entry is read).
        spec: the spec given.
        starting_from: True for `--init-from` (a new run from that one), False for `--resume`.
        python: the resume is `flowrec.train(resume=)`'s: a new run is named by its argument (`out=`).

    Returns:
        The line, without "error: ".
    """
    line = f"the spec's model differs from the one the run in {folder} was trained with"
    old = recorded_spec(state)
    if old is not None and old.name != spec.name:  # another spec altogether, most likely: said first
        line += f" (a run of spec {old.name!r}; this spec is {spec.name!r})"
    changes = managed_changes(old, spec) if old is not None else []
    if not changes:
        found = model_differences(old, spec) if old is not None else []
        if not found:
            return line
        return f"{line}: {listed(found)} (compare the spec with {folder}/spec.json)"
    keep = ", ".join(c.keep() for c in changes)
    new_run = "out=" if python else "--out"
    todo = (f"keep {keep} to start from this run, or train without --init-from" if starting_from
            else f"keep {keep} to resume it, or start a new run (another {new_run}) with the new "
                 f"value{'s' if len(changes) > 1 else ''}")
    more = "" if _only_managed_differs(old, spec) else \
        f". Other parts of the model differ too (compare the spec with {folder}/spec.json)"
    return f"{line}: {'; '.join(c.phrase() for c in changes)}. To go on, {todo}{more}"


SHOWN = 3  # differences named in the line
_ABSENT = object()


def model_differences(old: ModelSpec, new: ModelSpec) -> list[str]:
    """Each part of the model (`model_fingerprint`'s: features, tables, modules, heads, optimizer,
    training.batch_size and precision) that differs between the run's spec and the one given, in
    words: "training.batch_size 32 in the run, 64 in the spec", "features[user].hash_buckets 50 in
    the run, 60 in the spec", "modules[extra] not in the run, in the spec"; named items (features,
    tables, modules, heads) are matched by name.

    Example:
        >>> model_differences(old_spec, new_spec)  # doctest: +SKIP
        ['training.batch_size 32 in the run, 64 in the spec']
    """
    return document_differences(_model_doc(old), _model_doc(new))


def listed(found: list[str]) -> str:
    """The first `SHOWN` differences, and how many more there are."""
    more = f"; and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
    return f"{'; '.join(found[:SHOWN])}{more}"


def document_differences(old: Any, new: Any) -> list[str]:
    """`model_differences` over two whole spec documents (`to_dict`), e.g. the run's spec.json and
    the spec given to resume it: "training.epochs 2 in the run, 3 in the spec"."""
    out: list[str] = []
    _differ(old, new, "", out)
    return out


def _model_doc(spec: ModelSpec) -> dict[str, Any]:
    from flowrec.graph.plan_io import FINGERPRINT_TRAINING
    from flowrec.spec.load import to_dict
    from flowrec.spec.model import identity_doc

    doc = identity_doc(to_dict(spec))
    model = {k: doc.get(k) for k in ("features", "tables", "modules", "heads", "optimizer")}
    model["training"] = {k: (doc.get("training") or {}).get(k) for k in FINGERPRINT_TRAINING}
    return model


def _differ(a: Any, b: Any, path: str, out: list[str]) -> None:
    if a == b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            _differ(a.get(key, _ABSENT), b.get(key, _ABSENT), f"{path}.{key}" if path else str(key), out)
        return
    named = isinstance(a, list) and isinstance(b, list) and all(
        isinstance(x, dict) and isinstance(x.get("name"), str) for x in [*a, *b])
    if named:
        left, right = {x["name"]: x for x in a}, {x["name"]: x for x in b}
        if len(left) == len(a) and len(right) == len(b):
            before = len(out)
            for name in [*left, *(n for n in right if n not in left)]:
                _differ(left.get(name, _ABSENT), right.get(name, _ABSENT), f"{path}[{name}]", out)
            if len(out) == before:  # the same items in another order
                out.append(f"{path}: the same items in another order")
            return
    out.append(f"{path} {_shown(a)} in the run, {_shown(b)} in the spec")


def _shown(value: Any) -> str:
    if value is _ABSENT:
        return "not there"
    text = _value(value) if not isinstance(value, (dict, list)) else json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def _only_managed_differs(old: ModelSpec, new: ModelSpec) -> bool:
    """True when `new` with the managed settings (and rows) of `old` restored is `old`'s model
    (`model_fingerprint`): the changes named are all there is to keep."""
    from flowrec.graph.plan_io import model_fingerprint as model_hash  # a call ending in "print" plus "(" reads as printing to the layer test

    before = {t.name: t for t in old.tables}
    restored = []
    for t in new.tables:
        o = before.get(t.name)
        if o is not None and (o.managed is None) != (t.managed is None):
            return False  # a table managed on one side only: its other fields differ anyway
        restored.append(t if o is None else replace(t, managed=o.managed, rows=o.rows))
    return model_hash(replace(new, tables=tuple(restored))) == model_hash(old)
