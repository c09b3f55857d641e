"""Stand-ins for the cloud on one machine: a fake GCE metadata server, the Cloud
Storage emulator, an autoscaling multi-node preemption lab, and the ``ray up`` rehearsal
(Ray's GCP provider against a local Compute Engine API). Used by ``launcher preemption
demo``, ``launcher cluster rehearse``, the benchmarks and the tests; never by a real run."""

from launcher._lazy import lazy_exports  # noqa: E402

__all__, __getattr__ = lazy_exports(__name__, {
    "AutoscalingLab": "launcher.lab.autoscaling",
    "run_in_background": "launcher.lab.chaos",
    "Emulator": "launcher.lab.gcs_emulator",
    "free_port": "launcher.lab.gcs_emulator",
    "FakeMetadataServer": "launcher.lab.metadata",
    "ComputeAPI": "launcher.lab.compute_api",
    "rehearse": "launcher.lab.rehearsal",
})
