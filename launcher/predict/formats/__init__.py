"""Model formats: how a model folder is loaded, what its instances look like, what it answers.

One registry for ``launcher predict`` and ``launcher serve``. A format turns instances
(as a JSON body or a data file holds them) into the model's input batch, runs the model
on a batch, and turns its outputs back into one prediction per instance:

========== ============================================ ==================================
format     the folder holds                             a prediction
========== ============================================ ==================================
workload   a run's ``model.pt2`` or ``saved_model/``,   a classifier's ``{"prediction",
           with ``model.json`` naming the workload      "scores"}``; otherwise the output
program    a torch training function's ``model.pt2``,   the output (several: by name)
           with ``model.json`` naming its inputs
keras      ``model.keras`` (a Keras training function)  the output (several: by name)
savedmodel ``saved_model.pb`` (TensorFlow, Vertex's     the output (several: by name)
           prebuilt container's format)
sklearn    ``model.joblib`` or ``model.pkl``            what ``model.predict`` gives
xgboost    ``model.bst``                                what ``Booster.predict`` gives (a
                                                        run's classifier: class and scores)
========== ============================================ ==================================

The modules: :mod:`~.base` what every format shares (the batch, a dict of arrays, one
per named input, so that requests batched together are joined and split by the same
two functions whatever the model; :class:`~.base.Loaded`, and :class:`~.base.Named` for
models with named inputs); :mod:`~.instances` the checks of instances sent as numbers or
by name; :mod:`~.exports` a launcher run's own exports (``workload``, ``program``);
:mod:`~.tensorflow` (``savedmodel``, ``keras``) and :mod:`~.tabular` (``sklearn``,
``xgboost``) the files Vertex AI's prebuilt containers serve. Bad instances raise
ValueError saying what was expected (the forms accepted), which the callers turn into a
400 or one line.
"""

from __future__ import annotations

from typing import Any

from launcher.predict.formats.base import Loaded
from launcher.predict.formats.exports import Program, Workload
from launcher.predict.formats.tabular import Sklearn, XGBoost
from launcher.predict.formats.tensorflow import Keras, SavedModel

FORMATS: dict[str, type[Loaded]] = {cls.format: cls for cls in (Workload, Program, Sklearn, XGBoost, SavedModel, Keras)}
# name -> the files that mark a folder of it, in the order they are looked for (the formats a
# model.json describes, workload and program, have none of their own)
MARKERS: dict[str, tuple[str, ...]] = {cls.format: cls.files for cls in (Sklearn, XGBoost, SavedModel, Keras)}
ACCEPTED = "model.joblib/model.pkl (scikit-learn), model.bst (XGBoost), saved_model.pb (TensorFlow), model.keras"


def detect(info: dict[str, Any], files: list[str]) -> str | None:
    """The format of a folder whose ``model.json`` says ``info`` (empty without one) and which
    holds ``files``; None when nothing here can be served."""
    if info.get("framework") == "xgboost" and "model.bst" in files:
        return "xgboost"
    if info.get("input_shape") is not None and info.get("workload") and info.get("kind") != "training function":
        return "workload"
    if info.get("inputs") and "model.pt2" in files:
        return "program"
    for name, marks in MARKERS.items():
        if any(m in files for m in marks):
            return name
    return None



def load(name: str, directory: str, info: dict[str, Any]) -> Loaded:
    """The model in ``directory`` loaded as format ``name`` (a key of :data:`FORMATS`)."""
    return FORMATS[name](directory, info)
