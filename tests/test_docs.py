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


# --- measured figures: docs/figures.yaml holds each current figure once, with its commit; the pages quote it ---
#
# A figure is quoted inside a block `<!-- figure: KEY -->` ... `<!-- /figure -->` (HTML comments: invisible when
# the page is rendered). Its entry in docs/figures.yaml gives what was measured, the commit, date, machine and
# command, and `quoted`: every number, date and commit the block's prose and tables quote, in order (fenced code,
# inline code and link targets are not read). A number edited on the page but not in the data, a number in the
# data the page does not quote, a key quoted twice or never, and a commit quoted outside a block all fail.

FIGURES = ROOT / "docs" / "figures.yaml"
FIGURE_PAGES = [README, ROOT / "recipes" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"<!-- figure: ([\w.-]+) -->\n(.*?)<!-- /figure -->", re.S)
_UNIT = r"(?:x|%| ?(?:ms/token|ms|s/step|s|min|MiB|GiB|GB|MB|B/token|tok/s|tokens/s|TFLOP/s|GFLOP))"
TOKEN = re.compile(
    r"(?P<date>\b\d{4}-\d{2}-\d{2}\b)"
    r"|(?P<commit>(?<![\w./-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}(?![\w-]))"
    rf"|(?P<number>(?<![\w.@/=:])(?<![A-Za-z_]-)[-+]?\d+(?:,\d{{3}})*(?:\.\d+)?(?:e-?\d+)?{_UNIT}?(?!\w))"
)
FIELDS = {"what", "commit", "date", "machine", "command", "quoted"}


def figure_tokens(text: str) -> list[str]:
    """The numbers, dates and commits that a piece of a page quotes, in order (what `quoted` lists)."""
    text = FENCE.sub("", text)
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code: commands and settings, not figures
    text = re.sub(r"\]\([^()\s]*\)", "]", text)  # link targets
    return [m.group(0) for m in TOKEN.finditer(text)]


def _figures() -> dict[str, dict]:
    import yaml

    return yaml.safe_load(FIGURES.read_text(encoding="utf-8"))


def _blocks() -> list[tuple[Path, str, str]]:
    return [(page, key, body) for page in FIGURE_PAGES for key, body in BLOCK.findall(page.read_text(encoding="utf-8"))]


def test_every_figure_in_the_data_is_quoted_once_and_every_quoted_block_is_in_the_data():
    keys = [key for _, key, _ in _blocks()]
    figures = _figures()
    assert sorted(k for k in set(keys) if keys.count(k) > 1) == [], "a figure is quoted once; other pages link to it"
    assert sorted(set(keys) - set(figures)) == [], "blocks on the pages with no entry in docs/figures.yaml"
    assert sorted(set(figures) - set(keys)) == [], "entries of docs/figures.yaml that no page quotes"
    for page in FIGURE_PAGES:
        text = page.read_text(encoding="utf-8")
        assert text.count("<!-- figure: ") == text.count("<!-- /figure -->") == len(BLOCK.findall(text)), \
            f"{page.relative_to(ROOT)}: a figure block is not closed (or nested)"


def test_every_figure_entry_says_what_when_where_and_how():
    for key, entry in _figures().items():
        assert set(entry) >= FIELDS, f"docs/figures.yaml {key}: missing {sorted(FIELDS - set(entry))}"
        assert re.fullmatch(r"[0-9a-f]{7,40}", str(entry["commit"])), f"docs/figures.yaml {key}: commit"
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(entry["date"])), f"docs/figures.yaml {key}: date"


@pytest.mark.parametrize("page,key,body", _blocks(), ids=[key for _, key, _ in _blocks()])
def test_a_block_quotes_exactly_the_figures_of_its_entry(page, key, body):
    entry = _figures()[key]
    quoted, data = figure_tokens(body), [str(v) for v in entry["quoted"]]
    where = f"{page.relative_to(ROOT)} figure {key}"
    if quoted != data:
        i = next((n for n, (a, b) in enumerate(zip(quoted, data)) if a != b), min(len(quoted), len(data)))
        page_has, data_has = quoted[i:i + 3], data[i:i + 3]
        pytest.fail(f"{where}: after {quoted[max(0, i - 3):i]} the page quotes {page_has}, docs/figures.yaml "
                    f"{data_has} (edit both: the data is the figure's record)")
    assert str(entry["commit"]) in quoted, f"{where}: the block does not name its commit {entry['commit']}"


@pytest.mark.parametrize("page", FIGURE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_commit_is_quoted_only_with_its_figure(page):
    """Measurements carry their commit, and a commit outside a figure block is a figure that escaped the data."""
    outside = BLOCK.sub("", page.read_text(encoding="utf-8"))
    commits = [t for t in figure_tokens(outside) if TOKEN.fullmatch(t) and TOKEN.fullmatch(t).group("commit")]
    assert commits == [], f"{page.relative_to(ROOT)} quotes {commits} outside a figure block (docs/figures.yaml)"
