"""Exporting the final model in the framework's own format under ``<run>/model/``.

For PyTorch: ``model.pt2`` (a ``torch.export`` program with a dynamic batch
dimension: ``torch.export.load(path).module()(x)`` needs none of our code),
``state_dict.pt`` (the weights, for ``load_state_dict``) and ``model.json``
(workload, input shape, classes).
"""

from __future__ import annotations

import json
import os
import tempfile

import workloads
from launcher.storage import Storage
from launcher.train_torch import MODEL_FILE


def export_torch(spec, checkpoint_dir: str, storage: Storage) -> str:
    """Write the model in ``checkpoint_dir`` to ``<storage>/<name>/model/``; returns its URI."""
    import torch

    workload = workloads.get(spec.workload)
    model = workload.torch_model(spec.params)
    model.load_state_dict(torch.load(os.path.join(checkpoint_dir, MODEL_FILE), map_location="cpu"))
    model.eval()
    shape = workload.input_shape(spec.params)
    example = (torch.zeros(2, *shape),)  # batch 2: a batch of 1 would be specialised
    program = torch.export.export(model, example, dynamic_shapes=({0: torch.export.Dim.AUTO},))
    with tempfile.TemporaryDirectory(prefix="launcher-export-") as d:
        torch.export.save(program, os.path.join(d, "model.pt2"))
        torch.save(model.state_dict(), os.path.join(d, "state_dict.pt"))
        with open(os.path.join(d, "model.json"), "w", encoding="utf-8") as f:
            json.dump({"workload": spec.workload, "framework": "torch", "input_shape": list(shape),
                       "num_classes": workload.num_classes(spec.params), "params": spec.params,
                       "files": {"model.pt2": "torch.export program: torch.export.load(p).module()",
                                 "state_dict.pt": "weights for the workload's torch model"}}, f, indent=1)
        storage.upload_dir(d, spec.name, "model")
    return storage.uri_of(spec.name, "model")
