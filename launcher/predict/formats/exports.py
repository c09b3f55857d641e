"""A launcher run's own exports, as its ``model.json`` describes them.

``workload``: a built-in or user workload's model (``model.pt2``, or ``saved_model/``
for TensorFlow), fed through the workload's own preprocessing; a classifier answers with
softmax scores and the class. ``program``: a torch training function's ``torch.export``
program, taking its inputs by the names of its forward's arguments.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

import workloads
from launcher.predict.formats.base import Batch, Loaded, Named
from launcher.predict.formats.instances import by_name, checked
from launcher.predict.formats.tensorflow import serving_signature, tensorflow


def _torch_program(path: str):
    """The ``torch.export`` program at ``path`` as a module, torch held to a few threads."""
    import torch

    module = torch.export.load(path).module()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    return module


class Workload(Loaded):
    """A run's export: a torch program or a SavedModel, fed through the workload's own
    preprocessing; a classifier answers with softmax scores and the class."""

    format = "workload"

    def __init__(self, directory: str, info: dict[str, Any]) -> None:
        super().__init__(directory, info)
        self.workload = workloads.get(info["workload"])
        self.params = info.get("params") or {}
        self.classes = info.get("num_classes") if isinstance(info.get("num_classes"), int) else None
        self.shape = tuple(int(d) for d in info["input_shape"])
        self._fn = self._tensorflow() if info.get("framework") == "tensorflow" else self._torch()

    def _torch(self) -> Callable[[np.ndarray], np.ndarray]:
        import torch

        program = _torch_program(self.path("model.pt2"))

        def run(x: np.ndarray) -> np.ndarray:
            with torch.no_grad():
                return program(torch.from_numpy(x)).numpy()
        return run

    def _tensorflow(self) -> Callable[[np.ndarray], np.ndarray]:
        tf = tensorflow()
        self._loaded, serve = serving_signature(self.path("saved_model"), "saved_model")

        def run(x: np.ndarray) -> np.ndarray:
            return next(iter(serve(x=tf.constant(x)).values())).numpy()
        return run


    def about(self) -> dict[str, Any]:
        return {"format": self.format, "workload": self.info.get("workload"), "framework":
                self.info.get("framework", "torch"), "input_shape": list(self.shape), "classes": self.classes}

    def inputs(self, instances: Any) -> Batch:
        array = checked(by_name(instances))
        x = self.workload.preprocess(array, self.params)
        if not np.all(np.isfinite(x)):
            raise ValueError("instances hold NaN or infinity")
        return {"x": np.ascontiguousarray(x)}

    def run(self, batch: Batch) -> Batch:
        x = batch["x"]
        if not len(x):
            return {"y": np.zeros((0, self.classes or 1), np.float32)}
        y = np.asarray(self._fn(x), dtype=np.float32)
        if self.classes:
            y = np.exp(y - y.max(axis=1, keepdims=True))
            y /= y.sum(axis=1, keepdims=True)
        return {"y": y}


class Program(Named):
    """A torch training function's ``torch.export`` program, its inputs as ``model.json``
    describes them (the names of its forward's arguments)."""

    format = "program"

    def __init__(self, directory: str, info: dict[str, Any]) -> None:
        import torch

        super().__init__(directory, info)
        self.torch = torch
        self.module = _torch_program(self.path("model.pt2"))
        self.specs = [(i["name"], tuple(None if d < 0 else d for d in i["shape"][1:]), np.dtype(i["dtype"]))
                      for i in info["inputs"]]
        self.keywords = {i["name"] for i in info["inputs"] if i.get("keyword")}
        self.outputs = [o["name"] for o in info.get("outputs") or [{"name": "output"}]]

    def run(self, batch: Batch) -> Batch:
        torch = self.torch
        tensors = {n: torch.from_numpy(np.ascontiguousarray(batch[n])) for n, _, _ in self.specs}
        with torch.no_grad():
            y = self.module(*[t for n, t in tensors.items() if n not in self.keywords],
                            **{n: t for n, t in tensors.items() if n in self.keywords})
        ys = list(y.values()) if isinstance(y, dict) else list(y) if isinstance(y, (list, tuple)) else [y]
        return {name: v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
                for name, v in zip(self.outputs, ys)}

