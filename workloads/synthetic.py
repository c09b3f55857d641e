"""resnet18-synthetic and resnet50-synthetic: random images for throughput benchmarks.

The images are Gaussian noise with random labels, generated per rank from a
fixed seed, so they cost no I/O and the numbers measure compute and
communication only. Accuracy on them is chance by construction.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from workloads.base import Defaults, Param, Split, Workload, check_split_name

DATA_SEED = 1234


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise ValueError("must be a positive integer")
    return n


def _image_size(value: str) -> int:
    n = int(value)
    if n < 32:
        raise ValueError("must be at least 32 (the ResNet downsamples 32x)")
    return n


class SyntheticResNet(Workload):
    def __init__(self, depth: int) -> None:
        super().__init__(
            name=f"resnet{depth}-synthetic",
            description=f"ResNet-{depth} on random images (for benchmarks; accuracy is chance)",
            defaults=Defaults(epochs=1, batch_size=32, lr=0.01, optimizer="sgd"),
            params=(
                Param("image_size", _image_size, 224, "height and width of the square images"),
                Param("num_samples", _positive, 256, "training images in total (all ranks)"),
                Param("test_samples", _positive, 64, "test images in total (all ranks)"),
                Param("num_classes", _positive, 1000, "number of classes"),
            ),
        )
        self.depth = depth

    def samples(self, data: str | None, split: str, params: Mapping[str, Any]) -> int | None:
        return params["num_samples"] if split == "train" else params["test_samples"]

    def load(self, data: str | None, split: str, rank: int, world_size: int,
             params: Mapping[str, Any]) -> Split:
        check_split_name(split)
        total = params["num_samples"] if split == "train" else params["test_samples"]
        if split == "train":
            count = total // world_size
        else:  # test shards cover every sample once
            count = len(range(rank, total, world_size))
        rng = np.random.default_rng([DATA_SEED, split == "train", rank, world_size])
        size = params["image_size"]
        x = rng.standard_normal((count, 3, size, size), dtype=np.float32)
        y = rng.integers(0, params["num_classes"], count, dtype=np.int64)
        return Split(x, y)

    def input_shape(self, params: Mapping[str, Any]) -> tuple[int, ...]:
        return (3, params["image_size"], params["image_size"])

    def num_classes(self, params: Mapping[str, Any]) -> int:
        return params["num_classes"]

    def torch_model(self, params: Mapping[str, Any]):
        from workloads.torch_models import resnet18, resnet50

        build = resnet18 if self.depth == 18 else resnet50
        return build(params["num_classes"])

    def tf_model(self, params: Mapping[str, Any]):
        from workloads.tf_models import resnet

        return resnet(self.depth, params["num_classes"], params["image_size"])
