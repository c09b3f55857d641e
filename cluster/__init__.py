"""Google Compute Engine: Ray cluster files, preflight checks and instance queries.

Empty for now: the cluster-file generator and the Compute Engine client layer
arrive with the Compute Engine work. This package never imports workloads/.
"""
