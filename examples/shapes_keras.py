"""A user workload for TensorFlow (tf.keras): the same shapes, a Keras CNN.

    launcher run --workload examples/shapes_keras.py:SHAPES --framework tensorflow --workers 2

The launcher trains it with MultiWorkerMirroredStrategy (--backend native) or
Horovod (--backend horovod). Inputs are channels-first, as for the torch model.
"""

import workloads
from shapes_data import ShapesWorkload
from workloads import Defaults


class KerasShapes(ShapesWorkload):
    def __init__(self):
        super().__init__(
            name="shapes-keras", description="16x16 shapes (square, disc, X) with a Keras CNN",
            frameworks=("tensorflow",), defaults=Defaults(epochs=4, batch_size=32, lr=0.003))

    def tf_model(self, params):
        k = workloads.keras()  # the legacy tf.keras (tf_keras) the launcher trains with
        return k.Sequential([
            k.layers.Input((1, 16, 16)), k.layers.Permute((2, 3, 1)),  # to channels-last for Conv2D
            k.layers.Conv2D(8, 3, padding="same", activation="relu"), k.layers.MaxPooling2D(),
            k.layers.Conv2D(16, 3, padding="same", activation="relu"), k.layers.MaxPooling2D(),
            k.layers.Flatten(), k.layers.Dense(3)])


SHAPES = KerasShapes()
