"""The documentation: the site builds with no warning, every page is reachable, the README stays
short, and the reference tables name every Loader setting and every command-line option."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import shutil
import sys

import pytest
import yaml

from .conftest import REPO, run_process

DOCS = os.path.join(REPO, "docs")
README_MAX_LINES = 300


def read(path: str) -> str:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


def nav_pages(nav) -> list[str]:
    """The page files a mkdocs ``nav`` lists, at any depth."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    return [page for item in nav for page in nav_pages(item)]


def docs_pages() -> set[str]:
    """Every Markdown page under docs/, as a path relative to it (the hooks folder holds code)."""
    pages = set()
    for folder, _, files in os.walk(DOCS):
        for name in files:
            if name.endswith(".md"):
                pages.add(os.path.relpath(os.path.join(folder, name), DOCS))
    return pages


@pytest.mark.processes
def test_site_builds_strict_with_no_warning(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)]
    run = run_process(command, timeout=240, cwd=REPO, env=env)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "WARNING" not in output, output
    # the home page is the README itself, its links into docs/ made relative to the pages
    home = (tmp_path / "index.html").read_text()
    assert "Quick start" in home and 'href="writing/"' in home
    assert not (tmp_path / "hooks").exists()


BREAKAGES = {
    "a missing anchor": ("README.md", "(docs/cli.md)", "(docs/cli.md#nope)"),
    "a missing page": ("docs/ray.md", "(writing.md)", "(writting.md)"),
    "a page left out of the nav": ("mkdocs.yml", "      - Writing on Ray: ray.md\n", ""),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_strict_build_fails_on(breakage, tmp_path, monkeypatch):
    """mkdocs.yml's validation makes each of these a warning, and strict mode a failed build
    (on a copy of README.md, mkdocs.yml and docs/ with one thing broken)."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    shutil.copytree(DOCS, tmp_path / "docs")
    for name in ("README.md", "mkdocs.yml"):
        (tmp_path / name).write_text(read(name))
    config = str(tmp_path / "mkdocs.yml")
    build(load_config(config, site_dir=str(tmp_path / "site")))  # the copy as it is builds
    path, old, new = BREAKAGES[breakage]
    text = (tmp_path / path).read_text()
    assert old in text
    (tmp_path / path).write_text(text.replace(old, new, 1))
    with pytest.raises(Abort, match="warning"):
        build(load_config(config, site_dir=str(tmp_path / "site")))


def test_readme_is_at_most_300_lines():
    lines = read("README.md").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail to docs/"


def test_every_docs_page_is_in_the_nav():
    config = yaml.safe_load(read("mkdocs.yml"))
    listed = nav_pages(config["nav"])
    assert len(listed) == len(set(listed)), f"a page listed twice: {listed}"
    assert set(listed) == docs_pages()
    assert "design-notes.md" in listed


def test_no_link_to_files_outside_the_repository():
    """Nothing points at the steering folder beside the repository or at its design files."""
    banned = ["../" + "shared", "DESIGN" + ".md", "STYLE" + ".md"]
    pages = ["README.md", "mkdocs.yml"] + [os.path.join("docs", p) for p in docs_pages()]
    sources = [
        os.path.relpath(os.path.join(folder, name), REPO)
        for folder, _, files in os.walk(os.path.join(REPO, "wdsvlm"))
        for name in files
        if name.endswith(".py")
    ]
    found = [(path, word) for path in pages + sources for word in banned if word in read(path)]
    assert found == []


def test_loading_page_lists_every_loader_setting():
    from wdsvlm.loader.settings import LoaderSettings

    table = read("docs/loading.md")
    missing = [f.name for f in dataclasses.fields(LoaderSettings) if f"| `{f.name}` |" not in table]
    assert missing == [], "settings missing from the table of docs/loading.md"


def command_help(command: str) -> str:
    from wdsvlm.tools.cli import build_parser

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return out.getvalue()


@pytest.mark.parametrize(
    "command", ["write", "verify", "index", "inspect", "stats", "bench", "plan-cloud", "trace"]
)
def test_cli_page_documents_every_option(command):
    # `write`'s options are in the table of docs/writing.md; every command is on docs/cli.md
    pages = read("docs/cli.md") + (read("docs/writing.md") if command == "write" else "")
    assert f"## `wdsvlm {command}`" in read("docs/cli.md")
    options = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", command_help(command))) - {"--help"}
    assert options, command
    missing = sorted(o for o in options if f"`{o}" not in pages and f"[{o}" not in pages)
    assert missing == [], f"wdsvlm {command}: options missing from the docs"


# The pages of a user's path: what a user does and gets, without the project's history.
USER_PAGES = ["README.md"] + [
    os.path.join("docs", name)
    for name in (
        "loading.md families.md trainers.md training.md multi-node.md evaluation.md "
        "troubleshooting.md writing.md mixtures.md video.md storage.md ray-workers.md ray.md "
        "format.md cli.md glossary.md recipes.md scaling.md unsupported.md pretraining.md "
        "cloud.md monitoring.md"
    ).split()
]
SHORT_SENTENCE_PAGES = ["README.md", "docs/loading.md", "docs/families.md", "docs/trainers.md"]

_NUMBER = r"\d[\d,]*(?:\.\d+)?"
_UNIT = r"(?:x(?![A-Za-z])|%|\s?(?:µs|ms|s|MB|GB|kB)(?![A-Za-z]))"
_FIGURE = re.compile(rf"(?<![\w.])({_NUMBER})(?:\s?[-–]\s?({_NUMBER}))?({_UNIT})?")


def figures(text: str) -> set[tuple[str, str]]:
    """The numbers of a text, each with its unit (``x``, ``%``, ``s``, ``MB``, ...; ``""`` for
    none): ``"3.19-3.27x"`` gives ``("3.19", "x")`` and ``("3.27", "x")``."""
    found = set()
    for match in _FIGURE.finditer(text):
        unit = (match.group(3) or "").strip()
        for number in match.group(1, 2):
            if number:
                found.add((number.rstrip(",").replace(",", ""), unit))
    return found


def section(markdown: str, heading: str) -> str:
    return markdown.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def figures_missing_from_the_performance_page(readme: str) -> list[tuple[str, str]]:
    measured = figures(read("docs/performance.md"))
    bare = {number for number, _ in measured}
    cited = figures(section(readme, "## Performance"))
    return sorted((n, u) for n, u in cited if ((n, u) not in measured if u else n not in bare))


def test_readme_numbers_match_the_performance_page():
    """Every figure of the README's Performance section is on docs/performance.md, with its
    unit: a README that rounds, or keeps a number the page has replaced, fails."""
    readme = read("README.md")
    assert len(figures(section(readme, "## Performance"))) > 20
    assert figures_missing_from_the_performance_page(readme) == []
    for old, new in [("**1.51x**", "**1.52x**"), ("0.75 s", "0.8 s"), ("39 MB", "38 MB")]:
        assert old in readme
        changed = figures_missing_from_the_performance_page(readme.replace(old, new, 1))
        assert changed == [tuple(figures(new))[0]], (old, new)


def prose_sentences(markdown: str) -> list[str]:
    """The sentences of a page's prose: code blocks left out, links read as their text, each
    table cell and list item apart, split where a sentence ends."""
    text = re.sub(r"^```.*?^```[^\n]*$", "", markdown, flags=re.M | re.S)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    pieces = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if lines and all(line.lstrip().startswith("|") for line in lines):
            cells = [cell for line in lines for cell in line.strip().strip("|").split("|")]
            pieces += [cell for cell in cells if not set(cell) <= set("-: ")]
        else:
            pieces += re.split(r"\n\s*(?:[-*]|\d+\.)\s+|^\s*(?:[-*]|\d+\.)\s+", block)
    sentences = []
    for piece in pieces:
        piece = " ".join(piece.split())
        if piece and not piece.startswith("#"):
            sentences += re.split(r"(?:(?<=[.!?])|(?<=[.!?]\)))\s+(?=[A-Z(`*\[\"'])", piece)
    return sentences


@pytest.mark.parametrize("page", SHORT_SENTENCE_PAGES)
def test_user_pages_sentences_are_under_40_words(page):
    long = [s for s in prose_sentences(read(page)) if len(s.split()) >= 40]
    assert long == [], f"{page}: split these sentences"


def test_the_sentence_splitter_sees_tables_lists_and_code():
    page = "Short one. Another (a) one!\n\n- an item. Two\n\n| a | b c |\n| --- | --- |\n"
    page += "```\nnot prose\n```\n"
    want = ["Short one.", "Another (a) one!", "an item.", "Two", "a", "b c"]
    assert prose_sentences(page) == want


_INTERNAL = {
    "the word issue": re.compile(r"\bissues?\b", re.I),
    "a commit hash": re.compile(r"`(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}`"),
    "an internal target": re.compile(r"\bnot reached\b|\btargets?\b", re.I),
}


def test_user_pages_mention_no_issues_commits_or_internal_targets():
    pages = [p for p in USER_PAGES if os.path.exists(os.path.join(REPO, p))]
    assert len(pages) >= 10
    found = [
        (page, what, match.group())
        for page in pages
        for what, pattern in _INTERNAL.items()
        for match in pattern.finditer(read(page))
    ]
    assert found == [], "user pages say what a user does and gets: move this to design notes"
    assert _INTERNAL["a commit hash"].search("before (`59c8d9b`)")
    assert not _INTERNAL["a commit hash"].search("(`000000042`)")
