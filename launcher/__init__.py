"""A cluster-agnostic launcher for distributed deep-learning training on Ray.

The public Python API mirrors the CLI: build a :class:`JobSpec` (or load one
with :func:`load_spec_file`), validate it, and pass it to :func:`run`, which
returns a :class:`RunSummary`; :func:`submit` sends it to a cluster as a Ray
job instead. Bad input raises :class:`UserError`; a service that does not
answer, :class:`Unreachable`. Everything is imported on first use, so
``launcher --help`` stays instant.

The packages, in the order imports point (nothing imports ``cli``):
``cli`` -> ``tune``, ``predict`` -> ``driver`` -> ``worker`` -> ``backends``, ``storage``, ``preemption``
-> ``spec``, ``schema``, ``summary``, ``errors``; ``lab`` (test stand-ins for the
cloud) uses the driver. Every private Ray name used is in ``_ray``.
"""

from launcher._lazy import lazy_exports

__version__ = "0.1.0"

__all__, __getattr__ = lazy_exports(__name__, {
    "JobSpec": "launcher.spec",
    "load_spec_file": "launcher.spec",
    "RunSummary": "launcher.summary",
    "RunStatus": "launcher.summary",
    "LauncherError": "launcher.errors",
    "UserError": "launcher.errors",
    "Unreachable": "launcher.errors",
    "run": "launcher.driver.launch",
    "submit": "launcher.driver.jobs",
})
