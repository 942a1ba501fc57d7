"""DDP: parity with one process, gradient accumulation, bytes per step, overlap, unused and frozen parameters."""

from __future__ import annotations

import pytest
import torch
from parity import CONFIG, accumulated_backward, assert_state_close, batch, frozen_model, make_optimizer, reference_state
from torch import nn

import shardwise as sw
from shardwise.models import GPT
from shardwise.param_hooks import internal_hook

STEPS = 5


def train_ddp(comm, steps=STEPS, accumulate=1, set_to_none=True, freeze=(), bucket_mb=0.05):
    """Train the tiny GPT with DDP on this rank's slice of each global batch; return state and per-step bytes."""
    model = sw.DDP(frozen_model(freeze), comm, bucket_mb=bucket_mb, first_bucket_mb=0.01)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    per_step = []
    for step in range(steps):
        x, y = batch(step, comm.rank, comm.size)
        with comm.stats.measure() as measured:
            accumulated_backward(model, x, y, accumulate)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        per_step.append(measured.as_dict())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, per_step


def _grad_bytes(freeze=()) -> int:
    model = GPT(CONFIG, seed=0)
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith(freeze))


@pytest.fixture(scope="module")
def reference():
    return reference_state(STEPS)


@pytest.mark.parametrize("world", [2, 4])
def test_parity_with_one_process(world, reference):
    results = sw.launch(train_ddp, world)
    for state, _ in results:
        assert_state_close(state, reference)


@pytest.mark.parametrize("world, accumulate", [(2, 2), (4, 2)])
def test_no_sync_gradient_accumulation_matches(world, accumulate, reference):
    results = sw.launch(train_ddp, world, STEPS, accumulate)
    assert_state_close(results[0][0], reference)
    # Communication happened once per step, not once per micro-batch.
    n_buckets = results[0][1][0]["all_reduce"]["calls"]
    assert all(step["all_reduce"]["calls"] == n_buckets for step in results[0][1])


def test_zero_grad_keeping_tensors_matches(reference):
    state, _ = sw.launch(train_ddp, 2, STEPS, 1, False)[0]
    assert_state_close(state, reference)


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_bytes_per_step_equal_the_ring_formula(world):
    _, per_step = sw.launch(train_ddp, world, 2)[0]
    grad_bytes = _grad_bytes()
    for step in per_step:
        assert step["all_reduce"]["bytes"] == grad_bytes
        assert step["all_reduce"]["wire_bytes"] == 2 * (world - 1) * grad_bytes // world
        assert set(step) == {"all_reduce"}  # the GPT has no buffers: nothing else is sent


def test_frozen_parameters_are_skipped():
    frozen = ("blocks.0.",)
    results = sw.launch(train_ddp, 2, 3, 1, True, frozen)
    assert_state_close(results[0][0], reference_state(3, freeze=frozen))
    assert results[0][1][0]["all_reduce"]["bytes"] == _grad_bytes(frozen)


def test_buckets_follow_reverse_registration_order_and_sizes():
    comm = sw.init()
    model = sw.DDP(GPT(CONFIG, seed=0), comm, bucket_mb=0.05, first_bucket_mb=0.01)
    buckets = model.ddp_buckets()
    order = [name for b in buckets for name in b["params"]]
    assert order == [n for n, _ in reversed(list(model.named_parameters()))]
    assert buckets[0]["bytes"] >= 0.01 * 2**20 and len(buckets) > 3
    assert model.ddp_buckets()[-1]["params"][-1] == "tok_emb.weight"


def test_a_bucket_all_reduce_starts_before_backward_ends():
    """Log when each all-reduce is issued and when the last gradients of backward (the embeddings) are ready."""
    events: list[str] = []

    class Recording:
        """Delegates to a real Communicator, logging when each all-reduce is issued."""

        def __init__(self, inner):
            self.inner = inner

        def all_reduce(self, tensor, op=sw.ReduceOp.SUM, *, async_op=False):
            events.append(f"all_reduce issued rank {self.inner.rank}")
            return self.inner.all_reduce(tensor, op, async_op=async_op)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    def body(comm):
        model = GPT(CONFIG, seed=0)
        if comm.rank == 0:  # internal: a user's hook would be held back until the gradients are averaged
            model.pos_emb.weight.register_post_accumulate_grad_hook(
                internal_hook(lambda p: events.append("pos_emb grad ready")))
        model = sw.DDP(model, Recording(comm) if comm.rank == 0 else comm, bucket_mb=0.05, first_bucket_mb=0.01)
        x, y = batch(0, comm.rank, comm.size)
        model(x, y).backward()
        return len(model.ddp_buckets())

    n_buckets = sw.launch(body, 2)[0]
    last_grad = events.index("pos_emb grad ready")
    launched_before = events[:last_grad].count("all_reduce issued rank 0")
    # Every bucket but the last (which holds pos_emb) was launched while backward was still running.
    assert launched_before == n_buckets - 1 >= 2


class _TwoBranch(nn.Module):
    """A model with a branch used only on request, and a parameter never used."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.trunk = nn.Linear(4, 4)
        self.branch = nn.Linear(4, 4)
        self.never = nn.Linear(4, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, x, use_branch):
        h = self.trunk(x)
        if use_branch:
            h = self.branch(h)
        return h.square().mean()


def test_unused_parameter_is_an_error_naming_it():
    def body(comm):
        model = sw.DDP(_TwoBranch(), comm)
        model(torch.ones(2, 4), True).backward()

    with pytest.raises(sw.LaunchError, match=r"got no gradient.*never\.weight.*find_unused_parameters=True"):
        sw.launch(body, 2, timeout=10)


def test_find_unused_parameters_matches_one_process():
    """Rank 0 uses the branch, rank 1 does not; `never` is unused everywhere and keeps grad None."""
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))

    def body(comm):
        model = sw.DDP(_TwoBranch(), comm, find_unused_parameters=True, bucket_mb=1e-4, first_bucket_mb=1e-4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(x[comm.rank * 2 : comm.rank * 2 + 2], comm.rank == 0).backward()
            grads_none = {n: p.grad is None for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
        return {k: v.clone() for k, v in model.state_dict().items()}, grads_none

    ref = _TwoBranch()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        ((ref(x[0:2], True) + ref(x[2:4], False)) / 2).backward()
        opt.step()
        opt.zero_grad()
    for state, grads_none in sw.launch(body, 2):
        assert_state_close(state, ref.state_dict())
        assert grads_none["never.weight"] and grads_none["never.bias"]
        assert not grads_none["branch.weight"]


class _WithBuffer(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("scale", torch.tensor(float(scale)))

    def forward(self, x):
        return self.lin(x) * self.scale


def test_wrap_broadcasts_rank0_parameters_and_forward_broadcasts_buffers():
    def body(comm):
        torch.manual_seed(comm.rank)  # different initial weights on every rank (each thread seeds before building)
        model = _WithBuffer(scale=1.0)
        model = sw.DDP(model, comm)
        model.scale.fill_(10.0 + comm.rank)  # replicas' buffers drift apart
        model(torch.ones(1, 3))
        return {k: v.clone() for k, v in model.state_dict().items()}

    states = sw.launch(body, 3)
    for state in states[1:]:
        for name in states[0]:
            assert torch.equal(state[name], states[0][name]), name
    assert states[0]["scale"].item() == 10.0


def test_bad_options_are_value_errors():
    comm = sw.init()
    with pytest.raises(ValueError, match="bucket_mb=0 must be a positive number"):
        sw.DDP(nn.Linear(2, 2), comm, bucket_mb=0)
    with pytest.raises(ValueError, match="first_bucket_mb=-1"):
        sw.DDP(nn.Linear(2, 2), comm, first_bucket_mb=-1)
    model = sw.DDP(nn.Linear(2, 2), comm)
    with pytest.raises(ValueError, match="already wrapped"):
        sw.DDP(model, comm)


def test_memory_stats_of_ddp_with_adam():
    comm = sw.init()
    model = sw.DDP(GPT(CONFIG, seed=0), comm)
    opt = torch.optim.Adam(model.parameters())
    x, y = batch(0)
    model(x, y).backward()
    opt.step()
    stats = sw.memory_stats(model, opt)
    n = sum(p.numel() for p in model.parameters())
    assert stats.params == 4 * n and stats.grads == 4 * n  # grads live in the buckets
    assert 8 * n <= stats.optimizer <= 8 * n + 64 * len(list(model.parameters()))  # exp_avg, exp_avg_sq (+ step)


# ---- gloo processes ---------------------------------------------------------------------------------------------------
def _gloo_parity(comm):
    plain = train_ddp(comm)
    accumulated = train_ddp(comm, STEPS, 2)
    return plain, accumulated[0]


@pytest.mark.multiprocess
def test_gloo_parity_and_bytes(reference):
    results = sw.launch(_gloo_parity, 2, backend="gloo", timeout=60)
    grad_bytes = _grad_bytes()
    for (state, per_step), accumulated in results:
        assert_state_close(state, reference)
        assert_state_close(accumulated, reference)
        assert all(s["all_reduce"]["wire_bytes"] == grad_bytes for s in per_step)  # 2(N-1)/N = 1 for N = 2
