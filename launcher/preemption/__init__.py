"""Compute Engine preemption: a node-side watcher of GCE's 30 s notice that drains
the node's Ray node, so Ray Train checkpoints and restarts the workers in time."""
