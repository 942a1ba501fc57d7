"""A world of one process (`torch.distributed` with one rank): its collectives are computed locally
(comm/group_of_one.py), give what the backend gives, refuse what the backend's path refuses, and a ZeRO-3 model on
it trains exactly as through the backend."""

from __future__ import annotations

import contextlib

import pytest
import torch
from parity import CONFIG, batch

import shardwise as sw
from shardwise.comm import torch_backend
from shardwise.comm.base import ReduceOp
from shardwise.comm.torch_backend import TorchCommunicator
from shardwise.models import GPT
from shardwise.models.gpt import Block


def _both(one_rank_world):
    return TorchCommunicator(None, timeout=10), TorchCommunicator(None, timeout=10, local_if_alone=False)


def test_collectives_of_one_rank_match_the_backend_and_call_no_torch_collective(one_rank_world, monkeypatch):
    local, backend = _both(one_rank_world)
    x = torch.randn(6)
    results = {}
    for name, comm in (("backend", backend), ("local", local)):
        if name == "local":  # from here on, any torch.distributed collective is a failure
            for fn in ("all_reduce", "broadcast", "all_gather_single", "all_gather_into_tensor",
                       "reduce_scatter_single", "reduce_scatter_tensor"):
                if hasattr(torch_backend.dist, fn):
                    monkeypatch.setattr(torch_backend.dist, fn, lambda *a, _fn=fn, **k: pytest.fail(f"{_fn} called"))
            monkeypatch.setattr(torch_backend, "all_gather_flat", lambda *a, **k: pytest.fail("all_gather called"))
            monkeypatch.setattr(torch_backend, "reduce_scatter_flat", lambda *a, **k: pytest.fail("rs called"))
        out = {}
        for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
            t = x.clone()
            comm.all_reduce(t, op)
            out[f"all_reduce {op.name}"] = t
        t = x.clone()
        comm.all_reduce(t, ReduceOp.AVG, async_op=True).wait()
        out["all_reduce async"] = t
        gathered = torch.zeros(6)
        comm.all_gather(gathered, x.view(2, 3))
        out["all_gather"] = gathered
        scattered = torch.zeros(2, 3)
        comm.reduce_scatter(scattered, x, ReduceOp.AVG, async_op=True).wait()
        out["reduce_scatter"] = scattered.reshape(-1)
        t = x.clone()
        comm.broadcast(t, 0)
        out["broadcast"] = t
        comm.barrier()
        results[name] = out
        assert comm.stats.calls("all_reduce") == 4 and comm.stats.calls("reduce_scatter") == 1
    for key, value in results["backend"].items():
        assert torch.equal(results["local"][key], value), key


def test_a_group_of_one_refuses_what_a_larger_group_refuses(one_rank_world):
    local, _ = _both(one_rank_world)
    with pytest.raises(ValueError, match="all_gather"):
        local.all_gather(torch.zeros(5), torch.zeros(6))
    with pytest.raises(ValueError, match="reduce_scatter"):
        local.reduce_scatter(torch.zeros(5), torch.zeros(6))
    with pytest.raises(ValueError, match="broadcast"):
        local.broadcast(torch.zeros(2), src=1)
    with pytest.raises(ValueError, match="AVG"):
        local.all_reduce(torch.zeros(2, dtype=torch.int64), ReduceOp.AVG)


def _train(model: torch.nn.Module, steps: int = 3) -> dict[str, torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
    for i in range(steps):
        x, y = batch(i)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return sw.full_state_dict(model)


def test_zero3_on_a_world_of_one_issues_no_collective_and_matches_plain_pytorch(one_rank_world):
    local, _ = _both(one_rank_world)
    plain = GPT(CONFIG, seed=0)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
    for i in range(3):
        x, y = batch(i)
        plain(x, y).backward()
        opt.step()
        opt.zero_grad()
    zero3 = _train(sw.ZeRO(GPT(CONFIG, seed=0), local, stage=3, wrap=Block))
    # The full buffer is the master (nothing to gather) and the average over one rank is the gradient buffer.
    assert local.stats.calls() == 0, local.stats
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(zero3[name], value, rtol=0, atol=1e-6, msg=name)


def test_zero3_in_bf16_on_a_world_of_one_is_bit_identical_through_the_backend_and_locally(one_rank_world):
    local, backend = _both(one_rank_world)
    mp = sw.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    through_local = _train(sw.ZeRO(GPT(CONFIG, seed=0), local, stage=3, wrap=Block, mixed_precision=mp))
    through_backend = _train(sw.ZeRO(GPT(CONFIG, seed=0), backend, stage=3, wrap=Block, mixed_precision=mp))
    assert local.stats.calls("all_gather") > 0  # bf16 compute copies are gathered (cast) from the fp32 master
    assert local.stats.calls("all_gather") == backend.stats.calls("all_gather")
    for name, value in through_backend.items():
        assert torch.equal(through_local[name], value), name


class _TwoLayersAndAnUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.unused = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x))).pow(2).mean()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_shard_group_of_one_accumulates_under_no_sync_and_keeps_an_unused_grad_none(one_rank_world, stage):
    """Two microbatches (the first under no_sync), a parameter no forward uses: exactly plain PyTorch's step, and
    the unused parameter keeps grad None (AdamW's weight decay skips it) while nothing is communicated."""
    local, _ = _both(one_rank_world)
    plain, wrapped = _TwoLayersAndAnUnused(), sw.ZeRO(_TwoLayersAndAnUnused(), local, stage=stage,
                                                       wrap=torch.nn.Linear)
    xs = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    for model in (plain, wrapped):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
        for _ in range(2):
            with model.no_sync() if model is wrapped else contextlib.nullcontext():
                model(xs[0]).backward()
            model(xs[1]).backward()
            assert all(p.grad is None for n, p in model.named_parameters() if n.startswith("unused"))
            opt.step()
            opt.zero_grad()
    assert local.stats.calls() == 0, local.stats
    got = sw.full_state_dict(wrapped)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)


def test_two_backwards_before_a_step_add_on_a_shard_group_of_one_as_torch_adds(one_rank_world):
    local, _ = _both(one_rank_world)
    plain, wrapped = _TwoLayersAndAnUnused(), sw.ZeRO(_TwoLayersAndAnUnused(), local, stage=3,
                                                       wrap=torch.nn.Linear)
    xs = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(2))
    for model in (plain, wrapped):
        model(xs[0]).backward()
        model(xs[1]).backward()  # no zero_grad between: the second adds to .grad
    grads = {n: p.grad for n, p in wrapped.named_parameters()}
    for name, p in plain.named_parameters():
        if p.grad is None:
            assert grads[name] is None, name
        else:
            torch.testing.assert_close(grads[name].reshape(p.shape), p.grad, rtol=0, atol=1e-7, msg=name)


def test_an_nccl_group_of_one_refuses_a_host_tensor_as_nccl_would_on_more_ranks(one_rank_world):
    """Done locally, a collective would accept a CPU tensor on one GPU, and the same script would fail in NCCL on
    two: refused on one rank as well (the communicator made to look like NCCL's on cuda:0, the stand-in of
    tests/test_streams.py)."""
    local, _ = _both(one_rank_world)
    local.backend, local.device = "nccl", torch.device("cuda", 0)
    for call in (lambda: local.all_reduce(torch.ones(2)), lambda: local.broadcast(torch.ones(2)),
                 lambda: local.all_gather(torch.zeros(2), torch.ones(2)),
                 lambda: local.reduce_scatter(torch.zeros(2), torch.ones(2), async_op=True)):
        with pytest.raises(ValueError, match=r"a tensor is on cpu, but an NCCL communicator's collectives take "
                                             r"tensors on its GPU cuda:0"):
            call()
