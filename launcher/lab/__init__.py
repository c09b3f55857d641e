"""Stand-ins for the cloud on one machine: a fake GCE metadata server, the Cloud
Storage emulator and an autoscaling multi-node preemption lab. Used by ``launcher preemption
demo``, the benchmarks and the tests; never by a real run."""

from launcher._lazy import lazy_exports  # noqa: E402

__all__, __getattr__ = lazy_exports(__name__, {
    "AutoscalingLab": "launcher.lab.autoscaling",
    "run_in_background": "launcher.lab.chaos",
    "Emulator": "launcher.lab.gcs_emulator",
    "free_port": "launcher.lab.gcs_emulator",
    "FakeMetadataServer": "launcher.lab.metadata",
})
