"""launcher.driver.placement: machine types as Ray Train label selectors, and the check before any worker starts.

The fast tests build the selectors and run the check against node labels and
a cluster file written here. The integration tests start a 2-node
``ray.cluster_utils.Cluster`` whose nodes carry the labels of an n1-standard-4
head and an n1-standard-8 worker: a 2-worker run with ``--machine-type
n1-standard-8`` puts both ranks on the worker node, one with
``--primary-machine-type n1-standard-4`` puts rank 0 on the head, and a
machine type neither node has exits 2 with one line before any worker starts.

The same cluster (one start for the module) also carries two runs that only need two nodes:
a built-in run whose 3 workers cannot all fit on one node trains across both, and one run too
big for the cluster is refused counting every node; a Horovod ring of 4 workers, 2 per node,
whose ranks must follow the nodes. (They started clusters of their own in test_train_local.py
and test_backends_horovod.py.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from cluster import machine_types
from launcher.driver import placement
from launcher.errors import UserError
from launcher.spec import JobSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU8 = {"launcher/machine-type": "n1-standard-8", "launcher/accelerator": "none"}
CPU4 = {"launcher/machine-type": "n1-standard-4", "launcher/accelerator": "none"}
T4 = {"launcher/machine-type": "n1-standard-8", "launcher/accelerator": "nvidia-tesla-t4x1"}


@pytest.fixture()
def cluster_address(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")


def spec(**values) -> JobSpec:
    return JobSpec(**values).validated()


def test_selectors_put_rank_0_first(cluster_address):
    assert placement.label_selector(spec()) is None
    assert placement.label_selector(spec(machine_type="n1-standard-8")) == CPU8
    same = spec(machine_type="n1-standard-8", primary_machine_type="n1-standard-8")
    assert placement.label_selector(same) == CPU8
    # Ray Train gives bundle i the i-th selector, and world ranks start at bundle 0's node.
    mixed = spec(workers=3, machine_type="n1-standard-8+nvidia-tesla-t4", primary_machine_type="n1-standard-4")
    assert placement.label_selector(mixed) == [CPU4, T4, T4]
    assert placement.label_selector(spec(workers=2, primary_machine_type="n1-standard-4")) == [CPU4, {}]
    # As long as the most workers an elastic run may have, which Ray checks.
    from launcher.driver import trainer

    elastic = spec(workers=3, min_workers=2, machine_type="n1-standard-8", primary_machine_type="n1-standard-4")
    assert trainer.scaling_config(elastic).label_selector == [CPU4, CPU8, CPU8]


def test_a_local_run_notes_the_machine_types_and_places_nothing(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    run = spec(machine_type="n1-standard-8", primary_machine_type="n1-standard-4")
    assert placement.label_selector(run) is None
    notes = []
    placement.check(run, [], notes.append)
    assert notes == ["machine types n1-standard-4 (primary) / n1-standard-8 noted: a local run places all ranks "
                     "on this machine"]


def test_a_machine_type_the_cluster_lacks_is_one_line(cluster_address, tmp_path):
    nowhere = str(tmp_path / "no-cluster-file.yaml")
    placement.check(spec(machine_type="n1-standard-8"), [CPU4, CPU8], print, nowhere)  # it has one
    with pytest.raises(UserError) as err:
        placement.check(spec(machine_type="n1-standard-8+nvidia-tesla-t4"), [CPU4, CPU8], print, nowhere)
    assert str(err.value) == ("--machine-type n1-standard-8+nvidia-tesla-t4x1: the Ray cluster has no node of that "
                              "machine type; it has: n1-standard-4, n1-standard-8")
    with pytest.raises(UserError, match=r"^--primary-machine-type n1-standard-16: .*it has: n1-standard-8$"):
        placement.check(spec(machine_type="n1-standard-8", primary_machine_type="n1-standard-16"), [CPU8], print,
                        nowhere)
    with pytest.raises(UserError, match="none of its nodes has a launcher/machine-type label"):
        placement.check(spec(machine_type="n1-standard-8"), [{}], print, nowhere)


def test_the_cluster_files_node_types_count_before_their_nodes_are_up(cluster_address, tmp_path):
    from cluster.config import ray_cluster_config
    from cluster.spec import ClusterSpec

    cluster_spec = ClusterSpec.from_mapping({"project": "p", "source_dir": "/src", "min_workers": 0,
                                             "accelerator_type": "nvidia-tesla-t4"}).validated()
    path = tmp_path / "ray_bootstrap_config.yaml"
    path.write_text(yaml.safe_dump(ray_cluster_config(cluster_spec, "0.1.0")))
    # Only the head is up; the autoscaler starts T4 workers on demand.
    have = placement.cluster_machine_types([CPU4], str(path))
    assert have == {machine_types.parse("n1-standard-4"), machine_types.parse("n1-standard-8+nvidia-tesla-t4x1")}
    placement.check(spec(machine_type="n1-standard-8+nvidia-tesla-t4x1"), [CPU4], print, str(path))


# -- on a 2-node Ray cluster ------------------------------------------------------------------------

WHERE = '''
import json
import os

import ray
import ray.train


def where(config):
    """Each rank writes down which node it runs on."""
    rank = ray.train.get_context().get_world_rank()
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "node": ray.get_runtime_context().get_node_id()}, f)
    ray.train.report({"loss": 0.0})
'''


@pytest.fixture(scope="module")
def labelled_cluster():
    """An n1-standard-4 head and an n1-standard-8 worker node, 2 CPUs each: {machine type: node id}."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "labels": CPU4})
    try:
        worker = cluster.add_node(num_cpus=2, labels=CPU8)
        cluster.wait_for_nodes()
        yield cluster.address, {"n1-standard-4": cluster.head_node.node_id, "n1-standard-8": worker.node_id}
    finally:
        cluster.shutdown()


def launch(tmp_path, address: str, name: str, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`launcher run` of WHERE on the cluster; returns the process and {rank: node id}."""
    code, out = tmp_path / "code", tmp_path / name
    code.mkdir(exist_ok=True)
    out.mkdir()
    (code / "where.py").write_text(WHERE)
    done = subprocess.run([sys.executable, "-m", "launcher", "run", "--workload", f"{code / 'where.py'}:where",
                           "--address", address, "--workers", "2", "--storage", str(tmp_path / "runs"),
                           "--name", name, "--param", f"out={out}", "--json", *flags],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    ranks = {}
    for entry in out.iterdir():
        record = json.loads(entry.read_text())
        ranks[record["rank"]] = record["node"]
    return done, ranks


@pytest.mark.integration
def test_ranks_run_on_nodes_of_their_machine_type(labelled_cluster, tmp_path):
    address, nodes = labelled_cluster
    done, ranks = launch(tmp_path, address, "workers", "--machine-type", "n1-standard-8")
    assert done.returncode == 0, done.stderr[-3000:]
    assert ranks == {0: nodes["n1-standard-8"], 1: nodes["n1-standard-8"]}  # the head had room too
    done, ranks = launch(tmp_path, address, "primary", "--machine-type", "n1-standard-8",
                         "--primary-machine-type", "n1-standard-4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert ranks == {0: nodes["n1-standard-4"], 1: nodes["n1-standard-8"]}


@pytest.mark.integration
def test_a_machine_type_no_node_has_is_refused_before_any_worker_starts(labelled_cluster, tmp_path):
    address, _ = labelled_cluster
    done, ranks = launch(tmp_path, address, "nowhere", "--machine-type", "n1-standard-8+nvidia-tesla-t4")
    assert done.returncode == 2 and ranks == {}
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --machine-type n1-standard-8+nvidia-tesla-t4x1: the Ray cluster has no node of that "
                      "machine type; it has: n1-standard-4, n1-standard-8"], done.stderr
    assert "starting 2" not in done.stderr


def _without_ray_address() -> dict[str, str]:
    """This process's environment less RAY_ADDRESS (an in-process launch earlier in the session
    leaves it): a launch goes where --address says."""
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


@pytest.mark.integration
def test_a_run_across_both_nodes_trains_and_one_too_big_for_them_is_refused(labelled_cluster, tmp_path):
    """3 workers of 1 CPU on two 2-CPU nodes: the ranks must span both nodes, and the run trains.
    5 workers: refused before any worker starts, naming what every node has together."""
    address, _ = labelled_cluster
    cmd = [sys.executable, "-m", "launcher", "run", "--storage", str(tmp_path / "runs"), "--epochs", "2",
           "--workers", "3", "--address", address, "--json"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=_without_ray_address())
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads(res.stdout)
    assert s["status"] == "succeeded" and s["epochs_completed"] == 2 and s["workers"] == 3, s
    too_many = subprocess.run(cmd[:-1] + ["--workers", "5"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, env=_without_ray_address())
    assert too_many.returncode == 2, too_many.stderr[-3000:]
    assert "2 node(s) with 4 CPUs and 0 GPUs in all, room for 4" in too_many.stderr, too_many.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None,
                    reason="Horovod is not built in this environment: run scripts/install-horovod "
                           "(scripts/setup-env does)")
@pytest.mark.integration
def test_horovod_ring_ranks_follow_node_placement(labelled_cluster, tmp_path):
    """2 nodes x 2 CPUs, 4 workers (2 on each node): every worker's hvd ranks match its node."""
    address, _ = labelled_cluster
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent("""
        import json, os
        import horovod.torch as hvd
        import torch
        hvd.init()
        total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
        print("RANKS " + json.dumps({"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
              "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
              "node": os.environ["HOROVOD_HOSTNAME"], "total": total}))
    """))
    res = subprocess.run([sys.executable, "-m", "launcher", "run", "--script", str(script), "--backend",
                          "horovod", "--workers", "4", "--address", address, "--storage", str(tmp_path / "runs")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=_without_ray_address())
    assert res.returncode == 0, res.stdout + res.stderr
    seen = {}
    for line in res.stderr.splitlines():  # each rank's lines go to stderr, the summary to stdout
        prefix, _, rest = line.partition(" RANKS ")
        if rest:
            info = json.loads(rest)
            assert prefix == f"[rank {info['rank']}]"
            seen[info["rank"]] = info
    assert sorted(seen) == [0, 1, 2, 3], res.stderr
    nodes = [seen[r]["node"] for r in range(4)]
    assert len(set(nodes)) == 2 and all(nodes.count(n) == 2 for n in nodes)
    for r, info in seen.items():
        same_node = [q for q in range(4) if nodes[q] == info["node"]]
        node_order = list(dict.fromkeys(nodes))
        assert (info["size"], info["local_size"], info["cross_size"]) == (4, 2, 2)
        assert info["local_rank"] == same_node.index(r)
        assert info["cross_rank"] == node_order.index(info["node"])
        assert info["total"] == 6.0  # 0+1+2+3 over the ring that spans both nodes
