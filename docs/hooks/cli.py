"""MkDocs hooks: pages and files made at build time from the code, so they cannot drift.

- ``reference/cli.md``: every ``launcher`` command and subcommand, rendered from the
  argparse parser :func:`launcher.cli.main.build_parser` builds (its help line, and
  its ``--help`` text: usage, arguments and flags).
- ``reference/environment.md``: every ``LAUNCHER_*`` environment variable, from the table in
  :mod:`launcher.settings`.
- ``benchmarks/results/...``: the result files (plots, tables, JSON, CSV) under
  ``benchmarks/results/``, added to the site as they are, so the Results pages show
  the plots without a second copy of them in ``docs/``; ``results/files.md`` lists them.
- ``benchmarks/README.md``: the benchmark definitions, a page of the site.
- The API pages (mkdocstrings): the docstrings' Sphinx roles shown as plain code.
"""

from __future__ import annotations

import argparse
import functools
import html
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the launcher's packages, also without an installed copy
    sys.path.insert(0, str(ROOT))

PLACEHOLDER = "<!-- generated -->"
CLI_PAGE = "reference/cli.md"
ENV_PAGE = "reference/environment.md"
FILES_PAGE = "results/files.md"
RESULTS = ROOT / "benchmarks" / "results"
# Pages taken from outside docs/: their path in the site -> the file.
PAGES = {"benchmarks/README.md": ROOT / "benchmarks" / "README.md"}
HELP_WIDTH = 100


def result_files() -> list[Path]:
    """The files under benchmarks/results, in name order (caches left out)."""
    return sorted(p for p in RESULTS.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def on_files(files, config):
    for path in result_files():
        files.append(File.generated(config, path.relative_to(ROOT).as_posix(), abs_src_path=str(path)))
    for uri, path in PAGES.items():
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    uri = page.file.src_uri
    if uri == CLI_PAGE:
        return markdown.replace(PLACEHOLDER, cli_reference())
    if uri == FILES_PAGE:
        return markdown.replace(PLACEHOLDER, files_table())
    if uri == ENV_PAGE:
        return markdown.replace(PLACEHOLDER, environment_table())
    return markdown


# Sphinx roles in the docstrings (``:class:`X```) come out of mkdocstrings as ":class:" before
# the code; reST's "::" before a code block as a literal "::".
_ROLE = re.compile(r":(?:class|mod|func|meth|attr|data|exc|obj):(?=<code>)")


def on_page_content(html_text, page, config, files):
    """The API pages: docstrings' Sphinx roles shown as plain code."""
    if page.file.src_uri.startswith("reference/api-"):
        return _ROLE.sub("", html_text).replace("::</p>", ":</p>")
    return html_text


def on_serve(server, config, builder):
    """`mkdocs serve` rebuilds when the CLI or the results change, not only docs/."""
    for path in (ROOT / "launcher" / "cli", ROOT / "launcher" / "settings.py", RESULTS, *PAGES.values()):
        server.watch(str(path))
    return server


# -- the CLI reference ---------------------------------------------------------------------

def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str | None, argparse.ArgumentParser]]:
    """(name, help line, parser) of each subcommand, in the order ``--help`` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return [(choice.dest, choice.help, action.choices[choice.dest])
                    for choice in action._choices_actions]
    return []


def _inline(text: str) -> str:
    """Help text as Markdown: `code` kept, everything else shown literally."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    return "".join(p if p.startswith("`") else re.sub(r"([\\*_\[\]])", r"\\\1", html.escape(p, quote=False))
                   for p in parts)


def _help_text(parser: argparse.ArgumentParser) -> str:
    """``--help`` as it prints, at a fixed width (not the terminal's)."""
    parser.formatter_class = functools.partial(parser.formatter_class, width=HELP_WIDTH)
    return parser.format_help().rstrip()


def _render(parser: argparse.ArgumentParser, name: str, help_line: str | None, depth: int) -> list[str]:
    """A command's section: a heading, its help line, its ``--help``, then its subcommands'."""
    out = [f"{'#' * depth} {name}", ""]
    if help_line:
        out += [_inline(help_line), ""]
    out += ["```text", _help_text(parser), "```", ""]
    for sub_name, sub_help, sub_parser in _subcommands(parser):
        out += _render(sub_parser, f"{name} {sub_name}", sub_help, min(depth + 1, 6))
    return out


def cli_reference() -> str:
    """The page's body: ``launcher --help``, then each command (level 2) and subcommand (level 3)."""
    from launcher.cli.main import build_parser

    parser = build_parser()
    subs = _subcommands(parser)
    out = ["Commands: " + ", ".join(f"[{n}](#launcher-{n})" for n, _, _ in subs) + ".", "",
           "```text", _help_text(parser), "```", ""]
    for name, help_line, sub_parser in subs:
        out += _render(sub_parser, f"launcher {name}", help_line, 2)
    return "\n".join(out)


# -- the environment variables -----------------------------------------------------------------

def environment_table() -> str:
    """One table per audience (launcher.settings.Var.who), each variable's name, default and use."""
    from launcher.settings import TABLE

    titles = {"user": "What you set", "program": "What a program's ranks are given",
              "internal": "What the launcher sets for itself", "scripts": "What scripts/ reads",
              "tests": "What the tests and benchmarks read"}
    out = []
    for who, title in titles.items():
        out += [f"## {title}", "", "| variable | default | what it does |", "|---|---|---|"]
        out += [f"| `{v}` | {f'`{v.default}`' if v.default else '-'} | {_inline(v.help)} |" for v in TABLE if v.who == who]
        out.append("")
    return "\n".join(out)


# -- the list of result files ------------------------------------------------------------------

def files_table() -> str:
    rows = ["| file | bytes |", "|---|---|"]
    for path in result_files():
        rel = path.relative_to(ROOT).as_posix()
        rows.append(f"| [{path.relative_to(RESULTS).as_posix()}](../{rel}) | {path.stat().st_size:,} |")
    return "\n".join(rows)
