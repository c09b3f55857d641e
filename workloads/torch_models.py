"""PyTorch models used by the workloads: an MLP, two small CNNs and ResNets.

The ResNets are written here because there is no CPU build of torchvision
on the package registry. They follow the published architecture (He et al.,
2015: basic blocks for ResNet-18, bottleneck blocks for ResNet-50, with the
v1.5 placement of the stride in the 3x3 convolution), so parameter counts
match the usual figures (11.7 M and 25.6 M with 1000 classes).
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """Fully connected network on flattened inputs."""

    def __init__(self, in_features: int, hidden: tuple[int, ...], num_classes: int):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))


class SmallCNN(nn.Module):
    """Two or three conv+pool stages and a linear head: LeNet-sized, for MNIST/CIFAR."""

    def __init__(self, in_channels: int, image_size: int, widths: tuple[int, ...],
                 num_classes: int, hidden: int = 128):
        super().__init__()
        stages, cin, size = [], in_channels, image_size
        for w in widths:
            stages.append(_conv_block(cin, w))
            cin, size = w, size // 2
        self.features = nn.Sequential(*stages)
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(cin * size * size, hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    """ImageNet-style ResNet: 7x7 stem, max-pool, four stages, global average pool."""

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: tuple[int, int, int, int],
                 num_classes: int, in_channels: int = 3):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1))
        stages, cin = [], 64
        for i, (count, width) in enumerate(zip(layers, (64, 128, 256, 512))):
            blocks = []
            for j in range(count):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(block(cin, width, stride))
                cin = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def resnet18(num_classes: int) -> ResNet:
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes)


def resnet50(num_classes: int) -> ResNet:
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes)
