"""Google Compute Engine: Ray cluster files, preflight checks and instance queries.

spec.py (ClusterSpec and its presets), config.py (ClusterSpec -> Ray cluster
file for the GCP provider), machines.py (machine types as runs name them, and
the node type names and Ray node labels that say which a node is), compute.py
(google-cloud-compute look-ups), preflight.py (checks before `ray up`). Ray
stays the provisioner. This package never imports workloads/; from launcher/ it
uses only the leaf modules errors, schema and gcs.
"""
