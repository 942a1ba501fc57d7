"""convnet_bn: a small conv net with BatchNorm2d (written here): [conv3x3 - BatchNorm2d - ReLU] x 2, global average
pool, Linear; 5 classes.

Model: Conv2d(3, 8, 3, padding=1, bias=False) - BatchNorm2d(8) - ReLU - Conv2d(8, 16, 3, padding=1, bias=False) -
BatchNorm2d(16) - ReLU - AdaptiveAvgPool2d(1) - Linear(16, 5). fp32. 1,501 parameters in 8 tensors; 14 state-dict
keys (6 buffers). Ties: none.

Buffers (persistent, in the state dict, not shared): each BatchNorm's ``running_mean`` / ``running_var`` (fp32) and
``num_batches_tracked`` (int64), updated in every training forward from the batch the module sees.

Data-parallel parity does NOT hold without synchronised BatchNorm, by design: in training mode BatchNorm normalises
with the statistics of the batch it is given, so a rank's 4 images are normalised differently from the same images
among 8, and the mean of the halves' losses differs from the whole batch's loss (the smoke check prints the gap).
``sw.SyncBatchNorm.convert`` computes the statistics over the data-parallel group (the global batch) and restores
parity, running statistics included (they then equal the reference's). The batch's two halves are drawn from
different distributions (rows 4-7 shifted and scaled), so the per-rank statistics differ visibly.

Batch: ``images`` (8, 3, 8, 8), ``labels`` (8,) in 0..4. Loss: CrossEntropyLoss(mean) over the 8 images.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CHANNELS, IMAGE, CLASSES, BATCH = 3, 8, 5, 8

NOTES = ("BatchNorm2d: batch statistics couple the examples of a rank (no parity without SyncBatchNorm) and "
         "running-stat buffers (incl. int64 num_batches_tracked) change in every forward")
MAX_NORM = 0.2
TP_PLAN = None


class ConvNetBN(nn.Module):
    def __init__(self, classes: int = CLASSES) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(CHANNELS, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(16, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def build() -> nn.Module:
    return ConvNetBN()


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + step)
    images = torch.randn(BATCH, CHANNELS, IMAGE, IMAGE, generator=g)
    images[BATCH // 2:] = 2.0 * images[BATCH // 2:] + 1.0
    return {"images": images, "labels": torch.randint(0, CLASSES, (BATCH,), generator=g)}


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["images"]), batch["labels"])
