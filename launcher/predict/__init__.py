"""Using a run's exported model: batch prediction on Ray Data, an HTTP endpoint on Ray Serve.

``model`` finds and loads the model (with the workload's preprocessing),
``batch`` predicts over files (``launcher predict``), ``serve`` answers
AI Platform-style requests (``launcher serve``). It sits above the driver:
``cli`` -> ``predict`` -> ``driver``.
"""

from launcher._lazy import lazy_exports  # noqa: E402

__all__, __getattr__ = lazy_exports(__name__, {
    "locate": "launcher.predict.model",
    "Model": "launcher.predict.model",
    "predict": "launcher.predict.batch",
    "serve": "launcher.predict.serve",
})
