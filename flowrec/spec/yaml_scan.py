"""A linear pre-scan of YAML text for nesting depth, before any YAML parser sees it.

YAML parsers bound nesting themselves, each in its own way and words (libyaml 0.2.5 as bundled by
PyYAML 6.0.4 stops at 1,000 levels with "exceeded maximum nesting depth"; the pure-Python parser
has no bound). flowrec's own limit must not depend on which one is installed, so this scan counts
what a YAML scanner counts: one level per open flow collection (`[`, `{`) and one per block
collection whose column is deeper than the enclosing one (a mapping key or `- ` entry further
right). It skips comments, quoted text (across lines), block scalars (`|`, `>`) and brackets
inside plain text, so it never counts more levels than the document has; an indentless sequence
(`key:` then `- item` at the key's column) is the one level it does not count, which the exact
event walk after it catches (the parser cannot be near its own bound while this count is small).
It never fails: text that is not YAML is left to the parser to report.

Example:
    >>> yaml_too_deep("a: [[[1]]]\\n", max_depth=3)
    (1, 6)
    >>> yaml_too_deep("a:\\n  b:\\n    c: 1\\n", max_depth=3) is None
    True
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_FLOW_SPECIAL = re.compile(r"[\[\]{}\"'#\n]")
_KEY_END = re.compile(r":(?=\s|$)")  # a block mapping key ends at ': ' or ':' at the end of a line
_COMMENT = re.compile(r"(^|\s)#")
_PROPERTY = re.compile(r"[&!]\S*\s+")  # an anchor or a tag before a node
_BLOCK_SCALAR = re.compile(r"[|>][-+0-9]*\s*(#.*)?$")
_DOCUMENT_MARK = re.compile(r"(---|\.\.\.)(\s|$)")  # a document start or end at column 0


class _TooDeep(Exception):
    """Raised inside the scan at the first level beyond the limit, with its 1-based position."""

    def __init__(self, line: int, column: int) -> None:
        super().__init__(line, column)
        self.position = (line, column)


@dataclass
class _State:
    max_depth: int
    indents: list[int] = field(default_factory=list)  # columns of the open block collections
    flow: int = 0  # open flow collections
    quote: str = ""  # the quote character of a quoted scalar that continues on the next line
    block_scalar: int | None = None  # lines deeper than this column belong to a block scalar
    node_start: bool = True  # in flow context: the next character may start a node

    def roll(self, column: int, line: int) -> None:
        """A block collection at `column`: a new level when it is deeper than the current one."""
        if not self.indents or column > self.indents[-1]:
            self.indents.append(column)
            self.check(line, column)

    def check(self, line: int, column: int) -> None:
        if len(self.indents) + self.flow > self.max_depth:
            raise _TooDeep(line, column + 1)


def yaml_too_deep(text: str, max_depth: int) -> tuple[int, int] | None:
    """The (line, column) where nesting first goes beyond `max_depth` levels, or None."""
    state = _State(max_depth)
    try:
        for number, line in enumerate(text.split("\n"), start=1):
            _scan_line(state, line.rstrip("\r"), number)
    except _TooDeep as exc:
        return exc.position
    return None


def _scan_line(state: _State, line: str, number: int) -> None:
    if state.quote:
        end = _quote_end(line, 0, state.quote)
        if end is None:
            return
        state.quote = ""
        if state.flow:
            _scan_flow(state, line, end, number)
        else:
            _scan_after_node(state, line, end, number)
        return
    if state.flow:
        _scan_flow(state, line, 0, number)
        return
    stripped = line.lstrip(" ")
    column = len(line) - len(stripped)
    if state.block_scalar is not None:
        if not stripped or column > state.block_scalar:
            return
        state.block_scalar = None
    if not stripped or stripped.startswith("#") or (column == 0 and stripped.startswith("%")):
        return
    if column == 0 and _DOCUMENT_MARK.match(stripped):
        state.indents.clear()
        _scan_node(state, line, 3, number, key_allowed=False)
        return
    while state.indents and state.indents[-1] > column:
        state.indents.pop()
    _scan_node(state, line, column, number, key_allowed=True)


def _scan_node(state: _State, line: str, pos: int, number: int, key_allowed: bool) -> None:
    """Scan from `pos`: block entries, a key, then one node (flow, quoted, block scalar or plain)."""
    while True:
        pos = _skip_spaces(line, pos)
        rest = line[pos:]
        if rest[:1] in ("-", "?") and (len(rest) == 1 or rest[1] in " \t"):
            state.roll(pos, number)
            pos += 1
            key_allowed = True
            continue
        break
    node = pos
    while (m := _PROPERTY.match(line, pos)) is not None:
        pos = m.end()
    if key_allowed and line[pos:pos + 1] not in ('"', "'", "[", "{"):
        key = _KEY_END.search(_strip_comment(line[pos:]))
        if key is not None:
            state.roll(node, number)
            _scan_value(state, line, pos + key.end(), number)
            return
    _scan_value(state, line, pos, number, key_column=node if key_allowed else None)


def _scan_value(state: _State, line: str, pos: int, number: int, key_column: int | None = None) -> None:
    """One node's text: a flow collection, a quoted scalar, a block scalar header or plain text."""
    pos = _skip_spaces(line, pos)
    while (m := _PROPERTY.match(line, pos)) is not None:
        pos = m.end()
    head = line[pos:pos + 1]
    if head in ("[", "{"):
        _scan_flow(state, line, pos, number)
    elif head in ('"', "'"):
        end = _quote_end(line, pos + 1, head)
        if end is None:
            state.quote = head
            return
        if key_column is not None and _KEY_END.match(line, end):
            state.roll(key_column, number)  # "quoted key": value
            _scan_value(state, line, end + 1, number)
    elif head in ("|", ">") and _BLOCK_SCALAR.match(line, pos):
        state.block_scalar = state.indents[-1] if state.indents else -1


def _scan_after_node(state: _State, line: str, pos: int, number: int) -> None:
    """The rest of a line after a multi-line quoted scalar or flow collection closed on it."""
    m = _KEY_END.match(line, pos)
    if m is not None:
        _scan_value(state, line, m.end(), number)


def _scan_flow(state: _State, line: str, pos: int, number: int) -> None:
    """Count brackets inside flow collections. No plain text in flow context may hold a bracket,
    a comma or ': '; a quote opens a quoted scalar only where a node starts (`it's` is text)."""
    while pos < len(line):
        char = line[pos]
        if char in " \t":
            pos += 1
        elif char == "#" and (pos == 0 or line[pos - 1] in " \t"):
            return
        elif char in "[{":
            state.flow += 1
            state.node_start = True
            state.check(number, pos)
            pos += 1
        elif char in "]}":
            state.flow = max(state.flow - 1, 0)
            state.node_start = False
            pos += 1
            if state.flow == 0:
                _scan_after_node(state, line, pos, number)
                return
        elif char in ",:" and (char == "," or pos + 1 == len(line) or line[pos + 1] in " \t,[]{}"):
            state.node_start = True
            pos += 1
        elif char in "\"'" and state.node_start:
            end = _quote_end(line, pos + 1, char)
            if end is None:
                state.quote = char
                return
            state.node_start = False
            pos = end
        elif state.node_start and char in "&!":  # an anchor or a tag: the node follows it
            pos = _token_end(line, pos)
        elif char == "?" and line[pos + 1:pos + 2] in ("", " ", "\t"):  # an explicit key
            state.node_start = True
            pos += 1
        else:
            state.node_start = False
            pos = _plain_end(line, pos)


def _plain_end(line: str, pos: int) -> int:
    """Index of the flow indicator or comment that ends plain text started at `pos`."""
    while pos < len(line):
        char = line[pos]
        if char in ",[]{}" or (char == ":" and (pos + 1 == len(line) or line[pos + 1] in " \t,[]{}")):
            return pos
        if char == "#" and line[pos - 1] in " \t":
            return pos
        pos += 1
    return pos


def _token_end(line: str, pos: int) -> int:
    while pos < len(line) and line[pos] not in " \t,[]{}":
        pos += 1
    return pos


def _quote_end(line: str, pos: int, quote: str) -> int | None:
    """Index just after the closing quote on this line, or None when the scalar goes on."""
    while pos < len(line):
        char = line[pos]
        if quote == '"' and char == "\\":
            pos += 2
            continue
        if char == quote:
            if quote == "'" and line[pos + 1:pos + 2] == "'":
                pos += 2  # '' is an escaped quote
                continue
            return pos + 1
        pos += 1
    return None


def _strip_comment(text: str) -> str:
    m = _COMMENT.search(text)
    return text if m is None else text[:m.start()]


def _skip_spaces(line: str, pos: int) -> int:
    while pos < len(line) and line[pos] in " \t":
        pos += 1
    return pos
