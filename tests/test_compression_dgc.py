"""TopK with Deep Gradient Compression's momentum correction and local gradient clipping (Lin et al. 2018,
arXiv 1712.01887): the compressor against a dense re-statement of the paper's Algorithm (u = m u + g, v = v + u,
send top-k of v, mask u and v), clipping to C / sqrt(N), state round trips, bad options named, and DDP training
with a momentum-free SGD. Ranks are threads."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from parity import batch, frozen_model
from torch.profiler import profile

import shardwise as sw
from shardwise.compression import TopK
from shardwise.models import GPT, GPTConfig

NUMEL, STEPS = 300, 6


def grads_of(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(NUMEL, generator=g) * (1 + step)


def run(method: TopK, world: int, steps: int = STEPS) -> list[list[tuple[torch.Tensor, dict]]]:
    def body(comm):
        c = method.fresh()
        out = []
        for t in range(steps):
            g = grads_of(comm.rank, t).clone()
            c.reduce(0, g, comm).wait()
            out.append((g, c.state_dict()))
        return out

    return sw.launch(body, world)


def reference(ratio: float, m: float, clip: float | None, world: int, steps: int = STEPS,
              start_iter: int = 0) -> list[torch.Tensor]:
    """DGC's algorithm on dense tensors, every rank in one loop: the averaged sparse update of each step (the first
    `start_iter`: the averaged velocity, all of it sent, nothing masked: momentum SGD)."""
    u = [torch.zeros(NUMEL) for _ in range(world)]
    v = [torch.zeros(NUMEL) for _ in range(world)]
    k = math.ceil(ratio * NUMEL)
    out = []
    for t in range(steps):
        total = torch.zeros(NUMEL)
        for r in range(world):
            g = grads_of(r, t)
            if clip is not None and g.norm() > clip / math.sqrt(world):
                g = g * (clip / math.sqrt(world) / g.norm())
            u[r] = m * u[r] + g
            if t < start_iter:
                total += u[r]
                continue
            v[r] = v[r] + u[r]
            mask = torch.zeros(NUMEL, dtype=torch.bool)
            mask[v[r].abs().topk(k).indices] = True
            total += torch.where(mask, v[r], 0.0)
            v[r] = torch.where(mask, 0.0, v[r])
            u[r] = torch.where(mask, 0.0, u[r])
        out.append(total / world)
    return out


@pytest.mark.parametrize("clip", [None, 20.0])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_momentum_correction_follows_the_dgc_algorithm(world, clip):
    results = run(TopK(0.1, momentum_correction=0.9, clip_norm=clip), world)
    want = reference(0.1, 0.9, clip, world)
    for per_rank in results:
        for (got, _), expected in zip(per_rank, want):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The masking really happened: the velocity is zero exactly where the memory was just emptied (sent).
    _, state = results[0][-1]
    sent = state["memory/0"] == 0
    assert int(sent.sum()) >= math.ceil(0.1 * NUMEL) and bool((state["velocity/0"][sent] == 0).all())
    assert bool((state["velocity/0"][~sent] != 0).all())


def test_a_warm_up_keeps_the_velocity_running_and_masks_nothing():
    """TopK(start_iter=2) with momentum correction: the warm-up is momentum SGD on the averaged gradient (a
    momentum-free optimizer would otherwise run those steps without momentum), then DGC from an empty memory."""
    results = run(TopK(0.1, momentum_correction=0.9, clip_norm=20.0, start_iter=2), 2)
    want = reference(0.1, 0.9, 20.0, 2, start_iter=2)
    for (got, state), expected in zip(results[0], want):
        torch.testing.assert_close(got, expected)
    assert "memory/0" not in results[0][1][1] and "memory/0" in results[0][2][1]


def test_without_momentum_correction_the_momentum_is_not_carried():
    """The control: plain TopK differs from the DGC reference (its memory sums gradients, not velocities)."""
    got = run(TopK(0.1), 2)[0][-1][0]
    assert not torch.allclose(got, reference(0.1, 0.9, None, 2)[-1], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(run(TopK(0.1, momentum_correction=0.0), 2)[0][-1][0],
                               reference(0.1, 0.0, None, 2)[-1], rtol=1e-5, atol=1e-5)


def test_local_clipping_scales_each_rank_to_clip_over_sqrt_n():
    """ratio 1 sends everything, so the result is the average of the clipped gradients, each of norm C / sqrt(N)."""
    world, clip = 2, 3.0
    (got, _), = run(TopK(1.0, clip_norm=clip), world, steps=1)[0]
    want = sum(grads_of(r, 0) * (clip / math.sqrt(world) / grads_of(r, 0).norm()) for r in range(world)) / world
    torch.testing.assert_close(got, want)
    (small, _), = run(TopK(1.0, clip_norm=1e6), world, steps=1)[0]  # under the threshold: untouched
    torch.testing.assert_close(small, (grads_of(0, 0) + grads_of(1, 0)) / 2)


def test_velocity_is_saved_and_a_resumed_run_continues_exactly():
    method = TopK(0.1, momentum_correction=0.9, clip_norm=20.0)

    def body(comm):
        straight = method.fresh()
        for t in range(4):
            g = grads_of(comm.rank, t).clone()
            straight.reduce(0, g, comm).wait()
            if t == 1:
                saved = straight.state_dict()
        resumed = method.fresh()
        resumed.load_state_dict(saved)
        for t in (2, 3):
            h = grads_of(comm.rank, t).clone()
            resumed.reduce(0, h, comm).wait()
        return g, h, sorted(saved)

    for g, h, names in sw.launch(body, 2):
        assert torch.equal(g, h)
        assert names == ["iterations/0", "memory/0", "velocity/0"]


@pytest.mark.parametrize("build, match", [
    (lambda: TopK(0.1, momentum_correction=1.0), r"momentum_correction=1.0 must be None or a momentum in \[0, 1\)"),
    (lambda: TopK(0.1, momentum_correction="0.9"), r"momentum_correction='0.9'"),
    (lambda: TopK(0.1, clip_norm=0), r"clip_norm=0 must be None or a finite number > 0"),
    (lambda: TopK(0.1, clip_norm=float("inf")), r"clip_norm=inf"),
])
def test_bad_dgc_options_are_named(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_ddp_trains_with_dgc_and_a_momentum_free_sgd():
    """The intended use: the momentum lives in the compressor, the optimizer has none. Against the same TopK without
    momentum correction (and the same momentum-free SGD), the compressor's momentum must show: a lower loss over the
    last 6 of 18 steps of the tiny GPT. (Momentum SGD on uncompressed gradients is faster still this early: DGC's
    masking restarts the velocity of every sent coordinate; the paper's warm-up addresses that.)"""

    def train(comm, compression):
        model = sw.DDP(frozen_model(), comm, compression=compression)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0)
        losses = []
        for step in range(18):
            x, y = batch(step, comm.rank, comm.size)
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            avg = loss.detach().clone()
            comm.all_reduce(avg, sw.ReduceOp.AVG)
            losses.append(float(avg))
        return sum(losses[-6:]) / 6, losses[0], model.compressor.config()

    dgc, first, config = sw.launch(train, 2, TopK(0.05, momentum_correction=0.9, clip_norm=10.0))[0]
    plain, _, _ = sw.launch(train, 2, TopK(0.05))[0]
    assert config == {"method": "topk", "ratio": 0.05, "momentum_correction": 0.9, "clip_norm": 10.0}
    assert dgc < first * 0.8
    assert dgc < plain * 0.99


def test_local_clipping_reads_nothing_on_the_host():
    """DGC's local clipping scales by min(limit / norm, 1) as a tensor: over several buckets, one backward of DDP with
    TopK(clip_norm) reads one value on the host per step (the state transaction's finite check, which CUDA defers by
    a step), not one per bucket (`aten::_local_scalar_dense` is what .item(), float() and bool() run)."""
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)

    def body(comm):
        model = sw.DDP(GPT(cfg, seed=0), comm, bucket_mb=0.01, first_bucket_mb=0.01,
                       compression=TopK(0.1, momentum_correction=0.9, clip_norm=0.01))
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(comm.rank))
        for _ in range(2):
            model(x, x).backward()
        if comm.rank != 0:
            model(x, x).backward()
            return None
        with profile() as prof:
            model(x, x).backward()
        ops = collections.Counter({e.key: e.count for e in prof.key_averages()})
        return len(model.ddp_buckets()), ops["aten::_local_scalar_dense"]

    buckets, reads = sw.launch(body, 2)[0]
    assert buckets > 2 and reads == 1, (buckets, reads)
