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
    "a page left out of the nav": ("mkdocs.yml", "  - Writing on Ray: ray.md\n", ""),
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


@pytest.mark.parametrize("command", ["write", "verify", "index", "inspect", "stats", "bench"])
def test_cli_page_documents_every_option(command):
    # `write`'s options are in the table of docs/writing.md; every command is on docs/cli.md
    pages = read("docs/cli.md") + (read("docs/writing.md") if command == "write" else "")
    assert f"## `wdsvlm {command}`" in read("docs/cli.md")
    options = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", command_help(command))) - {"--help"}
    assert options, command
    missing = sorted(o for o in options if f"`{o}" not in pages and f"[{o}" not in pages)
    assert missing == [], f"wdsvlm {command}: options missing from the docs"
