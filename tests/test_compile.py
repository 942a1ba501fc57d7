"""torch.compile of wrapped models on CPU (the GPU run with inductor is tests/test_gpu.py and `make gpu-check`).

ZeRO / FSDP's forward hooks gather, free and swap parameters and issue collectives; they run eagerly under
torch.compile (torch.compiler.disable: a graph break at each unit's edges, the layers between them compiled). The
`aot_eager` backend traces and partitions forward and backward as inductor would, without a C++ compiler, so a
compiled run must equal the eager one bit for bit here; the number of graphs dynamo captured is bounded by the units.
"""

from __future__ import annotations

import pytest
import torch
from parity import CONFIG, batch

import shardwise as sw
from shardwise.comm.thread_backend import ThreadWorld
from shardwise.models import GPT
from shardwise.models.gpt import Block


def _train(model, forward, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-5)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = forward(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), {k: v.detach().clone() for k, v in sw.full_state_dict(model).items()}


def _wrap(kind):
    comm = ThreadWorld(1).communicators()[0]
    model = GPT(CONFIG, seed=0)
    if kind == "ddp":
        return sw.DDP(model, comm)
    return sw.ZeRO(model, comm, stage=int(kind[-1]), wrap=Block)


@pytest.mark.parametrize("kind", ["zero3", "zero2", "ddp"])
def test_a_compiled_wrapped_model_trains_exactly_as_eager(kind):
    from torch._dynamo.utils import counters

    eager = _wrap(kind)
    want_losses, want = _train(eager, eager)
    torch._dynamo.reset()
    counters.clear()
    model = _wrap(kind)
    compiled = torch.compile(model, backend="aot_eager")
    got_losses, got = _train(model, compiled)
    torch.testing.assert_close(got_losses, want_losses, rtol=0, atol=0)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    # the model's 2 Blocks + the root's pieces between them, compiled twice at most (ZeRO's first forward carries
    # the discovery hooks of sharding/inner_calls.py, removed after it): a handful of graphs, not one per layer
    assert 1 <= counters["stats"]["unique_graphs"] <= 8, dict(counters["stats"])
    graphs = counters["stats"]["unique_graphs"]
    _train(model, compiled, steps=2)
    assert counters["stats"]["unique_graphs"] == graphs, "later steps compiled again"


@pytest.mark.parametrize("kind", ["ddp", "zero3", "tp", "local_sgd"])
def test_wrapping_a_compiled_module_is_refused_naming_the_order_that_works(kind):
    from shardwise.async_sgd import LocalSGD

    comm = ThreadWorld(1).communicators()[0]
    compiled = torch.compile(GPT(CONFIG, seed=0), backend="eager")
    wrap = {"ddp": lambda m: sw.DDP(m, comm), "zero3": lambda m: sw.ZeRO(m, comm, stage=3),
            "tp": lambda m: sw.tensor_parallel.parallelize(m, comm, "gpt"),
            "local_sgd": lambda m: LocalSGD(m, comm, sync_every=2)}[kind]
    with pytest.raises(ValueError, match=r"torch.compile\(\)d GPT .*compile what the wrapper returns"):
        wrap(compiled)
    wrap(compiled._orig_mod)  # the plain module inside is fine


def test_shardwise_tools_see_through_a_compiled_wrapped_model():
    """sw.clip_grad_norm_ / sw.full_state_dict / sw.ShardedGradScaler given torch.compile(wrapped) act on the wrapped
    model's layout (found by tests/test_nanogpt_example.py's compiled run: the clip fell back to torch's)."""
    def body(comm):
        model = sw.ZeRO(GPT(CONFIG, seed=0), comm, stage=3, wrap=Block)
        compiled = torch.compile(model, backend="aot_eager")
        compiled(*batch(0, comm.rank, comm.size)).backward()
        norm = sw.clip_grad_norm_(compiled, 1e9)
        return float(norm), sorted(sw.full_state_dict(compiled)) == sorted(GPT(CONFIG, seed=0).state_dict())

    ref = GPT(CONFIG, seed=0)
    ref(*batch(0)).backward()
    want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
    for norm, same_keys in sw.launch(body, 2):
        assert same_keys
        assert abs(norm - want) <= 1e-5 * want


def _tp_losses(comm, compiled):
    import dataclasses

    model = sw.tensor_parallel.parallelize(GPT(dataclasses.replace(CONFIG, dropout=0.1), seed=0).double(), comm,
                                           "gpt")
    forward = torch.compile(model, backend="aot_eager") if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for step in range(2):
        loss = forward(*batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, sw.full_state_dict(model)


def test_a_compiled_tensor_parallel_model_trains_as_the_eager_one():
    """The tensor-parallel layers run eagerly inside a compiled model (a graph break each: dynamo's guards do not
    follow a slice whose shape says the dense tensor; compiling failed with "Guard failed on the same frame it was
    created"), everything between them compiles; dropout draws from the group's stream in both."""
    (want_losses, want), _ = sw.launch(_tp_losses, 2, False)
    (got_losses, got), _ = sw.launch(_tp_losses, 2, True)
    assert got_losses == want_losses
    for name in want:
        assert torch.equal(got[name], want[name]), name
