"""full_state_dict / load_full_state_dict move weights between strategies and world sizes."""

from __future__ import annotations

import pytest
import torch
from parity import CONFIG
from sharding_cases import wrap

import shardwise as sw
from shardwise.models import GPT


def _trained_state(comm, name):
    model = wrap(GPT(CONFIG, seed=0), comm, name)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * (comm.rank + 1))  # every shard changes, differently per rank
    return sw.full_state_dict(model)


def _load_and_report(comm, name, state):
    model = wrap(GPT(CONFIG, seed=1), comm, name) if name != "ddp" else sw.DDP(GPT(CONFIG, seed=1), comm)
    sw.load_full_state_dict(model, state)
    # A forward after loading uses the loaded weights (the gathered copies were refreshed).
    logits = model(torch.arange(8).view(1, 8))
    return sw.full_state_dict(model), logits.detach()


@pytest.mark.parametrize("src, src_world, dst, dst_world", [
    ("zero3", 4, "zero1", 2), ("zero3", 4, "ddp", 3), ("zero1", 2, "zero3", 4), ("shard_grad_op", 2, "zero2", 3),
])
def test_state_moves_between_strategies_and_world_sizes(src, src_world, dst, dst_world):
    state = sw.launch(_trained_state, src_world, src)[0]
    plain = GPT(CONFIG, seed=1)
    plain.load_state_dict(state)  # a full state dict is a plain PyTorch state dict
    want_logits = plain(torch.arange(8).view(1, 8)).detach()
    for reloaded, logits in sw.launch(_load_and_report, dst_world, dst, state):
        assert reloaded.keys() == state.keys()
        for key in state:
            assert torch.equal(reloaded[key], state[key]), key
        torch.testing.assert_close(logits, want_logits)


def test_rank0_only():
    def body(comm):
        return sw.full_state_dict(wrap(GPT(CONFIG, seed=0), comm, "zero3"), rank0_only=True)

    states = sw.launch(body, 2)
    assert states[0] and states[1] == {}


def test_load_errors_name_the_key():
    comm = sw.init()
    model = wrap(GPT(CONFIG, seed=0), comm, "zero3")
    state = sw.full_state_dict(model)
    bad = dict(state, **{"blocks.0.mlp.fc.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=r"'blocks.0.mlp.fc.weight' has shape \(3, 3\)"):
        sw.load_full_state_dict(model, bad)
    missing = {k: v for k, v in state.items() if k != "ln_f.bias"}
    with pytest.raises(ValueError, match=r"missing keys \['ln_f.bias'\]"):
        sw.load_full_state_dict(model, missing)
