"""Compute Engine preemption: a node-side watcher of GCE's 30 s notice that drains
the node's Ray node, so Ray Train checkpoints and restarts the workers in time."""

from launcher._lazy import lazy_exports  # noqa: E402

__all__, __getattr__ = lazy_exports(__name__, {
    "Watcher": "launcher.preemption.watcher",
    "poll_preempted": "launcher.preemption.watcher",
    "watch": "launcher.preemption.drain",
    "node_drainer": "launcher.preemption.drain",
})
