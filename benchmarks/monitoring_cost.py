"""What watching a run costs: samples/s with the step-time breakdown and usage sampling on
(the default) against both off, alternating, on the same run arguments.

"Off" is ``LAUNCHER_STEP_HOOKS=0`` (no gradient or optimizer hooks: sync and the optimizer
count as compute) and ``LAUNCHER_USAGE_S=0`` (no sampling thread); what stays is a few
``perf_counter`` calls per step, which no switch removes. Each pair runs on, then off (or the
reverse on odd pairs, so a machine warming up favours neither), each a new run name. Prints a
table and the median ratio, and writes JSON, CSV and a plot.

    python -m benchmarks.monitoring_cost --pairs 3 -- --workload examples/char_lm.py:train \\
        --data /tmp/text.txt --workers 2 --epochs 1

Whole runs vary by several per cent from one to the next, more than the cost looked for.
``--in-process digits|char_lm`` measures the per-step part alone, in one process without
Ray: a model's training steps (forward, backward, AdamW) in alternating blocks with the
session's clock (its hooks, and the calls a step makes) and without, the median ratio of
the blocks' step rates.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import machine, results
from launcher.worker import StepClock

OFF = {"LAUNCHER_STEP_HOOKS": "0", "LAUNCHER_USAGE_S": "0"}


def one_run(run_args: list[str], storage: str, name: str, on: bool) -> dict:
    """``launcher run --json`` with monitoring on or off; its summary."""
    env = {k: v for k, v in os.environ.items() if k not in OFF}
    if not on:
        env.update(OFF)
    done = subprocess.run([sys.executable, "-m", "launcher", "run", "--json", "--storage", storage, "--name", name,
                           *run_args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"the run failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratios(pairs: list[tuple[float, float]]) -> list[float]:
    """on / off per pair (samples/s)."""
    return [round(on / off, 4) if off else float("nan") for on, off in pairs]


def _model(name: str):
    """(model, a batch maker, a loss) of the digits MLP or the char_lm transformer at its defaults."""
    import torch
    import torch.nn.functional as F

    if name == "digits":
        from workloads.torch_models import MLP

        return (MLP(64, (128, 64), 10), lambda: (torch.randn(32, 64), torch.randint(0, 10, (32,))), F.cross_entropy)
    spec = importlib.util.spec_from_file_location("char_lm", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "char_lm.py"))
    char_lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(char_lm)
    p = {param.name: param.default for param in char_lm.PARAMS}
    context = int(p["context"])
    model = char_lm.CharTransformer(96, context, int(p["width"]), int(p["layers"]), int(p["heads"]))
    return (model, lambda: (torch.randint(0, 96, (16, context)), torch.randint(0, 96, (16, context))),
            lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))


def in_process(name: str, blocks: int, steps: int) -> list[dict]:
    """Alternating blocks of ``steps`` training steps with the clock on and off; one row per pair."""
    import torch

    torch.set_num_threads(1)
    model, batch, loss_fn = _model(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [batch() for _ in range(8)]

    def block(clock) -> float:
        started = time.perf_counter()
        for i in range(steps):
            t0 = time.perf_counter()
            x, y = data[i % len(data)]
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if clock is not None:  # what UserSession.step and Session.after_step add per step
                clock.add("notice", time.perf_counter() - t0)
                clock.add("checkpoint", time.perf_counter() - t0)
                clock.step_done()
        return steps / (time.perf_counter() - started)

    clock = StepClock()
    clock.watch_gradients(model)
    clock.watch_optimizer(optimizer)
    block(None)  # warm up
    rows = []
    for i in range(blocks):
        got = {}
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            clock.hooks = on
            if on and not clock._grad_hooks:
                clock.watch_gradients(model)
                clock.watch_optimizer(optimizer)
            elif not on:
                clock.close()
            got[on] = block(clock if on else None)
        rows.append({"pair": i + 1, "on_steps_per_s": round(got[True], 2), "off_steps_per_s": round(got[False], 2),
                     "ratio": round(got[True] / got[False], 4)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-process", choices=("digits", "char_lm"),
                        help="time the per-step part alone, in this process (no Ray, no run)")
    parser.add_argument("--steps", type=int, default=200, help="--in-process: steps per block")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON, CSV and PNG")
    parser.add_argument("--stem", default="monitoring-cost")
    parser.add_argument("run_args", nargs=argparse.REMAINDER, help="after --: arguments for `launcher run`")
    args = parser.parse_args(argv)
    run_args = args.run_args[1:] if args.run_args[:1] == ["--"] else args.run_args
    if args.in_process:
        return report_in_process(args)
    if not run_args:
        parser.error("give the run's arguments after --")
    load = os.getloadavg()
    pairs, rows = [], []
    with tempfile.TemporaryDirectory(prefix="monitoring-cost-") as storage:
        for i in range(args.pairs):
            got = {}
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                summary = one_run(run_args, storage, f"p{i}_{'on' if on else 'off'}_{int(time.time())}", on)
                got[on] = float(summary["samples_per_s"])
                print(f"pair {i + 1}: monitoring {'on ' if on else 'off'} {got[on]:,.1f} samples/s", flush=True)
            pairs.append((got[True], got[False]))
            rows.append({"pair": i + 1, "on_samples_per_s": got[True], "off_samples_per_s": got[False],
                         "ratio": ratios([pairs[-1]])[0]})
    median = statistics.median(r["ratio"] for r in rows)
    print(machine.header(machine.describe(load_average=load),
                         f"monitoring on / off, `launcher run {' '.join(run_args)}`"))
    print(f"{'pair':>4} {'on':>10} {'off':>10} {'on/off':>7}")
    for r in rows:
        print(f"{r['pair']:>4} {r['on_samples_per_s']:>10,.1f} {r['off_samples_per_s']:>10,.1f} {r['ratio']:>7.3f}")
    print(f"median on/off {median:.3f} (cost {100 * (1 - median):.1f}% of samples/s); load average before "
          f"{load[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    fig, ax = results.new_figure()
    ax.plot([r["pair"] for r in rows], [r["on_samples_per_s"] for r in rows], "o-", label="monitoring on")
    ax.plot([r["pair"] for r in rows], [r["off_samples_per_s"] for r in rows], "s--", label="off")
    ax.set_xlabel("pair")
    ax.set_ylabel("samples/s")
    ax.set_title(f"monitoring on / off: median {median:.3f}")
    ax.legend()
    paths = results.write(args.out, args.stem, rows, {"run_args": run_args, "median_ratio": median,
                                                       "machine": machine.describe(load_average=load)}, fig)
    print("wrote " + ", ".join(paths))
    return 0


def report_in_process(args: argparse.Namespace) -> int:
    load = os.getloadavg()
    rows = in_process(args.in_process, args.pairs, args.steps)
    median = float(np.median([r["ratio"] for r in rows]))
    # Over all blocks: each pair's blocks ran side by side, so the machine's drift cancels in the sum.
    pooled = sum(1 / r["off_steps_per_s"] for r in rows) / sum(1 / r["on_steps_per_s"] for r in rows)
    print(machine.header(machine.describe(load_average=load),
                         f"the step clock on / off, {args.in_process} in one process, {args.steps} steps a block"))
    print(f"{'pair':>4} {'on':>9} {'off':>9} {'on/off':>7}   (steps/s)")
    for r in (rows if len(rows) <= 20 else rows[:10] + rows[-10:]):
        print(f"{r['pair']:>4} {r['on_steps_per_s']:>9,.1f} {r['off_steps_per_s']:>9,.1f} {r['ratio']:>7.4f}")
    print(f"{len(rows)} pairs: median on/off {median:.4f}, all blocks together {pooled:.4f} (cost "
          f"{100 * (1 - pooled):.2f}% of steps/s); load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    fig, ax = results.new_figure()
    ax.plot([r["pair"] for r in rows], [r["ratio"] for r in rows], "o-")
    ax.axhline(0.99, color="gray", linestyle="--", label="the goal: 1 % at most")
    ax.set_xlabel("pair of blocks")
    ax.set_ylabel("steps/s on / off")
    ax.set_title(f"{args.in_process}: the step clock's cost, median {median:.4f}")
    ax.legend()
    paths = results.write(args.out, args.stem, rows, {"model": args.in_process, "steps": args.steps,
                                                       "median_ratio": median,
                                                       "pooled_ratio": pooled,
                                                       "machine": machine.describe(load_average=load)}, fig)
    print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
