"""`launcher bench`'s registry (launcher/cli/bench_registry.py): every benchmark registered by
name, its flags derived from its declaration, a bad value refused in one line (exit 2) before
anything runs, and every `launcher bench` command line the docs show still parsing to valid
settings. No Ray, no subprocess."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from benchmarks import preemption
from launcher import schema
from launcher.cli import bench
from launcher.cli.bench_registry import BENCHMARKS, OUT
from launcher.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
NAMES = {"scaling", "allreduce", "project", "checkpoint", "stall", "overhead", "preemption", "serve", "input",
         "sharding"}
URI = ["gs://bucket/set"]  # bench input's one argument


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def settings_of(*argv: str):
    return bench.settings(build_parser().parse_args(["bench", *argv]))


def test_every_benchmark_is_registered_by_name_with_its_subcommand():
    assert set(BENCHMARKS) == NAMES
    assert set(subcommands(subcommands(build_parser())["bench"])) == NAMES


@pytest.mark.parametrize("name", sorted(NAMES))
def test_the_flags_derive_from_the_declaration_and_none_given_means_its_defaults(name):
    declared = BENCHMARKS[name].settings
    parser = subcommands(subcommands(build_parser())["bench"])[name]
    flags = {s for a in parser._actions for s in a.option_strings}
    for f in schema.fields(declared):
        assert f.help, f"{name}: {f.name} has no help"
        assert f.flag in flags or (f.flag == "URI" and name == "input"), f"{name}: no {f.flag}"
    assert "--out" in flags
    assert [a.option_strings for a in parser._actions if a.option_strings and not a.help] == []
    args = build_parser().parse_args(["bench", name, *(URI if name == "input" else [])])
    assert bench.settings(args) == declared(**({"uri": URI[0]} if name == "input" else {}))
    assert args.out == OUT


def test_given_flags_become_typed_settings():
    s = settings_of("sharding", "--workers-list", "4,1,2", "--no-bare", "--stall", "none", "--d-model", "64",
                    "--heads", "2")
    assert (s.workers, s.no_bare, s.stall, s.d_model, s.resume) == ((4, 1, 2), True, ("none",), 64, False)
    s = settings_of("project", "--from", "a.json", "--from", "b.json", "--network-gbps", "25,100", "--overlap", "0")
    assert (s.source, s.network_gbps, s.overlap, s.gpus_per_node) == (("a.json", "b.json"), (25.0, 100.0), 0.0, 8)
    # A repeated flag is not split at commas; --framework is --frameworks (argparse's prefix match).
    s = settings_of("scaling", "--framework", "xgboost", "--param", "sizes=1,2", "--param", "b=3")
    assert (s.frameworks, s.param) == (("xgboost",), ("sizes=1,2", "b=3"))
    # A switch takes no value: the URI after it stays the URI.
    s = settings_of("input", "--compare-local", URI[0], "--batches", "3")
    assert (s.uri, s.compare_local, s.batches, s.cache_gb) == (URI[0], True, 3, None)


@pytest.mark.parametrize("argv,needle", [
    (["stall", "--mb", "0"], "--mb must be at least 1, got 0"),
    (["stall", "--mb", "lots"], "argument --mb: invalid int value: 'lots'"),
    (["scaling", "--warmup", "-1"], "--warmup must be at least 0, got -1"),
    (["scaling", "--image-size", "16"], "--image-size must be at least 32, got 16"),
    (["scaling", "--backends", ","], "--backends ',' gives no value"),
    (["project", "--overlap", "1.5"], "--overlap must be at most 1, got 1.5"),
    (["project", "--fusion-mb", "0"], "--fusion-mb must be more than 0"),
    (["project", "--gpus", "8,many"], "--gpus '8,many' is not a comma-separated list of integers"),
    (["serve", "--concurrency", "8,0"], "--concurrency '8,0': every value must be at least 1"),
    (["checkpoint", "--model", "vgg"], "argument --model: invalid choice: 'vgg'"),
    (["input", *URI, "--cache-gb", "0"], "--cache-gb must be more than 0"),
    (["preemption", "--workers", "1"], "--workers must be at least 2, got 1"),
    (["preemption", "--min-workers", "4"], "--min-workers 4 must be between 1 and --workers - 1 (3)"),
    (["preemption", "--every-s", "20"], "--every-s (20) must be longer than the notice (30s)"),
    (["preemption", "--strategies", "wait,sometimes"], f"--strategies: unknown sometimes; valid: "
                                                       f"{', '.join(preemption.STRATEGIES)}"),
    (["allreduce", "--backends", "gloo,mpi"], "--backends: unknown mpi; valid: gloo, horovod, nccl"),
])
def test_a_bad_value_is_one_line_and_exit_2_before_anything_runs(capsys, tmp_path, argv, needle):
    out = tmp_path / "out"
    assert main(["bench", *argv, "--out", str(out)]) == 2
    stdout, err = capsys.readouterr()
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert stdout == "" and not out.exists()


def documented_bench_lines() -> list[tuple[str, str]]:
    """(file, command line) for each `launcher bench NAME ARGS...` in the README, benchmarks/README.md
    and docs/: in code blocks (a trailing backslash continues the line; `#` starts a comment) and in
    inline code. A synopsis's optional parts ([--flag X]) count as given, its placeholders (URI, X) as 1."""
    fence = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
    found = []
    for path in [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        lines = [line for block in fence.findall(text) for line in block.replace("\\\n", " ").splitlines()]
        lines += re.findall(r"`([^`]+)`", fence.sub("", text))
        for line in lines:
            words = line.split(" #")[0].replace("[", "").replace("]", "").split()
            if words[:2] == ["launcher", "bench"] and len(words) > 3 and not any(w == "|" or "..." in w for w in words):
                found.append((path.relative_to(ROOT).as_posix(), " ".join(words)))
    return found


def test_every_documented_bench_line_parses_to_valid_settings():
    lines = documented_bench_lines()
    assert {shlex.split(line)[2] for _, line in lines} == NAMES  # every benchmark shown with its flags
    for where, line in lines:
        argv = ["1" if re.fullmatch(r"[A-Z]+", w) else w for w in shlex.split(line)[1:]]
        try:
            bench.settings(build_parser().parse_args(argv))
        except Exception as exc:  # noqa: BLE001 - name the line
            pytest.fail(f"{where}: `{line}`: {exc}")
