"""Google Compute Engine: Ray cluster files, preflight checks and instance queries.

machines.py (the one table of Compute Engine machine facts: GPU models,
machine types with built-in GPUs, N1 GPU shapes, boot disk types per series,
which GPUs the pinned torch runs on; and machine types as runs name them, with
the node type names and Ray node labels that say which a node is), spec.py
(ClusterSpec and its presets), config.py (ClusterSpec -> Ray cluster file for
the GCP provider), compute.py (google-cloud-compute look-ups, and deleting the
VMs `ray down` leaves), preflight.py (checks before `ray up`). Ray stays the
provisioner. This package never imports workloads/; from launcher/ it
uses only the leaf modules errors, schema, gcs and _deferred (the cluster extra
that google-cloud-compute comes in).
"""
