"""The ready example of `shardwise check --gpt`: the library's tiny GPT and batches of random byte tokens.

Top-level functions, so they also run in gloo processes (`--backend gloo`). The GPT has no dropout and no buffers;
its loss is the mean next-token cross entropy over every position of every row, a mean over examples of equal
weight, so the data-parallel ranks' average equals the whole batch's loss.
"""

from __future__ import annotations

import torch

from ..models.gpt import GPT, GPTConfig

__all__ = ["build_gpt", "gpt_batch", "GPT_ROWS"]

#: Rows of the global batch: divisible by 1, 2, 4 and 8 data-parallel ranks.
GPT_ROWS = 8


def build_gpt() -> GPT:
    """GPTConfig.preset("tiny"): 2 layers, width 64, 4 heads, 32 positions, 256 byte tokens (~0.12 M parameters)."""
    return GPT(GPTConfig.preset("tiny"))


def gpt_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of step `step`: GPT_ROWS rows of 32 random tokens, the targets shifted by one."""
    seq = GPTConfig.preset("tiny").seq_len
    tokens = torch.randint(0, 256, (GPT_ROWS, seq + 1), generator=torch.Generator().manual_seed(1000 + step))
    return tokens[:, :-1], tokens[:, 1:]
