"""Compression in the sharding engine: ZeRO-1/2 (a compressed all-reduce of each unit, then this rank's shard; a 16-bit
cast as a 16-bit reduce-scatter, also in ZeRO-3 / full_shard / shard_grad_op), FSDP no_shard and the replicate axis
of hybrid_shard. Full-rank PowerSGD equals the uncompressed strategy; FP16 on the
replicate axis trains within 0.5%; fewer bytes; every unsupported (method x strategy) cell is refused by name."""

from __future__ import annotations

import pytest
import torch
from compression_cases import run_steps
from parity import batch, frozen_model
from sharding_cases import wrap

import shardwise as sw
from shardwise.compression import BF16, FP16, OneBit, PowerSGD, RandomK, TopK

STEPS = 6
FULL_RANK = PowerSGD(rank=1024, start_iter=0, min_compression_rate=0)


def train(comm, name, compression=None, steps=STEPS, **options):
    """(full state, losses, per-step world CommStats of forward + backward, compressor state) under `name`."""
    model = wrap(frozen_model(), comm, name, compression=compression, **options)
    losses, measured = run_steps(comm, model, steps)
    state = model.compressor.state_dict() if model.compressor is not None else {}
    return sw.full_state_dict(model), losses, measured, state


@pytest.mark.parametrize("name", ["zero1", "zero2", "no_shard", "hybrid_shard1"])
def test_full_rank_powersgd_equals_the_uncompressed_strategy(name):
    # 3 steps: the error-feedback memory and the warm-started Q are carried into two later steps
    want, want_losses, *_ = sw.launch(train, 2, name, None, 3)[0]
    for got, losses, _, state in sw.launch(train, 2, name, FULL_RANK, 3):
        assert any(k.startswith("memory/") for k in state)  # it did compress
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=key)
        assert losses == pytest.approx(want_losses, rel=1e-5)


@pytest.mark.parametrize("method", [FP16(), OneBit(), TopK(0.1)], ids=repr)
def test_the_replicate_axis_of_hybrid_shard_is_compressed(method):
    """4 ranks, shard groups of 2: the reduce-scatter inside a group stays exact, the all-reduce of each shard
    across the 2 groups is compressed."""
    _, want_losses, *_ = sw.launch(train, 4, "hybrid_shard")[0]
    results = sw.launch(train, 4, "hybrid_shard", method)
    _, losses, _, state = results[0]
    assert losses[-1] < losses[0] * 0.95
    if isinstance(method, FP16):
        for got, want in zip(losses, want_losses):
            assert abs(got - want) <= 0.005 * want
    else:
        assert losses != pytest.approx(want_losses, rel=1e-6)  # lossy: not the exact average
        assert state and not torch.equal(*(r[3][next(iter(state))] for r in results[:2]))  # per-rank residuals


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_zero_with_powersgd_all_reduces_fewer_bytes_than_its_reduce_scatter(name):
    _, _, plain, _ = sw.launch(train, 2, name, None, 2)[0]
    _, losses, compressed, _ = sw.launch(train, 2, name, PowerSGD(rank=2, start_iter=0), 2)[0]
    assert "reduce_scatter" in plain[-1].ops
    assert "reduce_scatter" not in compressed[-1].ops  # replaced by the compressed all-reduce
    assert compressed[-1].wire_bytes("all_reduce") * 3 < plain[-1].wire_bytes("reduce_scatter")


@pytest.mark.parametrize("name, method, match", [
    ("zero3", TopK(0.1), r"zero3: compression=TopK\(ratio=0.1\) is not supported with sharded parameters.*allowed "
                         r"here: FP16\(\) and BF16\(\) without error_feedback.*every method is allowed with DDP, "
                         r"ZeRO stage 1/2, FSDP no_shard, and the replicate axis of hybrid_shard"),
    ("full_shard", PowerSGD(rank=2), r"full_shard: compression=PowerSGD\(.*\) is not supported"),
    ("shard_grad_op", OneBit(), r"shard_grad_op: compression=OneBit\(\) is not supported"),
    ("zero3", BF16(error_feedback=True), r"zero3: compression=BF16\(error_feedback=True.*\) is not supported.*"
                                         r"without error_feedback"),
    ("hybrid_shard", PowerSGD(rank=2), r"hybrid_shard: compression=PowerSGD needs whole matrices.*shard_size=2"),
    ("no_shard", "topk", r"compression='topk' must be None or a sw.compression method"),
    ("hybrid_shard4", OneBit(), r"shard_size=4 leaves one group \(no replicate axis\)"),
])
def test_unsupported_cells_are_refused_naming_what_is_allowed(name, method, match):
    def body(comm):
        wrap(frozen_model(), comm, name, compression=method)

    with pytest.raises(sw.LaunchError, match=match):
        sw.launch(body, 4 if name.startswith("hybrid_shard") else 2)


@pytest.mark.parametrize("method", [BF16(), FP16()], ids=repr)
def test_a_16_bit_method_with_a_reduce_dtype_is_refused(method):
    def body(comm):
        wrap(frozen_model(), comm, "no_shard", compression=method,
             mixed_precision=sw.MixedPrecision(reduce_dtype=torch.bfloat16))

    with pytest.raises(sw.LaunchError, match=r"compression=\w+\(\) and MixedPrecision\(reduce_dtype=torch.bfloat16\) "
                                             r"cannot both be set"):
        sw.launch(body, 2)


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "shard_grad_op"])
@pytest.mark.parametrize("method", [FP16(), BF16()], ids=repr)
def test_a_16_bit_cast_keeps_the_reduce_scatter_at_half_its_bytes(name, method):
    """ZeRO and FSDP with FP16() / BF16(): each rank casts its share (BF16: stochastic rounding) and one 16-bit
    reduce-scatter sums them: half the fp32 reduce-scatter's bytes, no all-reduce, training within 0.5%."""
    _, want_losses, plain, _ = sw.launch(train, 2, name)[0]
    _, losses, measured, state = sw.launch(train, 2, name, method)[0]
    for step_plain, step in zip(plain, measured):
        assert step.wire_bytes("reduce_scatter") * 2 == step_plain.wire_bytes("reduce_scatter") > 0
        assert step.wire_bytes("all_reduce") == step_plain.wire_bytes("all_reduce")  # none added
    for got, want in zip(losses, want_losses):
        assert abs(got - want) <= 0.005 * want
    assert losses != want_losses  # a real 16-bit reduction, not the fp32 one
    assert state and all(int(v) == STEPS for k, v in state.items() if k.startswith("iterations/"))


def test_randomk_on_no_shard_trains():
    _, losses, *_ = sw.launch(train, 2, "no_shard", RandomK(0.25))[0]
    assert losses[-1] < losses[0]


# ---- the dp axis of sw.parallelize ----------------------------------------------------------------------------
def train_3d(comm, dp_strategy, compression, steps=4):
    from shardwise.models import GPT

    mesh = sw.Mesh(comm, dp=2, tp=1, pp=2)
    model = sw.parallelize(GPT(frozen_model().config, seed=0), mesh, dp_strategy=dp_strategy, n_microbatches=2,
                           compression=compression)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = batch(step, mesh.coords.dp, 2)
        losses.append(float(model.step(x, y)))
        opt.step()
        opt.zero_grad()
    return sw.full_state_dict(model), losses


@pytest.mark.parametrize("dp_strategy", ["ddp", "zero2"])
def test_parallelize_compresses_the_dp_axis(dp_strategy):
    """dp=2 x pp=2: full-rank PowerSGD on the dp axis equals the uncompressed run; OneBit trains but differs."""
    want, want_losses = sw.launch(train_3d, 4, dp_strategy, None)[0]
    got, losses = sw.launch(train_3d, 4, dp_strategy, FULL_RANK)[0]
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=key)
    _, onebit_losses = sw.launch(train_3d, 4, dp_strategy, OneBit())[0]
    assert onebit_losses != pytest.approx(want_losses, rel=1e-6) and onebit_losses[-1] < onebit_losses[0]


def test_parallelize_reduce_scatters_a_16_bit_cast_on_a_zero3_dp_axis():
    """dp=2 x pp=2 with ZeRO-3 on the dp axis: BF16() is accepted (a 16-bit reduce-scatter) and trains within 0.5%
    of the fp32 run, but not identically."""
    _, want_losses = sw.launch(train_3d, 4, "zero3", None)[0]
    _, losses = sw.launch(train_3d, 4, "zero3", BF16())[0]
    assert losses != want_losses
    for got, want in zip(losses, want_losses):
        assert abs(got - want) <= 0.005 * want


@pytest.mark.parametrize("method", [TopK(0.05), OneBit()], ids=lambda m: m.name)
def test_parallelize_keeps_every_copy_of_a_parameter_equal(method):
    """dp=2 x tp=2 x pp=2: a weight tied across pipeline ranks (the GPT's embedding and head) and the parameters
    replicated over tp ranks (LayerNorms, row-parallel biases, position embeddings) enter the compressed reduction
    equal but leave it different (each rank's compressor has its own buckets and residuals); the hybrid averages
    them again, so after training every copy is bit-identical to the others."""
    from shardwise import layout
    from shardwise.models import GPT

    def body(comm):
        mesh = sw.Mesh(comm, dp=2, tp=2, pp=2)
        model = sw.parallelize(GPT(frozen_model().config, seed=0), mesh, tp_plan="gpt", n_microbatches=2,
                               compression=method)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(3):
            model.step(*batch(step, mesh.coords.dp, 2))
            opt.step()
            opt.zero_grad()
        checked, drifted = 0, []
        for name, pl in layout.placements(model).items():
            groups = [g for g in pl.replicated_over if g is mesh.tp] + ([pl.tied_over] if pl.tied_over else [])
            for group in groups:
                mean = pl.param.detach().clone()
                group.all_reduce(mean, sw.ReduceOp.AVG)
                checked += 1
                if not torch.equal(mean, pl.param.detach()):
                    drifted.append(name)
        return checked, drifted

    for checked, drifted in sw.launch(body, 8):
        assert checked > 0 and drifted == []


def test_parallelize_refuses_an_unsupported_dp_cell():
    def body(comm):
        sw.parallelize(frozen_model(), sw.Mesh(comm, dp=2, tp=1, pp=1), dp_strategy="zero3", compression=TopK(0.1))

    with pytest.raises(sw.LaunchError, match=r"zero3: compression=TopK\(ratio=0.1\) is not supported with sharded "
                                             r"parameters"):
        sw.launch(body, 2)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_compression_of_a_hand_built_tensor_parallel_model_is_refused(strategy):
    """Tensor parallel by hand, then a compressed data-parallel wrapper: the tp-replicated parameters (norms,
    biases) would drift apart across tp ranks with no error, so the wrap is refused and names sw.parallelize, which
    averages the copies. Without compression the same wrap is allowed."""
    from shardwise import tensor_parallel as tp
    from shardwise.models import GPT

    def body(comm):
        mesh = sw.Mesh(comm, dp=2, tp=2, pp=1)
        model = tp.parallelize(GPT(frozen_model().config, seed=0), mesh.tp, plan="gpt")
        wrapper = sw.DDP if strategy == "ddp" else (lambda m, c, **kw: sw.ZeRO(m, c, stage=2, **kw))
        with pytest.raises(ValueError, match=r"has copies on other ranks.*sw\.parallelize"):
            wrapper(model, mesh.dp, compression=TopK(0.1))
        wrapper(model, mesh.dp)  # the same wrap without compression is fine
        return True

    assert all(sw.launch(body, 4))
