"""Every sharding configuration trains to the parameters of one process (thread ranks; gloo in test_sharding_gloo)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from parity import CONFIG, assert_state_close, batch, make_optimizer
from sharding_cases import CONFIGS, reference, train_sharded, wrap
from torch import nn

import shardwise as sw
from shardwise.sharded_tensor import local
from shardwise.models import GPT


@pytest.fixture(scope="module")
def plain_reference():
    return reference()[0]


# hybrid_shard uses shard groups of 2, so it needs 4 ranks to also replicate. A world of one too: `sw.init()` without
# a launcher gives one, and there every piece is its whole tensor.
@pytest.mark.parametrize("name, world", [(n, w) for n in CONFIGS for w in (1, 2, 4)
                                         if not (n == "hybrid_shard" and w < 4)])
def test_parity(name, world, plain_reference):
    for state, _, _ in sw.launch(train_sharded, world, name):
        assert_state_close(state, plain_reference)


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "shard_grad_op"])
def test_gradient_accumulation(name, plain_reference):
    state, per_step, _ = sw.launch(train_sharded, 2, name, 5, 2)[0]
    assert_state_close(state, plain_reference)
    assert all(step["reduce_scatter"]["calls"] == per_step[0]["reduce_scatter"]["calls"] for step in per_step)


def _accumulate_synced(comm, name, steps=5):
    """Two half-batch backwards per step, both reduced (no no_sync): the reduced gradients add up on .grad."""
    model = wrap(GPT(CONFIG, seed=0), comm, name)
    opt = make_optimizer(model.parameters())
    for step in range(steps):
        x, y = batch(step, comm.rank, comm.size)
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            (model(xm, ym) / 2).backward()
        opt.step()
        opt.zero_grad()
    return sw.full_state_dict(model)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "shard_grad_op"])
def test_accumulation_with_every_backward_reduced(name, world, plain_reference):
    """As torch adds a second backward's gradients to `.grad`; a world of one included, where each piece is the
    whole tensor in its own shape."""
    for state in sw.launch(_accumulate_synced, world, name):
        assert_state_close(state, plain_reference)


def _two_forwards_one_backward(comm, name, steps=5):
    """Each step: two half-batch forwards summed into one loss, then one backward (outside no_sync): ZeRO-3 keeps
    the first forward's last unit gathered until the second forward's first unit starts, which must free it."""
    model = wrap(GPT(CONFIG, seed=0), comm, name)
    opt = make_optimizer(model.parameters())
    gathered = []
    for step in range(steps):
        x, y = batch(step, comm.rank, comm.size)
        with comm.stats.measure() as moved:
            halves = [model(xm, ym) for xm, ym in zip(x.chunk(2), y.chunk(2))]
            (sum(halves) / 2).backward()
        opt.step()
        opt.zero_grad()
        gathered.append(moved.as_dict()["all_gather"]["bytes"])
    return sw.full_state_dict(model), gathered, [4 * u["padded"] for u in model.sharding_units()]


@pytest.mark.parametrize("name", ["zero3", "full_shard"])
def test_two_forwards_before_one_backward(name, plain_reference):
    for state, gathered, unit_bytes in sw.launch(_two_forwards_one_backward, 2, name):
        assert_state_close(state, plain_reference)
        psi, root, last = sum(unit_bytes), unit_bytes[-1], unit_bytes[-2]
        # Forwards: every unit twice but the root, which stays gathered. Backward (autograd runs the second forward's
        # graph first, then the first's): every unit once per forward but the root, less the second forward's last
        # unit, still gathered when backward starts with it.
        assert gathered == [(2 * psi - root) + (2 * (psi - root) - last)] * len(gathered)


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_clipping_matches_single_process_norm(name):
    want_state, want_norms = reference(clip=0.05)
    state, _, norms = sw.launch(train_sharded, 4, name, 5, 1, 0.05)[0]
    assert norms == pytest.approx(want_norms, rel=1e-5)
    assert want_norms[0] > 0.05  # clipping really happened
    assert_state_close(state, want_state)


@pytest.mark.parametrize("freeze", [("blocks.0.",), ("blocks.1.attn.", "pos_emb")])
def test_frozen_parameters(freeze):
    want, _ = reference(freeze=freeze)
    state, _, _ = sw.launch(train_sharded, 2, "zero3", 5, 1, None, freeze)[0]
    assert_state_close(state, want)


def test_param_groups_by_name():
    want, _ = reference(param_groups=True)
    state, _, _ = sw.launch(train_sharded, 2, "zero3", 5, 1, None, (), True)[0]
    assert_state_close(state, want)


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_activation_checkpointing(name, plain_reference):
    state, per_step, _ = sw.launch(partial(train_sharded, activation_checkpointing=True), 2, name)[0]
    assert_state_close(state, plain_reference)


@pytest.mark.parametrize("wrap_policy", ["auto", "size:0.01", None])
def test_wrap_policies_train_the_same(wrap_policy, plain_reference):
    state, _, _ = sw.launch(partial(train_sharded, wrap=wrap_policy, group_mb=0.05), 2, "zero3")[0]
    assert_state_close(state, plain_reference)


def test_cpu_offload(plain_reference):
    state, _, _ = sw.launch(partial(train_sharded, cpu_offload=True), 2, "zero3")[0]
    assert_state_close(state, plain_reference)


def test_without_prefetch(plain_reference):
    state, _, _ = sw.launch(partial(train_sharded, prefetch=False), 2, "zero3")[0]
    assert_state_close(state, plain_reference)


class _Odd(nn.Module):
    """58 parameters: not divisible by 3 or 4, so shards are padded."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(7, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).square().mean()


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parameter_count_not_divisible_by_world(world, stage):
    x = torch.randn(12, 7, generator=torch.Generator().manual_seed(3))
    init = _Odd().state_dict()

    def body(comm):
        model = _Odd()
        model.load_state_dict(init)
        model = sw.ZeRO(model, comm, stage=stage, wrap=nn.Linear)
        shards = {n: local(p).numel() for n, p in model.named_parameters()}  # this rank's piece
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(3):
            b = 12 // comm.size
            model(x[comm.rank * b : (comm.rank + 1) * b]).backward()
            opt.step()
            opt.zero_grad()
        return sw.full_state_dict(model), shards

    ref = _Odd()
    ref.load_state_dict(init)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for _ in range(3):
        ref(x).backward()
        opt.step()
        opt.zero_grad()
    results = sw.launch(body, world)
    for state, _ in results:
        assert_state_close(state, ref.state_dict())
    # Every element is owned by exactly one rank.
    for name, p in ref.named_parameters():
        assert sum(shards[name] for _, shards in results) == p.numel()


def _shard_shapes(comm):
    plain = GPT(CONFIG, seed=0)
    names = [n for n, _ in plain.named_parameters()]
    model = wrap(plain, comm, "zero3")
    shards = {n: (p.shape, p.dim(), p.numel(), local(p).numel(), isinstance(p, nn.Parameter))
              for n, p in model.named_parameters()}
    return names, shards, model.tok_emb.weight is model.head.weight


def test_named_parameters_are_pieces_that_answer_for_the_original_tensors():
    """Each rank trains a 1-D piece, but shape, dim() and numel() are the original tensor's (as FSDP2's DTensor
    parameters answer), so grouping by p.dim() and counting parameters give one process's answers."""
    results = sw.launch(_shard_shapes, 4)
    names = results[0][0]
    plain = dict(GPT(CONFIG, seed=0).named_parameters())
    for _, shards, _ in results:
        assert list(shards) == names
        for name, (shape, dim, numel, _, is_param) in shards.items():
            assert (shape, dim, numel, is_param) == (plain[name].shape, plain[name].dim(), plain[name].numel(), True)
    total = sum(piece for _, shards, _ in results for *_, piece, _ in shards.values())
    assert total == sum(p.numel() for p in plain.values())  # every element on exactly one rank


def test_tied_weights_stay_tied():
    assert all(tied for _, _, tied in sw.launch(_shard_shapes, 2))
