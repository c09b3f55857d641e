"""Machine types as a run names them, checked against :mod:`cluster.machines`' table.

A run names the Compute Engine machine type its ranks must run on as
AI Platform's ``masterType`` / ``workerType`` plus ``acceleratorConfig``, or
Vertex AI's ``machineSpec``, would: ``MACHINE[+ACCELERATOR[xCOUNT]]``, e.g.
``n1-standard-8``, ``n1-standard-8+nvidia-tesla-t4x2`` (the job files' own
``NVIDIA_TESLA_T4`` is read as ``nvidia-tesla-t4``). An A2/A3/G2 type
brings its GPUs, so ``g2-standard-8`` alone means ``g2-standard-8+nvidia-l4x1``.
A type without ``+`` has no GPU: ``n1-standard-8`` is not a node with a T4.

The cluster file (:mod:`cluster.config`) gives every node type two Ray node
labels, ``launcher/machine-type`` and ``launcher/accelerator`` (``none`` on a
CPU node), and the driver places ranks with a label selector on them; a
hand-made cluster gets the same placement by starting Ray with the same
labels (``ray start --labels launcher/machine-type=n1-standard-8,launcher/accelerator=none``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Mapping

from cluster.machines import (ACCELERATOR_LABEL, ACCELERATOR_RE, ACCELERATORS, EXAMPLE, GPU_MACHINES, MACHINE_LABEL,
                              MACHINE_RE, N1_SHAPES, NO_ACCELERATOR, check_gpu_machine, machine_series)
from launcher.errors import UserError


@dataclass(frozen=True, order=True)
class MachineType:
    """A Compute Engine machine type and the GPUs on it (``count`` 0: none)."""

    machine: str
    accelerator: str | None = None
    count: int = 0

    def __str__(self) -> str:
        return f"{self.machine}+{self.accelerator}x{self.count}" if self.accelerator else self.machine

    @property
    def labels(self) -> dict[str, str]:
        """The Ray node labels of a node of this type, and the label selector that finds one."""
        accelerator = f"{self.accelerator}x{self.count}" if self.accelerator else NO_ACCELERATOR
        return {MACHINE_LABEL: self.machine, ACCELERATOR_LABEL: accelerator}

    @property
    def node_type(self) -> str:
        """A Ray node type name for it: n1-standard-8, n1-standard-8-t4x1, g2-standard-8-l4x1."""
        if not self.accelerator:
            return self.machine
        short = self.accelerator.removeprefix("nvidia-").removeprefix("tesla-")
        return f"{self.machine}-{short}x{self.count}"


def parse(text: str, flag: str = "--machine-type") -> MachineType:
    """``MACHINE[+ACCELERATOR[xCOUNT]]`` checked, the GPUs of an A2/A3/G2 type filled in.

    Raises:
        UserError: naming ``flag``, the bad part and a good spelling.
    """
    machine, plus, accelerator = text.strip().lower().partition("+")
    accelerator = accelerator.replace("_", "-")  # AI Platform's and Vertex's NVIDIA_TESLA_T4
    if not MACHINE_RE.match(machine):
        raise UserError(f"{flag} {text}: {machine!r} is not a Compute Engine machine type", f"write {EXAMPLE}")
    check_gpu_machine(machine)
    implied = _bundled(machine)
    if not plus:
        return implied or MachineType(machine)
    m = ACCELERATOR_RE.match(accelerator)
    name = m.group("name") if m else accelerator
    acc = ACCELERATORS.get(name)
    if acc is None:
        close = difflib.get_close_matches(name, ACCELERATORS, n=1)
        raise UserError(f"{flag} {text}: unknown accelerator {name!r}",
                        f"did you mean {close[0]}?" if close else f"valid: {', '.join(ACCELERATORS)}")
    if acc.retired:
        raise UserError(f"{flag} {text}: {acc.retired}", "use nvidia-tesla-t4 or a G2/A2/A3 machine type")
    count = int(m.group("count") or (implied.count if implied else 1))
    given = MachineType(machine, acc.name, count)
    if implied and given != implied:
        raise UserError(f"{flag} {text}: {machine} comes with {implied.count} x {implied.accelerator}",
                        f"write {implied}, or just {machine}")
    if machine_series(machine) not in acc.series:
        raise UserError(f"{flag} {text}: {acc.name} attaches to "
                        f"{'/'.join(s.upper() for s in acc.series)} machine types, not {machine}",
                        f"write {acc.series[0]}-...+{acc.name}")
    if not implied and count not in N1_SHAPES.get(acc.name, {1: 0, 2: 0, 4: 0, 8: 0}):
        allowed = ", ".join(map(str, N1_SHAPES.get(acc.name, (1, 2, 4, 8))))
        raise UserError(f"{flag} {text}: {count} x {acc.name} per VM", f"Compute Engine attaches {allowed}")
    return given


def from_labels(labels: Mapping[str, str]) -> MachineType | None:
    """The machine type a node's labels name (None for a node without them)."""
    machine = labels.get(MACHINE_LABEL)
    if not machine:
        return None
    accelerator = labels.get(ACCELERATOR_LABEL) or NO_ACCELERATOR
    if accelerator == NO_ACCELERATOR:
        return MachineType(machine)
    m = ACCELERATOR_RE.match(accelerator)
    if not m:
        return MachineType(machine, accelerator, 1)
    return MachineType(machine, m.group("name"), int(m.group("count") or 1))


def of_node(machine: str, accelerator: str | None, count: int) -> MachineType:
    """The machine type of a cluster file's node (no accelerator, or ``count`` of them; an
    A2/A3/G2 type's own GPUs whatever the file says)."""
    return _bundled(machine) or (MachineType(machine, accelerator, count) if accelerator and count
                                 else MachineType(machine))


def _bundled(machine: str) -> MachineType | None:
    gpu = GPU_MACHINES.get(machine)
    return MachineType(machine, gpu.accelerator, gpu.gpus) if gpu else None
