"""TensorFlow under Horovod: the launcher against horovodrun on one unmodified script.

Runs a Horovod TensorFlow script with N workers under ``launcher run --script ...
--backend horovod --framework tensorflow`` and under ``horovodrun -np N``, alternating,
and prints each pair's images per second and their ratio (launcher / horovodrun), with
JSON, CSV and a plot under --out. The script is ``benchmarks/hvd_tf_synthetic.py``
(Keras' ResNet50 on random images with Horovod's DistributedGradientTape) unless
``--script`` names another: any script whose rank 0 prints Horovod's synthetic
benchmark's last line, ``Total img/sec on N ...: X``, such as Horovod's own
``examples/tensorflow2/tensorflow2_synthetic_benchmark.py``.

    python -m benchmarks.hvd_tf_ratio --pairs 2 --out benchmarks/results
    python -m benchmarks.hvd_tf_ratio --pairs 3 --script ~/horovod/examples/tensorflow2/\
tensorflow2_synthetic_benchmark.py -- --no-cuda --batch-size 4 --num-warmup-batches 1 \
--num-batches-per-iter 2 --num-iters 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import machine, results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "hvd_tf_synthetic.py")
# Horovod's synthetic benchmarks end with this line on rank 0 (the project's script too).
_TOTAL = re.compile(r"Total img/sec on \d+ \S+: ([0-9.]+)")


def total_images_per_second(output: str) -> float | None:
    """The last ``Total img/sec on N CPU(s): X +-Y`` figure in a run's output, or None."""
    found = _TOTAL.findall(output)
    return float(found[-1]) if found else None


def _command(variant: str, script: str, workers: int, extra: list[str], storage: str, index: int,
             script_args: list[str]) -> list[str]:
    if variant == "horovodrun":
        return [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", str(workers),
                "-H", f"localhost:{workers}", sys.executable, script, *extra, *script_args]
    return [sys.executable, "-m", "launcher", "run", "--script", script, "--backend", "horovod",
            "--framework", "tensorflow", "--workers", str(workers), "--storage", storage,
            "--name", f"hvd_tf_{index}", "--", *extra, *script_args]


def measure(pairs: int, workers: int, script_args: list[str], note, script: str = SCRIPT) -> list[dict]:
    samples = []
    ours = os.path.abspath(script) == SCRIPT
    with tempfile.TemporaryDirectory(prefix="hvd-tf-ratio-") as d:
        for i in range(pairs):
            order = ("launcher", "horovodrun") if i % 2 == 0 else ("horovodrun", "launcher")
            for variant in order:
                out = os.path.join(d, f"{variant}-{i}.json")
                extra = ["--json", out] if ours else []  # the project's script also records its threads
                started = time.perf_counter()
                proc = subprocess.run(_command(variant, script, workers, extra, os.path.join(d, "runs"), i,
                                               script_args),
                                      cwd=ROOT, capture_output=True, text=True,
                                      env={**os.environ, "TF_USE_LEGACY_KERAS": "1"})
                wall = time.perf_counter() - started
                total = total_images_per_second(proc.stdout + "\n" + proc.stderr)
                if proc.returncode != 0 or total is None:
                    raise SystemExit(f"{variant} failed (exit {proc.returncode}"
                                     f"{'' if total else ', no Total img/sec line'}): {proc.stderr[-2000:]}")
                threads = None
                if ours and os.path.exists(out):
                    with open(out, encoding="utf-8") as f:
                        threads = json.load(f)["threads"]
                samples.append({"pair": i, "variant": variant, "img_per_s": total, "wall_s": wall,
                                "threads": threads})
                note(f"pair {i + 1}/{pairs} {variant}: {total:.2f} img/s (wall {wall:.0f} s"
                     f"{f', threads {threads}' if threads else ''})")
    return samples


def summarize(samples: list[dict]) -> list[dict]:
    rows = []
    for i in sorted({s["pair"] for s in samples}):
        by = {s["variant"]: s for s in samples if s["pair"] == i}
        rows.append({"pair": i + 1, "launcher_img_s": round(by["launcher"]["img_per_s"], 3),
                     "horovodrun_img_s": round(by["horovodrun"]["img_per_s"], 3),
                     "ratio": round(by["launcher"]["img_per_s"] / by["horovodrun"]["img_per_s"], 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--script", default=SCRIPT,
                        help="a Horovod TensorFlow script printing 'Total img/sec on N ...: X' on rank 0 "
                             "(default: benchmarks/hvd_tf_synthetic.py)")
    parser.add_argument("--out", default=None, help="folder for hvd-tf-ratio.json/.csv/.png")
    parser.add_argument("script_args", nargs="*", help="after --: arguments for the script")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.script):
        parser.error(f"--script {args.script}: no such file")
    samples = measure(args.pairs, args.workers, args.script_args, lambda m: print(m, file=sys.stderr, flush=True),
                      script=os.path.abspath(args.script))
    rows = summarize(samples)
    info = machine.describe(load_average=os.getloadavg())
    ours = os.path.abspath(args.script) == SCRIPT
    name = "Horovod TF2 ResNet50 synthetic" if ours else os.path.basename(args.script)
    print(machine.header(info, f"{name}, {args.workers} workers: launcher / horovodrun"))
    print(f"{'pair':>4}  {'launcher img/s':>14}  {'horovodrun img/s':>16}  {'ratio':>6}")
    for r in rows:
        print(f"{r['pair']:>4}  {r['launcher_img_s']:>14.2f}  {r['horovodrun_img_s']:>16.2f}  {r['ratio']:>6.3f}")
    median = statistics.median(r["ratio"] for r in rows)
    print(f"median ratio {median:.3f}")
    if args.out:
        fig, ax = results.new_figure()
        xs = [r["pair"] for r in rows]
        ax.bar([x - 0.2 for x in xs], [r["launcher_img_s"] for r in rows], width=0.4, label="launcher run --script")
        ax.bar([x + 0.2 for x in xs], [r["horovodrun_img_s"] for r in rows], width=0.4, label="horovodrun")
        ax.set_xlabel("pair (alternating order)")
        ax.set_ylabel("images/s, all workers")
        ax.set_title(f"{name}, {args.workers} workers: median ratio {median:.3f}")
        ax.legend()
        for path in results.write(args.out, "hvd-tf-ratio", rows, {"samples": samples, "machine": info,
                                                                    "script": args.script,
                                                                    "script_args": args.script_args,
                                                                    "median_ratio": median}, fig):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
