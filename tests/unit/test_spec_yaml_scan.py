"""flowrec's own YAML depth scan: never counts more levels than the document has, counts flow and
block nesting exactly, and decides the depth limit before (and whatever) the parser does.

The reference depth is the deepest run of collection events from PyYAML's pure-Python parser,
which bounds nothing itself; documents are random nested values dumped in block, flow and mixed
styles, with brackets, '#' and quotes inside text that must not count.
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from yaml.events import CollectionEndEvent, CollectionStartEvent

from flowrec.spec.errors import SpecError
from flowrec.spec.read import MAX_DEPTH, parse_yaml
from flowrec.spec.yaml_scan import yaml_too_deep

TEXT = st.sampled_from(["a", "x [y", "{z", "q: r", "# not a comment", "it's", 'say "hi"', "- dash",
                        "a]b}", "multi\nline [", "  lead", "|", ">"])
KEYS = st.sampled_from(["k", "key [1]", "b{", "#c", "d-e", "with space", "'q'"])
VALUES = st.recursive(
    TEXT | st.integers(-5, 5) | st.none() | st.booleans(),
    lambda inner: st.lists(inner, min_size=1, max_size=3) | st.dictionaries(KEYS, inner, min_size=1, max_size=3),
    max_leaves=25,
)


def _event_depth(text: str) -> int:
    depth = deepest = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):  # the pure-Python parser: no bound of its own
        if isinstance(event, CollectionStartEvent):
            depth += 1
            deepest = max(deepest, depth)
        elif isinstance(event, CollectionEndEvent):
            depth -= 1
    return deepest


def _scan_depth(text: str) -> int:
    """The smallest limit the scan accepts the text under: its count of levels."""
    return next(limit for limit in range(200) if yaml_too_deep(text, limit) is None)


def _value_depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(_value_depth(v) for v in value.values())
    if isinstance(value, list):
        return 1 + max(_value_depth(v) for v in value)
    return 0


@settings(max_examples=int(os.environ.get("FLOWREC_FUZZ_EXAMPLES", "150")), deadline=None)
@given(value=VALUES, style=st.sampled_from([False, True, None]), indent=st.sampled_from([2, 4]))
def test_scan_never_counts_more_than_the_document_has(value, style, indent):
    text = yaml.safe_dump(value, default_flow_style=style, indent=indent, width=30)
    assert yaml.safe_load(text) == value
    events = _event_depth(text)
    scanned = _scan_depth(text)
    assert scanned <= events, text
    if style is True or not _has_sequence_in_mapping(value):
        assert scanned == events == _value_depth(value), text  # exact but for indentless sequences
    else:
        assert events <= 2 * scanned, text  # an indentless sequence is at most every other level


def _has_sequence_in_mapping(value: Any) -> bool:
    if isinstance(value, dict):
        return any(isinstance(v, list) or _has_sequence_in_mapping(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_sequence_in_mapping(v) for v in value)
    return False


@pytest.mark.parametrize("text,position", [
    ("[" * 30_000 + "]" * 30_000, (1, 65)),
    ("[" * 1_000_000, (1, 65)),  # never closed
    ("{a: " * 100_000 + "1" + "}" * 100_000, (1, 257)),
    ("".join(" " * i + f"k{i}:\n" for i in range(80)) + " " * 80 + "1\n", (65, 65)),
    ("".join(" " * (2 * i) + "- \n" for i in range(70)), (65, 129)),
    ("- " * 2_000 + "x\n", (1, 129)),
    ("a:\n" + "  [\n" * 70 + "  ]\n" * 70, (65, 3)),  # the mapping, then 64 brackets over lines
])
def test_position_of_the_first_level_too_deep(text, position):
    assert yaml_too_deep(text, MAX_DEPTH) == position


@pytest.mark.parametrize("text", [
    "a: '[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[['\n",
    'a: "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\\"["\n',
    "a: x [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\n",
    "a: 1 # [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\n",
    "a: |\n" + "".join(" " * (i + 2) + "- x:\n" for i in range(100)) + "b: 1\n",
    "a: [\"]]]\",\n  '[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[',\n  1]\n",
    "a: 'multi\n  [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\n  line'\n",
], ids=["single_quoted", "double_quoted", "plain", "comment", "block_scalar", "flow_quotes", "multiline_quote"])
def test_brackets_and_indents_in_text_do_not_count(text):
    assert yaml_too_deep(text, 2) is None
    assert _event_depth(text) <= 2


def test_flowrec_decides_the_limit_before_the_parser():
    """Beyond the C parser's own bound (1,000 levels in libyaml 0.2.5) the message is still flowrec's."""
    for text in ("[" * 5_000 + "]" * 5_000, "".join(" " * i + "k:\n" for i in range(1_500)) + " " * 1_500 + "1\n"):
        with pytest.raises(SpecError) as info:
            parse_yaml(text)
        assert [str(issue) for issue in info.value.issues] == [
            f"line {1 if text[0] == '[' else MAX_DEPTH + 1}, column {MAX_DEPTH + 1}: "
            f"the document nests deeper than {MAX_DEPTH} levels"]


def test_indentless_sequences_are_caught_exactly_by_the_event_walk():
    """`k:` then `- k:` at the same column: the scan counts half the levels, the event walk all."""
    text = "".join(" " * (2 * i) + "k:\n" + " " * (2 * i) + "-\n" for i in range(40)) + " " * 80 + "1\n"
    assert yaml_too_deep(text, MAX_DEPTH) is None
    with pytest.raises(SpecError, match=f"nests deeper than {MAX_DEPTH} levels"):
        parse_yaml(text)
