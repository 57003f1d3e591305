"""The networks of ``pyro-bdl compare`` (``--network``): builders ``(input_shape, num_outputs)
-> nn.Module``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = ["NETWORKS", "cnn", "mlp"]


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 100) -> nn.Module:
    """Two hidden ReLU layers."""
    from torch import nn  # here, not at the top: `pyro-bdl --help` loads no torch

    d = 1
    for s in input_shape:
        d *= s
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(d, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def cnn(input_shape: tuple[int, ...], num_classes: int, width: int = 16) -> nn.Module:
    """Two 3×3 convolutions with BatchNorm, global average pooling and a linear head."""
    from torch import nn

    c = input_shape[0]
    return nn.Sequential(
        nn.Conv2d(c, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, stride=2),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, num_classes),
    )


NETWORKS = {"mlp": mlp, "cnn": cnn}
