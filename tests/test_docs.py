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
import re
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



# -- quoted output: the progress and summary lines the code prints today (issue 65 item 6) ----------
#
# A guide that quotes an epoch line or a summary shows what a user will see. The lines are checked
# by their shape (numbers, names and paths aside) against what the formatting functions print when
# fed the reports the workers send (launcher.worker.usersession's data wait and
# launcher.worker.timing's breakdown) and RunSummary objects: a quoted token the code no longer
# prints (`input wait N%` where the line says `43% waiting for data`), or a torch run's output
# without the time breakdown every torch run now reports, fails here.

NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
PLACEHOLDER = re.compile(r"\b[NXM]\b")  # `input wait N%`: a number in prose
EPOCH_LINE = re.compile(r"^epoch \d+(?:/\d+)?  step \d+")
PREFIX = re.compile(r"^\s*\| ?")  # a transcript's quoted lines: `   | epoch 1/1 ...`
METRIC_TOKEN = re.compile(r"[A-Za-z_][\w.-]* #")  # a metric by its name: `train_loss 0.0995`, `val_acc 0.91`
EPOCH_WORDS = ("waiting for data", "input wait", "samples/s", "straggler rank", "elapsed", "computing",
               "synchronising gradients", "checkpointing", "optimizer step", "preemption notices")


def _pages() -> dict[str, str]:
    pages = {"README.md": (ROOT / "README.md").read_text(encoding="utf-8")}
    pages.update({p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
                  for p in sorted(DOCS.rglob("*.md")) if "hooks" not in p.parts})
    return pages


def _blocks(text: str) -> tuple[list[list[str]], str]:
    """(the fenced code blocks' lines, a transcript's `| ` taken off; the prose around them)."""
    blocks, prose, inside = [], [], None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if inside is None:
                inside = []
            else:
                blocks.append(inside)
                inside = None
        elif inside is not None:
            inside.append(PREFIX.sub("", line) if PREFIX.match(line) else line)
        else:
            prose.append(line)
    return blocks, "\n".join(prose)


def _shape(text: str) -> str:
    return NUMBER.sub("#", text)


def _reports() -> list[dict]:
    """Epoch reports as the workers send them: a session's (your loop's, the managed torch
    loop's: data wait and the time breakdown, each phase the largest in turn, with and without
    a straggler and a rank that waits long for data), the TensorFlow loop's and XGBoost's
    (no breakdown), a Ray Train function's (its own metrics)."""
    import numpy as np

    from launcher.worker.timing import PHASES, breakdown
    from launcher.worker.usersession import data_wait

    base = {"epoch": 2, "global_step": 32, "train_loss": 1.03, "loss": 0.9, "accuracy": 0.6, "samples_per_s": 548.0,
            "train_time_s": 10.0}
    reports = [base, {"epoch": 12, "global_step": 12, "train-rmse": 51.2, "validation-rmse": 61.6}]
    for top in PHASES:
        for slow in (1.0, 2.0):
            for waits in ([0.5, 0.5], [0.5, 6.0]):
                rows = np.full((len(PHASES) + 1, 2), 0.5)
                rows[PHASES.index(top)] = 6.0
                rows[PHASES.index("compute"), 1] *= slow * (2 if top != "compute" else 1)
                rows[PHASES.index("data")] = np.maximum(rows[PHASES.index("data")], waits)
                rows[-1] = rows[:-1].sum(axis=0)
                reports.append({**base, "val_acc": 0.91, **data_wait(np.array(waits), 10.0), **breakdown(rows)})
    return reports


def _epoch_tokens() -> tuple[set[str], set[str]]:
    """(every token an epoch line prints, by shape; those that say where the time went)."""
    from launcher.driver.progress import format_epoch
    from launcher.worker.timing import WORDS

    tokens = {_shape(t) for m in _reports() for t in format_epoch(m, 10, 12.3).split("  ")}
    shares = {t for t in tokens if any(t.endswith(f"% {w}") for w in WORDS.values())}
    return tokens, shares


def _summary_parts(line: str) -> list[str]:
    """A summary line's parts (split at "; "), each by its shape: numbers, names, paths and free
    text made placeholders, a list of metrics or of phases one placeholder."""
    from launcher.summary import TIME_PHASES

    if line.startswith("run ") and ": " in line:
        return ["run NAME: " + line.split(": ", 1)[1]]
    if re.match(r"^ {4,}\S", line):  # a line that continues the one above (free text)
        return ["CONTINUED"]
    line = re.sub(r"^  \S+ / \S+ / \S+", "  W / F / B", line)
    line = re.sub(r"strategy \S+,", "strategy S,", line)
    line = re.sub(r"^  (run log|checkpoint|model|mlflow): +\S.*$", r"  \1: P", line)
    line = re.sub(r"^  error: .*$", "  error: E", line)
    line = _shape(line)
    line = re.sub(r"# epochs?\)", "# epoch(s))", line)
    line = re.sub(r"# (?:/ # )+MB", "#s MB", line)
    if re.fullmatch(r"  [\w.-]+ #(?:, [\w.-]+ #)*", line):
        return ["  METRICS"]
    parts = line.split("; ")
    for i, part in enumerate(parts):
        shares = re.fullmatch(r"(  )?time: ((?:\w+ #%(?:, )?)+)", part)
        if shares and all(p.split()[0] in TIME_PHASES for p in shares.group(2).split(", ")):
            parts[i] = (shares.group(1) or "") + "time: SHARES"
    return parts


def _summaries():
    """RunSummary objects covering what a summary prints: a torch run as the default prints it;
    one with every optional line (restarts, a resume, a note, an error, MLflow, set-up time, GPU
    memory, no breakdown but an input wait); an XGBoost run; a program; many ranks."""
    import dataclasses

    from launcher.measures import summarise_usage

    from launcher.summary import RunSummary

    known = {f.name for f in dataclasses.fields(RunSummary)}
    usage = summarise_usage({0: [[0, 34, 525, 0, 0]], 1: [[0, 33, 524, 0, 0]]})
    base = dict(name="r", status="succeeded", workload="digits-mlp", framework="torch", backend="native",
                strategy="ddp", workers=2, epochs=10, epochs_completed=10, steps_completed=230,
                metrics={"loss": 0.15, "accuracy": 0.95}, samples_per_s=7361.0, wall_s=51.3,
                time_shares={"sync": 0.734, "compute": 0.194, "optimizer": 0.055, "data": 0.016},
                stragglers=[{"rank": 0, "factor": 1.5, "epochs": 1}, {"rank": 1, "factor": 1.5, "epochs": 3}],
                peak_rss_mb_max=530.0, peak_rss_mb_ranks=[530.0, 528.0], usage=usage, run_dir="/p/runs/r",
                checkpoint="/p/runs/r/checkpoint_1", model="/p/runs/r/model")
    gpu = summarise_usage({r: [[0, 90, 500, 80, 2000]] for r in range(2)})
    everything = {**base, "restarts": 2, "preemptions": 1, "preemption_notices": 1, "notice_checkpoint_s": 1.2,
                  "resumed_from": {"epoch": 3, "step": 69}, "note": "nothing to train: the run already completed "
                  "10 epoch(s)", "error": "rank 0: KeyError: 'x'", "mlflow": "run abc in ./mlruns",
                  "model_note": "weights only", "setup_s": 3.0, "time_shares": {}, "data_wait_fraction": 0.04,
                  "data_wait_max_fraction": 0.3, "peak_gpu_mb_max": 2000.0, "peak_gpu_mb_ranks": [2000.0, 1990.0],
                  "usage": gpu}
    many = {**base, "workers": 12, "peak_rss_mb_ranks": [500.0] * 12,
            "usage": summarise_usage({r: [[0, 50, 500, 0, 0]] for r in range(12)})}
    for fields in (base, everything, many, {**base, "framework": "xgboost", "steps_completed": 30},
                   {**base, "exit_codes": {"0": 0, "1": 0}, "metrics": {"accuracy": 0.9}, "restarts": 1}):
        yield RunSummary(**{k: v for k, v in fields.items() if k in known})


def _quoted_runs():
    """(page, the block's epoch lines, its summary lines) for each quoted run's output."""
    for page, text in _pages().items():
        blocks, _ = _blocks(text)
        for block in blocks:
            epochs = [line.strip() for line in block if EPOCH_LINE.match(line.strip())]
            summary, inside = [], False
            for line in block:
                if re.match(r"^run \S+: (succeeded|failed|cancelled|preempted)$", line.rstrip()):
                    inside, summary = True, [line.rstrip()]
                elif inside and line.startswith("  ") and line.strip() != "...":
                    summary.append(line.rstrip())
                elif inside and line.strip() != "...":
                    inside = False
            if epochs or summary:
                yield page, epochs, summary


def test_quoted_epoch_lines_and_summaries_are_what_the_code_prints():
    from launcher.cli.run import format_summary

    tokens, shares = _epoch_tokens()
    printed = {part for s in _summaries() for line in format_summary(s).splitlines() for part in _summary_parts(line)}
    stale, seen = [], 0
    for page, epochs, summary in _quoted_runs():
        for line in epochs:
            seen += 1
            odd = [t for t in line.split("  ") if _shape(t) not in tokens and not METRIC_TOKEN.fullmatch(_shape(t))]
            if odd:
                stale.append(f"{page}: {line!r}: the progress line prints no {odd}")
        for line in summary:
            seen += 1
            odd = [p for p in _summary_parts(line) if p not in printed]
            if odd:
                stale.append(f"{page}: {line!r}: a summary prints no {odd}")
        header = next((line for line in summary if re.match(r"^  \S+ / torch / ", line)), None)
        if header and not any(line.startswith("  exit status") for line in summary):
            # Every torch run (your loop, the managed loop) times its phases: the lines say so.
            if not any(line.startswith("  time: ") for line in summary):
                stale.append(f"{page}: a torch run's summary without its `time:` line")
            stale += [f"{page}: {line!r}: a torch run's epoch line without where the time went"
                      for line in epochs if not any(_shape(t) in shares for t in line.split("  "))]
    assert stale == [], "\n".join(stale)
    assert seen >= 20, "the docs' quoted runs were not found"


def test_quoted_pieces_of_the_epoch_line_are_what_it_prints():
    """`43% waiting for data` in a sentence about the epoch line: every such piece is tokens
    the line prints (a placeholder N or X stands for a number)."""
    tokens, _ = _epoch_tokens()
    stale, seen = [], 0
    for page, text in _pages().items():
        _, prose = _blocks(text)
        for span in re.findall(r"`([^`\n|]{3,60})`", prose):
            shape = _shape(PLACEHOLDER.sub("0", span))
            if "#" not in shape or not any(w in span for w in EPOCH_WORDS):
                continue
            seen += 1
            if not all(t in tokens for t in shape.split("  ")):
                stale.append(f"{page}: `{span}`")
    assert stale == [], "quoted as the epoch line's, which prints no such thing: " + ", ".join(stale)
    assert seen >= 2, "the quoted pieces of the epoch line were not found"
