"""The table of LAUNCHER_* environment variables (launcher.settings): declared once, used by name.

The source scans fail on a ``LAUNCHER_`` string in launcher/ outside the table (docstrings
aside: they describe, they do not name), and on a ``LAUNCHER_`` variable used anywhere in the
repository (code, scripts, docs) that the table does not declare.
"""

from __future__ import annotations

import ast
import os
import pickle
import re
from pathlib import Path

from launcher import settings
from launcher.settings import TABLE, Var

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bLAUNCHER_[A-Z][A-Z0-9_]*\b")
NOT_OURS = {"LAUNCHER_TEST_A", "LAUNCHER_TEST_B"}  # tests/test_serve_parts.py's stand-ins for any variable


def _strings(tree: ast.AST) -> list[ast.Constant]:
    """The module's string constants (f-strings' parts included), docstrings left out."""
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_no_launcher_variable_is_named_in_launcher_outside_the_table():
    found = []
    for path in sorted((ROOT / "launcher").rglob("*.py")):
        if path == ROOT / "launcher" / "settings.py":
            continue
        found += [f"{path.relative_to(ROOT)}:{n.lineno} {n.value!r}"
                  for n in _strings(ast.parse(path.read_text(encoding="utf-8"))) if settings.PREFIX in n.value]
    assert found == [], "take the name from launcher.settings: " + "; ".join(found)


def test_the_scan_sees_a_name_in_a_string_and_an_f_string_and_not_in_a_docstring():
    source = '"""LAUNCHER_X in a docstring."""\nA = "LAUNCHER_X"\nB = f"set {A} or LAUNCHER_Y"\n'
    assert sorted(n.value for n in _strings(ast.parse(source)) if settings.PREFIX in n.value) == \
        [" or LAUNCHER_Y", "LAUNCHER_X"]


def test_every_launcher_variable_the_repository_uses_is_in_the_table():
    declared = set(TABLE)
    used: dict[str, str] = {}
    folders = ("launcher", "workloads", "cluster", "benchmarks", "scripts", "tests", "docs", "examples", ".ci")
    for folder in folders:
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path != Path(__file__).resolve() and path.suffix in ("", ".py", ".md", ".sh", ".yaml", ".yml", ".toml") \
                    and "results" not in path.parts and "__pycache__" not in path.parts:
                for name in NAME.findall(path.read_text(encoding="utf-8", errors="replace")):
                    used.setdefault(name, str(path.relative_to(ROOT)))
    missing = {name: where for name, where in used.items() if name not in declared | NOT_OURS}
    assert missing == {}, f"declare these in launcher/settings.py: {missing}"


def test_each_variable_is_declared_once_with_its_use():
    names = [str(v) for v in TABLE]
    assert len(names) == len(set(names)) and all(n.startswith(settings.PREFIX) for n in names)
    assert all(v.help and v.who in ("user", "program", "internal", "scripts", "tests") for v in TABLE)
    assert {getattr(settings, a) for a in dir(settings) if isinstance(getattr(settings, a), Var)} == set(TABLE)


def test_a_variable_is_its_name_reads_its_default_and_pickles_as_a_plain_name(monkeypatch):
    usage = settings.USAGE_S
    assert usage == "LAUNCHER_USAGE_S" and f"{usage}" == "LAUNCHER_USAGE_S" and {usage: 1} == {"LAUNCHER_USAGE_S": 1}
    monkeypatch.delenv(usage, raising=False)
    assert usage.get() == "5"
    monkeypatch.setenv(usage, "")
    assert usage.get() == "5"  # set but empty: the default
    monkeypatch.setenv("LAUNCHER_USAGE_S", "0.5")
    assert usage.get() == "0.5" and os.environ[usage] == "0.5"
    back = pickle.loads(pickle.dumps({usage: "x"}))
    assert back == {"LAUNCHER_USAGE_S": "x"} and type(next(iter(back))) is str
    monkeypatch.delenv(settings.PG_CLEANER, raising=False)
    assert settings.PG_CLEANER.get() is None  # no default: unset
