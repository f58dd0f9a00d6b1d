"""A multilayer perceptron for feature vectors: ``[B, in_features] -> [B, out_features]``."""

from __future__ import annotations

from torch import Tensor, nn


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden: list[int], out_features: int = 1) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for width in hidden:
            layers += [nn.Linear(in_features, width), nn.ReLU()]
            in_features = width
        self.net = nn.Sequential(*layers, nn.Linear(in_features, out_features))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)
