"""A cluster-agnostic launcher for distributed deep-learning training on Ray.

The public Python API mirrors the CLI: build a :class:`launcher.spec.JobSpec`
and pass it to :func:`launcher.driver.launch.run`. Nothing heavy is imported here,
so ``launcher --help`` stays instant.
"""

__version__ = "0.1.0"
