"""Activation checkpointing, one implementation: every unit (True) or every k-th (k, the design documents'
CheckpointInterval), in the sharding engine and in sw.parallelize; training equals one process and the activations
kept for backward shrink in order: none > every 2nd > every one. Applying it twice to a module is a no-op."""

from __future__ import annotations

import pytest
import torch
from parity import RTOL, batch, make_optimizer, reference_state

import shardwise as sw
from shardwise.activation_checkpointing import checkpoint_module, is_checkpointed
from shardwise.models import GPT, GPTConfig
from shardwise.models.gpt import Block
from shardwise.tensor_parallel import saved_activations

CONFIG = GPTConfig.preset("tiny", n_layers=4)


def train(comm, ac, steps=3):
    model = sw.ZeRO(GPT(CONFIG, seed=0), comm, stage=3, wrap=Block, activation_checkpointing=ac)
    opt = make_optimizer(model.parameters())
    kept = []
    for step in range(steps):
        x, y = batch(step, comm.rank, comm.size)
        with saved_activations(model) as saved:
            loss = model(x, y)
        loss.backward()
        kept.append(saved.total)
        opt.step()
        opt.zero_grad()
    return sw.full_state_dict(model), kept[-1]


def test_every_kth_unit_trains_like_one_process_and_keeps_less():
    want = reference_state(3, CONFIG)
    kept = {}
    for ac in (False, 2, True):
        results = sw.launch(train, 2, ac)
        for state, _ in results:
            for name in want:
                torch.testing.assert_close(state[name], want[name], rtol=RTOL, atol=1e-6)
        kept[ac] = results[0][1]
    assert kept[False] > kept[2] > kept[True]


def test_checkpointing_is_never_applied_twice_and_bad_values_are_named():
    block = Block(CONFIG)
    checkpoint_module(checkpoint_module(block))
    assert is_checkpointed(block) and block.forward.__wrapped__.__self__ is block  # wrapped once
    with pytest.raises(ValueError, match="activation_checkpointing=-1 must be True, False or a positive int"):
        sw.ZeRO(GPT(CONFIG, seed=0), sw.init(), stage=3, activation_checkpointing=-1)
