"""A read-only view of a spec document for the semantic checks.

The view knows which items passed the schema (`clean`) and resolves module inputs (names and
selectors) to features and modules, and infers the width of every field a module reads.
It never raises on a document the schema rejected: unclean items only lend their names.

Example:
    >>> v = DocView.of({"features": [{"name": "a", "type": "dense"}]}, bad=frozenset())
    >>> [f.name for f in v.dense_features()]
    ['a']
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import Any, Mapping, get_args

from flowrec.spec.model import SELECTOR_DENSE, SELECTOR_PREFIX, SELECTOR_SPARSE, ModuleKind

SECTIONS = ("features", "tables", "modules", "heads")
SPARSE_TYPES = ("categorical", "sequence")


@dataclass(frozen=True)
class Item:
    """One entry of a list section (`features[3]`).

    Args:
        section: features, tables, modules or heads.
        index: position in the section.
        body: the entry's mapping.
        clean: True when the schema found nothing wrong inside it.
    """

    section: str
    index: int
    body: dict
    clean: bool

    @property
    def path(self) -> str:
        return f"{self.section}[{self.index}]"

    @property
    def name(self) -> str | None:
        n = self.body.get("name")
        return n if isinstance(n, str) else None

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        """The value of `key` if it has the expected Python type, else `default`."""
        v = self.body.get(key, default)
        return v if isinstance(v, kind) and not (isinstance(v, bool) and kind is not bool) else default

    @property
    def is_dense(self) -> bool:
        return self.body.get("type") == "dense"

    @property
    def is_sparse(self) -> bool:
        return self.body.get("type") in SPARSE_TYPES

    @property
    def unpooled(self) -> bool:
        return self.is_sparse and self.body.get("pooling") == "none"

    @property
    def tags(self) -> tuple[str, ...]:
        tags = self.get("tags", list, [])
        return tuple(t for t in tags if isinstance(t, str))

    @property
    def inputs(self) -> tuple[str, ...] | None:
        """The module's inputs when they are a list of strings, else None."""
        ins = self.get("inputs", list)
        if ins is None or not all(isinstance(s, str) for s in ins):
            return None
        return tuple(ins)


@dataclass(frozen=True)
class Field:
    """One field a module reads: a vector of `width` (None: unknown) or an unpooled sequence."""

    label: str
    width: int | None
    sequence: bool = False


@dataclass(frozen=True)
class DocView:
    """Items of every list section, indexed by name (first occurrence wins).

    The indexes (names per section, features per tag and per selector, module kinds) are built
    once, in one pass each: the checks look names up per input and per feature, so an index
    rebuilt per lookup made their work grow with the square of the spec (200 tags read by 200
    selectors over 4,000 features rescanned all 4,000 per selector, several times).
    """

    doc: dict
    sections: dict[str, tuple[Item, ...]]
    bad_sections: frozenset[str]

    @classmethod
    def of(cls, doc: dict, bad: frozenset[tuple[Any, ...]]) -> "DocView":
        sections = {}
        bad_sections = {p[0] for p in bad if len(p) == 1 or p[0] not in SECTIONS}
        for sec in SECTIONS:
            raw = doc.get(sec, [])
            raw = raw if isinstance(raw, list) else []
            sections[sec] = tuple(
                Item(sec, i, body, (sec, i) not in bad and sec not in bad_sections)
                for i, body in enumerate(raw)
                if isinstance(body, dict)
            )
        return cls(doc, sections, frozenset(bad_sections))

    def items(self, section: str) -> tuple[Item, ...]:
        return self.sections[section]

    def by_name(self, section: str) -> Mapping[str, Item]:
        """Name -> the first item of that name (read-only: one index shared by every check)."""
        return self._names[section]

    @cached_property
    def _names(self) -> dict[str, Mapping[str, Item]]:
        names = {}
        for section, items in self.sections.items():
            out: dict[str, Item] = {}
            for item in items:
                if item.name is not None:
                    out.setdefault(item.name, item)
            names[section] = MappingProxyType(out)
        return names

    @cached_property
    def _tagged(self) -> dict[str, tuple[Item, ...]]:
        out: dict[str, list[Item]] = {}
        for f in self.items("features"):
            for tag in dict.fromkeys(f.tags):  # a tag given twice selects its feature once
                out.setdefault(tag, []).append(f)
        return {tag: tuple(items) for tag, items in out.items()}

    @property
    def tags(self) -> tuple[str, ...]:
        """Every tag some feature has, in the order the features first give them."""
        return tuple(self._tagged)

    @cached_property
    def module_kinds(self) -> Mapping[str, str]:
        """Module name -> kind (of the modules that have both)."""
        return MappingProxyType({n: m.body["kind"] for n, m in self.by_name("modules").items()
                                 if isinstance(m.body.get("kind"), str)})

    @cached_property
    def unknown_kind_modules(self) -> frozenset[str]:
        """Names of the modules whose kind is misspelt or missing."""
        known = get_args(ModuleKind)
        return frozenset(n for n, m in self.by_name("modules").items() if m.body.get("kind") not in known)

    def section(self, key: str) -> dict | None:
        """A top-level mapping section (data, optimizer...) if it passed the schema."""
        value = self.doc.get(key)
        return value if isinstance(value, dict) and key not in self.bad_sections else None

    def dense_features(self) -> list[Item]:
        return list(self._dense)

    def pooled_features(self) -> list[Item]:
        return list(self._pooled)

    @cached_property
    def _dense(self) -> tuple[Item, ...]:
        return tuple(f for f in self.items("features") if f.is_dense)

    @cached_property
    def _pooled(self) -> tuple[Item, ...]:
        return tuple(f for f in self.items("features") if f.is_sparse and not f.unpooled)

    def tagged(self, tag: str) -> list[Item]:
        return list(self._tagged.get(tag, ()))

    def selector_features(self, token: str) -> list[Item]:
        """Features a selector (`@dense`, `@sparse`, `@tag`) stands for."""
        if token == SELECTOR_DENSE:
            return self.dense_features()
        if token == SELECTOR_SPARSE:
            return self.pooled_features()
        return self.tagged(token[len(SELECTOR_PREFIX):])

    def feature_dim(self, feature: Item) -> int | None:
        """Embedding width of a clean sparse feature (its table's dim when it names one)."""
        if not feature.clean or not feature.is_sparse:
            return None
        table_name = feature.get("table", str)
        if table_name is None:
            return feature.get("dim", int)
        table = self.by_name("tables").get(table_name)
        return table.get("dim", int) if table is not None and table.clean else None

    def feature_fields(self, features: list[Item], label: str) -> list[Field]:
        """Fields of selected features: dense ones concatenated into one, sparse ones each."""
        dense = [f for f in features if f.is_dense]
        fields = [Field(label if len(features) > 1 else dense[0].name or label, len(dense))] if dense else []
        for f in features:
            if f.is_sparse:
                fields.append(Field(f.name or label, self.feature_dim(f), f.unpooled))
        return fields
