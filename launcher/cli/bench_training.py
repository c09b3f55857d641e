"""``bench scaling`` (a workload, a training function, or XGBoost), ``allreduce``, ``project``,
``overhead`` and ``sharding``: each one's settings declared, and the function registered for
them (:mod:`launcher.cli.bench_registry`), which checks names against the benchmark's own
registries, runs it, prints the machine header and the table, and writes the results."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import dataclass

from launcher.cli.bench_registry import benchmark, load_line, names, note, shared, wrote
from launcher.cli.options import EXIT_FAILED, EXIT_OK, parse_params
from launcher.errors import UserError
from launcher.schema import option

@dataclass(frozen=True)
class Scaling:
    workload: str = option("resnet50-synthetic", help="a workload (see `launcher workloads`), yours too "
                           "(FILE.py:NAME); --image-size and --num-classes apply to the synthetic ones")
    frameworks: tuple[str, ...] = option(("torch",), help="comma-separated: torch,tensorflow; or xgboost alone (whole "
                                         "runs of the tabular workload against XGBoost's own tracker without Ray)")
    rows: int = option(200_000, ge=1, help="xgboost: rows of the synthetic table (without --data)")
    features: int = option(28, ge=1, help="xgboost: its feature columns")
    rounds: int = option(50, ge=1, help="xgboost: boosting rounds per run")
    backends: tuple[str, ...] = option(("native",), help="comma-separated: native,horovod")
    workers: tuple[int, ...] = option((1, 2), ge=1, help="comma-separated worker counts, e.g. 1,2,4")
    image_size: int = option(64, ge=32, help="the synthetic images' side, at least 32 (the ResNet downsamples 32x)")
    batch_size: int = option(32, ge=1, help="images per worker per step")
    warmup: int = option(10, ge=0, help="untimed steps first")
    iters: int = option(10, ge=1, help="timed iterations")
    batches_per_iter: int = option(10, ge=1, help="steps per timed iteration")
    threads: int = option(1, ge=1, help="threads per worker (torch/TF/OMP)")
    num_classes: int = option(1000, ge=1, help="the synthetic workloads' classes")
    repeats: int = option(3, ge=1, help="a training function: launcher/bare pairs per worker count (default 3)")
    epochs: int = option(1, ge=1, help="a training function: epochs per run (default 1)")
    data: str | None = option(None, help="a training function: its --data; xgboost: a table whose label column is "
                              "y (default: a synthetic table of --rows x --features)")
    param: tuple[str, ...] = option((), repeat=True, metavar="KEY=VALUE",
                                    help="a training function's or the tabular workload's --param (repeatable)")
    no_bare: bool = option(False, help="skip the bare baseline (each torch run again under torchrun / horovodrun, "
                           "without Ray)")


@benchmark("scaling", Scaling, help="training throughput and scaling efficiency against workers")
def scaling_bench(s: Scaling, args: argparse.Namespace) -> int:
    import workloads
    from benchmarks import machine, scaling
    from launcher.spec import FRAMEWORKS

    if s.frameworks == ("xgboost",):
        return _xgboost_scaling(s, args.out)
    if s.workload not in scaling.SYNTHETIC:
        try:
            workload = workloads.get(s.workload)
        except workloads.UnknownName as exc:
            raise UserError(f"--workload: {exc}") from None
        except workloads.WorkloadError as exc:
            raise UserError(str(exc)) from None
        if isinstance(workload, workloads.TrainingFunction):
            return _function_scaling(s, args.out)
    frameworks = names("--frameworks", s.frameworks, FRAMEWORKS)
    settings = shared(scaling.Settings, s)
    info = machine.describe(s.threads)
    print(machine.header(info, f"scaling: {s.workload}, image {s.image_size}, batch {s.batch_size}/worker, "
                               f"{s.warmup} warm-up + {s.iters} x {s.batches_per_iter} steps"), flush=True)
    measured, skipped = scaling.run(settings, frameworks, list(s.backends), sorted(set(s.workers)), note,
                                    bare=not s.no_bare)
    rows = scaling.summarize(measured)
    print(scaling.format_rows(rows, skipped))
    wrote(scaling.write_results(rows, measured, skipped, info, settings, args.out))
    return EXIT_OK if measured else EXIT_FAILED


def _function_scaling(s: Scaling, out: str) -> int:
    """bench scaling of a training function: whole runs, each launcher run then its bare twin."""
    from benchmarks import function_scaling, machine, overhead

    backends = names("--backends", s.backends, function_scaling.BARE)
    job = overhead.Job(_checked_workload(s.workload), s.epochs, s.data, s.param)
    info = machine.describe(s.threads)
    print(machine.header(info, f"scaling: {s.workload}, {s.epochs} epoch(s) per run, {s.repeats} "
                               f"launcher/bare pair(s) per worker count"), flush=True)
    measured = function_scaling.run(job, backends, sorted(set(s.workers)), s.repeats, s.threads, note)
    rows = function_scaling.summarize(measured)
    print(function_scaling.format_rows(rows))
    wrote(function_scaling.write_results(rows, measured, info, job, out))
    return EXIT_OK if rows else EXIT_FAILED


def _xgboost_scaling(s: Scaling, out: str) -> int:
    """bench scaling --framework xgboost: whole runs of the tabular workload, each then XGBoost alone."""
    import workloads
    from benchmarks import machine, xgb_scaling
    from launcher.spec import JobSpec

    if s.data and not os.path.exists(s.data):
        raise UserError(f"--data {s.data} does not exist", "give a CSV or Parquet table whose label column is y, "
                        "or drop --data for a synthetic one")
    # The run's own checks first (bad --param, a table without a y column): one line, nothing started.
    spec = JobSpec(framework="xgboost", data=s.data, params=parse_params([*s.param, "label=y"])).validated()
    if s.data:
        try:
            workloads.get("tabular").check_data(os.path.abspath(s.data), spec.params)
        except workloads.DataError as exc:
            raise UserError(str(exc)) from None
    info = machine.describe(s.threads)
    with tempfile.TemporaryDirectory(prefix="launcher-xgbtable-") as tmp:
        data = os.path.abspath(s.data) if s.data else xgb_scaling.make_table(tmp, s.rows, s.features)
        setup = {"data": s.data or "synthetic", "rows": s.rows, "features": s.features, "rounds": s.rounds,
                 "threads": s.threads, "repeats": s.repeats, "params": list(s.param)}
        print(machine.header(info, f"scaling: xgboost, {s.rounds} rounds on {s.rows:,} rows x {s.features} "
                                   f"features, {s.repeats} launcher/alone pair(s) per worker count"), flush=True)
        measured = xgb_scaling.run(data, sorted(set(s.workers)), s.repeats, s.rounds, s.threads, list(s.param), note)
    rows = xgb_scaling.summarize(measured)
    print(xgb_scaling.format_rows(rows))
    wrote(xgb_scaling.write_results(rows, measured, info, setup, out))
    return EXIT_OK if rows else EXIT_FAILED


def _checked_workload(name: str) -> str:
    """The workload (or training function) checked as `launcher run` checks it, as an absolute
    reference (the variants start elsewhere)."""
    from launcher.spec import canonical_workload, load_workload

    load_workload(name)
    return canonical_workload(name)


@dataclass(frozen=True)
class Allreduce:
    sizes: str = option("4KB..256MB", help="LO..HI (powers of two) or a list 4KB,1MB,...")
    backends: tuple[str, ...] = option(("gloo", "horovod", "nccl"), help="comma-separated: gloo,horovod,nccl")
    workers: int = option(2, ge=2, help="worker processes, at least 2 for an allreduce to move data (default 2)")
    threads: int = option(1, ge=1, help="threads per worker")
    rounds: int = option(1, ge=1, help="launcher and bare (torchrun/horovodrun) runs alternate this many times; "
                         "medians kept")


@benchmark("allreduce", Allreduce, help="allreduce bandwidth (algbw, busbw) and latency per message size")
def allreduce_bench(s: Allreduce, args: argparse.Namespace) -> int:
    from benchmarks import allreduce, machine

    try:
        sizes = allreduce.parse_sizes(s.sizes)
    except ValueError as exc:
        raise UserError(f"--sizes: {exc}", "for example --sizes 4KB..256MB or --sizes 4KB,1MB") from None
    backends = names("--backends", s.backends, allreduce.CHOICES)
    info = machine.describe(s.threads)
    print(machine.header(info, f"allreduce: float32 sum, {s.workers} workers, "
                               f"{allreduce.human(sizes[0])}..{allreduce.human(sizes[-1])}"), flush=True)
    measured, skipped, copy_bw = allreduce.run(backends, sizes, s.workers, s.threads, note, rounds=s.rounds)
    rows = allreduce.summarize(measured, copy_bw)
    print(allreduce.format_rows(rows, skipped, copy_bw))
    wrote(allreduce.write_results(rows, skipped, copy_bw, info, args.out))
    return EXIT_OK if measured else EXIT_FAILED


@dataclass(frozen=True)
class Project:
    source: tuple[str, ...] = option((), flag="--from", repeat=True,
                                     help="a scaling.json from `launcher bench scaling` (repeatable)")
    figures: tuple[str, ...] = option((), repeat=True, help="YAML/JSON list of {model, gradient_bytes|gradient_mb|"
                                      "params, step_time_s} (repeatable)")
    model: tuple[str, ...] = option((), repeat=True, metavar="NAME:GRADIENT_MB:STEP_S",
                                    help="a published per-GPU figure, e.g. resnet101:178:0.25 (repeatable)")
    network_gbps: tuple[float, ...] = option((25.0, 100.0, 200.0), gt=0,
                                             help="per-node network bandwidth(s), Gbit/s")
    gpus: tuple[int, ...] = option((8, 16, 32, 64, 128, 256, 512, 1024), ge=1, help="GPU counts")
    gpus_per_node: int = option(8, ge=1, help="GPUs in each node (default 8)")
    intra_node_gbps: float = option(1200.0, gt=0, help="link inside a node (NVLink), Gbit/s")
    fusion_mb: float = option(128.0, gt=0, help="tensor fusion buffer (Horovod's threshold), MiB")
    latency_us: float = option(30.0, ge=0, help="per ring step and buffer")
    overlap: float = option(0.5, ge=0, le=1, help="share of the backward pass that hides communication")


@benchmark("project", Project, help="project scaling efficiency to many GPUs (ring-allreduce model)")
def project_bench(s: Project, args: argparse.Namespace) -> int:
    from benchmarks import machine, project

    inputs: list[project.Workload] = []
    try:
        for path in s.source:
            inputs += project.from_scaling_results(path)
        for path in s.figures:
            inputs += project.from_figures_file(path)
        for item in s.model:
            parts = item.rsplit(":", 2)
            if len(parts) != 3:
                raise ValueError(f"--model {item!r} is not NAME:GRADIENT_MB:STEP_S (e.g. resnet101:178:0.25)")
            inputs.append(project.figure({"model": parts[0], "gradient_mb": parts[1], "step_time_s": parts[2]},
                                         f"--model {item}"))
    except OSError as exc:
        raise UserError(f"cannot read {exc.filename}: {exc.strerror}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(str(exc).strip("'\""), "see `launcher bench project --help` for the input formats") from None
    if not inputs:
        raise UserError("nothing to project",
                        "give --from scaling.json, --figures FILE or --model NAME:GRADIENT_MB:STEP_S")
    gpus = sorted(set(s.gpus))
    model = project.Model(fusion_bytes=s.fusion_mb * 1024 * 1024, latency_s=s.latency_us * 1e-6, overlap=s.overlap,
                          gpus_per_node=s.gpus_per_node, intra_node_gbps=s.intra_node_gbps)
    info = machine.describe()
    print(machine.header(info, "projection: analytic ring-allreduce model (no measurement; inputs below)"))
    for w in inputs:
        print(f"# input {w.name}: gradients {w.gradient_bytes / 1e6:.1f} MB, compute {1000 * w.step_time_s:.1f} ms/step"
              + (f" ({w.source})" if w.source else ""))
    rows = project.project(inputs, list(s.network_gbps), gpus, model)
    print(project.format_rows(rows, gpus))
    wrote(project.write_results(rows, inputs, model, info, args.out))
    return EXIT_OK


@dataclass(frozen=True)
class Overhead:
    repeats: int = option(3, ge=1, help="rounds of the variants (launcher cold, launcher warm, torchrun, horovodrun), "
                          "one run of each per round, alternating; the table shows each one's median, min and max "
                          "(default 3)")
    workers: int = option(2, ge=1, help="worker processes of every run (default 2)")
    workload: str = option("digits-mlp", help="a built-in workload, FILE.py:NAME or module:NAME (a workload or a "
                           "training function)")
    epochs: int = option(1, ge=1, help="epochs of every run (default 1)")
    data: str | None = option(None, help="--data for the workload")
    param: tuple[str, ...] = option((), repeat=True, metavar="KEY=VALUE",
                                    help="a workload parameter, as `launcher run --param` (repeatable)")


@benchmark("overhead", Overhead, help="1-epoch job under launcher (cold, warm), torchrun and horovodrun")
def overhead_bench(s: Overhead, args: argparse.Namespace) -> int:
    from benchmarks import machine, overhead

    job = overhead.Job(_checked_workload(s.workload), s.epochs, s.data, s.param)
    info = machine.describe(overhead.THREADS)
    print(machine.header(info, f"overhead: {s.epochs}-epoch {s.workload}, {s.workers} workers, "
                               f"{s.repeats} repeats"), flush=True)
    samples = overhead.run(s.repeats, s.workers, note, job)
    rows = overhead.summarize(samples)
    print(overhead.format_rows(rows))
    print(overhead.format_phases(overhead.phase_medians(samples)))
    wrote(overhead.write_results(rows, samples, args.out, info))
    return EXIT_OK


@dataclass(frozen=True)
class Sharding:
    strategies: tuple[str, ...] = option(("ddp", "fsdp"), help="comma-separated: ddp,fsdp (default both)")
    workers: tuple[int, ...] = option((1, 2, 4), ge=1, flag="--workers-list",
                                      help="comma-separated worker counts (default 1,2,4)")
    steps: int = option(12, ge=1, help="training steps per worker in each run (default 12)")
    batch_size: int = option(8, ge=1, help="sequences per worker per step (default 8)")
    d_model: int = option(256, ge=1, help="the model's width (default 256)")
    layers: int = option(4, ge=1, help="transformer blocks (default 4)")
    heads: int = option(4, ge=1, help="attention heads, a divisor of --d-model (default 4)")
    context: int = option(64, ge=1, help="characters per sequence (default 64)")
    repeats: int = option(1, ge=1, help="launcher/torchrun pairs per strategy and worker count")
    no_bare: bool = option(False, help="skip the torchrun twin of each run")
    stall: tuple[str, ...] = option(("ddp", "fsdp"), help="strategies whose checkpoint stall is measured (sync and "
                                    "async upload), or none")
    stall_workers: int = option(2, ge=1, help="workers of the stall runs (default 2)")
    every: int = option(3, ge=1, help="the stall runs checkpoint every N steps (default 3)")
    resume: bool = option(False, help="instead: a small fsdp run stopped on 4 workers and resumed on 2, 3 and 4; its "
                          "losses against the uninterrupted run's, and its final weights")

    def check(self) -> None:
        if self.d_model % self.heads:
            raise ValueError(f"--d-model {self.d_model} is not a multiple of --heads {self.heads}; for example "
                             "--d-model 256 --heads 4")
        if self.stall != ("none",) and self.steps <= self.every:
            raise ValueError(f"--steps {self.steps} leaves no step checkpoint at --every {self.every} (the last "
                             f"step's is the epoch's); raise --steps above {self.every} or lower --every, or --stall "
                             "none")


@benchmark("sharding", Sharding, help="--strategy fsdp against ddp on examples/gpt.py: state and peak memory per "
           "worker, samples/s against torchrun, checkpoint stall with sync and async upload")
def sharding_bench(s: Sharding, args: argparse.Namespace) -> int:
    from benchmarks import machine, sharding

    stall = () if s.stall == ("none",) else names("--stall", s.stall, sharding.STRATEGIES)
    settings = shared(sharding.Settings, s, strategies=tuple(names("--strategies", s.strategies, sharding.STRATEGIES)),
                      workers=tuple(sorted(set(s.workers))), bare=not s.no_bare, stall=tuple(stall))
    info = machine.describe(sharding.THREADS, load_average_before=os.getloadavg())
    if s.resume:
        return _sharded_resume(info, args.out)
    print(machine.header(info, f"sharding: examples/gpt.py d_model {s.d_model}, {s.layers} layers, context "
                               f"{s.context}, batch {s.batch_size}/worker, {s.steps} steps/worker; strategies "
                               f"{','.join(settings.strategies)}, workers {','.join(map(str, settings.workers))}"))
    print(load_line("before", info["load_average_before"]), flush=True)
    measured = sharding.run(settings, note)
    info["load_average_after"] = os.getloadavg()
    rows = sharding.summarize(measured)
    checked = sharding.goals(rows)
    print(sharding.format_rows(rows))
    print(sharding.format_goals(checked))
    print(load_line("after", info["load_average_after"]))
    wrote(sharding.write_results(rows, checked, measured, info, settings, args.out))
    return EXIT_OK if rows and not any("failed" in m for m in measured) else EXIT_FAILED


def _sharded_resume(info: dict, out: str) -> int:
    """``bench sharding --resume``: the trajectories, printed and written as JSON."""
    from benchmarks import machine, sharded_resume

    print(machine.header(info, "sharded resume: examples/gpt.py (small), --strategy fsdp, stopped on 4 workers, "
                               "resumed on 2, 3 and 4"))
    print(load_line("before", info["load_average_before"]), flush=True)
    result = sharded_resume.run(note)
    info["load_average_after"] = os.getloadavg()
    print(sharded_resume.format_result(result))
    print(load_line("after", info["load_average_after"]))
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "sharding-resume.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"machine": info, **result}, f, indent=1, default=str)
    wrote([path])
    ok = all(r["summary"]["status"] == "succeeded" for r in result["resumed"].values())
    return EXIT_OK if ok else EXIT_FAILED
