"""Dropout in a tensor-parallel model's parallel regions draws each rank's own masks (shardwise/dropout_regions.py),
in its replicated regions the group's shared ones (dropout_stream.py).

Between a column-parallel layer and the next row-parallel one each rank holds its own heads or MLP columns, which one
process drops out independently; before, every rank drew the same mask at the same local position there (head h of
rank 0 dropped exactly like head h of rank 1). After the row-parallel layer the activations are replicated and the
masks must stay equal, or the replicated parameters drift apart. Checked on thread ranks: a column -> dropout -> row
-> dropout block, the shardwise GPT's attention dropout, and a checkpointed model whose recompute replays each rank's
own masks.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import torch
from parity import CONFIG
from torch import nn

import shardwise as sw
from shardwise import dropout_regions
from shardwise import tensor_parallel as tp
from shardwise.activation_checkpointing import checkpoint_module
from shardwise.models import GPT
from shardwise.sharded_tensor import local


_BUILD = threading.Lock()


class Block(nn.Module):
    """A column-parallel layer, dropout (a parallel region), a row-parallel layer, dropout (a replicated region)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 64)
        self.split_dropout = nn.Dropout(0.5)
        self.down = nn.Linear(64, 8)
        self.replicated_dropout = nn.Dropout(0.5)

    def forward(self, x):
        return self.replicated_dropout(self.down(self.split_dropout(self.up(x))))


def _masks(comm):
    with _BUILD:  # thread ranks share torch's generator
        torch.manual_seed(0)
        block = Block()
    model = tp.parallelize(block, comm, {"up": "colwise", "down": "rowwise"})
    seen = {}
    for name in ("split_dropout", "replicated_dropout"):
        getattr(model, name).register_forward_hook(lambda m, args, out, name=name: seen.update({name: out != 0}))
    model(torch.ones(4, 8))
    return seen


def test_split_activations_draw_each_ranks_masks_and_replicated_ones_the_groups():
    first, second = sw.launch(_masks, 2)
    assert torch.equal(first["replicated_dropout"], second["replicated_dropout"])
    assert not torch.equal(first["split_dropout"], second["split_dropout"])  # equal before
    for seen in (first, second):  # each still drops about half
        assert 0.3 < float(seen["split_dropout"].float().mean()) < 0.7


def _places(comm):
    config = dataclasses.replace(CONFIG, dropout=0.5, n_layers=2)
    model = tp.parallelize(GPT(config, seed=0), comm, "gpt")
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model(tokens, tokens).backward()
    return {n: local(p.grad).clone() for n, p in model.named_parameters() if "ln" in n and p.grad is not None}


def test_the_gpts_attention_dropout_is_in_a_parallel_region_and_its_residual_dropout_is_not(monkeypatch):
    """Where each of the GPT's draws falls: its attention's (split heads) in a region, as the rank's place; the
    embedding's and the residuals' outside. The replicated norms' gradients stay equal on both ranks."""
    drawn = []
    place = dropout_regions.place
    monkeypatch.setattr(dropout_regions, "place", lambda: drawn.append((threading.get_ident(), place())) or place())
    first, second = sw.launch(_places, 2)
    for grad in first:
        assert torch.equal(first[grad], second[grad]), grad
    per_thread = {}
    for thread, where in drawn:
        per_thread.setdefault(thread, []).append(where)
    places = sorted(sorted(set(p)) for p in per_thread.values())
    assert places == [[0, 1], [0, 2]], places  # rank r's attention draws at place r + 1, the rest at 0
    for seen in per_thread.values():
        assert seen.count(0) == 1 + 2 * 2 and len(seen) == 1 + 3 * 2  # embedding, 2 residuals and attention per block


def _checkpointed(comm, checkpointed):
    config = dataclasses.replace(CONFIG, dropout=0.3, n_layers=2)
    model = tp.parallelize(GPT(config, seed=0), comm, "gpt")
    if checkpointed:
        for block in model.blocks:
            checkpoint_module(block)
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    model(tokens, tokens).backward()
    return {n: local(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_recompute_replays_each_ranks_own_masks():
    plain = sw.launch(functools.partial(_checkpointed, checkpointed=False), 2)
    recomputed = sw.launch(functools.partial(_checkpointed, checkpointed=True), 2)
    for want, got in zip(plain, recomputed):
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(want[name], got[name]), name
