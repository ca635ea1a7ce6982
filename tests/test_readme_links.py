"""The README stays a newcomer's page and its links, and those of docs/, lead somewhere.

Every relative link in README.md and docs/*.md must name a file or directory of the repository, and
an anchor on a Markdown target must name one of its headings (as GitHub derives anchors from them).
Links inside code (fenced blocks, `spans`) are not links and are skipped; web links are not fetched.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 150

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`[^`]*`")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # https:, mailto:, ...


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file's headings give; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: Counter[str] = Counter()
    out = set()
    for _, line in prose_lines(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        out.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return out


def documents() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def broken_links(doc: Path, root: Path = REPO_ROOT) -> list[str]:
    problems = []
    for n, line in prose_lines(doc.read_text()):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if EXTERNAL.match(target):
                continue
            path_part, _, anchor = target.partition("#")
            dest = (doc.parent / path_part).resolve() if path_part else doc
            where = f"{doc.relative_to(root)}:{n}: ({target})"
            if not dest.exists():
                problems.append(f"{where} no such file")
            elif not dest.is_relative_to(root):
                problems.append(f"{where} leaves the repository")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where} no heading gives #{anchor} (have {sorted(anchors(dest))})")
    return problems


def test_the_checker_sees_broken_links_and_anchors(tmp_path):
    """The check itself: good links pass; a missing file, a missing anchor and an escape fail."""
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "a.md").write_text("# Title\n\n## What `make demo` shows\n\n## Twice\n\n## Twice\n")
    doc = root / "README.md"
    doc.write_text("\n".join([
        "[ok](docs/a.md#what-make-demo-shows) [ok](docs/a.md#twice-1) [ok](#top) [web](https://x.invalid/y)",
        "`[in code](nowhere.md)`",
        "```", "[fenced](nowhere.md)", "```",
        "[gone](docs/b.md)", "[no anchor](docs/a.md#nothing)", "[out](../outside.md)",
        "# Top",
    ]) + "\n")
    (tmp_path / "outside.md").write_text("# Outside\n")
    problems = broken_links(doc, root)
    assert [p.split(": (")[1].split(")")[0] for p in problems] == [
        "docs/b.md", "docs/a.md#nothing", "../outside.md"], problems


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(doc):
    assert broken_links(doc) == []


def test_readme_stays_short():
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, \
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move operator material to docs/"


def test_readme_names_the_commands_and_links_every_operator_guide():
    readme = (REPO_ROOT / "README.md").read_text()
    for command in ("make demo", "make test", "make test-quick"):
        assert f"\n{command}\n" in readme, f"README.md's quick start lacks `{command}`"
    for guide in ("security", "deployment", "precision", "recipes", "engines"):
        assert f"](docs/{guide}.md)" in readme, f"README.md does not link docs/{guide}.md"
