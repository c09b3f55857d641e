"""Exporting the final model in the framework's own format under ``<run>/model/``.

For PyTorch: ``model.pt2`` (a ``torch.export`` program with a dynamic batch
dimension: ``torch.export.load(path).module()(x)`` needs none of our code),
``state_dict.pt`` (the weights, for ``load_state_dict``) and ``model.json``
(workload, input shape, classes).

For XGBoost: ``model.bst`` (the booster as Vertex AI's prebuilt XGBoost container loads it:
``xgboost.Booster(model_file=path)``; UBJSON inside), ``booster.json`` (the same booster in
XGBoost's JSON) and ``model.json``, describing the features, objective and classes.

For TensorFlow: ``saved_model/`` (TensorFlow's SavedModel format:
``tf.saved_model.load(path).serve(x)`` or ``tf_keras.models.load_model``),
``model.weights.npz`` and the same ``model.json``. Both take the same input:
the workload's channels-first layout.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import workloads
from launcher.storage import Storage
from launcher.worker.formats import TF_MODEL_FILE, TORCH_MODEL_FILE, load_arrays
from workloads.tf_models import native_stderr_silenced


def _describe(spec, workload, shape, files: dict[str, str], directory: str) -> None:
    with open(os.path.join(directory, "model.json"), "w", encoding="utf-8") as f:
        json.dump({"workload": spec.workload, "framework": spec.framework, "input_shape": list(shape),
                   "num_classes": workload.num_classes(spec.params) if workload.is_classifier else None,
                   "params": spec.params,
                   "files": files}, f, indent=1)


def export(spec, checkpoint_dir: str, storage: Storage) -> str:
    """Export the framework's model in ``checkpoint_dir``; returns the model folder's URI."""
    fn = {"tensorflow": export_tensorflow, "xgboost": export_xgboost}.get(spec.framework, export_torch)
    return fn(spec, checkpoint_dir, storage)


def export_xgboost(spec, checkpoint_dir: str, storage: Storage) -> str:
    """The booster in ``checkpoint_dir`` as ``model.bst`` and ``booster.json`` under
    ``<storage>/<name>/model/``, with a ``model.json`` naming its features; returns the URI."""
    import xgboost as xgb

    booster = xgb.Booster()
    with open(os.path.join(checkpoint_dir, "model.ubj"), "rb") as f:
        booster.load_model(bytearray(f.read()))
    config = json.loads(booster.save_config())["learner"]
    objective = config["objective"]["name"]
    classes = int(config["learner_model_param"].get("num_class", "0") or 0)
    with tempfile.TemporaryDirectory(prefix="launcher-export-") as d:
        with open(os.path.join(d, "model.bst"), "wb") as f:
            f.write(bytes(booster.save_raw("ubj")))
        booster.save_model(os.path.join(d, "booster.json"))
        with open(os.path.join(d, "model.json"), "w", encoding="utf-8") as f:
            json.dump({"workload": spec.workload, "framework": "xgboost", "objective": objective,
                       "num_classes": classes or (2 if objective.startswith("binary:") else None),
                       "features": booster.feature_names or [],
                       "label": spec.params.get("label"), "rounds": booster.num_boosted_rounds(),
                       "params": spec.params, "data": spec.data,
                       "files": {"model.bst": "the booster (UBJSON): xgboost.Booster(model_file=p), as Vertex AI's "
                                              "prebuilt XGBoost container loads it",
                                 "booster.json": "the same booster in XGBoost's JSON"}}, f, indent=1)
        storage.upload_dir(d, spec.name, "model")
    return storage.uri_of(spec.name, "model")


def export_torch(spec, checkpoint_dir: str, storage: Storage) -> str:
    """Write the model in ``checkpoint_dir`` to ``<storage>/<name>/model/``; returns its URI."""
    import torch

    workload = workloads.get(spec.workload)
    if isinstance(workload, workloads.TrainingFunction):
        return export_weights(spec, checkpoint_dir, storage)
    model = workload.torch_model(spec.params)
    model.load_state_dict(torch.load(os.path.join(checkpoint_dir, TORCH_MODEL_FILE), map_location="cpu"))
    model.eval()
    shape = workload.input_shape(spec.params)
    example = (torch.zeros(2, *shape),)  # batch 2: a batch of 1 would be specialised
    program = torch.export.export(model, example, dynamic_shapes=({0: torch.export.Dim.AUTO},))
    with tempfile.TemporaryDirectory(prefix="launcher-export-") as d:
        torch.export.save(program, os.path.join(d, "model.pt2"))
        torch.save(model.state_dict(), os.path.join(d, "state_dict.pt"))
        _describe(spec, workload, shape, {"model.pt2": "torch.export program: torch.export.load(p).module()",
                                          "state_dict.pt": "weights for the workload's torch model"}, d)
        storage.upload_dir(d, spec.name, "model")
    return storage.uri_of(spec.name, "model")


def export_weights(spec, checkpoint_dir: str, storage: Storage) -> str:
    """A training function's model: its weights (the model class is the user's, so no program
    is exported) and a model.json saying where the code is."""
    with tempfile.TemporaryDirectory(prefix="launcher-export-") as d:
        shutil.copy(os.path.join(checkpoint_dir, TORCH_MODEL_FILE), os.path.join(d, "state_dict.pt"))
        with open(os.path.join(d, "model.json"), "w", encoding="utf-8") as f:
            json.dump({"workload": spec.workload, "framework": spec.framework, "kind": "training function",
                       "params": spec.params,
                       "files": {"state_dict.pt": "the registered model's weights: build the model as your "
                                                  "function does, then model.load_state_dict(torch.load(p))"}},
                      f, indent=1)
        storage.upload_dir(d, spec.name, "model")
    return storage.uri_of(spec.name, "model")


def export_tensorflow(spec, checkpoint_dir: str, storage: Storage) -> str:
    """Write the TensorFlow model in ``checkpoint_dir`` as a SavedModel under ``<storage>/<name>/model/``."""
    from workloads.tf_models import keras

    workload = workloads.get(spec.workload)
    with native_stderr_silenced():  # TensorFlow's C++ start-up notes (no GPU, CPU features)
        keras()  # selects the legacy tf.keras before TensorFlow loads
        import tensorflow as tf

        model = workload.tf_model(spec.params)
    model.set_weights(load_arrays(os.path.join(checkpoint_dir, TF_MODEL_FILE)))
    shape = workload.input_shape(spec.params)
    serve = tf.function(lambda x: model(x, training=False),
                        input_signature=[tf.TensorSpec((None, *shape), tf.float32, name="x")])
    with tempfile.TemporaryDirectory(prefix="launcher-export-") as d:
        tf.saved_model.save(model, os.path.join(d, "saved_model"), signatures={"serving_default": serve})
        shutil.copy(os.path.join(checkpoint_dir, TF_MODEL_FILE), d)
        _describe(spec, workload, shape, {
            "saved_model": "TensorFlow SavedModel: tf.saved_model.load(p).signatures['serving_default'](x=...)",
            TF_MODEL_FILE: "weights for the workload's tf.keras model (model.set_weights)"}, d)
        storage.upload_dir(d, spec.name, "model")
    return storage.uri_of(spec.name, "model")
