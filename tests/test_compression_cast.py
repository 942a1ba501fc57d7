"""FP16 / BF16 with error_feedback=True: the first step equals the plain cast, each rank's residual is exactly what
its cast rounded away (sent + residual = the gradients' sum), the sum of the results tracks the sum of the average
gradients far closer than without feedback, the bytes are unchanged, and a state_dict resume continues bit for bit.
Ranks are threads."""

from __future__ import annotations

import pytest
import torch
from test_compression import NUMEL, SHAPES, average, exchange, random_grads

import shardwise as sw
from shardwise.compression import BF16, FP16

METHODS = [FP16, BF16]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.__name__)
def test_first_step_equals_the_plain_cast(method):
    grads_of = random_grads(3)
    plain = exchange(method(), 2, grads_of)
    fed = exchange(method(error_feedback=True), 2, grads_of)
    for rank in range(2):
        assert torch.equal(plain[rank][0][0], fed[rank][0][0])


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.__name__)
def test_residual_is_what_the_cast_rounded_away(method, world):
    """Per rank and step: sent = N x cast((g + e) / N) (the 16-bit value it put on the wire), e' = g + e - sent, so
    sum_t sent_t + e_K = sum_t g_t; and e' is within one rounding of g + e."""
    grads_of, steps = random_grads(7, scale=1e-2), 12
    results = exchange(method(error_feedback=True), world, grads_of, steps=steps)
    for rank, per_step in enumerate(results):
        total_sent = torch.zeros(NUMEL, dtype=torch.float64)
        for t, (_, before, after, _) in enumerate(per_step):
            acc = grads_of(rank, t) + (0 if before is None else before)
            sent = ((acc / world).to(method.dtype)).float() * world
            torch.testing.assert_close(after, acc - sent, rtol=0, atol=1e-12)
            assert (after.abs() <= method.eps / 2 * acc.abs() + method.tiny * world).all()
            total_sent += sent.double()
        true_sum = sum(grads_of(rank, t).double() for t in range(steps))
        torch.testing.assert_close(total_sent + per_step[-1][2].double(), true_sum, rtol=0, atol=1e-6)
        assert per_step[-1][2].abs().max() > 0  # a residual exists: the check above is not vacuous


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.__name__)
def test_sum_of_results_tracks_the_sum_of_gradients(method):
    """One rank (no 16-bit additions on the wire): with feedback the gap between the summed results and the summed
    gradients stays one rounding, without it the roundings add up. Gradients = a fixed mean + noise, as in training."""
    world, steps = 1, 200
    mu = torch.randn(NUMEL, generator=torch.Generator().manual_seed(11)) * 1e-3
    noise = random_grads(12, scale=1e-4)

    def grads_of(rank, step):
        return mu + noise(rank, step)

    want = sum(average(grads_of, world, t).double() for t in range(steps))

    def gap(compressor):
        results = exchange(compressor, world, grads_of, steps=steps)[0]
        return float((sum(r[0].double() for r in results) - want).norm() / want.norm())

    fed, plain = gap(method(error_feedback=True)), gap(method())
    assert fed < plain / 10, (fed, plain)
    assert fed < method.eps  # the gap of the sum is below one rounding of the sum


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.__name__)
def test_bytes_unchanged_and_config(method):
    fed = method(error_feedback=True)
    results = exchange(fed, 2, random_grads(1), steps=2)
    for per_rank in results:
        for *_, measured in per_rank:
            assert measured.wire_bytes() == method().wire_bytes(SHAPES, 2) == fed.wire_bytes(SHAPES, 2) > 0
    assert fed.config() == {"method": method.name, "error_feedback": True}
    assert method().config() == {"method": method.name}  # plain casts keep the config older checkpoints saved
    assert repr(fed) == f"{method.__name__}(error_feedback=True)"


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.__name__)
def test_state_dict_resume_continues_bit_for_bit(method):
    grads_of = random_grads(5, scale=1e-2)
    config = method(error_feedback=True)

    def body(comm, restore):
        straight = config.fresh()
        for t in range(4):
            g = grads_of(comm.rank, t).clone()
            straight.reduce(0, g, comm, SHAPES).wait()
            if t == 1:
                saved = straight.state_dict()
        resumed = config.fresh()
        if restore:
            resumed.load_state_dict(saved)
        for t in (2, 3):
            h = grads_of(comm.rank, t).clone()
            resumed.reduce(0, h, comm, SHAPES).wait()
        return torch.equal(g, h), saved

    for same, saved in sw.launch(body, 2, True):
        assert same and saved["memory/0"].dtype == torch.float32
    assert not all(same for same, _ in sw.launch(body, 2, False))  # the residual matters: the check can fail


def test_a_16_bit_bucket_keeps_its_residual_in_fp32():
    comm = sw.comm.ThreadWorld(1).communicators()[0]
    c = BF16(error_feedback=True).fresh()
    g = (torch.randn(64) * 1e-3).to(torch.float16)
    c.reduce(0, g, comm).wait()
    assert c.memory["0"].dtype == torch.float32 and c.memory["0"].abs().max() > 0


@pytest.mark.parametrize("value", [1, "yes", None])
def test_bad_error_feedback_is_named(value):
    with pytest.raises(ValueError, match=rf"BF16: error_feedback={value!r} must be True or False"):
        BF16(error_feedback=value)
