"""Stand-ins for the cloud on one machine: a fake GCE metadata server, the Cloud
Storage emulator and a multi-node preemption lab. Used by ``launcher preemption
demo``, the benchmarks and the tests; never by a real run."""
