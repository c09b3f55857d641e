"""A user workload for PyTorch: a small CNN that tells three shapes apart.

    launcher run --workload examples/shapes_torch.py:SHAPES --workers 2

Without --data it trains on a file it writes itself (see shapes_data.py, which
also reads the data for it); with --data DIR it reads DIR/shapes.npz
(`python examples/shapes_data.py DIR` writes one).
"""

from shapes_data import ShapesWorkload
from workloads import Defaults, Param


class Shapes(ShapesWorkload):
    def __init__(self):
        super().__init__(
            name="shapes-cnn", description="16x16 shapes (square, disc, X) with a 2-layer CNN",
            frameworks=("torch",), defaults=Defaults(epochs=4, batch_size=32, lr=0.003),
            params=(Param("channels", int, 8, "channels of the first convolution"),))

    def torch_model(self, params):
        from torch import nn

        c = params["channels"]
        return nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(2 * c * 4 * 4, 3))


SHAPES = Shapes()
