"""The Keras CNN of the MultiWorkerMirroredStrategy tutorial, on CIFAR-10-shaped data,
with the launcher's checkpoints, exact resume and preemption notices.

    launcher run --workload examples/keras_cifar.py:train --workers 2 --checkpoint-every-steps 20

The model and its compile() are written as Keras users write them; what the launcher
adds is three lines: build inside ``session.scope()``, batch by
``session.global_batch_size``, and ``session.fit`` in place of ``model.fit``. The data are
generated CIFAR-shaped arrays (32x32x3 images, 10 classes, each class a colour pattern
under noise) so that nothing is downloaded; ``--param npz=PATH`` trains on a file with
``x_train, y_train, x_test, y_test`` instead (e.g. ``keras.datasets.cifar10.load_data()``
saved with ``np.savez``).
"""

import numpy as np
import tensorflow as tf

import workloads
from workloads import Param


def cifar_like(samples: int, seed: int):
    """Images (uint8, 32x32x3) whose class is a colour pattern under noise; labels 0-9."""
    rng = np.random.default_rng(seed)
    patterns = np.random.default_rng(0).uniform(64, 192, size=(10, 4, 4, 3))
    y = rng.integers(0, 10, size=samples)
    base = np.repeat(np.repeat(patterns[y], 8, axis=1), 8, axis=2)
    x = np.clip(base + rng.normal(0, 160, size=base.shape), 0, 255).astype(np.uint8)
    return x, y.astype(np.int64)


def load(params):
    if params.get("npz"):
        with np.load(params["npz"]) as f:
            return (f["x_train"], f["y_train"].reshape(-1)), (f["x_test"], f["y_test"].reshape(-1))
    return cifar_like(params["samples"], 1), cifar_like(max(256, params["samples"] // 5), 2)


def build_and_compile_cnn_model(lr: float):
    model = tf.keras.Sequential([
        tf.keras.layers.Input(shape=(32, 32, 3)),
        tf.keras.layers.Rescaling(1 / 255),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(optimizer=tf.keras.optimizers.Adam(learning_rate=lr),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@workloads.training_function(
    epochs=3, batch_size=32, lr=0.001, framework="tensorflow",
    params=[Param("samples", int, 2048, "generated training images"),
            Param("npz", str, "", "an .npz with x_train, y_train, x_test, y_test (CIFAR-10's)")])
def train(session):
    (x_train, y_train), (x_test, y_test) = load(session.params)
    dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(len(x_train), seed=session.seed)
    with session.scope():
        model = build_and_compile_cnn_model(session.lr)
    session.fit(model, dataset.batch(session.global_batch_size), validation_data=(x_test, y_test))
