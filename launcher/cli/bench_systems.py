"""``bench checkpoint``, ``stall``, ``serve``, ``input`` and ``preemption``: each one's settings
declared, and the function registered for them (:mod:`launcher.cli.bench_registry`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from dataclasses import dataclass
from typing import Iterator, Literal

from launcher.cli.bench_registry import benchmark, load_line, names, note, shared, wrote
from launcher.cli.options import (EXIT_FAILED, EXIT_OK, add_program_flags, add_run_flags, program_from_args,
                                  program_spec, spec_from_args, wants_job_dir)
from launcher.errors import UserError
from launcher.schema import option
from launcher.storage import Storage, gcs
from launcher.storage.uri import normalize_storage

# `bench preemption`'s default replacement boot time: not measured here (no GCE from this machine); an
# estimate for a Spot GPU VM whose image already holds the set-up (see docs/guides/preemption.md).
BOOT_S = 90.0
# The run's fields each strategy sets (the rest of what `launcher run` takes is the user's).
PREEMPTION_BENCH_OWNS = ("workers", "min_workers", "epochs", "name", "storage", "address", "max_failures",
                         "replace_on_notice", "keep_checkpoints")


@dataclass(frozen=True)
class Checkpoint:
    storage: tuple[str, ...] = option((), repeat=True, help="destination (folder or gs://BUCKET/PREFIX; repeatable; "
                                      "default: a local temp folder)")
    emulator: bool = option(False, help="also measure against a Cloud Storage emulator started on loopback")
    repeats: int = option(3, ge=1, help="a save and a restore per repeat, to each destination; the table shows the "
                          "median and the slowest (default 3)")
    model: Literal["resnet50", "resnet18"] = option("resnet50", help="whose training state (default resnet50)")


@benchmark("checkpoint", Checkpoint, help="checkpoint save/restore throughput (ResNet-50 training state)")
def checkpoint_bench(s: Checkpoint, args: argparse.Namespace) -> int:
    from benchmarks import checkpoint_io

    with contextlib.ExitStack() as stack:
        uris = list(s.storage)
        if not uris:
            uris.append(stack.enter_context(tempfile.TemporaryDirectory(prefix="launcher-bench-")))
        if s.emulator:
            uris.append(stack.enter_context(_bench_emulator()))
        storages = [Storage.resolve(normalize_storage(u)) for u in uris]
        for storage in storages:
            storage.check_writable()
        samples = checkpoint_io.run(storages, s.repeats, s.model, note)
    rows = checkpoint_io.summarize(samples)
    print(checkpoint_io.format_rows(rows))
    wrote(checkpoint_io.write_results(rows, samples, args.out))
    return EXIT_OK


@contextlib.contextmanager
def _bench_emulator() -> Iterator[str]:
    """A fake-gcs-server on loopback with a bucket; yields the gs:// URI to use."""
    from launcher.lab.gcs_emulator import Emulator

    with tempfile.TemporaryDirectory(prefix="launcher-gcs-") as root:
        emulator = Emulator(root).start()
        previous = os.environ.get(gcs.EMULATOR_ENV)
        os.environ[gcs.EMULATOR_ENV] = emulator.url
        try:
            gcs.client().create_bucket("launcher-bench")
            yield "gs://launcher-bench/checkpoints"
        finally:
            emulator.stop()
            if previous is None:
                os.environ.pop(gcs.EMULATOR_ENV, None)
            else:
                os.environ[gcs.EMULATOR_ENV] = previous


# where `bench stall` checkpoints: a temporary folder on local disk, the Cloud Storage emulator
STALL_STORAGES = ("local", "gcs")


@dataclass(frozen=True)
class Stall:
    mb: int = option(100, ge=1, help="size of the state in MB (default 100)")
    steps: int = option(40, ge=1, help="steps in the run (default 40)")
    every: int = option(5, ge=1, help="checkpoint every N steps (default 5)")
    storages: tuple[str, ...] = option(STALL_STORAGES, help="comma-separated: local (a temporary folder on "
                                       "local disk), gcs (the Cloud Storage emulator on loopback) (default: both)")
    uploads: tuple[str, ...] = option(("sync", "async"), help="comma-separated --checkpoint-upload modes: sync, "
                                      "async (default: both)")


@benchmark("stall", Stall, help="training time one step checkpoint costs: local disk and the Cloud Storage "
           "emulator, synchronous and asynchronous upload")
def stall_bench(s: Stall, args: argparse.Namespace) -> int:
    from benchmarks import checkpoint_stall, machine

    kinds = names("--storages", s.storages, STALL_STORAGES)
    modes = names("--uploads", s.uploads, checkpoint_stall.MODES)
    info = machine.describe(1)
    print(machine.header(info, f"checkpoint stall: a {s.mb} MB state, a checkpoint every {s.every} steps"),
          flush=True)
    with contextlib.ExitStack() as stack:
        storages = []
        for kind in kinds:
            if kind == "local":
                folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="launcher-stall-"))
                storages.append(("local disk", folder))
            else:
                storages.append(("GCS emulator", stack.enter_context(_bench_emulator())))
        rows = checkpoint_stall.run(storages, s.mb, s.steps, s.every, note, modes)
    print(checkpoint_stall.format_rows(rows))
    wrote(checkpoint_stall.write_results(rows, info, args.out))
    return EXIT_OK if all("failed" not in r for r in rows) else EXIT_FAILED


# launcher serve and the servers it is set beside (benchmarks/serve_servers.py's kinds)
SERVE_SERVERS = ("launcher", "ray-serve", "ray-serve-direct", "starlette")


@dataclass(frozen=True)
class Serve:
    run: str | None = option(None, metavar="NAME", help="the run whose model to serve, under --storage")
    model: str | None = option(None, help="a run's folder or its model folder (instead of --run)")
    storage: str | None = option(None, help="where --run is")
    concurrency: tuple[int, ...] = option((1, 8, 32, 128), ge=1,
                                          help="concurrent clients per level (default 1,8,32,128)")
    instances: tuple[int, ...] = option((1, 64), ge=1, help="instances per request (default 1,64)")
    seconds: float = option(5.0, gt=0, help="measured seconds per level, after 1 s of warm-up")
    restarts: int = option(3, ge=0, help="stop-under-load and restart cycles (default 3)")
    max_batch: int = option(64, ge=1, help="the server's --max-batch (default 64)")
    batch_wait_ms: float = option(5.0, help="the server's --batch-wait-ms (default 5)")
    protocol: Literal["vertex", "v2"] = option("vertex", help="launcher serve's requests in Vertex AI's JSON body, or "
                                               "the V2 protocol with the instances as binary float32 (default vertex)")
    servers: tuple[str, ...] = option(SERVE_SERVERS, help="comma-separated, run one after another: launcher (launcher "
                                      "serve), ray-serve (a bare Ray Serve deployment), ray-serve-direct (the same, "
                                      "direct ingress), starlette (one uvicorn process) (default: all)")
    rounds: int = option(1, ge=1, help="the servers take turns this many times, in the opposite order each round; "
                         "the table gives each figure's median over the rounds (default 1; 3 or more for figures)")


@benchmark("serve", Serve, help="`launcher serve` beside a bare Ray Serve deployment and a one-process server on "
           "the same model and clients: requests/s, latency percentiles, ratios; restart on the same port")
def serve_bench(s: Serve, args: argparse.Namespace) -> int:
    from benchmarks import machine, serve_load
    from launcher.predict.model import locate

    ref = locate(s.model, s.run, s.storage)  # one line and exit 2 if there is no model
    flags = ["--max-batch", str(s.max_batch), "--batch-wait-ms", f"{s.batch_wait_ms:g}"]
    info = machine.describe()
    print(machine.header(info, f"serve: {ref.what} ({ref.format}), max batch {s.max_batch}, {s.batch_wait_ms:g} ms "
                               f"wait, {s.seconds:g}s per level, {s.protocol} requests"), flush=True)
    servers = tuple(names("--servers", s.servers, SERVE_SERVERS))
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as state:
        rows, restarts = serve_load.run(ref.uri, sorted(set(s.concurrency)), sorted(set(s.instances)), s.seconds,
                                        s.restarts if "launcher" in servers else 0, flags, s.max_batch, note, state,
                                        s.protocol, servers, s.batch_wait_ms, s.rounds)
    print(serve_load.format_rows(rows, restarts))
    settings = {"model": ref.uri, "max_batch": s.max_batch, "batch_wait_ms": s.batch_wait_ms, "seconds": s.seconds,
                "protocol": s.protocol, "servers": list(servers), "rounds": s.rounds}
    wrote(serve_load.write_results(rows, restarts, info, settings, args.out))
    return EXIT_OK if all(r["errors"] == 0 for r in rows) else EXIT_FAILED


@dataclass(frozen=True)
class Input:
    uri: str = option(flag="URI", help="a shard set (folder or gs://BUCKET/PREFIX with an index.json)")
    workers: int = option(2, ge=1, help="reader processes, one rank each (default 2)")
    batch_size: int = option(32, ge=1, help="samples per rank per batch (default 32)")
    batches: int | None = option(None, ge=1, help="batches per rank (default: one epoch)")
    transform: str = option("none", help="what each sample goes through: none, decode-image (a WebDataset jpg/png to "
                            "an array), tensor (a parquet/jsonl row's numbers to a float32 array); default none")
    compare_local: bool = option(False, help="a gs:// set: also copy it to a local folder and measure it there")
    step_ms: float = option(0.0, ge=0, help="each reader sleeps this long per batch, as a training step; the table "
                            "shows its wait")
    cache_gb: float | None = option(None, gt=0, help="the node cache's limit (default --data-cache-gb's)")


@benchmark("input", Input, help="a streamed shard set's input pipeline alone: samples/s, MB/s, first batch, wait "
           "and memory of W reader processes (no model)")
def input_bench(s: Input, args: argparse.Namespace) -> int:
    from benchmarks import input_pipeline, machine

    settings = shared(input_pipeline.Settings, s)
    index = input_pipeline.check(s.uri, settings)  # one line and exit 2 without an index
    info = machine.describe(1, load_average_before=os.getloadavg())
    span = f"{s.batches} batches" if s.batches else "one epoch"
    print(machine.header(info, f"input: {index.uri} ({index.kind}, {index.samples:,} samples, {len(index.shards)} "
                               f"shards, {index.bytes / 1e6:,.1f} MB), {s.workers} reader(s), batch {s.batch_size}, "
                               f"{span}, transform {s.transform}" + (f", {s.step_ms:g} ms step" if s.step_ms else "")),
          flush=True)
    rows, per_rank = input_pipeline.run(index.uri, settings, note, compare_local=s.compare_local)
    info["load_average_after"] = os.getloadavg()
    print(input_pipeline.format_rows(rows))
    print(load_line("before", info["load_average_before"]))
    print(load_line("after", info["load_average_after"]))
    wrote(input_pipeline.write_results(rows, per_rank, info, settings, args.out))
    return EXIT_OK if not any(r["failed"] for r in rows) else EXIT_FAILED


@dataclass(frozen=True)
class Preemption:
    strategies: tuple[str, ...] | None = option(None, help="which to run, comma-separated (default: every one; an "
                                                "unknown name lists them)")
    workers: int = option(4, ge=2, help="worker nodes, one worker each, at least 2 (default 4)")
    min_workers: int | None = option(None, ge=1, help="the elastic strategies' --min-workers (default --workers - 1)")
    every_s: float = option(60.0, help="preempt a node this often (default 60)")
    preemptions: int = option(2, ge=1, help="how many nodes are preempted (default 2)")
    boot_s: float = option(BOOT_S, ge=0, help=f"a replacement node is ready this long after the autoscaler asks "
                           f"(default {BOOT_S:g}: a GCE Spot GPU VM with the generated set-up; see the preemption "
                           "guide)")
    stockout_s: float = option(0.0, ge=0, help="after each loss, creating a node fails for this long (no Spot "
                               "capacity; default 0)")
    epochs: int = option(1000, ge=1, help="the run's length cap (it stops after the last preemption's recovery; "
                         "default 1000)")
    notice_s: float = option(30.0, help="notice length (GCE: 30)")
    without_notice: bool = option(False, help="lose nodes without a notice")
    project: str | None = option(None, const="-", metavar="RESULTS", help="run nothing: project each strategy's "
                                 "goodput to 64-1,024 GPUs (a model from published figures, --boot-s and --notice-s, "
                                 "and RESULTS, a preemption.json of this benchmark, for the measured ones)")

    def check(self) -> None:
        if self.min_workers is not None and self.min_workers >= self.workers:
            raise ValueError(f"--min-workers {self.min_workers} must be between 1 and --workers - 1 "
                             f"({self.workers - 1})")
        if self.every_s <= self.notice_s and not self.without_notice:
            raise ValueError(f"--every-s ({self.every_s:g}) must be longer than the notice ({self.notice_s:g}s); "
                             "raise --every-s or lower --notice-s")


def _run_flags(parser: argparse.ArgumentParser) -> None:
    """What trains: anything `launcher run` takes (digits-mlp by default), less what each strategy sets."""
    add_run_flags(parser, skip=PREEMPTION_BENCH_OWNS)
    add_program_flags(parser)


@benchmark("preemption", Preemption, more_flags=_run_flags, help="goodput, steps lost, time at reduced size and "
           "recovery per strategy when nodes are preempted and replaced as slowly as GCE")
def preemption_bench(s: Preemption, args: argparse.Namespace) -> int:
    from benchmarks import preemption as bench, preemption_report as report

    if s.project:
        return _project(s, args)
    strategies = names("--strategies", s.strategies or bench.STRATEGIES, bench.STRATEGIES)
    program = program_from_args(args)
    fixed = [name for name, strategy in bench.STRATEGIES.items() if not strategy.elastic]
    if program is not None and set(strategies) - set(fixed):
        raise UserError(f"--strategies {','.join(strategies)}: a --script or --package run restarts at its full "
                        "size (the program reads its world size once, at start), so only "
                        f"{' or '.join(map(repr, fixed))} applies to it", f"add --strategies {','.join(fixed)}")
    # The run's own flags, with this benchmark's sizes (each strategy sets them again).
    run_args = argparse.Namespace(**{**vars(args), "workers": s.workers, "epochs": s.epochs})
    base = program_spec(run_args, program) if program is not None else spec_from_args(run_args)
    result = bench.run(strategies, workers=s.workers, min_workers=s.min_workers or s.workers - 1, every_s=s.every_s,
                       preemptions=s.preemptions, boot_s=s.boot_s, stockout_s=s.stockout_s, notice_s=s.notice_s,
                       with_notice=not s.without_notice, epochs=s.epochs, note=note, base=base, program=program,
                       program_args=args.program_args, job_dir=wants_job_dir(args, program))
    print(report.format_table(result))
    wrote(report.write_results(result, args.out))
    return EXIT_OK


def _project(s: Preemption, args: argparse.Namespace) -> int:
    from benchmarks import preemption_project as model

    inputs = model.Inputs(boot_s=s.boot_s, notice_s=s.notice_s)
    if s.project != "-":
        try:
            inputs = model.from_bench(s.project, inputs)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"--project {s.project}: cannot read it ({exc})",
                            "give a preemption.json written by `launcher bench preemption`, or --project alone") from None
    rows = model.project_rows(inputs, strategies=names("--strategies", s.strategies or model.STRATEGIES,
                                                       model.STRATEGIES))
    print(model.format_rows(rows, inputs))
    wrote(model.write_results(rows, inputs, args.out))
    return EXIT_OK
