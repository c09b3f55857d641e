"""The tabular formats Vertex AI's prebuilt containers serve: scikit-learn and XGBoost.

Each takes rows of numbers (or, where the model's features have names, one object of
them per row); a scikit-learn text pipeline takes its documents as text.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import joblib
import numpy as np

from launcher.predict.formats.base import Batch, Loaded
from launcher.predict.formats.instances import as_array, by_name, checked, numeric


class Sklearn(Loaded):
    """scikit-learn's ``model.joblib`` / ``model.pkl`` (an estimator or a pipeline), as Vertex
    AI's prebuilt container loads it: unpickled, so only a model you trust."""

    format = "sklearn"
    files = ("model.joblib", "model.pkl")

    def __init__(self, directory: str, info: dict[str, Any]) -> None:
        super().__init__(directory, info)
        name = next(m for m in self.files if os.path.exists(self.path(m)))
        if name.endswith(".joblib"):
            self.model = joblib.load(self.path(name))
        else:
            with open(self.path(name), "rb") as f:
                self.model = pickle.load(f)  # noqa: S301 - the user's own model, as Vertex loads it
        if not callable(getattr(self.model, "predict", None)):
            raise ValueError(f"{name} holds a {type(self.model).__name__}, which has no predict method")
        self.width = getattr(self.model, "n_features_in_", None)

    def about(self) -> dict[str, Any]:
        return {"format": self.format, "estimator": type(self.model).__name__, "features": self.width}

    def inputs(self, instances: Any) -> Batch:
        features = getattr(self.model, "feature_names_in_", None)
        instances = by_name(instances, [str(f) for f in features] if features is not None else None)
        array = as_array(instances)
        if array.dtype.kind in "US" and array.ndim == 1:
            return {"x": array}  # a text pipeline's documents
        return {"x": numeric(checked(instances), self.width, f"the {type(self.model).__name__}'s features")}

    def run(self, batch: Batch) -> Batch:
        return {"y": np.asarray(self.model.predict(batch["x"]))}


class XGBoost(Loaded):
    """XGBoost's ``model.bst``: a booster over rows of features. A run's classifier (its
    ``model.json`` names the classes) answers with the class and the scores."""

    format = "xgboost"
    files = ("model.bst",)

    def __init__(self, directory: str, info: dict[str, Any]) -> None:
        import xgboost as xgb

        super().__init__(directory, info)
        self.booster = xgb.Booster()
        with open(self.path("model.bst"), "rb") as f:  # bytes: XGBoost guesses the format from them, silently
            self.booster.load_model(bytearray(f.read()))
        self.width = self.booster.num_features()
        self.objective = info.get("objective") or ""
        classes = info.get("num_classes")
        self.classes = classes if isinstance(classes, int) and classes >= 2 and (
            self.objective.startswith("binary:logistic") or self.objective == "multi:softprob") else None

    def about(self) -> dict[str, Any]:
        return {"format": self.format, "features": self.width, "objective": self.objective or None,
                "classes": self.classes}

    def inputs(self, instances: Any) -> Batch:
        instances = by_name(instances, self.booster.feature_names)
        return {"x": numeric(checked(instances), self.width, "the booster's features")}

    def run(self, batch: Batch) -> Batch:
        import xgboost as xgb

        matrix = xgb.DMatrix(batch["x"], feature_names=self.booster.feature_names)
        y = np.asarray(self.booster.predict(matrix), dtype=np.float32)
        if self.classes and y.ndim == 1:  # binary: the positive class's probability
            y = np.stack([1 - y, y], axis=1)
        return {"y": y}

