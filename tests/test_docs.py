"""The documentation a newcomer reads: README.md stays short, every relative link in README.md and docs/ leads to a
file (and heading) that exists, README's test command is the one CI runs, its command table names the CLI's
subcommands, and every doc page an error message sends a user to exists."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from eagle3_zoo.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _prose(path: Path) -> str:
    """The page without its fenced code blocks (a `# comment` in a shell block is no heading)."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but `-` and `_` dropped, spaces to `-`; repeats get `-N`."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", _prose(path), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def _section(text: str, heading: str) -> str:
    """The text under `## heading` up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README.md has no '## {heading}' section"
    return match.group(1)


def test_readme_is_under_15_kb():
    assert README.stat().st_size <= 15_000, f"README.md is {README.stat().st_size} bytes; move detail to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_docs_tree_has_its_pages():
    docs = ROOT / "docs"
    expected = [
        "README.md",
        "commands.md",
        "python-api.md",
        "runs.md",
        "engines.md",
        "publishing.md",
        "performance.md",
        "concepts.md",
        "architecture.md",
        "contributing/adding-a-family.md",
        "contributing/adding-a-loss.md",
        "contributing/adding-a-layout.md",
        "contributing/adding-a-drafter-kind.md",
    ]
    assert [p for p in expected if not (docs / p).is_file()] == []
    index = (docs / "README.md").read_text(encoding="utf-8")
    assert [p for p in expected[1:] if f"({p})" not in index] == [], "docs/README.md links every page"


def test_readme_gives_the_two_commands_ci_and_newcomers_run():
    commands = re.findall(
        r"^(bash scripts/\S+)(?: +#.*)?$", _section(README.read_text(encoding="utf-8"), "Two commands"), re.M
    )
    assert commands == ["bash scripts/quickstart.sh", "bash scripts/test.sh"]


def test_the_command_table_names_every_subcommand_of_the_cli():
    table = _section(README.read_text(encoding="utf-8"), "Commands")
    named = re.findall(r"^\| `eagle3-zoo ([a-z-]+)", table, re.M)
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(named) == sorted(set(named)), "one line per subcommand"
    assert set(named) - set(sub.choices) == set(), "README names a subcommand the CLI does not have"
    assert set(sub.choices) - set(named) == set(), "a subcommand is missing from README's command table"


def test_doc_pages_named_in_error_messages_exist():
    named = {
        m
        for f in (ROOT / "eagle3_zoo").rglob("*.py")
        for m in re.findall(r"docs/[\w/.-]+\.md", f.read_text(encoding="utf-8"))
    }
    assert {"docs/contributing/adding-a-family.md", "docs/contributing/adding-a-loss.md"} <= named
    assert [m for m in sorted(named) if not (ROOT / m).is_file()] == []
