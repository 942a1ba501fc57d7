"""DDP(compression=...): FP16/BF16 train like the uncompressed all-reduce, PowerSGD at full rank equals it, every
method's bytes per step equal its formula summed over the buckets, each rank keeps its own state, bad options named;
and every method on 2 gloo processes."""

from __future__ import annotations

import pytest
import torch
from compression_cases import run_steps
from parity import CONFIG, frozen_model

import shardwise as sw
from shardwise.compression import BF16, FP16, OneBit, PowerSGD, RandomK, TopK

STEPS = 8


def train(comm, compression=None, steps=STEPS):
    """The tiny GPT under DDP on this rank's slice of each global batch: (state, losses, per-step CommStats,
    bucket shapes, compressor state)."""
    model = sw.DDP(frozen_model(), comm, bucket_mb=0.05, first_bucket_mb=0.01, compression=compression)
    losses, measured = run_steps(comm, model, steps)
    shapes = dict(model.named_parameters())
    buckets = [[shapes[name].shape for name in b["params"]] for b in model.ddp_buckets()]
    state = model.compressor.state_dict() if model.compressor is not None else {}
    return ({k: v.detach().clone() for k, v in model.state_dict().items()}, losses, measured, buckets, state)


@pytest.fixture(scope="module")
def uncompressed():
    return sw.launch(train, 2)[0]


@pytest.mark.parametrize("method", [FP16(), BF16()], ids=repr)
def test_fp16_bf16_train_close_to_uncompressed(method, uncompressed):
    state, losses, *_ = sw.launch(train, 2, method)[0]
    want_state, want_losses, *_ = uncompressed
    assert losses[-1] < losses[0] * 0.9  # it trained
    for got, want in zip(losses, want_losses):
        assert abs(got - want) <= 0.005 * want  # within 0.5% at every step
    for name, want in want_state.items():
        assert (state[name] - want).norm() <= 0.01 * want.norm() + 1e-6, name


def test_powersgd_at_full_rank_equals_uncompressed(uncompressed):
    rank = max(CONFIG.d_model, CONFIG.vocab_size) * 4
    state, losses, measured, *_ = sw.launch(train, 2, PowerSGD(rank=rank, start_iter=0, min_compression_rate=0))[0]
    want_state, want_losses, *_ = uncompressed
    assert set(measured[-1].ops) == {"all_reduce"}
    for name, want in want_state.items():
        torch.testing.assert_close(state[name], want, rtol=1e-4, atol=1e-5, msg=name)
    assert losses == pytest.approx(want_losses, rel=1e-5)


def test_low_rank_powersgd_differs_but_trains(uncompressed):
    state, losses, *_ = sw.launch(train, 2, PowerSGD(rank=2, start_iter=2))[0]
    want_state, want_losses, *_ = uncompressed
    assert losses[:3] == pytest.approx(want_losses[:3], rel=1e-5)  # start_iter=2: the first two steps exact
    assert any(not torch.allclose(state[k], want_state[k], rtol=1e-4, atol=1e-5) for k in want_state)
    assert losses[-1] < losses[0]


METHODS = [FP16(), BF16(), TopK(0.05), RandomK(0.05), OneBit(), PowerSGD(rank=2, start_iter=0)]


@pytest.mark.parametrize("method", METHODS, ids=repr)
def test_bytes_per_step_equal_the_formula_over_buckets(method):
    results = sw.launch(train, 2, method, 3)
    for _, losses, measured, buckets, state in results:
        want = sum(method.wire_bytes(shapes, 2) for shapes in buckets)
        # Per step (forward + backward; the loss average comes after the measured block): the buckets only.
        assert [m.wire_bytes() for m in measured] == [want] * 3
        assert losses[-1] < losses[0]
    if not isinstance(method, (FP16, BF16)):
        # Error feedback is per rank: each rank kept a different residual.
        mem0, mem1 = (r[4] for r in results)
        assert mem0.keys() == mem1.keys() and any(k.startswith("memory/") for k in mem0)
        assert any(not torch.equal(mem0[k], mem1[k]) for k in mem0 if k.startswith("memory/"))


def test_bad_compression_is_named():
    def body(comm):
        sw.DDP(frozen_model(), comm, compression="powersgd")

    with pytest.raises(sw.LaunchError, match="compression='powersgd' must be None or a sw.compression method"):
        sw.launch(body, 1)


def _every_method(comm):
    return {repr(m): train(comm, m, 3)[1] for m in [None] + METHODS}


@pytest.mark.multiprocess
def test_every_method_on_gloo_processes():
    """gloo carries each method's dtypes (fp16, bf16, uint8 signs, int32 indices) and the results agree with the
    same run on thread ranks."""
    on_gloo = sw.launch(_every_method, 2, backend="gloo", timeout=60)[0]
    on_threads = sw.launch(_every_method, 2)[0]
    for name, losses in on_threads.items():
        assert on_gloo[name] == pytest.approx(losses, rel=1e-4), name
