"""`sw.parallelize`: data x tensor x pipeline parallelism in one call matches one process on the same global batch.

The tiny GPT (2 blocks, so 4 pipeline layers: enough for 2 ranks x 2 virtual stages) trains 5 AdamW steps with
clipping at a max-norm that binds, on 8 thread ranks as dp2 x tp2 x pp2 (1F1B and interleaved 1F1B, with DDP,
ZeRO-1, ZeRO-3, ZeRO-2 with sequence parallel) and as pp2 x dp4 with FSDP hybrid_shard; then inference, the grad
scaler, describe(), wrap-time errors. Every dp rank feeds its slice of the global batch; the reference is one
process. AdamW eps=1e-5 as in the tensor-parallel tests (tests/test_tensor_parallel_gpt.py explains why).
"""

from __future__ import annotations

import pytest
import torch
from parity import CONFIG, RTOL, batch

import shardwise as sw
from shardwise.sharded_tensor import local
from shardwise.models import GPT

STEPS, MAX_NORM, EPS, ATOL_TP = 5, 0.3, 1e-5, 1e-5


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=EPS)


def dense(steps=STEPS):
    model = GPT(CONFIG, seed=0)
    opt = optimizer(model.parameters())
    losses, norms = [], []
    for step in range(steps):
        x, y = batch(step)
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms


def train(comm, sizes, options, steps=STEPS, sync_after_schedule=True):
    dp, tp_size, pp_size = sizes
    mesh = sw.Mesh(comm, dp=dp, tp=tp_size, pp=pp_size)
    model = sw.parallelize(GPT(CONFIG, seed=0), mesh, tp_plan="gpt" if tp_size > 1 else None, **options)
    if not sync_after_schedule:  # the reduction must happen inside the last microbatch's backward
        for stage in model.pipe.stages.values():
            stage.sync_gradients = _refuse_sync
    opt = optimizer(model.parameters())
    losses, norms = [], []
    for step in range(steps):
        x, y = batch(step, mesh.coords.dp, dp)
        losses.append(float(model.step(x, y)))
        norms.append(float(sw.clip_grad_norm_(model, MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return sw.full_state_dict(model), losses, norms


@pytest.fixture(scope="module")
def reference():
    return dense()


CASES = {
    "1f1b-ddp": ((2, 2, 2), dict(dp_strategy="ddp")),
    "1f1b-zero1": ((2, 2, 2), dict(dp_strategy="zero1")),
    "1f1b-zero3": ((2, 2, 2), dict(dp_strategy="zero3")),
    "interleaved-ddp": ((2, 2, 2), dict(dp_strategy="ddp", pp_schedule="interleaved_1f1b", virtual_stages=2)),
    "interleaved-zero1": ((2, 2, 2), dict(dp_strategy="zero1", pp_schedule="interleaved_1f1b", virtual_stages=2)),
    "interleaved-zero3": ((2, 2, 2), dict(dp_strategy="zero3", pp_schedule="interleaved_1f1b", virtual_stages=2)),
    "1f1b-zero2-sp-ac": ((2, 2, 2), dict(dp_strategy="zero2", sequence_parallel=True, activation_checkpointing=True)),
    "pp2-dp4-hybrid_shard": ((4, 1, 2), dict(dp_strategy="fsdp:hybrid_shard", dp_shard=2, n_microbatches=2)),
    "pp2-dp2-hybrid_shard1": ((2, 1, 2), dict(dp_strategy="fsdp:hybrid_shard", dp_shard=1)),
    "gpipe-ddp-ac": ((2, 2, 2), dict(dp_strategy="ddp", pp_schedule="gpipe", activation_checkpointing=True)),
    "1f1b-zero3-offload": ((2, 2, 2), dict(dp_strategy="zero3", cpu_offload="optimizer")),
    # the weight pass's torch.autograd.grad on tensor-parallel slices (refused as user code; its post-accumulate-grad
    # hooks, which it runs itself) and sequence parallel's gradient hooks in both passes
    "zb_h1-ddp-sp-ac": ((2, 2, 2), dict(dp_strategy="ddp", pp_schedule="zb_h1", sequence_parallel=True,
                                         activation_checkpointing=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_clipped_training_matches_one_process(case, reference):
    sizes, options = CASES[case]
    want, want_losses, want_norms = reference
    assert min(want_norms) > MAX_NORM  # clipping binds at every step
    dp = sizes[0]
    results = sw.launch(train, sizes[0] * sizes[1] * sizes[2], sizes, options)
    for rank, (state, losses, norms) in enumerate(results):
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(want_norms), rtol=RTOL, atol=0)
        assert state.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=RTOL, atol=ATOL_TP, msg=lambda m: f"{name}: {m}")
    # The loss returned is this dp group's mean; averaged over dp groups it is the global batch's loss.
    by_dp = {}
    for rank, (_, losses, _) in enumerate(results):
        by_dp.setdefault((rank // sizes[1]) % dp, losses)
    mean = torch.tensor(list(by_dp.values())).mean(0)
    torch.testing.assert_close(mean, torch.tensor(want_losses), rtol=RTOL, atol=1e-5)


def _refuse_sync():
    raise AssertionError("sync_gradients() called: the reduction did not overlap the last microbatch's backward")


# pp = 1 (dp, dp x tp): the last microbatch runs outside no_sync(), so its backward launches the data-parallel
# reduction (bucket by bucket, unit by unit) instead of sync_gradients() after the schedule.
PP1_CASES = {
    "dp2-tp2-ddp": ((2, 2, 1), dict(dp_strategy="ddp")),
    "dp2-tp2-zero3-gpipe": ((2, 2, 1), dict(dp_strategy="zero3", pp_schedule="gpipe")),
    "dp2-zero2-m4": ((2, 1, 1), dict(dp_strategy="zero2", n_microbatches=4)),
    "dp4-zero1-ac": ((4, 1, 1), dict(dp_strategy="zero1", activation_checkpointing=True)),
    "dp4-hybrid_shard": ((4, 1, 1), dict(dp_strategy="fsdp:hybrid_shard", dp_shard=2)),
}


@pytest.mark.parametrize("case", list(PP1_CASES))
def test_without_pipeline_the_reduction_overlaps_the_last_backward(case, reference):
    sizes, options = PP1_CASES[case]
    want, _, want_norms = reference
    results = sw.launch(train, sizes[0] * sizes[1], sizes, {"n_microbatches": 2, **options}, STEPS, False)
    for state, _, norms in results:
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(want_norms), rtol=RTOL, atol=0)
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=RTOL, atol=ATOL_TP, msg=lambda m: f"{name}: {m}")


def test_predict_and_eval_equal_one_process():
    model = GPT(CONFIG, seed=0).eval()
    x, _ = batch(0)
    with torch.no_grad():
        want = model(x)

    def body(comm, to):
        mesh = sw.Mesh(comm, dp=2, tp=2, pp=2)
        hybrid = sw.parallelize(GPT(CONFIG, seed=0), mesh, tp_plan="gpt", sequence_parallel=True,
                                dp_strategy="zero3").eval()
        out = hybrid.predict(x, to=to)
        return out, sw.memory_stats(hybrid).gathered

    for to in ("all", 1):
        for rank, (out, gathered) in enumerate(sw.launch(body, 8, to)):
            assert gathered == 0
            if to == "all" or (rank // 4) == to:
                assert out is not None and not out.requires_grad
                torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
            else:
                assert out is None


def test_grad_scaler_skips_on_every_rank_of_the_mesh():
    def body(comm):
        mesh = sw.Mesh(comm, dp=2, tp=2, pp=2)
        hybrid = sw.parallelize(GPT(CONFIG, seed=0), mesh, tp_plan="gpt", dp_strategy="zero2")
        opt = optimizer(hybrid.parameters())
        scaler = sw.ShardedGradScaler(hybrid, init_scale=8.0)
        x, y = batch(0, mesh.coords.dp, 2)
        hybrid.step(x, y)
        if comm.rank == 5:
            next(local(p.grad) for p in hybrid.parameters() if p.grad is not None and local(p.grad).numel()).view(
                -1)[0] = float("nan")
        before = [p.detach().clone() for p in hybrid.parameters()]
        took = scaler.step(opt)
        scaler.update()
        return took, scaler.get_scale(), all(torch.equal(local(a), local(p)) for a, p in zip(before,
                                                                                               hybrid.parameters()))

    assert sw.launch(body, 8) == [(False, 4.0, True)] * 8


def test_describe_shows_layers_and_the_512_rank_dry_run():
    def body(comm):
        mesh = sw.Mesh(comm, dp=1, tp=2, pp=2)
        return sw.parallelize(GPT(CONFIG, seed=0), mesh, tp_plan="gpt").describe()

    text = sw.launch(body, 4)[0]
    assert "stage 0 (pp rank 0): tok_emb" in text and "stage 1 (pp rank 1): blocks.1, ln_f, head" in text
    big = sw.Mesh.dry_run(512, dp=None, tp=8, pp=8)
    described = big.describe()
    assert big.sizes == {"dp": 8, "cp": 1, "ep": 1, "edp": 8, "tp": 8, "pp": 8} and "over 512 ranks" in described
    assert "dp 7: [504 505 506 507 508 509 510 511]" in described


@pytest.mark.parametrize("options, message", [
    (dict(dp_strategy="zero2", pp_schedule="zb_h1"), "pp_schedule='zb_h1'"),
    (dict(dp_strategy="fsdp:hybrid_shard"), "needs dp_shard"),
    (dict(dp_strategy="zero4"), "dp_strategy='zero4' is not supported"),
    (dict(tp_plan=None), "tp=2 but tp_plan is None"),
    (dict(dp_shard=2), "dp_shard=2 only applies"),
    (dict(cpu_offload="full"), "cpu_offload='full' needs a sharded dp_strategy"),
    (dict(dp_strategy="zero3", cpu_offload="gpu"), "cpu_offload='gpu' is not an offload level"),
])
def test_unsupported_combinations_are_refused_at_wrap_time(options, message):
    def body(comm):
        mesh = sw.Mesh(comm, dp=1, tp=2, pp=2)
        options.setdefault("tp_plan", "gpt")
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            sw.parallelize(GPT(CONFIG, seed=0), mesh, **options)

    sw.launch(body, 4)


def _mixed(comm, dtype, init_scale, steps, skip_first=0):
    import dataclasses

    mesh = sw.Mesh(comm, dp=2, tp=2, pp=2)
    untied = dataclasses.replace(CONFIG, tie_weights=False)
    mp = sw.MixedPrecision(param_dtype=dtype) if dtype is not None else None
    model = sw.parallelize(GPT(untied, seed=0), mesh, tp_plan="gpt", dp_strategy="zero2", mixed_precision=mp)
    opt = optimizer(model.parameters())
    scaler = sw.ShardedGradScaler(model, init_scale=init_scale)
    out = []
    for step in range(steps):
        x, y = batch(step, mesh.coords.dp, 2)
        loss = model.step(x, y, loss_scale=scaler.get_scale())
        took = scaler.step(opt) if step >= skip_first else False
        if step >= skip_first:
            scaler.update()
        opt.zero_grad()
        out.append((loss.item(), took))
    return out


def test_bf16_and_fp16_with_the_scaler_on_the_whole_mesh():
    """bf16 compute stays within 2% of fp32 at every step; fp16 starting at an overflowing scale skips the same
    steps on all 8 ranks (a skip on any rank skips on all), then trains within 2% of the fp32 losses shifted by the
    skipped steps. Losses compared are rank 0's (its dp group's mean), in every run."""
    fp32 = sw.launch(_mixed, 8, None, 1.0, 5)[0]
    bf16 = sw.launch(_mixed, 8, torch.bfloat16, 1.0, 5)[0]
    for (want, _), (got, took) in zip(fp32, bf16):
        assert took and abs(got - want) <= 0.02 * want
    fp16 = sw.launch(_mixed, 8, torch.float16, 2.0**21, 7)
    assert all([t for _, t in r] == [t for _, t in fp16[0]] for r in fp16)  # the same skips on every rank
    skipped = [not took for _, took in fp16[0]]
    assert skipped[0] and not skipped[-1]  # 2**21 overflows fp16 gradients; halving finds a scale that fits
    first = skipped.index(False)
    shifted = sw.launch(_mixed, 8, None, 1.0, 7, first)[0]  # fp32 skipping the same first steps
    for (want, _), (got, _) in zip(shifted[first:], fp16[0][first:]):
        assert abs(got - want) <= 0.02 * want


def test_mixed_precision_with_weights_tied_across_pipeline_ranks_is_refused():
    def body(comm):
        mesh = sw.Mesh(comm, dp=1, tp=1, pp=2)
        with pytest.raises(ValueError, match="mixed_precision with weights tied across pipeline ranks"):
            sw.parallelize(GPT(CONFIG, seed=0), mesh, dp_strategy="zero1",
                           mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="mixed_precision needs a sharded dp_strategy"):
            sw.parallelize(GPT(CONFIG, seed=0), sw.Mesh(comm, dp=1, tp=1, pp=2), dp_strategy="ddp",
                           mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16))

    sw.launch(body, 2)
