"""The torch session without Ray, for a process that torchrun or horovodrun started."""

from __future__ import annotations

import os
import time
from typing import Any

from launcher.spec import JobSpec
from launcher.worker.session import TorchSession


class BareSession(TorchSession):
    """The same session without Ray, for a process that torchrun or horovodrun started: the
    benchmarks' bare twin of a launcher run, or a quick try of a training function. It trains
    and keeps its reports in :attr:`reports`; it takes no checkpoint and polls for no notice."""

    def __init__(self, spec: JobSpec, comm, function: Any = None) -> None:
        super().__init__(spec, comm, function)
        self.reports: list[dict[str, Any]] = []

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", os.environ.get("HOROVOD_LOCAL_RANK", "0")))

    def send(self, metrics: dict[str, Any], checkpoint: bool = True) -> None:
        self.reports.append({**metrics, "epoch": self.pos.epoch, "global_step": self.pos.global_step})

    def preemption_action(self) -> str | None:
        return None

    def start(self, config: dict[str, Any] | None = None, started: float | None = None) -> None:
        self.marks["worker_ready"] = time.time()
        self.run_function()
