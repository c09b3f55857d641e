"""Compute Engine machine facts (one table), and machine types as a run names them.

**The table.** Everything the launcher knows about Compute Engine hardware
lives here, and only here: the GPU models (quota metric, the machine series
they attach to or come with, their CUDA compute capability and whether the
pinned torch's CUDA wheels still run on them), the machine types that bring
their own GPUs (A2, A3, A4, G2: how many, which, how many vCPUs), the N1
shapes Compute Engine allows per GPU model and count, the boot disk types
each machine series takes, and which machine types exist: the predefined
sizes of the N1, N2, N2D, E2, C2, C2D and T2D families and the limits of
N1/N2/N2D/E2 custom types (``custom-6-16384``), so ``n1-standard-7`` is
refused offline, with the nearest types that exist (a series the table does
not list passes unchecked). :mod:`cluster.spec` and :mod:`cluster.config`
build cluster files from it, :mod:`cluster.preflight` checks files against it,
and a fake Compute Engine API can refuse requests by it.

Sources: Google's "GPU machine types" and "Accelerator-optimized machine
family" pages (GPUs per type, vCPUs, N1 limits), each machine series' "supported
disk types" table, the "General-purpose" and "Compute-optimized machine family"
pages and "Create a VM with a custom machine type" (sizes, custom limits),
PyPI's metadata of torch 2.13.0 (built against CUDA 13.0.3, which needs an
NVIDIA driver >= 580 and compute capability >= 7.5), and PyTorch's CUDA
support matrix (CUDA 12.8/13.0 builds: Turing and newer). Regions and zones
live in :mod:`cluster.zones`.

**Names** (``n1-standard-8+nvidia-tesla-t4x1``): :mod:`cluster.machine_types`.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from launcher.errors import UserError

MACHINE_LABEL = "launcher/machine-type"
ACCELERATOR_LABEL = "launcher/accelerator"
NO_ACCELERATOR = "none"
MACHINE_RE = re.compile(r"^[a-z][a-z0-9]*-[a-z0-9-]*[a-z0-9]$")
ACCELERATOR_RE = re.compile(r"^(?P<name>[a-z][a-z0-9-]*?)(?:x(?P<count>\d+))?$")
EXAMPLE = "n1-standard-8, or n1-standard-8+nvidia-tesla-t4x1 with a GPU"

# -- what the nodes install ------------------------------------------------------------------------
# torch 2.13.0's Linux wheel on PyPI depends on cuda-toolkit 13.0.3: its kernels need compute
# capability 7.5 (Turing) or newer and an NVIDIA driver of the 580 series or newer.
TORCH_VERSION = "2.13.0"
TORCH_CUDA = "13.0"
MIN_DRIVER = 580
MIN_CAPABILITY = (7, 5)


@dataclass(frozen=True)
class Accelerator:
    """A GPU model: its Compute Engine name, quota metric, the machine series it attaches to (N1)
    or comes with (A2/A3/A4/G2: ``bundled``), its architecture and CUDA compute capability."""

    name: str
    quota: str
    series: tuple[str, ...]
    architecture: str
    capability: tuple[int, int]
    bundled: bool = False  # the machine type brings it: no guestAccelerators
    retired: str = ""      # why Compute Engine no longer offers it

    @property
    def torch_runs(self) -> bool:
        """Whether the pinned torch's CUDA wheels have kernels for this GPU."""
        return self.capability >= MIN_CAPABILITY

    @property
    def generation(self) -> str:
        return f"{self.architecture}, compute capability {self.capability[0]}.{self.capability[1]}"


ACCELERATORS = {a.name: a for a in (
    Accelerator("nvidia-tesla-t4", "NVIDIA_T4_GPUS", ("n1",), "Turing", (7, 5)),
    Accelerator("nvidia-tesla-v100", "NVIDIA_V100_GPUS", ("n1",), "Volta", (7, 0)),
    Accelerator("nvidia-tesla-p100", "NVIDIA_P100_GPUS", ("n1",), "Pascal", (6, 0)),
    Accelerator("nvidia-tesla-p4", "NVIDIA_P4_GPUS", ("n1",), "Pascal", (6, 1)),
    Accelerator("nvidia-tesla-k80", "NVIDIA_K80_GPUS", ("n1",), "Kepler", (3, 7),
                retired="Compute Engine ended K80 support on 2024-05-01"),
    Accelerator("nvidia-l4", "NVIDIA_L4_GPUS", ("g2",), "Ada Lovelace", (8, 9), bundled=True),
    Accelerator("nvidia-tesla-a100", "NVIDIA_A100_GPUS", ("a2",), "Ampere", (8, 0), bundled=True),
    Accelerator("nvidia-a100-80gb", "NVIDIA_A100_80GB_GPUS", ("a2",), "Ampere", (8, 0), bundled=True),
    Accelerator("nvidia-h100-80gb", "NVIDIA_H100_GPUS", ("a3",), "Hopper", (9, 0), bundled=True),
    Accelerator("nvidia-h100-mega-80gb", "NVIDIA_H100_MEGA_GPUS", ("a3",), "Hopper", (9, 0), bundled=True),
    Accelerator("nvidia-h200-141gb", "NVIDIA_H200_GPUS", ("a3",), "Hopper", (9, 0), bundled=True),
    Accelerator("nvidia-b200", "NVIDIA_B200_GPUS", ("a4",), "Blackwell", (10, 0), bundled=True),
)}


@dataclass(frozen=True)
class GpuMachine:
    """A machine type that comes with its GPUs."""

    accelerator: str
    gpus: int
    vcpus: int
    spot_only: bool = False  # offered only as Spot (or flex-start) VMs


def _gpu_machines() -> dict[str, GpuMachine]:
    table = {}
    for gpus, vcpus in ((1, 12), (2, 24), (4, 48), (8, 96)):
        table[f"a2-highgpu-{gpus}g"] = GpuMachine("nvidia-tesla-a100", gpus, vcpus)
        table[f"a2-ultragpu-{gpus}g"] = GpuMachine("nvidia-a100-80gb", gpus, vcpus)
    table["a2-megagpu-16g"] = GpuMachine("nvidia-tesla-a100", 16, 96)
    for gpus, vcpus in ((1, 26), (2, 52), (4, 104)):
        table[f"a3-highgpu-{gpus}g"] = GpuMachine("nvidia-h100-80gb", gpus, vcpus, spot_only=True)
    table["a3-highgpu-8g"] = GpuMachine("nvidia-h100-80gb", 8, 208)
    table["a3-megagpu-8g"] = GpuMachine("nvidia-h100-mega-80gb", 8, 208)
    table["a3-ultragpu-8g"] = GpuMachine("nvidia-h200-141gb", 8, 224)
    table["a4-highgpu-8g"] = GpuMachine("nvidia-b200", 8, 224)
    # G2: the vCPUs are in the name; most types have one L4.
    for vcpus, gpus in ((4, 1), (8, 1), (12, 1), (16, 1), (24, 2), (32, 1), (48, 4), (96, 8)):
        table[f"g2-standard-{vcpus}"] = GpuMachine("nvidia-l4", gpus, vcpus)
    return table


GPU_MACHINES = _gpu_machines()

# N1 + GPU shapes Compute Engine accepts: GPUs per VM -> (most vCPUs, most memory in GB).
# A count missing here does not exist (no 8 x T4, P4 or P100).
N1_SHAPES: dict[str, dict[int, tuple[int, int]]] = {
    "nvidia-tesla-t4": {1: (48, 312), 2: (48, 312), 4: (96, 624)},
    "nvidia-tesla-p4": {1: (24, 156), 2: (48, 312), 4: (96, 624)},
    "nvidia-tesla-v100": {1: (12, 78), 2: (24, 156), 4: (48, 312), 8: (96, 624)},
    "nvidia-tesla-p100": {1: (16, 104), 2: (32, 208), 4: (64, 208)},
    "nvidia-tesla-k80": {1: (8, 52), 2: (16, 104), 4: (32, 208), 8: (64, 416)},
}
# GB of memory per vCPU of the predefined N1 types.
N1_MEMORY_PER_VCPU = {"standard": 3.75, "highmem": 6.5, "highcpu": 0.9}
# Shared-core types (their names carry no vCPU count): vCPUs, GB of memory, the share of a core they
# may use over time (Compute Engine's machine-type documentation). A head can be one; a training
# worker on a fraction of a core is not worth it.
SHARED_CORE: dict[str, tuple[int, float, float]] = {
    "e2-micro": (2, 1.0, 0.25), "e2-small": (2, 2.0, 0.5), "e2-medium": (2, 4.0, 1.0),
    "f1-micro": (1, 0.6, 0.2), "g1-small": (1, 1.7, 0.5),
}

# Boot disk types per machine series, the default first. The API's own default, pd-standard, is
# refused by G2, A3, C3 and newer series; the newest series take Hyperdisk only.
PD = ("pd-balanced", "pd-ssd", "pd-standard")
DISK_TYPES: dict[str, tuple[str, ...]] = {
    **{s: PD for s in ("n1", "n2", "n2d", "e2", "c2", "c2d", "t2d", "t2a", "m1", "m2", "a2")},
    **{s: ("pd-balanced", "pd-ssd") for s in ("g2",)},
    **{s: ("pd-balanced", "pd-ssd", "hyperdisk-balanced") for s in ("a3", "c3", "c3d")},
    **{s: ("hyperdisk-balanced",) for s in ("c4", "c4a", "c4d", "n4", "a4")},
}
# Families whose types take only Hyperdisk, even when their series also has Persistent Disk types.
HYPERDISK_ONLY = ("a3-ultragpu",)
# Series whose VMs must use the gVNIC network interface.
GVNIC_SERIES = ("a3", "a4")
# Arm series (Ampere Altra, Google Axion): they boot ARM64 images only. Every other series, GPU types
# included, is x86-64, and so is every Deep Learning VM image.
ARM_SERIES = ("t2a", "c4a", "n4a")

# Predefined machine types: family -> the vCPU counts Compute Engine offers, from Google's
# "General-purpose machine family" and "Compute-optimized machine family" pages (2025). Only these
# series are checked by name; another series (C3, C4, N4, M1-M4, T2A, H3, Z3, ...), or a family
# of these series not listed (n1-megamem), passes unchecked, so a real type is never refused here
# (preflight asks the project, which knows every type of its zone).
_C2D = (2, 4, 8, 16, 32, 56, 112)
PREDEFINED: dict[str, tuple[int, ...]] = {
    "n1-standard": (1, 2, 4, 8, 16, 32, 64, 96), "n1-highmem": (2, 4, 8, 16, 32, 64, 96),
    "n1-highcpu": (2, 4, 8, 16, 32, 64, 96),
    "n2-standard": (2, 4, 8, 16, 32, 48, 64, 80, 96, 128), "n2-highmem": (2, 4, 8, 16, 32, 48, 64, 80, 96, 128),
    "n2-highcpu": (2, 4, 8, 16, 32, 48, 64, 80, 96),
    "n2d-standard": (2, 4, 8, 16, 32, 48, 64, 80, 96, 128, 224), "n2d-highmem": (2, 4, 8, 16, 32, 48, 64, 80, 96),
    "n2d-highcpu": (2, 4, 8, 16, 32, 48, 64, 80, 96, 128, 224),
    "e2-standard": (2, 4, 8, 16, 32), "e2-highmem": (2, 4, 8, 16), "e2-highcpu": (2, 4, 8, 16, 32),
    "c2-standard": (4, 8, 16, 30, 60), "c2d-standard": _C2D, "c2d-highmem": _C2D, "c2d-highcpu": _C2D,
    "t2d-standard": (1, 2, 4, 8, 16, 32, 48, 60),
}
# Family words Compute Engine uses: an unlisted family of a checked series spelled so is taken as real.
FAMILY_WORDS = ("standard", "highmem", "highcpu", "megamem", "ultramem", "hypermem", "custom")


@dataclass(frozen=True)
class CustomLimits:
    """What a series' custom types (``custom-CPUS-MB``, ``n2-custom-CPUS-MB[-ext]``) may have."""

    label: str           # how the rule is said: "1 or an even number up to 96"
    vcpus: tuple[int, ...]
    min_mb: int          # memory per vCPU, MB
    max_mb: int
    extended_mb: int = 0  # the most memory with extended memory (-ext); 0: none
    total_mb: int = 0     # the most memory in all; 0: no other limit


# Custom machine types: Google's "Create a VM with a custom machine type" page and its samples'
# limits (compute_custom_machine_type_helper_class); memory is a multiple of 256 MB. N4 and newer
# series' custom types are not checked here.
CUSTOM: dict[str, CustomLimits] = {
    "n1": CustomLimits("1 or an even number up to 96", (1, *range(2, 97, 2)), 922, 6656, 624 << 10),
    "n2": CustomLimits("an even number up to 32, then multiples of 4 up to 128",
                       (*range(2, 33, 2), *range(36, 129, 4)), 512, 8192, 624 << 10),
    "n2d": CustomLimits("2, 4, 8, 16, 32, 48, 64, 80 or 96", (2, 4, 8, 16, 32, 48, 64, 80, 96), 512, 8192,
                        768 << 10),
    "e2": CustomLimits("an even number up to 32", tuple(range(2, 33, 2)), 512, 8192, total_mb=128 << 10),
}
CUSTOM_RE = re.compile(r"^(?:(?P<series>[a-z][a-z0-9]*)-)?custom-(?P<cpus>\d+)-(?P<mb>\d+)(?P<ext>-ext)?$")
PREDEFINED_RE = re.compile(r"^(?P<family>[a-z][a-z0-9]*-[a-z]+)-(?P<size>\d+)$")
# series-family-size[-suffix] (c3-standard-4-lssd, a2-highgpu-1g) or a custom/shared-core name
TYPE_NAME_RE = re.compile(r"^[a-z][a-z0-9]*-[a-z]+-\d+[a-z0-9-]*$")


def machine_series(machine_type: str) -> str:
    """n1-standard-8 -> n1; custom-6-16384 -> n1 (N1's custom types carry no series prefix)."""
    series = machine_type.split("-", 1)[0]
    return "n1" if series == "custom" else series


def machine_vcpus(machine_type: str) -> int:
    """vCPUs of a machine type, from the table of GPU types or its name (n1-standard-8 -> 8)."""
    if machine_type in GPU_MACHINES:
        return GPU_MACHINES[machine_type].vcpus
    if machine_type in SHARED_CORE:
        return SHARED_CORE[machine_type][0]
    m = re.match(r"^(?:[a-z][a-z0-9]*-)?(standard|highmem|highcpu|megamem|ultramem|custom)-(\d+)",
                 machine_type)
    if not m:
        raise UserError(f"machine type {machine_type!r} is not one whose vCPU count is known",
                        "use a type like n1-standard-8, n2-highmem-16, e2-medium, g2-standard-8 or a2-highgpu-1g")
    return int(m.group(2))


def machine_memory_gb(machine_type: str) -> float | None:
    """Memory of a predefined or custom N1 type from its name; None when the name does not say."""
    if machine_type in SHARED_CORE:
        return SHARED_CORE[machine_type][1]
    m = re.match(r"^n1-(standard|highmem|highcpu)-(\d+)$", machine_type)
    if m:
        return int(m.group(2)) * N1_MEMORY_PER_VCPU[m.group(1)]
    m = re.match(r"^(?:n1-)?custom-(\d+)-(\d+)(?:-ext)?$", machine_type)
    return int(m.group(2)) / 1024 if m else None


def bundled_gpus(machine_type: str) -> int:
    """GPUs that come with a machine type (0 for types without built-in GPUs)."""
    gpu = GPU_MACHINES.get(machine_type)
    return gpu.gpus if gpu else 0


def bundled_accelerator(machine_type: str) -> str | None:
    """The GPU model a machine type comes with (None for types without built-in GPUs)."""
    gpu = GPU_MACHINES.get(machine_type)
    return gpu.accelerator if gpu else None


def check_gpu_machine(machine_type: str) -> None:
    """An A2/A3/A4/G2 name the table does not know is refused (its GPU count would be a guess)."""
    series = machine_series(machine_type)
    if series in ("a2", "a3", "a4", "g2") and machine_type not in GPU_MACHINES:
        family = machine_type.rsplit("-", 1)[0]
        known = [t for t in GPU_MACHINES if t.startswith(family + "-")] or \
            [t for t in GPU_MACHINES if t.startswith(series + "-")]
        raise UserError(f"machine type {machine_type!r} is not a known {series.upper()} type",
                        f"valid: {', '.join(known)}")


def check_machine_type(machine_type: str, flag: str = "--machine-type") -> None:
    """Offline: a type of a series the table knows must exist (n1-standard-7 does not).

    Raises:
        UserError: naming ``flag``, the type, why, and the nearest types that exist.
    """
    problem = machine_type_problem(machine_type)
    if problem:
        why, near = problem
        hint = f"did you mean {' or '.join(near)}? " if near else ""
        raise UserError(f"{flag} {machine_type}: {why}",
                        f"{hint}set {flag} to a type of `gcloud compute machine-types list`")


def machine_type_problem(machine_type: str) -> tuple[str, list[str]] | None:
    """Why Compute Engine has no such machine type, and the nearest ones it has; None when it has
    it or the table cannot tell (a series or family it does not list)."""
    series = machine_series(machine_type)
    if machine_type in GPU_MACHINES or machine_type in SHARED_CORE:
        return None
    if series in ("a2", "a3", "a4", "g2"):
        near = difflib.get_close_matches(machine_type, GPU_MACHINES, n=2)
        return f"not a known {series.upper()} type (it would bring GPUs the table does not know)", near
    custom = CUSTOM_RE.match(machine_type)
    if custom:
        return _custom_problem(custom.group("series") or "n1", int(custom.group("cpus")),
                               int(custom.group("mb")), bool(custom.group("ext")), machine_type)
    predefined = PREDEFINED_RE.match(machine_type)
    if predefined and predefined.group("family") in PREDEFINED:
        return _size_problem(predefined.group("family"), int(predefined.group("size")))
    if not TYPE_NAME_RE.match(machine_type) and not re.match(r"^e2-custom-(micro|small|medium)-\d+$", machine_type):
        return "not a machine type name (SERIES-FAMILY-VCPUS, like n1-standard-8, or custom-VCPUS-MB)", []
    family = machine_type.split("-")[1]
    families = {f for f in PREDEFINED if f.startswith(series + "-")}
    if families and family not in FAMILY_WORDS:
        near = difflib.get_close_matches(machine_type, [f"{f}-{n}" for f in families for n in PREDEFINED[f]], n=2)
        return f"{series.upper()} has no {family} family (it has {', '.join(sorted(families))})", near
    return None


def _size_problem(family: str, size: int) -> tuple[str, list[str]] | None:
    sizes = PREDEFINED[family]
    if size in sizes:
        return None
    near = sorted(sizes, key=lambda n: (abs(n - size), -n))[:2]
    return (f"{family} types have {_or_list(sizes)} vCPUs, not {size}",
            [f"{family}-{n}" for n in near])


def _custom_problem(series: str, cpus: int, mb: int, ext: bool, name: str) -> tuple[str, list[str]] | None:
    """A custom type against its series' limits (None for a series the table has no limits for)."""
    limits = CUSTOM.get(series)
    if limits is None:
        return None
    prefix, kind = name[:name.index("custom-") + len("custom")], f"{series.upper()} custom types"
    if cpus not in limits.vcpus:
        near = sorted(limits.vcpus, key=lambda v: (abs(v - cpus), -v))[:2]
        return f"{kind} have {limits.label} vCPUs, not {cpus}", [_custom(limits, prefix, n, mb) for n in near]
    low, high = _memory_range(limits, cpus)
    fixed = [_custom(limits, prefix, cpus, mb)]
    if mb % 256:
        return f"{kind} take memory in multiples of 256 MB, not {mb} MB", fixed
    if mb < low:
        return f"{kind} take at least {limits.min_mb / 1024:.1f} GB per vCPU ({low} MB for {cpus}), not {mb} MB", fixed
    if ext and not limits.extended_mb:
        return f"{kind} have no extended memory (-ext)", fixed
    if ext and mb > limits.extended_mb:
        return (f"{kind} take at most {limits.extended_mb >> 10} GB with extended memory, not {mb} MB",
                [f"{prefix}-{cpus}-{limits.extended_mb}-ext"])
    if not ext and mb > high and limits.extended_mb and mb <= limits.extended_mb:
        return (f"{kind} take at most {limits.max_mb / 1024:.1f} GB per vCPU ({high} MB for {cpus}) without "
                "extended memory", [f"{name}-ext", *fixed])
    if not ext and mb > high:
        return f"{kind} take at most {high} MB with {cpus} vCPUs, not {mb} MB", fixed
    return None


def _memory_range(limits: CustomLimits, cpus: int) -> tuple[int, int]:
    """The least and most MB (multiples of 256) a custom type with ``cpus`` vCPUs takes without -ext."""
    low = -(-cpus * limits.min_mb // 256) * 256
    high = cpus * limits.max_mb // 256 * 256
    return low, min(high, limits.total_mb) if limits.total_mb else high


def _custom(limits: CustomLimits, prefix: str, cpus: int, mb: int) -> str:
    """A valid custom type with ``cpus`` vCPUs and the memory nearest ``mb``."""
    low, high = _memory_range(limits, cpus)
    return f"{prefix}-{cpus}-{min(max(round(mb / 256) * 256, low), high)}"


def _or_list(values) -> str:
    items = [str(v) for v in values]
    return ", ".join(items[:-1]) + " or " + items[-1] if len(items) > 1 else items[0]


def image_driver(image: str) -> int | None:
    """The NVIDIA driver branch a Deep Learning VM image family or image name says it carries
    (``common-cu129-ubuntu-2204-nvidia-580`` -> 580), None when the name does not say."""
    m = re.search(r"nvidia-(\d{3})(?:\D|$)", image.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def machine_architecture(machine_type: str) -> str:
    """ARM64 for an Arm series' type (t2a-standard-8), else X86_64: Compute Engine's names for them."""
    return "ARM64" if machine_series(machine_type) in ARM_SERIES else "X86_64"


def image_architecture(image: str) -> str:
    """An image's architecture from its family or name: Google's Arm images say so (ubuntu-2204-lts-arm64,
    debian-12-arm64); the others, the Deep Learning VM families among them, are X86_64."""
    return "ARM64" if "arm64" in image.rstrip("/").rsplit("/", 1)[-1] else "X86_64"


def architecture_problem(machine_type: str, image: str) -> str | None:
    """Why a VM of ``machine_type`` cannot boot ``image`` (an x86-64 image on an Arm type, or the reverse)."""
    machine, boot = machine_architecture(machine_type), image_architecture(image)
    if machine == boot:
        return None
    return (f"{machine_type} is an {'Arm' if machine == 'ARM64' else 'x86-64'} ({machine}) machine type and image "
            f"{image.rstrip('/').rsplit('/', 1)[-1]} is {boot}: Compute Engine refuses to boot it")


def architecture_fix(machine_type: str, image: str) -> str:
    """What to change when :func:`architecture_problem` finds one."""
    series = machine_series(machine_type)
    if series in ARM_SERIES:  # the x86 series of the same shapes: t2a-standard-8 -> t2d-standard-8
        twin = {"t2a": "t2d", "c4a": "c4", "n4a": "n4"}[series] + machine_type[len(series):]
        return f"use an x86-64 machine type ({twin}, or another series), or an arm64 image"
    return "use an x86-64 image, or an Arm machine type (t2a-, c4a-)"


def disk_types(machine_type: str) -> tuple[str, ...]:
    """Boot disk types a machine type takes, its default first (pd-balanced for unknown series)."""
    if any(machine_type.startswith(f + "-") for f in HYPERDISK_ONLY):
        return ("hyperdisk-balanced",)
    return DISK_TYPES.get(machine_series(machine_type), PD)


def n1_shape_problem(accelerator: str, count: int, vcpus: int | None, memory_gb: float | None) -> str | None:
    """Why an N1 VM with ``count`` of ``accelerator`` and this many vCPUs / GB cannot exist, or None."""
    shapes = N1_SHAPES.get(accelerator)
    if not shapes:
        return None
    if count not in shapes:
        return (f"Compute Engine attaches {', '.join(map(str, shapes))} x {accelerator} to an N1 VM, "
                f"not {count}")
    most_cpus, most_gb = shapes[count]
    if vcpus is not None and vcpus > most_cpus:
        return f"{count} x {accelerator} allows at most {most_cpus} vCPUs on N1, not {vcpus}"
    if memory_gb is not None and memory_gb > most_gb:
        return f"{count} x {accelerator} allows at most {most_gb} GB of memory on N1, not {memory_gb:g}"
    return None


def n1_largest_type(accelerator: str, count: int) -> str:
    """The largest n1-standard type that fits a shape (for a fix hint)."""
    most_cpus, most_gb = N1_SHAPES[accelerator][count]
    best = max(n for n in (1, 2, 4, 8, 16, 32, 64, 96) if n <= most_cpus and n * 3.75 <= most_gb)
    return f"n1-standard-{best}"
