"""The driver: a validated JobSpec in, a trained (or resumed) run and its summary out.

It connects to Ray (a cluster, the warm local head, or a new local Ray),
builds the backend's Ray Train trainer, follows the run through the events
Ray Train's controller forwards, shows progress, and writes the run log. It
also runs unmodified scripts on the workers and submits runs as Ray jobs.
"""

from launcher._lazy import lazy_exports  # noqa: E402

__all__, __getattr__ = lazy_exports(__name__, {
    "run": "launcher.driver.launch",
    "ProgramRun": "launcher.driver.script",
    "connect": "launcher.driver.session",
    "check_fits": "launcher.driver.session",
    "describe_failure": "launcher.driver.trainer",
    "apply_ray_train_env": "launcher.driver.trainer",
    "prepare_trainer": "launcher.driver.trainer",
    "stop_running": "launcher.driver.trainer",
    "PHASES": "launcher.driver.startup",
    "submit": "launcher.driver.jobs",
    "up": "launcher.driver.localhead",
    "down": "launcher.driver.localhead",
    "running_head": "launcher.driver.localhead",
    "STATE_ENV": "launcher.driver.localhead",
})
