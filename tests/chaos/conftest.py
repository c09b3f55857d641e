"""The chaos modules' shared fixture: an autoscaling preemption lab per module."""

from __future__ import annotations

import pytest

from launcher.lab.autoscaling import AutoscalingLab


@pytest.fixture(scope="module")
def lab():
    """A head without CPUs and two 1-CPU worker nodes brought up by Ray's autoscaler, each with a
    fake GCE metadata server and the real watcher; a lost node's replacement comes from the
    autoscaler (at once: tests that need GCE's boot time set it with ``lab.set_delays``). Notices of
    6 s (GCE's are 30 s) keep the tests short. No spare: the cluster never exceeds two worker nodes,
    so an early replacement request cannot leave an idle third node for a test to preempt."""
    with AutoscalingLab(nodes=2, cpus_per_node=1, notice_s=6.0, margin_s=2.0, spare=0) as lab:
        yield lab
