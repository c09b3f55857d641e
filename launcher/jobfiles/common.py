"""What the job file formats share: the result (:class:`JobFile`), the words a key's help
uses to note or refuse it (``noted: WHY``, ``refused: WHY; FIX``) and :func:`_declared`,
which applies them through a whole file, and the helpers every format reads with (the
run's folder and name, durations, machine types, versions, Vertex's JSON spellings)."""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from cluster import machine_types
from launcher import schema
from launcher.errors import UserError
from launcher.schema import option
from launcher.tune.hyperparams import Hyperparameters

ARCHIVE_SUFFIXES = (".tar.gz", ".whl")
WHY_NO_PS = "the ranks synchronise by allreduce (Horovod or Ray Train's own), which needs no parameter server"
WHY_NO_CONTAINER = "AI Platform's container keys are not read: containers run from a Vertex AI CustomJob's " \
    "containerSpec"
WHY_NO_TPU = "the launcher trains on CPUs and NVIDIA GPUs"
# A key's help says what becomes of it: "noted: WHY" (one line, then the run goes on) or
# "refused: WHY; HOW TO FIX" (one line, exit 2); see :func:`_declared`.
REFUSE_CONTAINER = f"refused: {WHY_NO_CONTAINER}; write the job as a CustomJob whose workerPoolSpecs have a " \
    "containerSpec (imageUri, command, args), or give packageUris and pythonModule"
REFUSE_TPU = f"refused: {WHY_NO_TPU}; use an NVIDIA GPU type, e.g. NVIDIA_TESLA_T4"
REFUSE_KEYS = "refused: customer-managed encryption keys are Compute Engine's and Cloud Storage's to set; remove it"
REFUSE_SHELL = "refused: interactive shells into the ranks are not offered; remove it"
NOTE_DISKS = "noted: the cluster file sets the disks (`launcher cluster config --disk-size-gb`)"
NOTE_QUEUE = "noted: not applied, the launcher does not queue jobs; a run waits for its ranks' resources as Ray " \
    "schedules them"
NOTE_NETWORK = "noted: the cluster's to set (`launcher cluster config --network`), not the job's"
NOTE_ACCOUNT = "noted: the cluster's to set (`launcher cluster config --service-account`), not the job's"
NOTE_TRACKING = "noted: not used; TensorBoard logs go to AIP_TENSORBOARD_LOG_DIR under the run's folder"
NOTE_DEFAULT = "noted: not used; the search starts from its own points"


def _key(default: Any = None, **kw: Any) -> Any:
    return option(default, cli=False, help=kw.pop("help", ""), **kw)


@dataclass
class JobFile:
    """A job file as the launcher runs it. ``fields`` are JobSpec values (flags go over them)."""

    kind: str                                   # "ai-platform", "vertex-custom-job", "vertex-tuning-job"
    source: str
    fields: dict[str, Any] = field(default_factory=dict)
    package_uris: tuple[str, ...] = ()
    module: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    image: str | None = None                    # a containerSpec's imageUri: the ranks run ``command`` in it
    command: tuple[str, ...] = ()
    hyperparameters: Hyperparameters | None = None
    notes: list[str] = field(default_factory=list)
    machines: dict[str, str] = field(default_factory=dict)   # "primary", "workers" -> MACHINE[+ACCELxN]

    def check_packages(self, where: str) -> None:
        """Each package URI must be a built package (a local folder is taken as well)."""
        for uri in self.package_uris:
            if not uri.endswith(ARCHIVE_SUFFIXES) and not (not uri.startswith("gs://") and os.path.isdir(uri)):
                raise UserError(f"{self.source}: {where}packageUris: {uri} is not an sdist or wheel "
                                f"({', '.join(ARCHIVE_SUFFIXES)})",
                                "build one with `python setup.py sdist` (or `pip wheel .`) and name the file")

    @property
    def package(self) -> str | None:
        """``--package``'s value: the URIs, comma-separated (installed in order)."""
        return ",".join(self.package_uris) or None

    def note(self, text: str) -> None:
        self.notes.append(f"{self.source}: {text}")


def _placed(out: JobFile) -> JobFile:
    """Machine types as JobSpec fields: the workers' type, and rank 0's where there are workers."""
    primary, workers = out.machines.get("primary"), out.machines.get("workers")
    if workers:
        out.fields["machine_type"] = workers
        if primary and primary != workers:
            out.fields["primary_machine_type"] = primary
    elif primary:
        out.fields["machine_type"] = primary
    return out


def _declared(spec: Any, where: str, out: JobFile) -> None:
    """Every key given whose help says "refused: WHY; FIX" (UserError) or "noted: WHY" (a note),
    through the whole file; the other keys are read by the code below."""
    for f in schema.fields(type(spec)):
        value = getattr(spec, f.name)
        if value is None or value is False or value == ():
            continue
        at = f"{where}{f.name}"
        if f.help.startswith("refused: "):
            why, _, fix = f.help.removeprefix("refused: ").partition("; ")
            raise UserError(f"{out.source}: {at} is not supported: {why}", fix or f"remove {f.name}")
        if f.help.startswith("noted: "):
            out.note(f"{at} {_shown(value)}: {f.help.removeprefix('noted: ')}")
        if f.kind == "spec":
            _declared(value, at + ".", out)
        elif f.kind == "list" and not isinstance(f.item, str):
            for i, item in enumerate(value):
                _declared(item, f"{at}[{i}].", out)


def _shown(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _spelled(text: str) -> str:
    """A machine type as --machine-type spells it (cluster.machine_types); bad ones are left for the
    spec's own check, which names the flag."""
    try:
        return str(machine_types.parse(text))
    except UserError:
        return text


def _run_folder(uri: str, where: str, out: JobFile) -> None:
    """The run's folder is the job directory itself: storage its parent, name its last part
    (when that is a valid run name; else the run goes under it)."""
    base = uri.rstrip("/")
    parent, last = posixpath.split(base)
    if parent and parent not in ("gs:", "gs:/") and re.match(r"^[A-Za-z][A-Za-z0-9_]{0,127}$", last):
        out.fields["storage"], out.fields["name"] = parent, last
    else:
        out.fields["storage"] = base
        out.note(f"{where} {uri}: the run's folder is {base}/NAME ({last!r} is not a run name)")


def run_name(text: str) -> str:
    """A valid run name from a display name or job id (letters, digits, underscores)."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", text.strip())
    if not name or not name[0].isalpha():
        name = "job_" + name
    return name[:128]


def duration_s(text: str, where: str) -> float:
    """Seconds from a protobuf Duration (``7200s``, ``1.5s``) or a bare number."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*s?\s*", str(text))
    if not match or float(match.group(1)) <= 0:
        raise UserError(f"{where} {text!r} is not a duration", "write seconds with an s, e.g. 7200s")
    return float(match.group(1))


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


_INT64 = {"replicaCount", "acceleratorCount", "bootDiskSizeGb", "maxTrialCount", "parallelTrialCount",
          "maxFailedTrialCount", "workerCount", "parameterServerCount", "evaluatorCount"}


def _lenient(value: Any, key: str | None = None) -> Any:
    """The file with Vertex's JSON spellings made plain: int64 fields written as strings
    ("replicaCount": "2"), numeric args unquoted in YAML (args: [--epochs, 3])."""
    if isinstance(value, dict):
        return {k: _lenient(v, k) for k, v in value.items()}
    if isinstance(value, list):
        if key in ("args", "command", "packageUris", "containerArgs", "containerCommand"):
            return [str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in value]
        return [_lenient(v) for v in value]
    if key in _INT64 and isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if key in ("minValue", "maxValue") and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value
