"""The chaos modules' shared fixture: one autoscaling preemption lab for the whole package.

Starting a lab (a head, two worker nodes from Ray's autoscaler, their metadata servers and
watchers) takes about half a minute on 2 cores: the package's modules share one, and each
test starts from the lab's normal state (two free worker nodes, no boot delay, no stockout).
"""

from __future__ import annotations

import time

import pytest

from launcher.lab.autoscaling import AutoscalingLab

NODES = 2


def wait_for_free_cpus(count: int, timeout_s: float = 120) -> None:
    """Exactly ``count`` worker nodes, all free, first: the previous test's replacement node can
    still be joining, or a spare the autoscaler launched still be there (it goes once idle), and
    an elastic run takes what it finds (it then started on 1 worker, and losing the other node
    cost it nothing: seen in CI)."""
    import ray

    def ready() -> bool:
        return ray.cluster_resources().get("CPU", 0) == count and ray.available_resources().get("CPU", 0) == count

    deadline = time.time() + timeout_s
    while not ready() and time.time() < deadline:
        time.sleep(0.5)
    assert ready(), (ray.cluster_resources(), ray.available_resources())


@pytest.fixture(scope="package")
def chaos_lab():
    """A head without CPUs and two 1-CPU worker nodes brought up by Ray's autoscaler, each with a
    fake GCE metadata server and the real watcher; a lost node's replacement comes from the
    autoscaler (at once: tests that need GCE's boot time set it with ``lab.set_delays``). Notices of
    6 s (GCE's are 30 s) keep the tests short, and so does a node health check every second (Ray's:
    3 s), which sees a node lost without notice dead in ~5 s rather than ~15 s. No spare: the
    cluster never exceeds two worker nodes, so an early replacement request cannot leave an idle
    third node for a test to preempt."""
    with AutoscalingLab(nodes=NODES, cpus_per_node=1, notice_s=6.0, margin_s=2.0, spare=0,
                        health_check_s=1.0) as lab:
        yield lab


def normal_state(lab: AutoscalingLab) -> AutoscalingLab:
    """The lab back in its normal state: no boot delay or stockout a test left set, and both
    worker nodes up and free (a node the last test preempted may still be coming back)."""
    lab.set_delays(boot_s=0.0, stockout_s=0.0)
    lab.wait_for_nodes(NODES)
    wait_for_free_cpus(NODES)
    return lab


@pytest.fixture
def lab(chaos_lab):
    """The package's lab, in its normal state when the test starts."""
    return normal_state(chaos_lab)
