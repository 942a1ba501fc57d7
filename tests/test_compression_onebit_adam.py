"""OneBitAdam: the warm-up is exactly Adam on the global batch; afterwards the variance is frozen, the momentum is
exchanged 1-bit compressed (bytes = OneBit's formula, no dense all-reduce), replicas stay equal, loss keeps falling;
its state (moments, step, error feedback) resumes exactly; bad options named."""

from __future__ import annotations

import copy

import pytest
import torch
from parity import assert_state_close, batch, frozen_model

import shardwise as sw
from shardwise.compression import OneBit, OneBitAdam

LR = 1e-3


def train(comm, steps, freeze_step, save_at=None):
    model = frozen_model()
    opt = OneBitAdam(model.parameters(), comm, lr=LR, eps=1e-6, freeze_step=freeze_step)
    losses, measured, variances, saved = [], [], [], None
    for step in range(steps):
        x, y = batch(step, comm.rank, comm.size)
        loss = model(x, y)
        loss.backward()
        with comm.stats.measure() as m:
            opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        measured.append(m)
        variances.append(opt.state[next(model.parameters())]["exp_avg_sq"].clone())
        if save_at == step + 1:
            saved = (copy.deepcopy(opt.state_dict()),  # torch's state_dict holds live tensors
                      {k: v.clone() for k, v in model.state_dict().items()})
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, losses, measured, variances, saved, [p.shape for p in model.parameters()]


def test_warm_up_is_exactly_adam_on_the_global_batch():
    model = frozen_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=1e-6)
    for step in range(4):
        x, y = batch(step)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for state, *_ in sw.launch(train, 2, 4, 4):
        assert_state_close(state, want)


def test_after_freeze_the_momentum_goes_one_bit_and_the_variance_stays():
    steps, freeze = 12, 4
    results = sw.launch(train, 2, steps, freeze)
    state0, losses, measured, variances, _, shapes = results[0]
    for state, *_ in results[1:]:
        for k in state0:
            assert torch.equal(state[k], state0[k])  # every replica continues from the same averaged momentum
    for t in range(freeze, steps):
        assert torch.equal(variances[t], variances[freeze - 1])  # frozen
    assert not torch.equal(variances[1], variances[0])  # ... but it moved during warm-up
    numel = sum(torch.Size(s).numel() for s in shapes)
    for t in range(freeze):
        assert set(measured[t].ops) == {"all_reduce"} and measured[t].wire_bytes() == 2 * (2 - 1) * numel * 4 // 2
    for t in range(freeze, steps):
        assert set(measured[t].ops) == {"all_gather"}
        assert measured[t].wire_bytes() == OneBit().wire_bytes(shapes, 2)  # ~1/32 of the warm-up's bytes
    assert losses[-1] < losses[freeze]


def test_resume_continues_exactly():
    def resumed(comm, saved):
        optimizer_state, weights = saved
        model = frozen_model()
        model.load_state_dict(weights)
        opt = OneBitAdam(model.parameters(), comm, lr=LR, eps=1e-6, freeze_step=3)
        opt.load_state_dict(optimizer_state)
        for step in range(5, 8):
            x, y = batch(step, comm.rank, comm.size)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    straight = sw.launch(train, 2, 8, 3, 5)

    def per_rank(comm):  # each rank reloads its own state: the error-feedback residual is per rank
        return resumed(comm, straight[comm.rank][4])

    again = sw.launch(per_rank, 2)
    for (want, *_), got in zip(straight, again):
        for k in want:
            assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("kwargs, match", [
    (dict(freeze_step=0), r"freeze_step=0 must be an int >= 1"),
    (dict(betas=(0.9, 1.0)), r"betas=\(0.9, 1.0\) must be two numbers in \[0, 1\)"),
    (dict(lr=-1), r"lr=-1 must be a number >= 0"),
    (dict(compressor="onebit"), r"compressor='onebit' must be a sw.compression method or None"),
])
def test_bad_options_are_named(kwargs, match):
    comm = sw.comm.ThreadWorld(1).communicators()[0]
    with pytest.raises(ValueError, match=match):
        OneBitAdam(frozen_model().parameters(), comm, **kwargs)
    with pytest.raises(ValueError, match="must be a shardwise Communicator"):
        OneBitAdam(frozen_model().parameters(), None)
