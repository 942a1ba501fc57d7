"""frozen: a model with frozen parts and a branch taken on even steps only (written here).

Model (token ids -> 5 classes): ``embed`` Embedding(64, 32) FROZEN -> ``adapter`` Linear(32, 32) trainable ->
``block`` (Linear(32, 32) + LayerNorm(32)) FROZEN -> ``branch`` Linear(32, 32) trainable, applied (residually)
only when the batch's ``even`` flag is set -> mean over tokens -> ``head`` Linear(32, 5) trainable. fp32.
5,445 parameters in 11 tensors, 2,277 of them trainable in 6.
Frozen parameters sit before and between trainable ones (the adapter's gradient flows through the frozen block),
so a library must still propagate input gradients through modules whose parameters need none.

``requires_grad=False``: embed.weight, block.linear.weight/.bias, block.norm.weight/.bias (5 tensors).
Trainable: adapter, branch, head weights and biases (6 tensors). Ties: none. Buffers: none.

The branch: ``batch(step)["even"]`` is a (8,) bool tensor, all True on even steps and all False on odd ones (a
per-example column so that every data-parallel slice carries it). On odd steps ``branch.weight`` / ``branch.bias``
are not used: in one process their grad stays None after ``zero_grad()`` (set_to_none), so AdamW skips them
(no update, no weight decay) and the gradient clip leaves them out of the norm.

Batch: ``ids`` (8, 6) in 0..63, ``labels`` (8,) in 0..4, ``even`` (8,). Loss: CrossEntropyLoss(mean) over the 8 rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, CLASSES, SEQ, BATCH = 64, 32, 5, 6, 8

NOTES = ("frozen embedding and a frozen block between trainable layers (grad None, requires_grad False) and a "
         "parameter used on even steps only (grad None on odd steps in one process: no AdamW update then)")
MAX_NORM = 0.5
TP_PLAN = None


class FrozenBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + torch.tanh(self.linear(x)))


class FrozenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.adapter = nn.Linear(HIDDEN, HIDDEN)
        self.block = FrozenBlock()
        self.branch = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)
        for module in (self.embed, self.block):
            module.requires_grad_(False)

    def forward(self, ids: torch.Tensor, even: torch.Tensor) -> torch.Tensor:
        x = self.block(F.gelu(self.adapter(self.embed(ids))))
        take = bool(even.any())
        if take != bool(even.all()):
            raise ValueError("frozen: the batch's 'even' flags must be all equal")
        if take:
            x = x + F.gelu(self.branch(x))
        return self.head(x.mean(dim=1))


def build() -> nn.Module:
    return FrozenModel()


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(8000 + step)
    return {"ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            "labels": torch.randint(0, CLASSES, (BATCH,), generator=g),
            "even": torch.full((BATCH,), step % 2 == 0)}


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["ids"], batch["even"]), batch["labels"])
