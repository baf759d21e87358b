"""The README stays a newcomer's page and the reference in docs/ stays navigable: short README, no table row nobody
can read, and every relative link in docs/ reaching an existing file and heading."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")
README_MAX_LINES = 250
ROW_MAX_CHARS = 1000


def anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped except - and _, spaces to -; repeats get -1, -2."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(root)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(root)}")
    return broken


def test_readme_is_a_page_a_newcomer_reads() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move reference text to a docs/<topic>.md"


def test_no_table_row_too_long_to_read() -> None:
    long_rows = [f"{p.relative_to(ROOT)}:{n}: {len(line)} characters"
                 for p in [ROOT / "README.md", *DOCS] for n, line in enumerate(p.read_text().splitlines(), 1)
                 if line.startswith("|") and len(line) >= ROW_MAX_CHARS]
    assert not long_rows, "split these rows into a list or a section:\n" + "\n".join(long_rows)


def test_every_relative_link_in_docs_reaches_a_file_and_heading() -> None:
    broken = [f"{p.relative_to(ROOT)}: {b}" for p in DOCS for b in broken_links(p)]
    assert not broken, "\n".join(broken)


def test_the_link_checker_sees_a_broken_anchor_and_a_missing_file(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## What happens when…\n\n[ok](#what-happens-when) [bad](#nowhere) [gone](missing.md)\n")
    assert [b.split(":")[0] for b in broken_links(page, tmp_path)] == ["#nowhere", "missing.md"]
