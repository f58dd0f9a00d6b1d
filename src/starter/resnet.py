"""CIFAR ResNets built from torchvision's BasicBlock.

torchvision's ``ResNet`` hard-codes an ImageNet stem (7x7 stride-2 conv + max-pool) and the
64..512 widths; CIFAR's 32x32 images want a 3x3 stride-1 stem and no pooling, and the smoke
model wants narrower stages. So the stages are assembled here from torchvision's own
``BasicBlock``, ``conv1x1`` and ``conv3x3`` with torchvision's initialisation. Every op
here has a deterministic CUDA implementation (see ``forward`` for the one swap that needs).
"""

from __future__ import annotations

from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock, conv1x1, conv3x3


class CifarResNet(nn.Module):
    def __init__(self, widths: list[int], blocks: list[int], num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            conv3x3(3, widths[0]), nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True)
        )
        stages, in_ch = [], widths[0]
        for i, (width, n) in enumerate(zip(widths, blocks, strict=True)):
            stride = 1 if i == 0 else 2
            downsample = None
            if stride != 1 or in_ch != width:
                downsample = nn.Sequential(conv1x1(in_ch, width, stride), nn.BatchNorm2d(width))
            layer = [BasicBlock(in_ch, width, stride, downsample)]
            layer += [BasicBlock(width, width) for _ in range(n - 1)]
            stages.append(nn.Sequential(*layer))
            in_ch = width
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(in_ch, num_classes)
        for m in self.modules():  # torchvision's ResNet init; draws from the `init` stream
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        # Global average pool as a plain mean: nn.AdaptiveAvgPool2d's CUDA backward has no
        # deterministic implementation and would raise under repro=strict on a GPU.
        return self.fc(self.stages(self.stem(x)).mean(dim=(2, 3)))
