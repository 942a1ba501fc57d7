"""SyncBatchNorm: N ranks equal one process on the global batch (outputs, gradients, running statistics, training
under DDP and ZeRO-3), eval and a group of one are torch's BatchNorm, the collectives are the documented ones, and
bad arguments are refused.

References are computed: the same model (plain nn.BatchNorm) run in one process on the concatenated global batch.
Tolerances: float64 cases agree to 1e-12 (the only difference is summation order; the variance's cancellation
Q/n - mean^2 costs about 1e-16 (mean/std)^2). float32 training uses the parity contract (rtol 1e-5, atol 1e-6):
per-rank statistics and the split sums change rounding at the 1e-7 level, and AdamW with eps=1e-6 (tests/parity.py
explains why) keeps that from growing; convolutions before BatchNorm have no bias, whose gradient is mathematically
zero and would be pure rounding noise that Adam scales to a full step.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from parity import ATOL, RTOL
from torch import nn

import shardwise as sw
from shardwise.sync_batchnorm import SyncBatchNorm

STEPS = 3
GLOBAL = 12  # divides over 2 and 3 ranks
_BUILD = threading.Lock()  # thread ranks share torch's global RNG: one seeded build at a time


# ---- the conv net, its data and the one-process reference ----------------------------------------------------------
def conv_net() -> nn.Module:
    """Conv -> BN -> ReLU -> Conv -> BN -> ReLU -> pool -> Linear: the same seeded weights on every call."""
    with _BUILD, torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
            nn.Conv2d(6, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8, momentum=0.3), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def global_batch(step: int, size: int = GLOBAL) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    # An offset mean, so that the statistics are not those of a standard normal.
    return torch.randn(size, 3, 8, 8, generator=g) * 2 + 0.5, torch.randn(size, 4, generator=g)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.1)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference(steps: int = STEPS, size: int = GLOBAL) -> dict[str, torch.Tensor]:
    model = conv_net()
    opt = optimizer(model)
    for step in range(steps):
        x, y = global_batch(step, size)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return state(model)


def local_slice(t: torch.Tensor, rank: int, sizes: list[int]) -> torch.Tensor:
    start = sum(sizes[:rank])
    return t[start:start + sizes[rank]]


def train_ddp(comm, batch_norm: str | None = "convert", sizes: list[int] | None = None, wrapper: str = "ddp"):
    """STEPS AdamW steps on this rank's slice of each global batch (equal slices unless `sizes`); the full state.
    batch_norm: "convert" (SyncBatchNorm.convert before wrapping), else the wrapper's `batch_norm=` option."""
    sizes = sizes or [GLOBAL // comm.size] * comm.size
    model = conv_net()
    if batch_norm == "convert":
        model, batch_norm = SyncBatchNorm.convert(model, comm), None
    if wrapper == "ddp":
        model = sw.DDP(model, comm, batch_norm=batch_norm)
    else:
        model = sw.ZeRO(model, comm, stage=3, batch_norm=batch_norm)
    opt = optimizer(model)
    for step in range(STEPS):
        x, y = global_batch(step, sum(sizes))
        out = model(local_slice(x, comm.rank, sizes))
        # The data-parallel average of the ranks' losses is the global mean: each rank's sum x ranks / global size.
        loss = F.mse_loss(out, local_slice(y, comm.rank, sizes), reduction="sum") * comm.size / (sum(sizes) * 4)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return sw.full_state_dict(model) if wrapper == "zero3" else state(model)


def assert_state_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def want() -> dict[str, torch.Tensor]:
    return reference()


# ---- conv net under DDP --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3])
def test_ddp_conv_net_equals_one_process_on_the_global_batch(world, want):
    for got in sw.launch(train_ddp, world):
        assert_state_close(got, want)
        assert got["1.num_batches_tracked"].item() == STEPS


def test_with_local_batch_norm_the_statistics_are_per_rank_and_differ(want):
    got = sw.launch(train_ddp, 2, "local")[0]  # torch DDP's behaviour: rank 0's per-rank statistics, broadcast
    for name in ("1.running_mean", "1.running_var", "4.running_var", "0.weight"):
        assert not torch.allclose(got[name], want[name], rtol=RTOL, atol=ATOL), name


@pytest.mark.parametrize("wrapper", ["ddp", "zero3"])
def test_the_wrappers_option_sync_equals_one_process(want, wrapper):
    for got in sw.launch(train_ddp, 2, "sync", None, wrapper):
        assert_state_close(got, want)


@pytest.mark.parametrize("wrapper", ["ddp", "zero3"])
def test_plain_batch_norm_using_batch_statistics_is_refused_by_default(wrapper):
    with pytest.raises(sw.LaunchError, match=r"BatchNorm2d '1' would normalise by this rank's slice.*"
                                             r"batch_norm='sync'.*batch_norm='local'"):
        sw.launch(train_ddp, 2, None, None, wrapper)


def test_batch_norm_in_eval_mode_passes_and_equals_one_process():
    """A frozen BatchNorm (eval mode, running statistics: fine-tuning a backbone) normalises each sample alike."""
    def run(model, rank=0, world=1):
        model.eval()
        opt = optimizer(model)
        for step in range(STEPS):
            x, y = global_batch(step, GLOBAL)
            F.mse_loss(model(local_slice(x, rank, [GLOBAL // world] * world)),
                       local_slice(y, rank, [GLOBAL // world] * world)).backward()
            opt.step()
            opt.zero_grad()
        return model

    want = state(run(conv_net()))
    for got in sw.launch(lambda comm: state(run(sw.DDP(conv_net(), comm), comm.rank, comm.size)), 2):
        assert_state_close(got, want)


def test_a_bad_batch_norm_option_is_refused():
    with pytest.raises(sw.LaunchError, match="batch_norm='global' is not supported; allowed None.*'sync'.*'local'"):
        sw.launch(lambda comm: sw.DDP(conv_net(), comm, batch_norm="global"), 2)


def test_ddp_uneven_local_batches_equal_one_process():
    want = reference(size=8)
    for got in sw.launch(train_ddp, 2, "convert", [3, 5]):
        assert_state_close(got, want)


# ---- ZeRO stage 3 --------------------------------------------------------------------------------------------------
def test_zero3_equals_one_process(want):
    for got in sw.launch(train_ddp, 2, "convert", None, "zero3"):
        assert_state_close(got, want)


# ---- BatchNorm1d, float64, options, eval, group of one, collectives ------------------------------------------------
def bn1d_case(shape: tuple[int, ...], options: dict, sizes: list[int]):
    """A float64 BatchNorm1d, a global input (offset mean) and per-sample output weights (so dy varies)."""
    g = torch.Generator().manual_seed(7)
    bn = nn.BatchNorm1d(shape[0], dtype=torch.float64, **options)
    if bn.affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5, generator=g)
            bn.bias.uniform_(-0.5, 0.5, generator=g)
    x = torch.randn(sum(sizes), *shape, generator=g, dtype=torch.float64) * 3 + 1.5
    dy = torch.randn(sum(sizes), *shape, generator=g, dtype=torch.float64)
    return bn, x, dy


def run_bn(bn: nn.Module, x: torch.Tensor, dy: torch.Tensor, passes: int = 2):
    """`passes` forward/backward passes; the last output, input gradient, parameter gradients (summed) and state."""
    for _ in range(passes):
        x = x.detach().requires_grad_(True)
        out = bn(x)
        (out * dy).sum().backward()
    grads = {n: p.grad.clone() for n, p in bn.named_parameters()}
    return out.detach(), x.grad, grads, state(bn)


def _bn_rank(comm, bn, x, dy, sizes):
    layer = SyncBatchNorm.convert(copy.deepcopy(bn), comm)
    out, dx, grads, st = run_bn(layer, local_slice(x, comm.rank, sizes), local_slice(dy, comm.rank, sizes))
    for g in grads.values():  # what DDP's reduction does, as a sum: the loss here is the sum of the ranks' losses
        comm.all_reduce(g)
    return out, dx, grads, st


OPTIONS = [{}, {"momentum": None}, {"affine": False}, {"track_running_stats": False}, {"eps": 1e-3, "momentum": 0.5}]


def _case_id(name: str, options: dict, sizes: list[int]) -> str:
    return f"{name}-{','.join(f'{k}={v}' for k, v in options.items()) or 'default'}-{'+'.join(map(str, sizes))}"


CASES = ([pytest.param(shape, options, [3, 5], id=_case_id(name, options, [3, 5]))
          for shape, name in (((5,), "NC"), ((5, 7), "NCL")) for options in OPTIONS]
         + [pytest.param((5, 7), {}, [4, 4], id="NCL-4+4"),
            pytest.param((5,), {"momentum": None}, [0, 2, 6], id="NC-momentum=None-0+2+6 (a rank without samples)")])


@pytest.mark.parametrize("shape, options, sizes", CASES)
def test_bn1d_float64_equals_one_process(shape, options, sizes):
    bn, x, dy = bn1d_case(shape, options, sizes)
    out, dx, grads, st = run_bn(copy.deepcopy(bn), x, dy)
    for rank, (r_out, r_dx, r_grads, r_st) in enumerate(sw.launch(_bn_rank, len(sizes), bn, x, dy, sizes)):
        torch.testing.assert_close(r_out, local_slice(out, rank, sizes), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r_dx, local_slice(dx, rank, sizes), rtol=1e-12, atol=1e-12)
        assert r_grads.keys() == grads.keys()
        for name in grads:
            torch.testing.assert_close(r_grads[name], grads[name], rtol=1e-12, atol=1e-12)
        assert r_st.keys() == st.keys()
        for name in st:  # running statistics identical to one process, on every rank
            torch.testing.assert_close(r_st[name], st[name], rtol=1e-12, atol=1e-12)


def _collectives(comm, channels):
    layer = SyncBatchNorm(channels, comm)
    x = torch.randn(4, channels, 3, generator=torch.Generator().manual_seed(comm.rank), requires_grad=True)
    with comm.stats.measure() as forward:
        out = layer(x)
    with comm.stats.measure() as backward:
        out.square().sum().backward()
    layer.eval()
    with comm.stats.measure() as evaluation:
        layer(x)
    return forward.as_dict(), backward.as_dict(), evaluation.as_dict()


def test_one_all_reduce_each_way_and_none_in_eval():
    channels = 6
    for forward, backward, evaluation in sw.launch(_collectives, 2, channels):
        assert forward == {"all_reduce": {"calls": 1, "bytes": (2 * channels + 1) * 8,
                                          "wire_bytes": (2 * channels + 1) * 8}}  # ring: 2(N-1)/N = 1 on 2 ranks
        assert backward == {"all_reduce": {"calls": 1, "bytes": 2 * channels * 8, "wire_bytes": 2 * channels * 8}}
        assert evaluation == {}


def _eval_rank(comm, bn, x):
    layer = SyncBatchNorm.convert(copy.deepcopy(bn), comm)
    layer.train()
    layer(local_slice(x, comm.rank, [4, 4]))  # one training pass: running statistics of the global batch
    layer.eval()
    before = comm.stats.snapshot()
    out = layer(local_slice(x, comm.rank, [4, 4]) * 2 - 1)
    return out, comm.stats.since(before).calls()


@pytest.mark.parametrize("track", [True, False])
def test_eval_is_torch_batchnorm_and_communicates_nothing(track):
    bn, x, _ = bn1d_case((5, 3), {"track_running_stats": track}, [4, 4])
    ref = copy.deepcopy(bn)
    ref(x)  # the global batch's running statistics
    ref.eval()
    for rank, (out, calls) in enumerate(sw.launch(_eval_rank, 2, bn, x)):
        assert calls == 0
        # Running statistics (or, untracked, this rank's own batch, as torch.nn.SyncBatchNorm in eval)
        want = ref(local_slice(x, rank, [4, 4]) * 2 - 1)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def _group_of_one(comm, bn, x, dy):
    return run_bn(SyncBatchNorm.convert(copy.deepcopy(bn), comm), x, dy)


@pytest.mark.parametrize("options", [{}, {"momentum": None}, {"affine": False}])
def test_group_of_one_is_torch_batchnorm_bit_for_bit(options):
    bn, x, dy = bn1d_case((4, 5), options, [6])
    bn, x, dy = bn.float(), x.float(), dy.float()
    want = run_bn(copy.deepcopy(bn), x, dy)
    got = sw.launch(_group_of_one, 1, bn, x, dy)[0]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(got[2][n], want[2][n]) for n in want[2])
    assert all(torch.equal(got[3][n], want[3][n]) for n in want[3])


def _far_from_zero(comm, bn, x):
    layer = SyncBatchNorm.convert(copy.deepcopy(bn), comm)
    return layer(local_slice(x, comm.rank, [16, 16])).detach(), state(layer)


def test_float32_mean_far_from_zero_keeps_the_variance():
    """Activations with mean 1000 x std: float32 sums of squares would lose the variance (relative error ~6e-2);
    per-rank statistics from torch's kernel, combined in float64, keep it to float32 resolution."""
    g = torch.Generator().manual_seed(3)
    bn = nn.BatchNorm1d(3)
    x = torch.randn(32, 3, 4, generator=g) + 1000.0
    ref = copy.deepcopy(bn)
    want = ref(x).detach()
    for rank, (out, st) in enumerate(sw.launch(_far_from_zero, 2, bn, x)):
        torch.testing.assert_close(st["running_var"], ref.running_var, rtol=1e-5, atol=0)
        torch.testing.assert_close(st["running_mean"], ref.running_mean, rtol=1e-6, atol=0)
        # x itself is only known to float32 resolution at 1000 (6e-5), so xhat to about 1e-4.
        torch.testing.assert_close(out, local_slice(want, rank, [16, 16]), rtol=0, atol=2e-4)


# ---- gloo processes ------------------------------------------------------------------------------------------------
def _gloo_body(comm):
    return {k: v.clone() for k, v in train_ddp(comm).items()}


@pytest.mark.multiprocess
def test_gloo_ddp_equals_one_process(want):
    for got in sw.launch(_gloo_body, 2, backend="gloo", timeout=60):
        assert_state_close(got, want)


# ---- convert -------------------------------------------------------------------------------------------------------
def test_convert_keeps_tensors_modes_and_sharing():
    shared = nn.BatchNorm1d(4)
    torch_sync = nn.SyncBatchNorm(4, momentum=None)
    model = nn.Sequential(nn.Linear(4, 4), shared, nn.Sequential(shared, torch_sync), nn.BatchNorm3d(4).eval())
    before = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    buffers = {n: b for n, b in model.named_buffers(remove_duplicate=False)}
    comm = sw.init()
    converted = SyncBatchNorm.convert(model, comm)
    assert converted is model
    assert isinstance(model[1], SyncBatchNorm) and model[2][0] is model[1]  # one layer, still shared
    assert isinstance(model[2][1], SyncBatchNorm) and model[2][1].momentum is None
    assert isinstance(model[3], SyncBatchNorm) and not model[3].training and model[1].training
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert all(b is buffers[n] for n, b in model.named_buffers(remove_duplicate=False))
    assert len(list(model.parameters())) == 2 + 2 * 3
    # A BatchNorm at the root comes back as a new layer; one already converted is kept.
    root = nn.BatchNorm2d(3, affine=False, track_running_stats=False)
    new = SyncBatchNorm.convert(root, comm)
    assert isinstance(new, SyncBatchNorm) and new.weight is None and new.running_mean is None
    assert SyncBatchNorm.convert(new, comm) is new


def _copied(comm):
    model = SyncBatchNorm.convert(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)), comm)
    twin = copy.deepcopy(model)  # e.g. an EMA model: new tensors, the same group
    twin(torch.ones(2, 2) * comm.rank)  # trains over the group: rank 0 sees zeros, rank 1 ones
    return (twin[1].comm is comm, twin[1].weight is not model[1].weight, twin[1].running_mean.clone(),
            model[1].running_mean.clone())


def test_deepcopy_keeps_the_communicator_and_copies_the_tensors():
    for shares, fresh, twin_mean, model_mean in sw.launch(_copied, 2):
        assert shares and fresh
        assert torch.equal(model_mean, torch.zeros(3)) and not torch.equal(twin_mean, model_mean)


# ---- bad input -----------------------------------------------------------------------------------------------------
def test_bad_arguments_are_refused():
    comm = sw.init()
    with pytest.raises(ValueError, match=r"module=list object must be a torch.nn.Module"):
        SyncBatchNorm.convert([nn.BatchNorm1d(3)], comm)
    with pytest.raises(ValueError, match=r"comm=str object must be a shardwise Communicator"):
        SyncBatchNorm.convert(nn.BatchNorm1d(3), "dp")
    with pytest.raises(ValueError, match=r"num_features=0 must be a positive int"):
        SyncBatchNorm(0, comm)
    with pytest.raises(ValueError, match=r"lazy BatchNorm not yet initialized"):
        SyncBatchNorm.convert(nn.Sequential(nn.LazyBatchNorm1d()), comm)
    with pytest.raises(ValueError, match=r"already wrapped by ddp; convert the plain model first"):
        SyncBatchNorm.convert(sw.DDP(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), comm), comm)
    with pytest.raises(ValueError, match=r"expected an input of shape \(N, 3, \*\), got \(4, 5\)"):
        SyncBatchNorm(3, comm)(torch.randn(4, 5))


def _one_value(comm):
    SyncBatchNorm(2, comm)(torch.randn(comm.rank, 2))  # ranks hold 0 and 1 samples: one value per channel


def test_one_value_per_channel_over_the_group_is_refused_on_every_rank():
    with pytest.raises(sw.LaunchError) as failed:
        sw.launch(_one_value, 2)
    summaries = [failed.value.summary] + [summary for _, summary in failed.value.others]
    expected = "ValueError: SyncBatchNorm: expected more than 1 value per channel when training, got 1 across the 2"
    assert len(summaries) == 2 and all(s.startswith(expected) for s in summaries), summaries
