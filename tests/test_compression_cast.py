"""FP16 / BF16 with error_feedback=True: the first step equals the plain cast, each rank's residual is exactly what
its cast rounded away (sent + residual = the gradients' sum), the sum of the results tracks the sum of the average
gradients far closer than without feedback, the bytes are unchanged, and a state_dict resume continues bit for bit.
Ranks are threads."""

from __future__ import annotations

import pytest
import torch
from test_compression import NUMEL, SHAPES, average, exchange, random_grads, sent

import shardwise as sw
from shardwise.compression import BF16, FP16

METHODS = [FP16, BF16]


def nearest(method, **options):
    """The method rounding to nearest (BF16's default rounds stochastically): what the exact formulas below model."""
    return method(rounding="nearest", **options) if method is BF16 else method(**options)


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
    results = exchange(nearest(method, error_feedback=True), world, grads_of, steps=steps)
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

    fed, plain = gap(nearest(method, error_feedback=True)), gap(nearest(method))
    assert fed < plain / 10, (fed, plain)
    assert fed < method.eps  # the gap of the sum is below one rounding of the sum


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.__name__)
def test_bytes_unchanged_and_config(method):
    fed = method(error_feedback=True)
    results = exchange(fed, 2, random_grads(1), steps=2)
    for per_rank in results:
        for *_, measured in per_rank:
            assert measured.wire_bytes() == method().wire_bytes(SHAPES, 2) == fed.wire_bytes(SHAPES, 2) > 0
    rounding = {"rounding": "stochastic"} if method is BF16 else {}
    assert fed.config() == {"method": method.name, "error_feedback": True, **rounding}
    assert method().config() == {"method": method.name, **rounding}
    assert repr(fed) == f"{method.__name__}(error_feedback=True" + (", rounding='stochastic')" if rounding else ")")


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


# ---- BF16's stochastic rounding ---------------------------------------------------------------------------------
def test_stochastic_residual_is_within_one_bf16_step_and_sent_is_a_bf16_value():
    """With error feedback and stochastic rounding: what a rank sent, (g + e) - e', is N x a bf16 value, and e' is
    under one bf16 step of g + e (not half: stochastic rounding may round either way)."""
    world, steps = 2, 6
    grads_of = random_grads(21, scale=1e-2)
    for rank, per_step in enumerate(exchange(BF16(error_feedback=True), world, grads_of, steps=steps)):
        for t, (_, before, after, _) in enumerate(per_step):
            acc = grads_of(rank, t) + (0 if before is None else before)
            share = (acc - after) / world
            assert torch.equal(share.to(torch.bfloat16).float(), share)
            assert (after.abs() <= BF16.eps * acc.abs() + BF16.tiny * world).all()


def test_stochastic_rounding_is_unbiased_where_nearest_repeats_its_error():
    """One rank sends the same gradient every step: round to nearest returns the same rounded value each time (its
    error never averages out), stochastic rounding's results average to the gradient."""
    world, steps = 1, 400
    g = torch.randn(NUMEL, generator=torch.Generator().manual_seed(3))

    def mean_result(compressor):
        results = exchange(compressor, world, lambda rank, step: g, steps=steps)[0]
        return sum(r[0].double() for r in results) / steps

    nearest_error = (mean_result(BF16(rounding="nearest")) - g).abs().mean()
    stochastic_error = (mean_result(BF16()) - g).abs().mean()
    assert nearest_error > 0
    assert stochastic_error < nearest_error / 5, (float(stochastic_error), float(nearest_error))


def test_stochastic_rounding_repeats_per_seed_and_differs_per_rank():
    grads_of = random_grads(4)
    same_input = lambda rank, step: grads_of(0, step)  # noqa: E731: every rank sends the same gradient

    def shares(compressor):  # what each rank put on the wire, recovered from its residual
        return [sent(b, a, same_input(r, 0)) for r, ((_, b, a, _),) in
                enumerate(exchange(compressor, 2, same_input))]

    first, again, other_seed = shares(BF16(error_feedback=True)), shares(BF16(error_feedback=True)), \
        shares(BF16(error_feedback=True, seed=1))
    assert all(torch.equal(a, b) for a, b in zip(first, again))  # repeatable
    assert not torch.equal(first[0], first[1])  # ranks draw independently
    assert not torch.equal(first[0], other_seed[0])


def test_stochastic_rounding_keeps_non_finite_values():
    from shardwise.compression.rounding import stochastic_round_bf16

    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1.0, -3.0, 1e-40])
    out = stochastic_round_bf16(x, torch.Generator().manual_seed(0)).float()
    assert out[0] == float("inf") and out[1] == -float("inf") and out[2].isnan()
    assert torch.equal(out[3:7], x[3:7])  # bf16 values are left as they are
    # a NaN whose payload fills the low bits (the top of the int32 range) must not wrap into a number
    nan = torch.tensor([0x7FFFFFFF, -1], dtype=torch.int32).view(torch.float32)
    assert stochastic_round_bf16(nan, torch.Generator().manual_seed(0)).isnan().all()


@pytest.mark.parametrize("options, message", [({"rounding": "up"}, r"rounding='up'; allowed \['stochastic', "
                                                "'nearest'\\]"), ({"seed": 1.5}, "seed=1.5 must be an int")])
def test_bad_bf16_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        BF16(**options)
