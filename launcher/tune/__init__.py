"""Hyperparameter tuning on Ray Tune, from AI Platform's ``hyperparameters`` YAML.

``study`` reads and checks the definition (``hyperparams`` holds the YAML's
schema), ``search`` runs it with Ray Tune on the driver, ``trial`` is what each
trial runs (a whole distributed run, with its own run folder and
checkpoints), ``watch`` follows the trials and ``results`` writes the table,
the plot and the summary. It sits above the driver: ``cli`` -> ``tune`` ->
``driver``.
"""

from launcher._lazy import lazy_exports  # noqa: E402

__all__, __getattr__ = lazy_exports(__name__, {
    "Study": "launcher.tune.study",
    "load": "launcher.tune.study",
    "run": "launcher.tune.search",
})
