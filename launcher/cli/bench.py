"""``launcher bench ...``: the benchmark commands' parsers and handlers.

Each handler checks its flags (one clear line per mistake, before anything
starts), runs a library function from ``benchmarks/``, prints the machine
header and the table on stdout, progress on stderr, and writes
JSON/CSV/PNG under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import contextlib
import os
import sys
import tempfile
from typing import Iterator

from launcher.cli.options import (EXIT_FAILED, EXIT_OK, Parser, add_program_flags, add_run_flags, parse_params,
                                  program_from_args, program_spec, spec_from_args, wants_job_dir)
from launcher.errors import UserError
from launcher.storage import Storage, gcs
from launcher.storage.uri import normalize_storage

# `launcher bench preemption`'s strategies (benchmarks/preemption.py runs them) and its default
# replacement boot time: not measured here (no GCE from this machine); an estimate for a Spot GPU
# VM whose image already holds the set-up (see docs/guides/preemption.md).
STRATEGIES = ("wait", "elastic", "elastic-early")
BOOT_S = 90.0
# The run's fields each strategy sets (the rest of what `launcher run` takes is the user's).
PREEMPTION_BENCH_OWNS = ("workers", "min_workers", "epochs", "name", "storage", "address", "max_failures",
                         "replace_on_notice", "keep_checkpoints")


def add_parsers(sub) -> None:
    """Add ``bench`` and its benchmarks."""
    bench = sub.add_parser("bench", help="benchmarks (scaling, allreduce, overhead, checkpoint, project, "
                           "preemption, serve, input, sharding)")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", parser_class=Parser,
                                     required=True)
    out_help = "folder for JSON, CSV and PNG results"

    sc = bench_sub.add_parser("scaling", help="training throughput and scaling efficiency against workers")
    sc.add_argument("--workload", default="resnet50-synthetic",
                    help="a workload (see `launcher workloads`), yours too (FILE.py:NAME); --image-size and "
                    "--num-classes apply to the synthetic ones")
    sc.add_argument("--frameworks", "--framework", default="torch",
                    help="comma-separated: torch,tensorflow; or xgboost alone (whole runs of the tabular workload "
                    "against XGBoost's own tracker without Ray)")
    sc.add_argument("--rows", type=int, default=200_000, help="xgboost: rows of the synthetic table (without --data)")
    sc.add_argument("--features", type=int, default=28, help="xgboost: its feature columns")
    sc.add_argument("--rounds", type=int, default=50, help="xgboost: boosting rounds per run")
    sc.add_argument("--backends", default="native", help="comma-separated: native,horovod")
    sc.add_argument("--workers", default="1,2", help="comma-separated worker counts, e.g. 1,2,4")
    sc.add_argument("--image-size", type=int, default=64)
    sc.add_argument("--batch-size", type=int, default=32, help="images per worker per step")
    sc.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    sc.add_argument("--iters", type=int, default=10, help="timed iterations")
    sc.add_argument("--batches-per-iter", type=int, default=10, help="steps per timed iteration")
    sc.add_argument("--threads", type=int, default=1, help="threads per worker (torch/TF/OMP)")
    sc.add_argument("--num-classes", type=int, default=1000)
    sc.add_argument("--repeats", type=int, default=3,
                    help="a training function: launcher/bare pairs per worker count (default 3)")
    sc.add_argument("--epochs", type=int, default=1, help="a training function: epochs per run (default 1)")
    sc.add_argument("--data", default=None, help="a training function: its --data; xgboost: a table whose label "
                    "column is y (default: a synthetic table of --rows x --features)")
    sc.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                    help="a training function's or the tabular workload's --param (repeatable)")
    sc.add_argument("--no-bare", dest="bare", action="store_false",
                    help="skip the bare baseline (each torch run again under torchrun / horovodrun, without Ray)")
    sc.add_argument("--out", default="./bench-results", help=out_help)

    ar = bench_sub.add_parser("allreduce", help="allreduce bandwidth (algbw, busbw) and latency per message size")
    ar.add_argument("--sizes", default="4KB..256MB", help="LO..HI (powers of two) or a list 4KB,1MB,...")
    ar.add_argument("--backends", default="gloo,horovod,nccl", help="comma-separated: gloo,horovod,nccl")
    ar.add_argument("--workers", type=int, default=2)
    ar.add_argument("--threads", type=int, default=1, help="threads per worker")
    ar.add_argument("--rounds", type=int, default=1,
                    help="launcher and bare (torchrun/horovodrun) runs alternate this many times; medians kept")
    ar.add_argument("--out", default="./bench-results", help=out_help)

    pr = bench_sub.add_parser("project", help="project scaling efficiency to many GPUs (ring-allreduce model)")
    pr.add_argument("--from", dest="source", action="append", default=[],
                    help="a scaling.json from `launcher bench scaling` (repeatable)")
    pr.add_argument("--figures", action="append", default=[],
                    help="YAML/JSON list of {model, gradient_bytes|gradient_mb|params, step_time_s} (repeatable)")
    pr.add_argument("--model", action="append", default=[], metavar="NAME:GRADIENT_MB:STEP_S",
                    help="a published per-GPU figure, e.g. resnet101:178:0.25 (repeatable)")
    pr.add_argument("--network-gbps", default="25,100,200", help="per-node network bandwidth(s), Gbit/s")
    pr.add_argument("--gpus", default="8,16,32,64,128,256,512,1024", help="GPU counts")
    pr.add_argument("--gpus-per-node", type=int, default=8)
    pr.add_argument("--intra-node-gbps", type=float, default=1200.0, help="link inside a node (NVLink), Gbit/s")
    pr.add_argument("--fusion-mb", type=float, default=128.0, help="tensor fusion buffer (Horovod's threshold), MiB")
    pr.add_argument("--latency-us", type=float, default=30.0, help="per ring step and buffer")
    pr.add_argument("--overlap", type=float, default=0.5, help="share of the backward pass that hides communication")
    pr.add_argument("--out", default="./bench-results", help=out_help)

    ck = bench_sub.add_parser("checkpoint", help="checkpoint save/restore throughput (ResNet-50 training state)")
    ck.add_argument("--storage", action="append", default=[],
                    help="destination (folder or gs://BUCKET/PREFIX; repeatable; default: a local temp folder)")
    ck.add_argument("--emulator", action="store_true",
                    help="also measure against a Cloud Storage emulator started on loopback")
    ck.add_argument("--repeats", type=int, default=3,
                    help="a save and a restore per repeat, to each destination; the table shows the median and "
                    "the slowest (default 3)")
    ck.add_argument("--model", choices=("resnet50", "resnet18"), default="resnet50")
    ck.add_argument("--out", default="./bench-results", help=out_help)

    st = bench_sub.add_parser("stall", help="training time one step checkpoint costs: local disk and the Cloud "
                              "Storage emulator, synchronous and asynchronous upload")
    st.add_argument("--mb", type=int, default=100, help="size of the state in MB (default 100)")
    st.add_argument("--steps", type=int, default=40, help="steps in the run (default 40)")
    st.add_argument("--every", type=int, default=5, help="checkpoint every N steps (default 5)")
    st.add_argument("--out", default="./bench-results", help=out_help)

    ov = bench_sub.add_parser("overhead", help="1-epoch job under launcher (cold, warm), torchrun and horovodrun")
    ov.add_argument("--repeats", type=int, default=3,
                    help="rounds of the variants (launcher cold, launcher warm, torchrun, horovodrun), one run of "
                    "each per round, alternating; the table shows each one's median, min and max (default 3)")
    ov.add_argument("--workers", type=int, default=2, help="worker processes of every run (default 2)")
    ov.add_argument("--workload", default="digits-mlp",
                    help="a built-in workload, FILE.py:NAME or module:NAME (a workload or a training function)")
    ov.add_argument("--epochs", type=int, default=1, help="epochs of every run (default 1)")
    ov.add_argument("--data", default=None, help="--data for the workload")
    ov.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                    help="a workload parameter, as `launcher run --param` (repeatable)")
    ov.add_argument("--out", default="./bench-results", help=out_help)
    _add_preemption_parser(bench_sub)

    sv = bench_sub.add_parser("serve", help="`launcher serve` under concurrent keep-alive clients: requests/s, "
                              "latency percentiles, against the model's own forward pass; restart on the same port")
    sv.add_argument("--run", metavar="NAME", help="the run whose model to serve, under --storage")
    sv.add_argument("--model", help="a run's folder or its model folder (instead of --run)")
    sv.add_argument("--storage", default=None, help="where --run is")
    sv.add_argument("--concurrency", default="1,8,32,128", help="concurrent clients per level (default 1,8,32,128)")
    sv.add_argument("--instances", default="1,64", help="instances per request (default 1,64)")
    sv.add_argument("--seconds", type=float, default=5.0, help="measured seconds per level, after 1 s of warm-up")
    sv.add_argument("--restarts", type=int, default=3, help="stop-under-load and restart cycles (default 3)")
    sv.add_argument("--max-batch", type=int, default=64, help="the server's --max-batch (default 64)")
    sv.add_argument("--batch-wait-ms", type=float, default=5.0, help="the server's --batch-wait-ms (default 5)")
    sv.add_argument("--protocol", choices=("vertex", "v2"), default="vertex", help="requests in Vertex AI's JSON "
                    "body, or the V2 protocol with the instances as binary float32 (default vertex)")
    sv.add_argument("--out", default="./bench-results", help=out_help)
    _add_input_parser(bench_sub, out_help)
    _add_sharding_parser(bench_sub, out_help)


def _add_preemption_parser(bench_sub) -> None:
    b = bench_sub.add_parser("preemption", help="goodput, steps lost, time at reduced size and recovery per strategy "
                             "(wait, elastic, elastic-early) when nodes are preempted and replaced as slowly as GCE")
    b.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"which to run, comma-separated (default {','.join(STRATEGIES)})")
    b.add_argument("--workers", type=int, default=4, help="worker nodes, one worker each (default 4)")
    b.add_argument("--min-workers", type=int, default=None,
                   help="the elastic strategies' --min-workers (default --workers - 1)")
    b.add_argument("--every-s", type=float, default=60.0, help="preempt a node this often (default 60)")
    b.add_argument("--preemptions", type=int, default=2, help="how many nodes are preempted (default 2)")
    b.add_argument("--boot-s", type=float, default=BOOT_S,
                   help=f"a replacement node is ready this long after the autoscaler asks (default {BOOT_S:g}: "
                   "a GCE Spot GPU VM with the generated set-up; see the preemption guide)")
    b.add_argument("--stockout-s", type=float, default=0.0,
                   help="after each loss, creating a node fails for this long (no Spot capacity; default 0)")
    b.add_argument("--epochs", type=int, default=1000, help="the run's length cap (it stops after the last "
                   "preemption's recovery; default 1000)")
    b.add_argument("--notice-s", type=float, default=30.0, help="notice length (GCE: 30)")
    b.add_argument("--without-notice", action="store_true", help="lose nodes without a notice")
    b.add_argument("--out", default="./bench-results", help="folder for the results (JSON, CSV, plot)")
    # What trains: anything `launcher run` takes (digits-mlp by default), less what each strategy sets.
    add_run_flags(b, skip=PREEMPTION_BENCH_OWNS)
    add_program_flags(b)


def _add_input_parser(bench_sub, out_help: str) -> None:
    ip = bench_sub.add_parser("input", help="a streamed shard set's input pipeline alone: samples/s, MB/s, first "
                              "batch, wait and memory of W reader processes (no model)")
    ip.add_argument("uri", metavar="URI", help="a shard set (folder or gs://BUCKET/PREFIX with an index.json)")
    ip.add_argument("--workers", type=int, default=2, help="reader processes, one rank each (default 2)")
    ip.add_argument("--batch-size", type=int, default=32, help="samples per rank per batch (default 32)")
    ip.add_argument("--batches", type=int, default=None, help="batches per rank (default: one epoch)")
    ip.add_argument("--transform", default="none",
                    help="what each sample goes through: none, decode-image (a WebDataset jpg/png to an array), "
                    "tensor (a parquet/jsonl row's numbers to a float32 array); default none")
    ip.add_argument("--compare-local", action="store_true",
                    help="a gs:// set: also copy it to a local folder and measure it there")
    ip.add_argument("--step-ms", type=float, default=0.0,
                    help="each reader sleeps this long per batch, as a training step; the table shows its wait")
    ip.add_argument("--cache-gb", type=float, default=None, help="the node cache's limit (default --data-cache-gb's)")
    ip.add_argument("--out", default="./bench-results", help=out_help)


def _add_sharding_parser(bench_sub, out_help: str) -> None:
    sh = bench_sub.add_parser("sharding", help="--strategy fsdp against ddp on examples/gpt.py: state and peak memory "
                              "per worker, samples/s against torchrun, checkpoint stall with sync and async upload")
    sh.add_argument("--strategies", default="ddp,fsdp", help="comma-separated: ddp,fsdp (default both)")
    sh.add_argument("--workers-list", default="1,2,4", help="comma-separated worker counts (default 1,2,4)")
    sh.add_argument("--steps", type=int, default=12, help="training steps per worker in each run (default 12)")
    sh.add_argument("--batch-size", type=int, default=8, help="sequences per worker per step (default 8)")
    sh.add_argument("--d-model", type=int, default=256, help="the model's width (default 256)")
    sh.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    sh.add_argument("--heads", type=int, default=4, help="attention heads, a divisor of --d-model (default 4)")
    sh.add_argument("--context", type=int, default=64, help="characters per sequence (default 64)")
    sh.add_argument("--repeats", type=int, default=1, help="launcher/torchrun pairs per strategy and worker count")
    sh.add_argument("--no-bare", dest="bare", action="store_false", help="skip the torchrun twin of each run")
    sh.add_argument("--stall", default="ddp,fsdp",
                    help="strategies whose checkpoint stall is measured (sync and async upload), or none")
    sh.add_argument("--stall-workers", type=int, default=2, help="workers of the stall runs (default 2)")
    sh.add_argument("--every", type=int, default=3, help="the stall runs checkpoint every N steps (default 3)")
    sh.add_argument("--resume", action="store_true", help="instead: a small fsdp run stopped on 4 workers and "
                    "resumed on 2, 3 and 4; its losses against the uninterrupted run's, and its final weights")
    sh.add_argument("--out", default="./bench-results", help=out_help)


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _ints(flag: str, text: str, low: int = 1) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r} is not a comma-separated list of integers", f"for example {flag} 1,2,4") from None
    if not values or min(values) < low:
        raise UserError(f"{flag} {text!r}: every value must be >= {low}", f"for example {flag} 1,2,4")
    return sorted(dict.fromkeys(values))


def _floats(flag: str, text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r} is not a comma-separated list of numbers", f"for example {flag} 25,100") from None
    if not values or min(values) <= 0:
        raise UserError(f"{flag} {text!r}: every value must be > 0", f"for example {flag} 25,100")
    return values


def _names(flag: str, text: str, valid: tuple[str, ...] | list[str]) -> list[str]:
    names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    bad = [n for n in names if n not in valid]
    if bad or not names:
        raise UserError(f"{flag}: unknown {', '.join(bad) or 'empty list'}", f"valid: {', '.join(valid)}")
    return names


def _positive(flag: str, value: int) -> None:
    if value < 1:
        raise UserError(f"{flag} must be >= 1, got {value}")


def _wrote(paths: list[str]) -> None:
    for path in paths:
        print(f"wrote {path}")


def cmd_scaling(args: argparse.Namespace) -> int:
    import workloads
    from benchmarks import machine, scaling
    from launcher.spec import FRAMEWORKS

    if [t.strip() for t in args.frameworks.split(",") if t.strip()] == ["xgboost"]:
        return _xgboost_scaling(args)
    if args.workload not in ("resnet18-synthetic", "resnet50-synthetic"):
        try:
            workload = workloads.get(args.workload)
        except workloads.UnknownName as exc:
            raise UserError(f"--workload: {exc}") from None
        except workloads.WorkloadError as exc:
            raise UserError(str(exc)) from None
        if isinstance(workload, workloads.TrainingFunction):
            return _function_scaling(args)
    frameworks = _names("--frameworks", args.frameworks, FRAMEWORKS)
    backend_names = [t.strip() for t in args.backends.split(",") if t.strip()]
    if not backend_names:
        raise UserError("--backends is empty", "for example --backends native,horovod")
    counts = _ints("--workers", args.workers)
    for flag in ("image_size", "batch_size", "iters", "batches_per_iter", "threads", "num_classes"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag))
    if args.warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {args.warmup}")
    if args.image_size < 32:
        raise UserError(f"--image-size must be at least 32 (the ResNet downsamples 32x), got {args.image_size}")
    settings = scaling.Settings(workload=args.workload, image_size=args.image_size, batch_size=args.batch_size,
                                warmup=args.warmup, iters=args.iters, batches_per_iter=args.batches_per_iter,
                                threads=args.threads, num_classes=args.num_classes)
    info = machine.describe(args.threads)
    print(machine.header(info, f"scaling: {args.workload}, image {args.image_size}, batch {args.batch_size}/worker, "
                               f"{args.warmup} warm-up + {args.iters} x {args.batches_per_iter} steps"), flush=True)
    measured, skipped = scaling.run(settings, frameworks, backend_names, counts, note, bare=args.bare)
    rows = scaling.summarize(measured)
    print(scaling.format_rows(rows, skipped))
    _wrote(scaling.write_results(rows, measured, skipped, info, settings, args.out))
    return EXIT_OK if measured else EXIT_FAILED


def cmd_allreduce(args: argparse.Namespace) -> int:
    from benchmarks import allreduce, machine

    try:
        sizes = allreduce.parse_sizes(args.sizes)
    except ValueError as exc:
        raise UserError(f"--sizes: {exc}", "for example --sizes 4KB..256MB or --sizes 4KB,1MB") from None
    names = _names("--backends", args.backends, allreduce.CHOICES)
    if args.workers < 2:
        raise UserError(f"--workers must be >= 2 for an allreduce to move data, got {args.workers}")
    _positive("--threads", args.threads)
    info = machine.describe(args.threads)
    print(machine.header(info, f"allreduce: float32 sum, {args.workers} workers, "
                               f"{allreduce.human(sizes[0])}..{allreduce.human(sizes[-1])}"), flush=True)
    _positive("--rounds", args.rounds)
    measured, skipped, copy_bw = allreduce.run(names, sizes, args.workers, args.threads, note, rounds=args.rounds)
    rows = allreduce.summarize(measured, copy_bw)
    print(allreduce.format_rows(rows, skipped, copy_bw))
    _wrote(allreduce.write_results(rows, skipped, copy_bw, info, args.out))
    return EXIT_OK if measured else EXIT_FAILED


def cmd_project(args: argparse.Namespace) -> int:
    from benchmarks import machine, project

    inputs: list[project.Workload] = []
    try:
        for path in args.source:
            inputs += project.from_scaling_results(path)
        for path in args.figures:
            inputs += project.from_figures_file(path)
        for item in args.model:
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
        raise UserError("nothing to project", "give --from scaling.json, --figures FILE or --model NAME:GRADIENT_MB:STEP_S")
    networks = _floats("--network-gbps", args.network_gbps)
    gpus = _ints("--gpus", args.gpus)
    _positive("--gpus-per-node", args.gpus_per_node)
    if not 0 <= args.overlap <= 1:
        raise UserError(f"--overlap must be between 0 and 1, got {args.overlap}")
    for flag in ("fusion_mb", "intra_node_gbps"):
        if getattr(args, flag) <= 0:
            raise UserError(f"--{flag.replace('_', '-')} must be > 0")
    if args.latency_us < 0:
        raise UserError(f"--latency-us must be >= 0, got {args.latency_us}")
    model = project.Model(fusion_bytes=args.fusion_mb * 1024 * 1024, latency_s=args.latency_us * 1e-6,
                          overlap=args.overlap, gpus_per_node=args.gpus_per_node,
                          intra_node_gbps=args.intra_node_gbps)
    info = machine.describe()
    print(machine.header(info, "projection: analytic ring-allreduce model (no measurement; inputs below)"))
    for w in inputs:
        print(f"# input {w.name}: gradients {w.gradient_bytes / 1e6:.1f} MB, compute {1000 * w.step_time_s:.1f} ms/step"
              + (f" ({w.source})" if w.source else ""))
    rows = project.project(inputs, networks, gpus, model)
    print(project.format_rows(rows, gpus))
    _wrote(project.write_results(rows, inputs, model, info, args.out))
    return EXIT_OK


def cmd_overhead(args: argparse.Namespace) -> int:
    from benchmarks import machine, overhead

    _positive("--repeats", args.repeats)
    _positive("--workers", args.workers)
    _positive("--epochs", args.epochs)
    job = overhead.Job(_checked_workload(args.workload), args.epochs, args.data, tuple(args.param))
    info = machine.describe(overhead.THREADS)
    print(machine.header(info, f"overhead: {args.epochs}-epoch {args.workload}, {args.workers} workers, "
                               f"{args.repeats} repeats"), flush=True)
    samples = overhead.run(args.repeats, args.workers, note, job)
    rows = overhead.summarize(samples)
    print(overhead.format_rows(rows))
    print(overhead.format_phases(overhead.phase_medians(samples)))
    _wrote(overhead.write_results(rows, samples, args.out, info))
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    from benchmarks import machine, serve_load
    from launcher.predict.model import locate

    levels = _ints("--concurrency", args.concurrency)
    sizes = _ints("--instances", args.instances)
    _positive("--max-batch", args.max_batch)
    if args.restarts < 0 or args.seconds <= 0:
        raise UserError("--restarts must be >= 0 and --seconds > 0")
    ref = locate(args.model, args.run, args.storage)  # one line and exit 2 if there is no model
    model_dir = ref.uri
    flags = ["--max-batch", str(args.max_batch), "--batch-wait-ms", f"{args.batch_wait_ms:g}"]
    info = machine.describe()
    print(machine.header(info, f"serve: {ref.what} ({ref.format}), max batch {args.max_batch}, "
                               f"{args.batch_wait_ms:g} ms wait, {args.seconds:g}s per level, {args.protocol} requests"),
          flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as state:
        rows, restarts = serve_load.run(model_dir, levels, sizes, args.seconds, args.restarts, flags, args.max_batch,
                                        note, state, args.protocol)
    print(serve_load.format_rows(rows, restarts))
    settings = {"model": model_dir, "max_batch": args.max_batch, "batch_wait_ms": args.batch_wait_ms,
                "seconds": args.seconds, "protocol": args.protocol}
    _wrote(serve_load.write_results(rows, restarts, info, settings, args.out))
    return EXIT_OK if all(r["errors"] == 0 for r in rows) else EXIT_FAILED


def _function_scaling(args: argparse.Namespace) -> int:
    """bench scaling of a training function: whole runs, each launcher run then its bare twin."""
    from benchmarks import function_scaling, machine, overhead

    backend_names = [t.strip() for t in args.backends.split(",") if t.strip()]
    unknown = [b for b in backend_names if b not in function_scaling.BARE]
    if unknown or not backend_names:
        raise UserError(f"--backends {args.backends}: a training function runs on native and/or horovod")
    counts = _ints("--workers", args.workers)
    for flag in ("repeats", "epochs", "threads"):
        _positive("--" + flag, getattr(args, flag))
    job = overhead.Job(_checked_workload(args.workload), args.epochs, args.data, tuple(args.param))
    info = machine.describe(args.threads)
    print(machine.header(info, f"scaling: {args.workload}, {args.epochs} epoch(s) per run, {args.repeats} "
                               f"launcher/bare pair(s) per worker count"), flush=True)
    measured = function_scaling.run(job, backend_names, counts, args.repeats, args.threads, note)
    rows = function_scaling.summarize(measured)
    print(function_scaling.format_rows(rows))
    _wrote(function_scaling.write_results(rows, measured, info, job, args.out))
    return EXIT_OK if rows else EXIT_FAILED


def _xgboost_scaling(args: argparse.Namespace) -> int:
    """bench scaling --framework xgboost: whole runs of the tabular workload, each then XGBoost alone."""
    import workloads
    from benchmarks import machine, xgb_scaling
    from launcher.spec import JobSpec

    counts = _ints("--workers", args.workers)
    for flag in ("repeats", "threads", "rows", "features", "rounds"):
        _positive("--" + flag, getattr(args, flag))
    if args.data and not os.path.exists(args.data):
        raise UserError(f"--data {args.data} does not exist", "give a CSV or Parquet table whose label column is y, "
                        "or drop --data for a synthetic one")
    # The run's own checks first (bad --param, a table without a y column): one line, nothing started.
    spec = JobSpec(framework="xgboost", data=args.data, params=parse_params(args.param + ["label=y"])).validated()
    if args.data:
        try:
            workloads.get("tabular").check_data(os.path.abspath(args.data), spec.params)
        except workloads.DataError as exc:
            raise UserError(str(exc)) from None
    info = machine.describe(args.threads)
    with tempfile.TemporaryDirectory(prefix="launcher-xgbtable-") as tmp:
        data = os.path.abspath(args.data) if args.data else xgb_scaling.make_table(tmp, args.rows, args.features)
        setup = {"data": args.data or "synthetic", "rows": args.rows, "features": args.features,
                 "rounds": args.rounds, "threads": args.threads, "repeats": args.repeats, "params": args.param}
        print(machine.header(info, f"scaling: xgboost, {args.rounds} rounds on {setup['rows']:,} rows x "
                                   f"{setup['features']} features, {args.repeats} launcher/alone pair(s) per worker "
                                   "count"), flush=True)
        measured = xgb_scaling.run(data, counts, args.repeats, args.rounds, args.threads, args.param, note)
    rows = xgb_scaling.summarize(measured)
    print(xgb_scaling.format_rows(rows))
    _wrote(xgb_scaling.write_results(rows, measured, info, setup, args.out))
    return EXIT_OK if rows else EXIT_FAILED


def _checked_workload(name: str) -> str:
    """The workload (or training function) checked as `launcher run` checks it, as an absolute
    reference (the variants start elsewhere)."""
    from launcher.spec import canonical_workload, load_workload

    load_workload(name)
    return canonical_workload(name)


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from benchmarks import checkpoint_io

    _positive("--repeats", args.repeats)
    with contextlib.ExitStack() as stack:
        uris = list(args.storage)
        if not uris:
            uris.append(stack.enter_context(tempfile.TemporaryDirectory(prefix="launcher-bench-")))
        if args.emulator:
            uris.append(stack.enter_context(_bench_emulator()))
        storages = [Storage.resolve(normalize_storage(u)) for u in uris]
        for storage in storages:
            storage.check_writable()
        samples = checkpoint_io.run(storages, args.repeats, args.model, note)
    rows = checkpoint_io.summarize(samples)
    print(checkpoint_io.format_rows(rows))
    _wrote(checkpoint_io.write_results(rows, samples, args.out))
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


def cmd_stall(args: argparse.Namespace) -> int:
    from benchmarks import checkpoint_stall, machine

    for flag in ("mb", "steps", "every"):
        _positive("--" + flag, getattr(args, flag))
    info = machine.describe(1)
    print(machine.header(info, f"checkpoint stall: a {args.mb} MB state, a checkpoint every {args.every} steps"),
          flush=True)
    with contextlib.ExitStack() as stack:
        local = stack.enter_context(tempfile.TemporaryDirectory(prefix="launcher-stall-"))
        remote = stack.enter_context(_bench_emulator())
        rows = checkpoint_stall.run([("local disk", local), ("GCS emulator", remote)], args.mb, args.steps,
                                    args.every, note)
    print(checkpoint_stall.format_rows(rows))
    _wrote(checkpoint_stall.write_results(rows, info, args.out))
    return EXIT_OK if all("failed" not in r for r in rows) else EXIT_FAILED


def cmd_bench_preemption(args: argparse.Namespace) -> int:
    from benchmarks import preemption as bench

    strategies = [t.strip() for t in args.strategies.split(",") if t.strip()]
    unknown = [t for t in strategies if t not in STRATEGIES]
    if unknown or not strategies:
        raise UserError(f"--strategies: unknown strategy {unknown[0] if unknown else '(none)'!r}",
                        f"choose from {', '.join(STRATEGIES)}")
    if args.workers < 2:
        raise UserError(f"--workers {args.workers}: preempting a node needs at least 2", "for example --workers 4")
    min_workers = args.min_workers if args.min_workers is not None else args.workers - 1
    if not 1 <= min_workers < args.workers:
        raise UserError(f"--min-workers {min_workers} must be between 1 and --workers - 1 ({args.workers - 1})")
    if args.preemptions < 1:
        raise UserError(f"--preemptions {args.preemptions} must be at least 1")
    if args.every_s <= args.notice_s and not args.without_notice:
        raise UserError(f"--every-s ({args.every_s:g}) must be longer than the notice ({args.notice_s:g}s)",
                        "raise --every-s or lower --notice-s")
    if args.boot_s < 0 or args.stockout_s < 0:
        raise UserError("--boot-s and --stockout-s must be 0 or more")
    program = program_from_args(args)
    if program is not None and set(strategies) - {"wait"}:
        raise UserError(f"--strategies {','.join(strategies)}: a --script or --package run restarts at its full "
                        "size (the program reads its world size once, at start), so only 'wait' applies to it",
                        "add --strategies wait")
    base = (program_spec(args, program) if program is not None else spec_from_args(args))
    result = bench.run(strategies, workers=args.workers, min_workers=min_workers, every_s=args.every_s,
                       preemptions=args.preemptions, boot_s=args.boot_s, stockout_s=args.stockout_s,
                       notice_s=args.notice_s, with_notice=not args.without_notice, epochs=args.epochs,
                       note=lambda text: print(text, file=sys.stderr, flush=True), base=base, program=program,
                       program_args=args.program_args, job_dir=wants_job_dir(args, program))
    print(bench.format_table(result))
    for path in bench.write_results(result, args.out):
        print(f"wrote {path}")
    return EXIT_OK


def cmd_input(args: argparse.Namespace) -> int:
    from benchmarks import input_pipeline, machine

    settings = input_pipeline.Settings(workers=args.workers, batch_size=args.batch_size, batches=args.batches,
                                       transform=args.transform, step_ms=args.step_ms, cache_gb=args.cache_gb)
    index = input_pipeline.check(args.uri, settings)  # one line and exit 2 without an index
    info = machine.describe(1, load_average_before=os.getloadavg())
    span = f"{args.batches} batches" if args.batches else "one epoch"
    print(machine.header(info, f"input: {index.uri} ({index.kind}, {index.samples:,} samples, {len(index.shards)} "
                               f"shards, {index.bytes / 1e6:,.1f} MB), {args.workers} reader(s), batch "
                               f"{args.batch_size}, {span}, transform {args.transform}"
                               + (f", {args.step_ms:g} ms step" if args.step_ms else "")), flush=True)
    rows, per_rank = input_pipeline.run(index.uri, settings, note, compare_local=args.compare_local)
    info["load_average_after"] = os.getloadavg()
    print(input_pipeline.format_rows(rows))
    print("# load average (1, 5, 15 min): before " + " ".join(f"{v:.2f}" for v in info["load_average_before"])
          + ", after " + " ".join(f"{v:.2f}" for v in info["load_average_after"]))
    _wrote(input_pipeline.write_results(rows, per_rank, info, settings, args.out))
    return EXIT_OK if not any(r["failed"] for r in rows) else EXIT_FAILED


def sharding_settings(args: argparse.Namespace):
    """``bench sharding``'s flags as :class:`benchmarks.sharding.Settings`; a bad flag is one line (exit 2)."""
    from benchmarks import sharding

    strategies = _names("--strategies", args.strategies, sharding.STRATEGIES)
    counts = _ints("--workers-list", args.workers_list)
    for flag in ("steps", "batch_size", "d_model", "layers", "heads", "context", "repeats", "stall_workers",
                 "every"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag))
    if args.d_model % args.heads:
        raise UserError(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}",
                        "for example --d-model 256 --heads 4")
    stall = [] if args.stall.strip() == "none" else _names("--stall", args.stall, sharding.STRATEGIES)
    if stall and args.steps <= args.every:
        raise UserError(f"--steps {args.steps} leaves no step checkpoint at --every {args.every} (the last step's "
                        "is the epoch's)", f"raise --steps above {args.every} or lower --every, or --stall none")
    return sharding.Settings(strategies=tuple(strategies), workers=tuple(counts), d_model=args.d_model,
                             layers=args.layers, heads=args.heads, context=args.context, batch_size=args.batch_size,
                             steps=args.steps, repeats=args.repeats, bare=args.bare, stall=tuple(stall),
                             stall_workers=args.stall_workers, every=args.every)


def cmd_sharding(args: argparse.Namespace) -> int:
    from benchmarks import machine, sharding

    settings = sharding_settings(args)
    info = machine.describe(sharding.THREADS, load_average_before=os.getloadavg())
    if args.resume:
        return _sharded_resume(info, args.out)
    print(machine.header(info, f"sharding: examples/gpt.py d_model {settings.d_model}, {settings.layers} layers, "
                               f"context {settings.context}, batch {settings.batch_size}/worker, {settings.steps} "
                               f"steps/worker; strategies {','.join(settings.strategies)}, workers "
                               f"{','.join(map(str, settings.workers))}"))
    print("# load average (1, 5, 15 min) before: " + " ".join(f"{v:.2f}" for v in info["load_average_before"]),
          flush=True)
    measured = sharding.run(settings, note)
    info["load_average_after"] = os.getloadavg()
    rows = sharding.summarize(measured)
    checked = sharding.goals(rows)
    print(sharding.format_rows(rows))
    print(sharding.format_goals(checked))
    print("# load average (1, 5, 15 min) after: " + " ".join(f"{v:.2f}" for v in info["load_average_after"]))
    _wrote(sharding.write_results(rows, checked, measured, info, settings, args.out))
    return EXIT_OK if rows and not any("failed" in m for m in measured) else EXIT_FAILED


def _sharded_resume(info: dict, out: str) -> int:
    """``bench sharding --resume``: the trajectories, printed and written as JSON."""
    from benchmarks import machine, sharded_resume

    print(machine.header(info, "sharded resume: examples/gpt.py (small), --strategy fsdp, stopped on 4 workers, "
                               "resumed on 2, 3 and 4"))
    print("# load average (1, 5, 15 min) before: " + " ".join(f"{v:.2f}" for v in info["load_average_before"]),
          flush=True)
    result = sharded_resume.run(note)
    info["load_average_after"] = os.getloadavg()
    print(sharded_resume.format_result(result))
    print("# load average (1, 5, 15 min) after: " + " ".join(f"{v:.2f}" for v in info["load_average_after"]))
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "sharding-resume.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"machine": info, **result}, f, indent=1, default=str)
    _wrote([path])
    ok = all(r["summary"]["status"] == "succeeded" for r in result["resumed"].values())
    return EXIT_OK if ok else EXIT_FAILED


HANDLERS = {"scaling": cmd_scaling, "allreduce": cmd_allreduce, "project": cmd_project,
            "overhead": cmd_overhead, "checkpoint": cmd_checkpoint, "stall": cmd_stall,
            "preemption": cmd_bench_preemption, "serve": cmd_serve, "input": cmd_input,
            "sharding": cmd_sharding}


def cmd_bench(args: argparse.Namespace) -> int:
    return HANDLERS[args.bench_command](args)


COMMANDS = {"bench": cmd_bench}
