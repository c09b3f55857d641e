"""The chaos modules' shared fixture: a preemption lab per module."""

from __future__ import annotations

import pytest

from launcher.lab.chaos import PreemptionLab


@pytest.fixture(scope="module")
def lab():
    """A head without CPUs and two 1-CPU worker nodes, each with a fake GCE metadata server and
    the real watcher; notices of 6 s (GCE's are 30 s) keep the tests short."""
    with PreemptionLab(nodes=2, cpus_per_node=1, notice_s=6.0, margin_s=2.0) as lab:
        yield lab
