"""Rank bodies for tests/test_collective_check.py (importable by gloo processes)."""

from __future__ import annotations

import torch
from parity import CONFIG, batch

import shardwise as sw
from shardwise.models import GPT


def rank0_only_eval(comm):
    """nanoGPT's rank-0-only evaluation of a ZeRO-3 model: rank 0 runs a forward (all-gathers) alone while rank 1
    goes on training (its forward's all-gathers, then the reduce-scatters of a backward)."""
    model = sw.ZeRO(GPT(CONFIG, seed=0), comm, stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        if comm.rank == 0 and step == 1:
            with torch.no_grad():
                model.eval()
                model(*batch(100))
                model.train()
        model(*batch(step, comm.rank, comm.size)).backward()
        opt.step()
        opt.zero_grad()
    return "trained on"


def sizes_differ(comm):
    """Two ranks all-reduce tensors of different sizes (4 and 6 elements)."""
    t = torch.ones(4 if comm.rank == 0 else 6)
    comm.all_reduce(t)
    return t.tolist()
