"""TensorFlow (tf.keras) models used by the workloads: the same shapes as torch_models.

Every model takes inputs in the layout the workloads produce, which is the
torch one (flat vectors, or channels-first images NCHW), and transposes
images to channels-last inside the model: TensorFlow's CPU convolutions only
support NHWC. So both frameworks read the same data and their exported models
take the same input.

Keras 3, which TensorFlow 2.21 ships, does not work under
MultiWorkerMirroredStrategy nor with Horovod; the legacy tf.keras (the
``tf-keras`` package) does. :func:`keras` selects it before TensorFlow is
imported.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null meanwhile: C++ libraries log there before any
    setting can stop them. Python exceptions still propagate (and print afterwards)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def keras():
    """The legacy tf.keras module (tf_keras), with TensorFlow set up to use it."""
    if "tensorflow" in sys.modules and os.environ.get("TF_USE_LEGACY_KERAS") != "1":
        raise RuntimeError("TensorFlow was imported before TF_USE_LEGACY_KERAS=1 was set; "
                           "set it in the environment before importing tensorflow")
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's C++ start-up chatter off
    import tf_keras

    return tf_keras


def mlp(input_shape: tuple[int, ...], hidden: tuple[int, ...], num_classes: int):
    """Fully connected network on the flattened inputs."""
    k = keras()
    layers = [k.layers.Input(input_shape), k.layers.Flatten()]
    layers += [k.layers.Dense(h, activation="relu") for h in hidden]
    layers.append(k.layers.Dense(num_classes))
    return k.Sequential(layers, name="mlp")


def _to_channels_last(k, shape: tuple[int, int, int]):
    return [k.layers.Input(shape), k.layers.Permute((2, 3, 1))]


def small_cnn(in_channels: int, image_size: int, widths: tuple[int, ...], num_classes: int,
              hidden: int = 128):
    """Conv(3x3, same)+ReLU+MaxPool(2) stages, then Dense(hidden)+ReLU and the classes."""
    k = keras()
    layers = _to_channels_last(k, (in_channels, image_size, image_size))
    for w in widths:
        layers += [k.layers.Conv2D(w, 3, padding="same", activation="relu"), k.layers.MaxPool2D(2)]
    layers += [k.layers.Flatten(), k.layers.Dense(hidden, activation="relu"), k.layers.Dense(num_classes)]
    return k.Sequential(layers, name="small_cnn")


def _bn(k):
    # torch's BatchNorm2d defaults: momentum 0.1 (keras counts it the other way) and eps 1e-5
    return k.layers.BatchNormalization(momentum=0.9, epsilon=1e-5)


def _conv(k, filters: int, size: int, stride: int = 1):
    return k.layers.Conv2D(filters, size, stride, padding="same", use_bias=False,
                           kernel_initializer="he_normal")


def _basic(k, x, width: int, stride: int):
    y = k.layers.ReLU()(_bn(k)(_conv(k, width, 3, stride)(x)))
    y = _bn(k)(_conv(k, width, 3)(y))
    return k.layers.ReLU()(k.layers.Add()([y, _shortcut(k, x, width, stride)]))


def _bottleneck(k, x, width: int, stride: int):
    y = k.layers.ReLU()(_bn(k)(_conv(k, width, 1)(x)))
    y = k.layers.ReLU()(_bn(k)(_conv(k, width, 3, stride)(y)))  # v1.5: stride in the 3x3
    y = _bn(k)(_conv(k, width * 4, 1)(y))
    return k.layers.ReLU()(k.layers.Add()([y, _shortcut(k, x, width * 4, stride)]))


def _shortcut(k, x, cout: int, stride: int):
    if stride == 1 and x.shape[-1] == cout:
        return x
    return _bn(k)(_conv(k, cout, 1, stride)(x))


def resnet(depth: int, num_classes: int, image_size: int, in_channels: int = 3):
    """ResNet-18 (basic blocks) or ResNet-50 (bottlenecks), as in workloads.torch_models."""
    k = keras()
    block, counts = {18: (_basic, (2, 2, 2, 2)), 50: (_bottleneck, (3, 4, 6, 3))}[depth]
    inputs = k.layers.Input((in_channels, image_size, image_size))
    x = k.layers.Permute((2, 3, 1))(inputs)
    x = k.layers.ReLU()(_bn(k)(_conv(k, 64, 7, 2)(x)))
    x = k.layers.MaxPool2D(3, 2, padding="same")(x)
    for i, (count, width) in enumerate(zip(counts, (64, 128, 256, 512))):
        for j in range(count):
            x = block(k, x, width, 2 if (i > 0 and j == 0) else 1)
    x = k.layers.GlobalAveragePooling2D()(x)
    return k.Model(inputs, k.layers.Dense(num_classes)(x), name=f"resnet{depth}")
