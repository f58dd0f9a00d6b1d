"""A multilayer perceptron: each sample flattened, ``[B, ...] -> [B, out_features]``.

Feature vectors ``[B, F]`` pass as they are; images ``[B, C, H, W]`` become ``C*H*W`` values.
"""

from __future__ import annotations

from torch import Tensor, nn

from reprotrain.api import ReprotrainError


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden: list[int], out_features: int = 1) -> None:
        super().__init__()
        self.in_features = in_features
        layers: list[nn.Module] = []
        for width in hidden:
            layers += [nn.Linear(in_features, width), nn.ReLU()]
            in_features = width
        self.net = nn.Sequential(*layers, nn.Linear(in_features, out_features))

    def forward(self, x: Tensor) -> Tensor:
        x = x.flatten(1)
        if x.shape[1] != self.in_features:
            raise ReprotrainError(
                f"model.in_features={self.in_features} but each sample has {x.shape[1]} "
                f"values; set model.in_features={x.shape[1]}"
            )
        return self.net(x)
