"""Every private Ray name the launcher uses, in one place.

Ray's public API does not cover everything a lean launcher needs (its
controller callbacks, its torch process-group routine without torch in the
driver, a node drain with a deadline). Each such name is listed in
:data:`PRIVATE` with why it is used; modules get them from here
(``from launcher._ray import ControllerCallback``), never from Ray directly.
What the launcher reads in Ray's private files is here too: Ray Train's list of
a run's checkpoints (:func:`snapshot_names`).

Nothing is imported until a name is first asked for: some of these modules
import torch at the top, and the driver must not. ``tests/test_layout.py``
resolves every name, so a Ray upgrade that moves one fails there, in one place,
rather than in the middle of a run.
"""

from __future__ import annotations

import importlib
import json
import logging
from typing import Any, Iterable

# name -> ("module:attribute", why the launcher needs it)
PRIVATE: dict[str, tuple[str, str]] = {
    # Ray Train V2's controller callbacks (preemption notices, restarts) and its trainer internals.
    "ControllerCallback": ("ray.train.v2._internal.execution.callback:ControllerCallback",
                           "the controller's state changes (notice seen, restart and its cause)"),
    "WorkerGroupCallback": ("ray.train.v2._internal.execution.callback:WorkerGroupCallback",
                            "--strategy ft: a poll's failed workers with their node-mates, so that Ray Train "
                            "replaces the replica groups of a lost node together"),
    "is_preemption_failure": ("ray.train.v2._internal.execution.failure_handling.default:_is_preemption_failure",
                              "whether Ray Train charges a restart to the preemption budget"),
    "train_context": ("ray.train.v2._internal.execution.context:get_train_context",
                      "a worker's own preemption notice without the barrier of ray.train.get_preemption_info "
                      "(a script worker polls it while the user's program trains)"),
    "DatasetsCallback": ("ray.train.v2._internal.callbacks.datasets:DatasetsCallback",
                         "dropped from the default callbacks when a run has no Ray Data datasets"),
    "PlacementGroupCleanerCallback": ("ray.train.v2._internal.callbacks.placement_group_callback:"
                                      "PlacementGroupCleanerCallback",
                                      "dropped: the driver always outlives its run"),
    "FixedScalingPolicy": ("ray.train.v2._internal.execution.scaling_policy:FixedScalingPolicy",
                           "a fixed-size group on a local Ray, without requests to the autoscaling coordinator"),
    "ElasticScalingPolicy": ("ray.train.v2._internal.execution.scaling_policy:ElasticScalingPolicy",
                             "an elastic group sized from a fresh view of the cluster, less draining nodes"),
    "ResizeDecision": ("ray.train.v2._internal.execution.scaling_policy:ResizeDecision",
                       "the elastic policy's decision to resize the group"),
    "NoopDecision": ("ray.train.v2._internal.execution.scaling_policy:NoopDecision",
                     "the elastic policy's decision to keep the group as it is (while it checkpoints)"),
    "TrainingFramework": ("ray.train.v2._internal.util:TrainingFramework",
                          "marks the lean torch process group as a torch backend"),
    # Ray's torch process-group set-up, called on the workers only (the module imports torch).
    "get_address_and_port": ("ray.train._internal.utils:get_address_and_port",
                             "rank 0's address and a free port for the torch rendezvous"),
    "set_torch_distributed_env_vars": ("ray.train.torch.config:_set_torch_distributed_env_vars",
                                       "torchrun's RANK, LOCAL_RANK, ... on each worker"),
    "setup_torch_process_group": ("ray.train.torch.config:_setup_torch_process_group",
                                  "init_process_group as Ray's TorchConfig does it"),
    "shutdown_torch": ("ray.train.torch.config:_shutdown_torch", "leave the process group"),
    "TorchConfigContextManager": ("ray.train.torch.config:TorchConfigContextManager",
                                  "each worker's default CUDA device"),
    # The GCS: draining a node for preemption, and reading the drain state.
    "StorageContext": ("ray.train.v2._internal.execution.storage:StorageContext",
                       "persist_current_checkpoint: Ray's own upload of a checkpoint folder, called from a custom "
                       "checkpoint_upload_fn once a background sharded save has written its files"),
    "GcsClient": ("ray._raylet:GcsClient", "drain a node with reason PREEMPTION and a deadline"),
    "canonicalize_bootstrap_address": ("ray._private.services:canonicalize_bootstrap_address_or_die",
                                       "an address ('auto', host:port) as the GCS client takes it"),
    "node_ip_address": ("ray._private.services:get_node_ip_address", "this machine's address as Ray names it"),
    "global_state": ("ray._private.state:state", "which nodes are draining, and until when (the chaos lab)"),
    # Runtime environments: walk a folder exactly as Ray does when it packs a working_dir.
    "dir_travel": ("ray._private.runtime_env.packaging:_dir_travel",
                   "the size of a user's code folder as Ray would ship it (.gitignore, .rayignore)"),
    "excludes_matcher": ("ray._private.runtime_env.packaging:_get_excludes",
                         "the runtime_env 'excludes' patterns as Ray applies them"),
    # A local Ray this launch started: the daemons it needs not (session.IDLE_DAEMONS), stopped.
    "global_worker": ("ray._private.worker:global_worker", "the node this driver started (.node.all_processes), and whether it did (.node.ray_init_cluster)"),
    "PROCESS_TYPE_MONITOR": ("ray._private.ray_constants:PROCESS_TYPE_MONITOR",
                             "the autoscaler monitor's key in that node's processes"),
    "PROCESS_TYPE_LOG_MONITOR": ("ray._private.ray_constants:PROCESS_TYPE_LOG_MONITOR",
                                 "the log monitor's key there"),
    "PROCESS_TYPE_DASHBOARD": ("ray._private.ray_constants:PROCESS_TYPE_DASHBOARD",
                               "the API server's key there (started even with include_dashboard=False)"),
    "DrainNodeReason": ("ray.core.generated.autoscaler_pb2:DrainNodeReason", "the PREEMPTION drain reason"),
    # The autoscaling preemption lab: Ray's fake multi-node provider, made as slow as GCE.
    "FakeMultiNodeProvider": ("ray.autoscaler._private.fake_multi_node.node_provider:FakeMultiNodeProvider",
                              "the lab's node provider subclasses it (boot delay, stock-outs)"),
    "FAKE_HEAD_NODE_ID": ("ray.autoscaler._private.fake_multi_node.node_provider:FAKE_HEAD_NODE_ID",
                          "the head's node id in a fake multi-node cluster (the lab never preempts it)"),
    # The `ray up` rehearsal: Ray's own GCP node provider (and its bootstrap), run against a local Compute API.
    "GCPNodeProvider": ("ray.autoscaler._private.gcp.node_provider:GCPNodeProvider",
                        "the rehearsal creates, lists and terminates VMs with the provider `ray up` uses"),
    # The warm head's pool (launcher.worker.pool): idle processes started ahead in a run's runtime
    # environment, by the raylet's own call (Ray offers no public one), and Ray Train's actor modules
    # that they import before any actor arrives.
    "init_grpc_channel": ("ray._private.grpc_utils:init_grpc_channel",
                          "a channel to this node's raylet that carries Ray's token, as Ray's own clients do"),
    "NodeManagerServiceStub": ("ray.core.generated.node_manager_pb2_grpc:NodeManagerServiceStub",
                               "the raylet's PrestartWorkers call"),
    "PrestartWorkersRequest": ("ray.core.generated.node_manager_pb2:PrestartWorkersRequest",
                               "how many processes, in which runtime environment, kept how long"),
    "RuntimeEnvInfo": ("ray.core.generated.runtime_environment_pb2:RuntimeEnvInfo",
                       "the runtime environment as Ray serialised it for the run's actors"),
    "PYTHON": ("ray.core.generated.common_pb2:PYTHON", "the language of the processes asked for"),
    "train_env_vars": ("ray.train.v2._internal.constants:get_env_vars_to_propagate",
                       "the settings Ray Train adds to its controller's and workers' runtime environment"),
    "WARN_BLOCKING_ENV": ("ray._common.constants:RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR",
                          "a variable Ray Train adds to its controller's runtime environment"),
    "WARN_BLOCKING_DEFAULT": ("ray.train.v2._internal.constants:DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE",
                              "its value there, unless the driver's environment sets one"),
    "RayTrainWorker": ("ray.train.v2._internal.execution.worker_group.worker:RayTrainWorker",
                       "the module every Ray Train worker actor imports first"),
    "TrainController": ("ray.train.v2._internal.execution.controller:TrainController",
                        "the module Ray Train's controller actor imports first"),
    # A replacement asked for on a notice goes through the coordinator Ray Train's own requests use.
    "DefaultAutoscalingCoordinator": ("ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator:"
                                      "DefaultAutoscalingCoordinator",
                                      "ask the autoscaler for a replacement node as a notice comes (its requests "
                                      "add to Ray Train's own; a direct sdk request would be overwritten)"),
    "ResourceRequestPriority": ("ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator:"
                                "ResourceRequestPriority", "that request's priority (as Ray Train's)"),
}

# Private methods of Ray classes that the launcher overrides: "module:Class.method".
OVERRIDDEN: dict[str, str] = {
    "ray.train.v2.api.data_parallel_trainer:DataParallelTrainer._create_default_callbacks":
        "LeanTrainer drops the Ray Data and placement-group-cleaner callbacks a run never uses",
    "ray.train.v2.api.data_parallel_trainer:DataParallelTrainer._initialize_and_run_controller":
        "LeanTrainer swaps the fixed scaling policy for one without autoscaler requests on a local Ray",
    "ray.train.v2._internal.execution.scaling_policy.scaling_policy:ScalingPolicy._maybe_send_resource_request":
        "the local Ray's fixed policy sends no resource requests (no coordinator is started)",
    "ray.train.v2._internal.execution.scaling_policy.elastic:ElasticScalingPolicy._get_reserved_resources":
        "ElasticNow asks the coordinator to recompute (its node list is up to 20 s old) and drops draining nodes",
    "ray.train.v2._internal.execution.scaling_policy.elastic:ElasticScalingPolicy."
    "make_decision_for_running_worker_group":
        "ElasticNow grows the group only after the running one has checkpointed",
    "ray.train.v2._internal.execution.scaling_policy.elastic:ElasticScalingPolicy."
    "make_decision_for_non_running_worker_group":
        "ElasticNow withdraws a checkpoint request the stopped group never answered",
    "ray.dashboard.modules.dashboard_sdk:SubmissionClient._do_request":
        "the job client's requests get a timeout (Ray sets none)",
}

# Ray's marker resource of the head node (1.0 there): a tuning trial's own driver asks for a
# sliver of it, so it stays on the head, which is never preempted. Not public; tests check it.
HEAD_RESOURCE = "node:__internal_head__"

# Not imported: a constant whose module is heavy (ray._private.runtime_env.constants).
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"   # set by Ray's job supervisor for a job's entrypoint
# Loggers of Ray's job client that log every package upload at INFO.
JOB_CLIENT_LOGGERS = ("ray.dashboard.modules.dashboard_sdk", "ray.dashboard.modules.job.sdk",
                      "ray._private.runtime_env.packaging")

# Ray Train V2's list of a run's checkpoints, in the run's folder: a literal, as the constant's module
# (ray.train.v2._internal.constants) imports Ray Train; tests/test_layout.py checks it is Ray's.
CHECKPOINT_SNAPSHOT = "checkpoint_manager_snapshot.json"


def snapshot_names(text: str, folders: Iterable[str]) -> list[str]:
    """Which of the run's checkpoint ``folders`` (names in the run's folder) Ray Train's list of
    the run's checkpoints names; ``text`` is that list (:data:`CHECKPOINT_SNAPSHOT`).

    Ray Train V2 restores the list when a run of the same name is launched again, and fails
    the launch (CheckpointManagerInitializationError) when a folder it names is gone. The
    launcher deletes checkpoints Ray did not register (see
    launcher.storage.checkpoint.prune), and some it did: when the list names one of those,
    the list is removed before they are deleted and Ray Train starts a fresh one. Removing it,
    rather than rewriting it without them, is the simplest robust way: it needs nothing of the
    list's format but what is read here, and the launcher resumes from the checkpoints their
    manifests vouch for, not from Ray's list. Ray then no longer deletes the checkpoints it
    registered before; the launcher's own pruning does, at the end of the launch. Until a
    launch has Ray write a new list the run's folder has none (``ray.train.Result.from_path``
    needs one; the launcher does not).

    Relies on: the file is JSON in which a checkpoint is named by a string that is its
    folder's name or a path ending with it (``checkpoint_dir_name`` in Ray 2.60's
    ``_CheckpointManagerState``: ``checkpoint_results``, ``latest_checkpoint_result``,
    ``pending_training_results``; the ``*_checkpoint_dir_names`` lists). Every string in the
    document is looked at, whatever key holds it, so a field a later Ray adds is seen too.
    Text that is not JSON names every folder.
    """
    folders = list(folders)
    try:
        document = json.loads(text)
    except ValueError:
        return folders
    strings: set[str] = set()
    pending = [document]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, str):
            strings.add(item.rstrip("/"))
    return [f for f in folders if any(s == f or s.endswith("/" + f) for s in strings)]


def persist_checkpoint(context, checkpoint, name: str):
    """Store a worker's checkpoint folder as Ray Train itself would (its pyarrow copy to the run's
    storage), from a ``checkpoint_upload_fn``; returns the stored checkpoint."""
    storage = context.get_storage()
    assert isinstance(storage, resolve("StorageContext")), type(storage)
    return storage.persist_current_checkpoint(checkpoint, name)


def prestart_workers(env: str, count: int, keep_alive_s: int) -> None:
    """Ask this node's raylet to start ``count`` idle Python worker processes in the runtime
    environment ``env`` (serialised as Ray serialises a task's), kept ``keep_alive_s`` before
    Ray may stop them. The raylet starts at most its start-up concurrency at a time and drops
    the rest of a request: the warm head raises it (launcher.driver.localhead)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == here)
    channel = resolve("init_grpc_channel")(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
    request = resolve("PrestartWorkersRequest")(
        language=resolve("PYTHON"), runtime_env_info=resolve("RuntimeEnvInfo")(serialized_runtime_env=env),
        keep_alive_duration_secs=keep_alive_s, num_workers=count)
    try:
        resolve("NodeManagerServiceStub")(channel).PrestartWorkers(request, timeout=10)
    finally:
        channel.close()


def started_by_this_process() -> bool:
    """Whether the Ray this process is connected to is one that its own ``ray.init()`` started (a
    single local node: nothing preempts it, no autoscaler scales it), not a cluster it joined."""
    node = getattr(resolve("global_worker"), "node", None)
    return bool(getattr(node, "ray_init_cluster", False))


def client_connected() -> bool:
    """Whether this process talks to Ray through Ray Client (``ray://``), where actors
    cannot be pinned to the driver's node and files on the driver's disk are not shared."""
    from ray.util.client import ray as client_ray

    return bool(client_ray.is_connected())


def quiet_job_client() -> None:
    """Ray's job client logs every package upload and socket close at INFO; its modules set
    that level when they are imported, so they are imported first, then turned down."""
    importlib.import_module("ray.dashboard.modules.dashboard_sdk")
    importlib.import_module("ray.dashboard.modules.job.sdk")
    for name in JOB_CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


_resolved: dict[str, Any] = {}


def resolve(name: str) -> Any:
    """The object behind ``name`` (a key of :data:`PRIVATE`), imported on first use."""
    if name not in _resolved:
        target, _ = PRIVATE[name]
        module, _, attribute = target.partition(":")
        # Ray itself first: some of its private modules (runtime_env.packaging) import `ray` half
        # way through, which fails as a circular import when they are the first Ray module loaded.
        importlib.import_module(module.partition(".")[0])
        _resolved[name] = getattr(importlib.import_module(module), attribute)
    return _resolved[name]


def __getattr__(name: str) -> Any:
    if name in PRIVATE:
        return resolve(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
