"""Semantic checks of the module DAG: references, selectors, cycles, shapes, usage, reachability.

Each check is ``check(view) -> list[SpecIssue]`` and reads only what the schema accepted.
Width rules (used for the shape checks): a pooled sparse feature is a field of its dim; a dense
input is one field of as many values as dense features; a module's output is one field of its
width: mlp -> last layer, linear -> out, fm -> 1, dot -> F(F-1)/2 for F fields, concat / cross ->
sum of input widths, target_attention and self_attention -> the sequence dim, similarity -> 1.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Mapping, get_args

from flowrec.spec.errors import SpecIssue
from flowrec.spec.model import (NAMED_OUTPUT_KINDS, SELECTOR_DENSE, SELECTOR_PREFIX, SELECTOR_SPARSE, ModuleKind,
                                split_output)
from flowrec.spec.schema_errors import NAME_PATTERN, UnknownNames
from flowrec.spec.view import DocView, Field, Item

TARGET_ATTENTION = "target_attention"
SELF_ATTENTION = "self_attention"
SIMILARITY = "similarity"
# The input (by index) of the kinds that read a pooling-none sequence, named in messages.
SEQUENCE_INPUT = {TARGET_ATTENTION: (1, "second input"), SELF_ATTENTION: (0, "input")}
SEQUENCE_READERS = "a target_attention module (as its second input) or a self_attention module"
FIELD_KINDS = ("dot", "fm")  # kinds whose fields must share one dim
MAX_NAMES_SHOWN = 3  # field names quoted per dim group in a shape message


@dataclass(frozen=True)
class Ref:
    """One resolved module input: the features or the module (and its named output) it stands for."""

    index: int
    token: str
    features: tuple[Item, ...] = ()
    module: Item | None = None
    output: str | None = None


def split_input(token: str, kinds: Mapping[str, str], unknown: frozenset[str]) -> tuple[str, str | None] | None:
    """`split_output`, where a module of an unknown kind (`DocView.unknown_kind_modules`) is still a module:
    its name, or `<module>.<output>`, reads it, so the modules and heads reading it are not also
    said to read an unknown name, nor it to feed no head.

    >>> split_input("mix.like", {"mix": "pel"}, frozenset({"mix"})), split_input("mix.like", {"mix": "mlp"}, frozenset())
    (('mix', 'like'), None)
    """
    split = split_output(token, kinds)
    if split is not None or not unknown:
        return split
    if token in unknown:
        return token, None
    module, dot, output = token.rpartition(".")
    return (module, output) if dot and module in unknown else None


def output_ref(view: DocView, token: str) -> tuple[Item, str | None] | None:
    """The module (and named output) `token` reads, if it reads a module (`split_input`)."""
    split = split_input(token, view.module_kinds, view.unknown_kind_modules)
    return None if split is None else (view.by_name("modules")[split[0]], split[1])


def resolve(view: DocView, module: Item) -> list[Ref]:
    """Known inputs of a module (unknown names and empty selectors are left out)."""
    features = view.by_name("features")
    refs = []
    for j, token in enumerate(module.inputs or ()):
        if token.startswith(SELECTOR_PREFIX):
            refs.append(Ref(j, token, tuple(view.selector_features(token))))
        elif token in features:
            refs.append(Ref(j, token, (features[token],)))
        elif (found := output_ref(view, token)) is not None:
            refs.append(Ref(j, token, module=found[0], output=found[1]))
    return refs


SHOWN_OUTPUTS = 20  # outputs a message lists (a moe of 5,000 heads made a 30 KB line)


def output_problem(module: Item, output: str | None) -> str | None:
    """Why a module has no such named output (None: it has it, or none was named)."""
    if output is None:
        return None
    kind = module.body.get("kind")
    if kind not in get_args(ModuleKind):
        return None  # a misspelt or missing kind: its own issue says so, its outputs cannot be told
    names = module.body.get(NAMED_OUTPUT_KINDS.get(kind, "") if isinstance(kind, str) else "", ())
    names = names if isinstance(names, list | tuple) else ()
    if output in names:
        return None
    if not names:  # its own list of outputs is missing or wrong: that error names it
        key = NAMED_OUTPUT_KINDS.get(kind) if isinstance(kind, str) else None
        what = f"its `{key}` list names none" if key else f"a {kind!r} module has no named outputs"
        return f"module {module.name!r} has no output {output!r} ({what})"
    shown = ", ".join(map(str, names[:SHOWN_OUTPUTS])) + (f", ... ({len(names):,} in all)" if len(names) > SHOWN_OUTPUTS else "")
    return f"module {module.name!r} has no output {output!r} (outputs: {shown})"


@dataclass
class Shapes:
    """Memoised output widths of modules (None: unknown, e.g. an unclean module or a cycle)."""

    view: DocView
    memo: dict[str, int | None] = field(default_factory=dict)

    def fields(self, module: Item, visiting: frozenset[str] = frozenset()) -> list[Field]:
        out: list[Field] = []
        for ref in resolve(self.view, module):
            if ref.module is not None:
                width = self.width(ref.module, visiting) if ref.output is None else _output_width(ref.module)
                out.append(Field(ref.token, width))
            else:
                out.extend(self.view.feature_fields(list(ref.features), ref.token))
        return out

    def width(self, module: Item, visiting: frozenset[str] = frozenset()) -> int | None:
        name = module.name or ""
        if name in self.memo:
            return self.memo[name]
        if not module.clean or name in visiting:
            return None
        fields = self.fields(module, visiting | {name})
        width = _WIDTH_RULES[module.body["kind"]](module, fields)
        self.memo[name] = width
        return width


def _sum(fields: list[Field]) -> int | None:
    if any(f.width is None or f.sequence for f in fields):
        return None
    return sum(f.width for f in fields)


def _output_width(module: Item) -> int | None:
    """Width of one named output of a module (a moe head: the experts' last layer)."""
    return module.body["expert_layers"][-1] if module.clean else None


_WIDTH_RULES: dict[str, Callable[[Item, list[Field]], int | None]] = {
    "moe": lambda m, fs: len(m.body["heads"]) * m.body["expert_layers"][-1],
    "ple": lambda m, fs: len(m.body["heads"]) * m.body["expert_layers"][-1],
    "custom": lambda m, fs: m.body.get("out_width"),  # None until the planning dry run fills it
    "mlp": lambda m, fs: m.body["layers"][-1],
    "linear": lambda m, fs: m.body.get("out", 1),
    "fm": lambda m, fs: 1,
    "dot": lambda m, fs: len(fs) * (len(fs) - 1) // 2,
    "concat": lambda m, fs: _sum(fs),
    "cross": lambda m, fs: _sum(fs),
    "target_attention": lambda m, fs: fs[1].width if len(fs) == 2 and fs[1].sequence else None,
    "self_attention": lambda m, fs: fs[0].width if len(fs) in (1, 2) and fs[0].sequence else None,
    "similarity": lambda m, fs: 1,
}


def check_inputs(view: DocView) -> list[SpecIssue]:
    """Unknown names (with did-you-mean), selectors matching nothing, repeated inputs (a
    did-you-mean for the first few unknown names and empty selectors: `UnknownNames`)."""
    features, modules = view.by_name("features"), view.by_name("modules")
    tags = sorted(SELECTOR_PREFIX + t for t in view.tags)
    selectors = [t for t in (SELECTOR_DENSE, SELECTOR_SPARSE, *tags) if view.selector_features(t)]  # what a typo meant
    unknown, empty = UnknownNames(), UnknownNames()
    issues = []
    for m in view.items("modules"):
        seen: set[str] = set()
        for j, token in enumerate(m.inputs or ()):
            path = f"{m.path}.inputs[{j}]"
            if token in seen:
                issues.append(SpecIssue(path, f"input {token!r} is listed twice"))
            seen.add(token)
            if not re.fullmatch(NAME_PATTERN, token.removeprefix(SELECTOR_PREFIX)):
                continue  # no name ('.like', 'like tower'): the schema's one line says so
            if token.startswith(SELECTOR_PREFIX):
                if not view.selector_features(token):
                    issues += empty.issue(path, token, lambda t: _empty_selector(t, selectors, empty.hint))
            elif token == m.name:
                issues.append(SpecIssue(path, f"module {token!r} cannot read its own output"))
            elif token in features:
                continue
            elif (found := output_ref(view, token)) is None:
                issues += unknown.issue(path, token, lambda t: _unknown_input(t, list(features), list(modules), unknown.hint))
            elif found[0].name == m.name:  # one of its named outputs ('experts.like' in experts' inputs)
                issues.append(SpecIssue(path, f"module {m.name!r} cannot read its own output {token!r}"))
            elif (problem := output_problem(*found)) is not None:
                issues.append(SpecIssue(path, problem))
    return issues


def _empty_selector(token: str, selectors: list[str], hint: Callable[[str, list[str]], str]) -> str:
    what = {SELECTOR_DENSE: "there are no dense features", SELECTOR_SPARSE: "there are no pooled sparse features"}
    reason = what.get(token, f"no feature has the tag {token[len(SELECTOR_PREFIX):]!r}")
    return f"selector {token!r} matches nothing ({reason}){hint(token, selectors)}"


def _unknown_input(token: str, features: list[str], modules: list[str],
                   hint: Callable[[str, list[str]], str]) -> str:
    if close := hint(token, modules):
        return f"unknown module {token!r}{close}"
    if close := hint(token, features):
        return f"unknown feature {token!r}{close}"
    return f"unknown feature or module {token!r}"


def check_sequences(view: DocView) -> list[SpecIssue]:
    """Pooling-none sequences only as the sequence input of target_attention / self_attention;
    the query of target_attention a vector."""
    issues = []
    for m in view.items("modules"):
        kind = m.body.get("kind")
        if kind not in get_args(ModuleKind):
            continue  # the schema names the kind it does not know: which inputs fit it cannot be told
        seq_index, seq_name = SEQUENCE_INPUT.get(kind, (None, ""))
        if kind == TARGET_ATTENTION and (swapped := _swapped_attention_inputs(view, m)) is not None:
            issues.append(swapped)
            continue
        for ref in resolve(view, m):
            path = f"{m.path}.inputs[{ref.index}]"
            seqs = [f.name for f in ref.features if f.unpooled]
            is_seq_slot = ref.index == seq_index
            via = f" (through {ref.token!r})" if ref.token.startswith(SELECTOR_PREFIX) else ""
            if seqs and kind == SELF_ATTENTION and ref.index == 1:  # the target (output: target)
                issues.append(SpecIssue(path, f"the target of self_attention is one vector (a one-id feature or a "
                                              f"module of the sequence dim), not the pooling-none sequence "
                                              f"{seqs[0]!r}{via}"))
            elif seqs and not is_seq_slot:
                issues.append(SpecIssue(path, f"sequence feature {seqs[0]!r}{via} has pooling none: only "
                                              f"{SEQUENCE_READERS} can read it"))
            if is_seq_slot and m.clean and not (len(ref.features) == 1 and seqs):
                issues.append(SpecIssue(path, f"the {seq_name} of {kind} must be one sequence "
                                              "feature with pooling none"))
            if kind == TARGET_ATTENTION and ref.index == 0 and m.clean and _bad_query(ref):
                issues.append(SpecIssue(path, "the query of target_attention must be one pooled sparse "
                                              "feature or a module"))
    return issues


def _swapped_attention_inputs(view: DocView, module: Item) -> SpecIssue | None:
    """`inputs: [click_sequence, adgroup_id]` of a target_attention, the order self_attention's
    `output: target` takes: one line saying which order it reads, where three lines said that the
    sequence, the query and the second input were each wrong."""
    refs = resolve(view, module)
    if len(refs) != 2 or len(module.inputs or ()) != 2:
        return None
    sequence, query = refs
    if len(sequence.features) != 1 or not sequence.features[0].unpooled or _bad_query(query):
        return None
    return SpecIssue(f"{module.path}.inputs", f"target_attention reads [query, sequence], the sequence second: write "
                                              f"inputs: [{query.token}, {sequence.token}]")


def _bad_query(ref: Ref) -> bool:
    if ref.module is not None:
        return False
    return len(ref.features) != 1 or not ref.features[0].is_sparse or ref.features[0].unpooled


def check_cycles(view: DocView) -> list[SpecIssue]:
    """Module inputs must form a DAG; each cycle is named once."""
    modules = view.by_name("modules")
    kinds, unknown = view.module_kinds, view.unknown_kind_modules
    edges = {n: [s[0] for t in (m.inputs or ()) if (s := split_input(t, kinds, unknown)) is not None and s[0] != n]
             for n, m in modules.items()}
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    issues = []

    def visit(name: str, stack: list[str]) -> None:
        state[name] = 1
        for nxt in edges[name]:
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                issues.append(SpecIssue(f"{modules[nxt].path}.inputs", "cycle " + " -> ".join(cycle)))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[name] = 2

    for name in modules:
        if name not in state:
            visit(name, [name])
    return issues


def check_shapes(view: DocView) -> list[SpecIssue]:
    """dot / fm fields share one dim; target_attention query and sequence share one dim;
    self_attention heads divide its sequence dim; similarity reads two vectors of one width."""
    shapes = Shapes(view)
    issues = []
    for m in view.items("modules"):
        kind = m.body.get("kind")
        if not m.clean or kind not in (*FIELD_KINDS, TARGET_ATTENTION, *_OWN_SHAPE_CHECKS):
            continue
        if kind in _OWN_SHAPE_CHECKS:
            issues += _OWN_SHAPE_CHECKS[kind](m, shapes)
            continue
        fields = shapes.fields(m)
        known = [f for f in fields if f.width is not None]
        if kind in FIELD_KINDS and len(fields) < 2 and _all_resolved(view, m):
            issues.append(SpecIssue(f"{m.path}.inputs", f"{kind} needs at least 2 fields, got {len(fields)}"))
        elif kind in FIELD_KINDS and len({f.width for f in known}) > 1:
            issues.append(SpecIssue(f"{m.path}.inputs", f"{kind} needs fields of equal dim, got {_dims(known)}"))
        elif kind == TARGET_ATTENTION and _dims_differ(view, m, known):
            q, s = known
            issues.append(SpecIssue(f"{m.path}.inputs", f"target_attention query {q.label!r} has dim {q.width} "
                                                        f"but sequence {s.label!r} has dim {s.width}"))
    return issues


def _heads_divide(module: Item, shapes: Shapes) -> list[SpecIssue]:
    """Heads divide the sequence dim; with output target there is a target of that width (and
    only then a second input)."""
    heads, dim = module.body.get("num_heads", 1), shapes.width(module)
    target = module.body.get("output") == "target"
    if _attention_inputs(module) is not None:
        return []  # check_attention_inputs reports it
    fields = shapes.fields(module)
    if target and len(fields) > 2:  # a selector of several fields (@sparse) as the target
        shown = ", ".join(f.label for f in fields[1:1 + MAX_NAMES_SHOWN])
        shown += ", ..." if len(fields) - 1 > MAX_NAMES_SHOWN else ""
        return [SpecIssue(f"{module.path}.inputs[1]", f"the target of self_attention is one vector (a feature or a "
                                                      f"module), not {len(fields) - 1} fields ({shown})")]
    if target and len(fields) == 2 and None not in (fields[1].width, dim) and fields[1].width != dim:
        return [SpecIssue(f"{module.path}.inputs", f"the target {fields[1].label!r} has width {fields[1].width}, "
                                                   f"the sequence dim is {dim}")]
    if dim is None or dim % heads == 0:
        return []
    return [SpecIssue(f"{module.path}.num_heads", f"{heads} heads do not divide the sequence dim {dim}")]


def _two_vectors(module: Item, shapes: Shapes) -> list[SpecIssue]:
    fields = shapes.fields(module)
    if len(fields) != 2 and _all_resolved(shapes.view, module):
        return [SpecIssue(f"{module.path}.inputs", f"similarity needs two vectors (one field each), got "
                                                   f"{len(fields)} fields")]
    widths = [f.width for f in fields]
    if len(fields) == 2 and None not in widths and widths[0] != widths[1]:
        return [SpecIssue(f"{module.path}.inputs", f"similarity needs two vectors of one width, got "
                                                   f"{_dims(fields)}")]
    return []


# Kinds with a shape rule of their own: (module, the memoised widths) -> issues.
_OWN_SHAPE_CHECKS: dict[str, Callable[[Item, Shapes], list[SpecIssue]]] = {
    SELF_ATTENTION: _heads_divide, SIMILARITY: _two_vectors}


def _dims_differ(view: DocView, module: Item, known: list[Field]) -> bool:
    refs = resolve(view, module)
    query_ok = len(refs) == 2 and refs[0].index == 0 and not _bad_query(refs[0])
    return query_ok and len(known) == 2 and known[1].sequence and known[0].width != known[1].width


def _all_resolved(view: DocView, module: Item) -> bool:
    refs = resolve(view, module)
    return len(refs) == len(module.inputs or ()) and all(r.features or r.module for r in refs)


def _dims(fields: list[Field]) -> str:
    groups: dict[int, list[str]] = {}
    for f in fields:
        groups.setdefault(f.width, []).append(f.label)
    parts = []
    for width, labels in groups.items():
        shown = ", ".join(labels[:MAX_NAMES_SHOWN])
        more = f" and {len(labels) - MAX_NAMES_SHOWN} more" if len(labels) > MAX_NAMES_SHOWN else ""
        parts.append(f"dim {width}: {shown}{more}")
    return "; ".join(parts)


def check_usage(view: DocView) -> list[SpecIssue]:
    """Every feature is read by some module (skipped while some module's inputs are unreadable or
    name nothing: a typo such as '@spares' for '@sparse' is check_inputs' one issue, not also one
    per feature it was meant to read)."""
    mods = view.items("modules")
    if any(m.inputs is None for m in mods) or "modules" in view.bad_sections:
        return []
    if not all(_all_resolved(view, m) for m in mods):
        return []
    used = {id(f) for m in mods for ref in resolve(view, m) for f in ref.features}
    return [
        SpecIssue(f.path, f"feature {f.name!r} is not used by any module (add it to a module's inputs, "
                          "directly or through '@sparse', '@dense' or a tag, or remove it)")
        for f in view.items("features") if id(f) not in used and f.name is not None
    ]


def check_reach(view: DocView) -> list[SpecIssue]:
    """Every module feeds some head, directly or through other modules."""
    mods, heads = view.by_name("modules"), view.items("heads")
    if "heads" in view.bad_sections or any(m.inputs is None for m in view.items("modules")):
        return []
    kinds, unknown = view.module_kinds, view.unknown_kind_modules
    reads = [split_input(h.get("input", str) or "", kinds, unknown) for h in heads]
    if any(r is None for r in reads):
        return []  # a head reading an unknown name is reported by check_heads
    todo = [r[0] for r in reads]
    reached: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(s[0] for t in mods[name].inputs or () if (s := split_input(t, kinds, unknown)) is not None)
    return [
        SpecIssue(m.path, f"module {name!r} does not feed any head (its output would be unused)")
        for name, m in mods.items() if name not in reached
    ]


def check_outputs_read(view: DocView) -> list[SpecIssue]:
    """Every named output of a moe / ple module is read by some module or head, unless the module
    is read whole (`mix`: all its outputs): an output nobody reads (`heads: [like, love, hate]`
    with no reader of `mix.hate`) trained its gate (and a ple's own experts of the last level)
    for nothing, without a word. Skipped while some reader names nothing or an output the module
    lacks, or a module or feature is named as an output: those are their own lines."""
    mods, heads = view.items("modules"), view.items("heads")
    if "heads" in view.bad_sections or "modules" in view.bad_sections or any(m.inputs is None for m in mods):
        return []
    if not all(_all_resolved(view, m) for m in mods) or not all(h.clean for h in heads):
        return []
    kinds, unknown = view.module_kinds, view.unknown_kind_modules
    reads = [split_input(h.body["input"], kinds, unknown) for h in heads]
    if any(split is None for split in reads):
        return []  # a head reading an unknown name: check_heads' line
    reads += [(r.module.name, r.output) for m in mods for r in resolve(view, m) if r.module is not None]
    read = set(reads)  # looked up per module and per output: a list was the square of the modules
    modules = view.by_name("modules")
    if any(output is not None and output_problem(modules[name], output) is not None for name, output in read):
        return []  # a misspelt output ('mix.lik') is check_inputs' line, not also 'like' read by nothing
    names = set(modules) | set(view.by_name("features"))
    issues = []
    for m in mods:
        key = NAMED_OUTPUT_KINDS.get(m.body.get("kind")) if m.clean else None
        if key is None or (m.name, None) in read:
            continue
        if any(f"{m.name}.{output}" in names for output in m.body[key]):
            return []  # a module or feature named as an output: that ambiguity is its own line
        issues += [SpecIssue(f"{m.path}.{key}[{j}]", f"output {output!r} of module {m.name!r} is read by no module "
                                                      f"or head (its gate would train for nothing): read it as "
                                                      f"{m.name}.{output}, or remove it")
                   for j, output in enumerate(m.body[key]) if (m.name, output) not in read]
    return issues


def _attention_inputs(module: Item) -> SpecIssue | None:
    """A self_attention reads [sequence], or [sequence, target] with output target."""
    if module.body.get("kind") != SELF_ATTENTION or not isinstance(module.inputs, tuple):
        return None
    target, count = module.body.get("output") == "target", len(module.inputs)
    if target and count != 2:
        return SpecIssue(f"{module.path}.inputs", "self_attention with output target reads [sequence, target] "
                                                  f"(got {count} input{'s' if count != 1 else ''})")
    if not target and count == 2:
        return SpecIssue(f"{module.path}.inputs", "a second input (the target) needs output: target")
    return None


def check_attention_inputs(view: DocView) -> list[SpecIssue]:
    """Input counts of self_attention modules (their other options may be wrong too)."""
    return [issue for m in view.items("modules") if (issue := _attention_inputs(m)) is not None]


MODULE_CHECKS = (check_inputs, check_sequences, check_cycles, check_shapes, check_usage, check_reach,
                 check_outputs_read, check_attention_inputs)
