"""Small float64 GPTs and their batches for the pipeline tests that compare with one process to 1e-10: a GPT whose
embedding is tied to its head (the tie spans the first and last pipeline stage), a mixture-of-experts GPT with its
load-balancing loss on, random token batches of 8 rows of 16, and AdamW with weight decay (eps 1e-5)."""

from __future__ import annotations

import torch

from shardwise.models import GPT, GPTConfig

ROWS, T, VOCAB = 8, 16, 64


def tied_gpt():
    config = GPTConfig(vocab_size=VOCAB, seq_len=T, d_model=16, n_heads=2, n_layers=4, dropout=0.0, tie_weights=True)
    return GPT(config, seed=0).double()


def moe_gpt():
    config = GPTConfig(vocab_size=VOCAB, seq_len=T, n_layers=4, n_heads=2, d_model=16, dropout=0.0, n_experts=4,
                       experts_per_token=2, moe_aux_loss_coef=0.1, tie_weights=False)
    return GPT(config, seed=0).double()


def tokens(step):
    """(inputs, targets) of step `step`: ROWS rows of T random tokens each."""
    generator = torch.Generator().manual_seed(step)
    return (torch.randint(0, VOCAB, (ROWS, T), generator=generator),
            torch.randint(0, VOCAB, (ROWS, T), generator=generator))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-5)
