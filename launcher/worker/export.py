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
``model.weights.npz`` (the model's variables, read from the session's checkpoint) and the same
``model.json``. Both take the same input: the workload's channels-first layout. A training
function's Keras model also gets ``model.keras`` (:func:`export_keras`).
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import shutil
import tempfile
from typing import Any

import workloads
from launcher.storage import Storage
from launcher.worker.formats import TF_MODEL_FILE, TORCH_MODEL_FILE, save_arrays, tf_model_arrays
from workloads.tf_models import native_stderr_silenced

KERAS_FILE = "model.keras"
SAVED_MODEL_DIR = "saved_model"


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


def export_weights(spec, checkpoint_dir: str, storage: Storage, program: dict[str, Any] | None = None,
                   why: str | None = None) -> str:
    """A training function's model: its weights and a model.json saying where the code is;
    with ``program`` (:func:`torch_program`) also the ``torch.export`` program, which predict
    and serve run without the user's class (without, model.json says ``why`` not)."""
    import torch

    files = {"state_dict.pt": "the registered model's weights: build the model as your function does, then "
                              "model.load_state_dict(torch.load(p))"}
    described: dict[str, Any] = {"workload": spec.workload, "framework": spec.framework,
                                 "kind": "training function", "params": spec.params, **hook_fields(spec)}
    with tempfile.TemporaryDirectory(prefix="launcher-export-") as d:
        shutil.copy(os.path.join(checkpoint_dir, TORCH_MODEL_FILE), os.path.join(d, "state_dict.pt"))
        if program is not None:
            torch.export.save(program["program"], os.path.join(d, "model.pt2"))
            files["model.pt2"] = "torch.export program (any batch size): torch.export.load(p).module()(*inputs)"
            described.update(inputs=program["inputs"], outputs=program["outputs"])
        elif why:
            described["no_program"] = why
        with open(os.path.join(d, "model.json"), "w", encoding="utf-8") as f:
            json.dump({**described, "files": files}, f, indent=1)
        storage.upload_dir(d, spec.name, "model")
    return storage.uri_of(spec.name, "model")


def weights_only_note(why: str) -> str:
    """What the summary says of a training function's model exported without a program: that
    predict and serve cannot take it, why, and how to predict instead (one line)."""
    return (f"weights only (state_dict.pt), no program launcher predict and serve can run (the model: {why}); "
            "to predict, build the model in your own code as your function does and load them: "
            "model.load_state_dict(torch.load(path))")


def hook_fields(spec) -> dict[str, Any]:
    """What a training function's model.json says for prediction: its data (a predict hook may
    read it, e.g. for a vocabulary) and its ``predict(model, instances)`` hook, when the
    function's file defines one."""
    from workloads.user import companion, is_reference

    fields: dict[str, Any] = {"data": spec.data}
    if is_reference(spec.workload) and companion(spec.workload, "predict") is not None:
        fields["predict"] = spec.workload.rpartition(":")[0] + ":predict"
    return fields


def example_rows(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """A model call's inputs cut to 2 rows, detached, on the CPU: the example a program is
    exported from (2, not 1: a batch of 1 would be specialised)."""
    import torch

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            rows = value.detach()[:2].cpu().clone()
            return torch.cat([rows, rows]) if value.dim() and len(rows) == 1 else rows
        return value

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def _described(name: str, value: Any, dynamic: tuple[bool, ...] = ()) -> dict[str, Any]:
    """A tensor's name, shape (-1 for the batch and any other size the program takes freely) and dtype."""
    shape = [-1] + [-1 if i + 1 < len(dynamic) and dynamic[i + 1] else int(d) for i, d in enumerate(value.shape[1:])]
    return {"name": name, "shape": shape, "dtype": str(value.dtype).replace("torch.", "")}


def _free_sizes(program) -> list[tuple[bool, ...]]:
    """For each input of ``program``, which of its sizes are symbolic (free), in order."""
    found = []
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in program.graph_signature.user_inputs:
            continue
        value = node.meta.get("val")
        # A size the program fixed prints as its number; a free one as its symbol (s0, ...).
        found.append(tuple(not str(d).isdigit() for d in getattr(value, "shape", ())))
    return found


def torch_program(model, example: tuple[tuple, dict[str, Any]], *,
                  keep: bool = True) -> tuple[dict[str, Any] | None, str | None]:
    """(the program and its inputs and outputs described, None) or (None, why it cannot be
    exported): ``model`` exported on the CPU from ``example`` with a dynamic batch size.
    ``keep``: leave ``model`` as it is (a copy is exported); False: it is a CPU copy already,
    the export's own (no second copy of the weights)."""
    import torch

    args, kwargs = example
    values = [*args, *kwargs.values()]
    if not values or not all(isinstance(v, torch.Tensor) and v.dim() for v in values):
        kinds = ", ".join(type(v).__name__ for v in values) or "nothing"
        return None, f"its forward takes {kinds}, and predict and serve send it tensors of a batch"
    names = [n for n in inspect.signature(model.forward).parameters][:len(args)] + list(kwargs)
    try:
        cpu = (copy.deepcopy(model).cpu() if keep else model).eval()

        def free(value):  # every size may vary where the model allows it (the batch, a sequence's length)
            return {i: torch.export.Dim.AUTO for i in range(value.dim())}

        program = torch.export.export(cpu, args, kwargs, dynamic_shapes={
            **{n: free(v) for n, v in zip(names, args)}, **{k: free(v) for k, v in kwargs.items()}})
        with torch.no_grad():
            out = program.module()(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the user's model; said in one line, the weights stay
        return None, f"torch.export failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    if isinstance(out, torch.Tensor):
        outputs = [_described("output", out)]
    elif isinstance(out, dict) and all(isinstance(v, torch.Tensor) for v in out.values()):
        outputs = [_described(str(k), v) for k, v in out.items()]
    elif isinstance(out, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in out):
        outputs = [_described(f"output{i}", v) for i, v in enumerate(out)]
    else:
        return None, f"its forward returns a {type(out).__name__}, not tensors"
    inputs = [_described(n, v, d) for n, v, d in zip(names, values, _free_sizes(program) + [()] * len(values))]
    for described in inputs[len(args):]:
        described["keyword"] = True  # passed by name, as the model was called
    return {"program": program, "inputs": inputs, "outputs": outputs}, None


def export_keras(spec, model, arrays: list, storage: Storage) -> str:
    """A TensorFlow training function's Keras ``model`` with its variables ``arrays``: in Keras'
    format, as a SavedModel and as plain arrays, with a model.json saying where the code is."""
    from workloads.tf_models import keras

    files = {TF_MODEL_FILE: "the weights: build the model as your function does, then "
                            "model.set_weights(list of arrays a0000, a0001, ... in order)"}
    with tempfile.TemporaryDirectory(prefix="launcher-export-") as d:
        save_arrays(os.path.join(d, TF_MODEL_FILE), arrays)
        try:
            copy = keras().models.clone_model(model)
            copy.set_weights(arrays)
            copy.save(os.path.join(d, KERAS_FILE))
            files[KERAS_FILE] = "tf_keras.models.load_model(p) (TF_USE_LEGACY_KERAS=1)"
        except Exception as exc:  # e.g. a subclassed model without get_config
            print(f"rank 0: the model cannot be saved in Keras' format ({type(exc).__name__}: {exc}); "
                  "its weights are exported", flush=True)
            shutil.rmtree(os.path.join(d, KERAS_FILE), ignore_errors=True)
            copy = None
        if copy is not None:
            try:  # what TensorFlow Serving and Vertex AI's prebuilt TensorFlow container load
                with native_stderr_silenced():
                    copy.export(os.path.join(d, SAVED_MODEL_DIR))
                files[SAVED_MODEL_DIR] = "TensorFlow SavedModel (model.export): its serving_default signature"
            except Exception as exc:  # noqa: BLE001 - model.keras and the weights are what matters
                print(f"rank 0: the model cannot be exported as a SavedModel ({type(exc).__name__}: {exc})",
                      flush=True)
                shutil.rmtree(os.path.join(d, SAVED_MODEL_DIR), ignore_errors=True)
        with open(os.path.join(d, "model.json"), "w", encoding="utf-8") as f:
            json.dump({"workload": spec.workload, "framework": "tensorflow", "kind": "training function",
                       "params": spec.params, **hook_fields(spec), "files": files}, f, indent=1)
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
    arrays = tf_model_arrays(checkpoint_dir)
    model.set_weights(arrays)
    shape = workload.input_shape(spec.params)
    serve = tf.function(lambda x: model(x, training=False),
                        input_signature=[tf.TensorSpec((None, *shape), tf.float32, name="x")])
    with tempfile.TemporaryDirectory(prefix="launcher-export-") as d:
        tf.saved_model.save(model, os.path.join(d, SAVED_MODEL_DIR), signatures={"serving_default": serve})
        save_arrays(os.path.join(d, TF_MODEL_FILE), arrays)
        _describe(spec, workload, shape, {
            "saved_model": "TensorFlow SavedModel: tf.saved_model.load(p).signatures['serving_default'](x=...)",
            TF_MODEL_FILE: "weights for the workload's tf.keras model (model.set_weights)"}, d)
        storage.upload_dir(d, spec.name, "model")
    return storage.uri_of(spec.name, "model")
