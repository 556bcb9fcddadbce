"""The pages a reader follows stay readable and whole: every markdown page of docs/ (its archive
pages included) and README.md is under the repository's 1 MB file limit, and every relative link in
them points at a file that exists and, for an #anchor into one of our .md pages, at a heading of that
page (GitHub's anchors: the heading's text lowercased, punctuation dropped, spaces to '-', a
repeated heading numbered -1, -2, ...). docs/benchmarks.md grows ~10-20 KB a round towards the
limit: its older rounds move to archive pages in docs/benchmarks/, and a link left pointing at a
page or heading that moved fails here."""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

MAX_PAGE_BYTES = 1_000_000  # bytes: the repository's file limit (1 MB)

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^()\s<>]*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def pages(root: Path) -> list[Path]:
    """README.md and every .md page under docs/, archive pages included."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _prose_lines(text: str, spans: bool = False) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks, inline code spans removed
    unless `spans`."""
    kept, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        opened = _FENCE.match(line)
        if fence is not None:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                fence = None
            continue
        if opened:
            fence = opened.group(1)
            continue
        kept.append((number, line if spans else _CODE_SPAN.sub("", line)))
    return kept


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text: inline links and images read as their text, then
    lowercased, every character but letters, digits, marks, connectors ('_'), '-' and spaces
    dropped, spaces to '-': the heading "Package load (tools/x.py)" has the anchor package-load-toolsxpy."""
    text = _INLINE_LINK.sub(lambda m: m.group(1), heading).lower()
    kept = (c for c in text if c in " -" or unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "Pc")
    return "".join(kept).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor GitHub gives the headings of a page (outside code blocks), repeats numbered."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in _prose_lines(text, spans=True):  # a code span in a heading keeps its text
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image and reference definition outside code."""
    found = []
    for number, line in _prose_lines(text):
        found += [(number, m.group(2)) for m in _INLINE_LINK.finditer(line)]
        reference = _REFERENCE.match(line)
        if reference:
            found.append((number, reference.group(1)))
    return found


def broken_links(page: Path, root: Path) -> list[str]:
    """'page:line: target (why)' for each relative link of `page` that leads nowhere."""
    broken = []
    for number, target in links(page.read_text(encoding="utf-8")):
        if not target or _SCHEME.match(target):
            continue  # an absolute URL (https:, mailto:): not ours to check offline
        path, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path)).resolve() if path else page
        where = f"{page.relative_to(root)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            broken.append(f"{where} (no heading with that anchor)")
    return broken


def oversized(found: list[Path], root: Path) -> list[str]:
    """'page: N bytes' for each page at or over the repository's file limit."""
    return [f"{p.relative_to(root)}: {p.stat().st_size} bytes" for p in found if p.stat().st_size >= MAX_PAGE_BYTES]


def test_every_page_is_under_the_file_limit(repo: Path) -> None:
    found = pages(repo)
    assert repo / "docs" / "benchmarks.md" in found and len(found) > 2
    over = oversized(found, repo)
    assert over == [], f"move the oldest rounds to an archive page (docs/benchmarks.md says how): {over}"


def test_a_page_of_1_mb_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_bytes(b"x" * (MAX_PAGE_BYTES - 1))
    (tmp_path / "docs" / "big.md").write_bytes(b"x" * MAX_PAGE_BYTES)
    assert oversized(pages(tmp_path), tmp_path) == [f"docs/big.md: {MAX_PAGE_BYTES} bytes"]


def test_every_relative_link_of_the_docs_and_readme_leads_somewhere(repo: Path) -> None:
    checked = pages(repo)
    assert sum(len(links(p.read_text(encoding="utf-8"))) for p in checked) > 10  # the links are read
    broken = [line for page in checked for line in broken_links(page, repo)]
    assert broken == [], "\n".join(broken)


def test_the_benchmark_archive_pages_are_linked_from_the_entry_page(repo: Path) -> None:
    """Every archive page of docs/benchmarks/ is in the entry page's list and links back to it."""
    entry = repo / "docs" / "benchmarks.md"
    archive = sorted((repo / "docs" / "benchmarks").glob("*.md"))
    assert archive, "docs/benchmarks/ holds no archive page"
    targets = [target.partition("#")[0] for _, target in links(entry.read_text(encoding="utf-8"))]
    listed = {(entry.parent / target).resolve() for target in targets}
    for page in archive:
        assert page.resolve() in listed, f"docs/benchmarks.md does not link {page.name}"
        first = page.read_text(encoding="utf-8").splitlines()[0]
        assert "](../benchmarks.md)" in first, f"{page.name}'s first line does not link back: {first}"


@pytest.mark.parametrize(("heading", "anchor"), [
    ("Round 42 (issue 28): the casting on the CPU by one kernel, `flowrec train`'s step 15 % shorter",
     "round-42-issue-28-the-casting-on-the-cpu-by-one-kernel-flowrec-trains-step-15--shorter"),
    ("First runs on a GPU (one NVIDIA H200, 2026-11-30)", "first-runs-on-a-gpu-one-nvidia-h200-2026-11-30"),
    ("Calibrated device profiles (`flowrec calibrate`)", "calibrated-device-profiles-flowrec-calibrate"),
    ("See [the guide](guide.md) — twice → here", "see-the-guide--twice--here"),
])
def test_anchors_follow_githubs_rules(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_repeated_headings_and_code_blocks() -> None:
    text = "# A\n\n## Round 3\n\n```\n# not a heading\n[x](nowhere.md)\n```\n\n## Round 3\n\n`[y](nowhere.md)`\n"
    assert anchors(text) == {"a", "round-3", "round-3-1"}
    assert links(text) == []


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs" / "archive").mkdir(parents=True)
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## Round 9 (issue 28)\n", encoding="utf-8")
    page = tmp_path / "docs" / "archive" / "old.md"
    page.write_text(
        "Old rounds; back to [the entry page](../other.md).\n\n## Here\n\n"
        "[fine](../other.md#round-9-issue-28) [self](#here) [web](https://example.com/x.md#nothing)\n"
        "[gone](other.md) [moved](../other.md#round-10-issue-28) [dangling](#there)\n\n"
        "[ref]: ../missing.md\n",
        encoding="utf-8")
    assert broken_links(page, tmp_path) == [
        "docs/archive/old.md:6: other.md (no such file)",
        "docs/archive/old.md:6: ../other.md#round-10-issue-28 (no heading with that anchor)",
        "docs/archive/old.md:6: #there (no heading with that anchor)",
        "docs/archive/old.md:8: ../missing.md (no such file)",
    ]
