"""The documentation site (mkdocs.yml, docs/) and the short README.

The fast tests check that every page in docs/ is in mkdocs.yml's nav and every nav
entry exists, and that README.md stays short and keeps its two commands. The
integration test builds the site with ``mkdocs build --strict`` (a broken link,
a missing anchor or a page outside the nav fails it) and checks that the CLI
reference, generated from the parser by docs/hooks/cli.py, names every command
and subcommand. The hand-written commands page must name every command too, so a
new command cannot go without a line of documentation.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_LINES = 150


class _Loader(yaml.SafeLoader):
    """mkdocs.yml as data: its ``!!python/name:...`` tags read as plain strings."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/name:", lambda loader, suffix, node: suffix)


def _config() -> dict:
    return yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_Loader)


def _nav_pages(entry) -> list[str]:
    """Every page a nav (or part of one) names."""
    if isinstance(entry, str):
        return [entry] if entry.endswith(".md") else []
    items = entry.values() if isinstance(entry, dict) else entry
    return [page for item in items for page in _nav_pages(item)]


def _hook():
    spec = importlib.util.spec_from_file_location("docs_hook_cli", DOCS / "hooks" / "cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's subcommands by name (none: an empty dict)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_readme_is_short_and_keeps_its_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    assert "scripts/run     # train the embedded default" in text
    assert "scripts/test    # run the test suite" in text  # the command .ci/run runs


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    nav = _nav_pages(_config()["nav"])
    assert len(nav) == len(set(nav)), "a page is in the nav twice"
    generated = _hook().PAGES  # pages the hook takes from outside docs/
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "hooks" not in p.parts}
    assert sorted(on_disk - set(nav)) == [], "pages in docs/ that mkdocs.yml's nav leaves out"
    missing = [p for p in nav if p not in on_disk and not (p in generated and generated[p].is_file())]
    assert missing == [], "nav entries with no page"


def test_the_commands_page_names_every_command():
    """The hand-written overview: a new command needs its line there (the CLI reference is generated)."""
    from launcher.cli.main import build_parser

    page = (DOCS / "reference" / "commands.md").read_text(encoding="utf-8")
    assert [name for name in _subcommands(build_parser()) if f"`launcher {name}" not in page] == []


@pytest.mark.integration
def test_the_site_builds_strictly_and_documents_every_command(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr

    from launcher.cli.main import build_parser

    parser = build_parser()
    cli_page = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    commands = _subcommands(parser)
    assert "run" in commands and "bench" in commands
    names = [f"{name} {child}".strip() for name, sub in commands.items() for child in ["", *_subcommands(sub)]]
    undocumented = [name for name in names if f'id="launcher-{name.replace(" ", "-")}"' not in cli_page]
    assert undocumented == [], "commands missing from the CLI reference"

    # The plots (benchmarks/results, outside docs/) are in the site, and the Results pages show them.
    plots = sorted((ROOT / "benchmarks" / "results").rglob("*.png"))
    assert plots
    for plot in plots:
        assert (site / plot.relative_to(ROOT)).is_file(), plot
    training = (site / "results" / "training" / "index.html").read_text(encoding="utf-8")
    assert "benchmarks/results/scaling.png" in training

