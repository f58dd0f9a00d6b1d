"""A small conv net with BatchNorm and an optional dropout: the framework's own test model.

BatchNorm's running statistics and dropout's draws from the global RNG (the ``train`` stream)
give a self-check both kinds of state. Closes: nondeterministic CUDA kernels (the global pool
is a plain mean: ``AdaptiveAvgPool2d``'s CUDA backward is nondeterministic)."""

from __future__ import annotations

from torch import Tensor, nn


class TinyConvNet(nn.Module):
    def __init__(
        self,
        widths: list[int] | tuple[int, ...] = (16, 32, 64),
        num_classes: int = 10,
        dropout: float = 0.0,
        convs_per_stage: int = 1,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        if not widths or min(widths) < 1 or not 0 <= dropout < 1 or convs_per_stage < 1:
            raise ValueError(
                "widths must be a non-empty list of positive ints, 0 <= dropout < 1 and "
                "convs_per_stage >= 1"
            )
        layers: list[nn.Module] = []
        in_ch = in_channels
        for i, width in enumerate(widths):
            for j in range(convs_per_stage):
                stride = 2 if i > 0 and j == 0 else 1
                layers += [
                    nn.Conv2d(in_ch, width, 3, stride=stride, padding=1, bias=False),
                    nn.BatchNorm2d(width),
                    nn.ReLU(inplace=True),
                ]
                in_ch = width
        self.features = nn.Sequential(*layers)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(in_ch, num_classes)
        for m in self.modules():  # draws from the `init` stream (the trainer seeds it)
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.dropout(self.features(x).mean(dim=(2, 3))))


# The benchmarks' and the GPU check's model size: 11.0M parameters, like a typical reference
# classifier, so a checkpoint or a step costs what it costs in a real run.
WIDE = {"widths": (64, 128, 256, 512), "convs_per_stage": 4}


class NullNet(nn.Module):
    """The null model of ``make bench``'s overhead figure: a linear head on each image's
    channel means, so a step is almost all framework (or bare loop) work."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.head = nn.Linear(in_channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(x.mean(dim=(2, 3)))
