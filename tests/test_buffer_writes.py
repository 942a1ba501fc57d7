"""Buffers a training forward writes (buffer_writes.py): a per-rank statistic is refused by name under every
data-parallel wrapper, the exact remedy (the statistic reduced over the ranks inside the forward) matches one process,
buffer_writes='local' keeps torch DDP's behaviour knowingly, writes that agree across ranks pass and stay watched,
and forwards in eval mode or without gradients communicate nothing (evaluation on rank 0 alone does not hang).

References are computed: the same model trained in one process on the global batch (AdamW with weight decay)."""

from __future__ import annotations

import pytest
import torch
from parity import assert_state_close, mlp_batch, small_mlp, train_mlp, value_error_text
from torch import nn

import shardwise as sw

WRAPS = {
    "ddp": lambda m, c, **kw: sw.DDP(m, c, **kw),
    "zero1": lambda m, c, **kw: sw.ZeRO(m, c, stage=1, **kw),
    "zero3": lambda m, c, **kw: sw.ZeRO(m, c, stage=3, wrap=nn.Linear, **kw),
    "fsdp": lambda m, c, **kw: sw.FSDP(m, c, **kw),
}


class RunningCentre(nn.Module):
    """Subtracts a running mean of its inputs that each training forward updates from the batch it sees (the
    pattern of an observation normaliser, DINO's centre or a VQ-VAE's EMA codebook). With `comm`, the batch mean is
    averaged over the data-parallel ranks first: the global batch's, as one process computes it."""

    def __init__(self, comm: sw.Communicator | None = None) -> None:
        super().__init__()
        self.comm = comm
        self.register_buffer("centre", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                mean = x.mean(0)
                if self.comm is not None:
                    self.comm.all_reduce(mean, sw.ReduceOp.AVG)  # equal slices: the mean of the means
                self.centre.mul_(0.8).add_(0.2 * mean)
        return x - self.centre


class Counted(nn.Module):
    """A step counter every rank advances alike (written, agreeing); from `diverge_at` on it adds the rank's own
    batch sum to a second buffer, which then differs across ranks."""

    def __init__(self, diverge_at: int | None = None) -> None:
        super().__init__()
        self.diverge_at = diverge_at
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps += 1
            if self.diverge_at is not None and int(self.steps) > self.diverge_at:
                self.seen += x.detach().sum()
        return x


def model_with(front: nn.Module) -> nn.Sequential:
    return nn.Sequential(front, *small_mlp())


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in sw.full_state_dict(model).items()}


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_a_per_rank_statistic_is_refused_by_name(wrap: str) -> None:
    def body(comm: sw.Communicator) -> str | None:
        model = WRAPS[wrap](model_with(RunningCentre()), comm)
        return value_error_text(lambda: train_mlp(model, mse, comm.rank, comm.size, steps=1))

    for text in sw.launch(body, 2):
        assert text is not None and "buffer '0.centre' differs across the 2 data-parallel ranks" in text
        assert "this training forward wrote it" in text and "buffer_writes='local'" in text


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_the_statistic_reduced_over_the_ranks_matches_one_process(wrap: str) -> None:
    want = {k: v.clone() for k, v in train_mlp(model_with(RunningCentre()), mse).state_dict().items()}
    assert float(want["0.centre"].abs().sum()) > 0  # the buffer moved, so the comparison covers it

    def body(comm: sw.Communicator) -> dict[str, torch.Tensor]:
        return full_state(train_mlp(WRAPS[wrap](model_with(RunningCentre(comm)), comm), mse, comm.rank, comm.size))

    for got in sw.launch(body, 2):
        assert_state_close(got, want)


@pytest.mark.parametrize("wrap", ["ddp", "zero3"])
def test_local_keeps_each_ranks_own_values(wrap: str) -> None:
    one = {k: v.clone() for k, v in train_mlp(model_with(RunningCentre()), mse).state_dict().items()}

    def body(comm: sw.Communicator) -> torch.Tensor:
        model = WRAPS[wrap](model_with(RunningCentre()), comm, buffer_writes="local")
        train_mlp(model, mse, comm.rank, comm.size)
        return model[0].centre.clone()

    centres = sw.launch(body, 2)
    if wrap == "ddp":  # rank 0's buffers are broadcast before each forward, then each rank writes its own
        assert not torch.equal(centres[0], centres[1])
    assert not torch.allclose(centres[0], one["0.centre"])  # not one process's: the choice is knowingly torch's


@pytest.mark.parametrize("wrap", ["ddp", "zero3"])
def test_agreeing_writes_pass_and_stay_watched(wrap: str) -> None:
    want = {k: v.clone() for k, v in train_mlp(model_with(Counted()), mse).state_dict().items()}

    def agreeing(comm: sw.Communicator) -> dict[str, torch.Tensor]:
        return full_state(train_mlp(WRAPS[wrap](model_with(Counted()), comm), mse, comm.rank, comm.size))

    for got in sw.launch(agreeing, 2):
        assert int(got["0.steps"]) == 4
        assert_state_close(got, want)

    def diverging(comm: sw.Communicator) -> tuple[str | None, int]:
        model = WRAPS[wrap](model_with(Counted(diverge_at=2)), comm)
        text = value_error_text(lambda: train_mlp(model, mse, comm.rank, comm.size))
        return text, int(model[0].steps)

    for text, steps in sw.launch(diverging, 2):
        assert text is not None and "buffer '0.seen' differs" in text
        assert steps == 3  # refused at the first forward that wrote a per-rank value, two forwards after the first


def test_forwards_without_gradients_or_in_eval_mode_issue_no_check() -> None:
    """A training-mode forward under no_grad and an eval-mode forward write the counter without a check (no
    collective); the training forwards after them are checked while the counter moves."""

    def body(comm: sw.Communicator) -> tuple[int, int, dict, int]:
        model = sw.ZeRO(model_with(Counted()), comm, stage=2)
        checks, issue = [], comm.all_reduce
        comm.all_reduce = lambda *a, **k: (checks.append(1), issue(*a, **k))[1]  # a spy: ZeRO-2 reduce-scatters
        x, y = mlp_batch(0, comm.rank, comm.size)
        with torch.no_grad():
            model(x)
        model.eval()
        model(x)
        model.train()
        quiet = len(checks)
        with comm.stats.measure() as checked:
            mse(model, x, y).backward()
        return quiet, len(checks), checked.as_dict(), int(model[0].steps)

    for quiet, checks, counted, steps in sw.launch(body, 2):
        assert quiet == 0 and checks == 1 and steps == 2
        assert "all_reduce" not in counted  # the check is control traffic, not counted in comm.stats


def test_instance_norm_running_statistics_are_refused() -> None:
    """InstanceNorm with track_running_stats keeps running statistics of each rank's samples; it is no BatchNorm,
    so the batch_norm= choice does not cover it."""

    def body(comm: sw.Communicator) -> str | None:
        model = nn.Sequential(nn.Unflatten(1, (1, 6)), nn.InstanceNorm1d(1, track_running_stats=True),
                              nn.Flatten(), *small_mlp())
        wrapped = sw.ZeRO(model, comm, stage=2)
        return value_error_text(lambda: train_mlp(wrapped, mse, comm.rank, comm.size, steps=1))

    for text in sw.launch(body, 2):
        assert text is not None and "buffer '1.running_mean' differs" in text


def test_batch_norm_buffers_follow_the_batch_norm_choice() -> None:
    def body(comm: sw.Communicator) -> None:
        model = sw.DDP(nn.Sequential(nn.BatchNorm1d(6), *small_mlp()), comm, batch_norm="local",
                       broadcast_buffers=False)
        train_mlp(model, mse, comm.rank, comm.size, steps=2)

    sw.launch(body, 2)  # each rank's own running statistics, chosen: no buffer error


def test_bad_option_and_distribute() -> None:
    def body(comm: sw.Communicator) -> tuple[str | None, str | None, int]:
        bad = value_error_text(lambda: sw.DDP(small_mlp(), comm, buffer_writes="average"))
        bad_zero = value_error_text(lambda: sw.ZeRO(small_mlp(), comm, stage=2, buffer_writes=True))
        model = sw.distribute(model_with(RunningCentre()), comm, strategy="zero2", buffer_writes="local")
        train_mlp(model, mse, comm.rank, comm.size, steps=2)
        return bad, bad_zero, int(model[0].centre.ne(0).sum())

    for bad, bad_zero, moved in sw.launch(body, 2):
        assert bad is not None and "DDP: buffer_writes='average' is not supported" in bad and "'local'" in bad
        assert bad_zero is not None and "buffer_writes=True is not supported" in bad_zero
        assert moved == 6


class Tracker(nn.Module):
    """Accumulates the mean activation of each batch it sees: a per-rank statistic inside a GPT block."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, hidden: torch.Tensor) -> None:
        if self.training:
            self.seen += hidden.detach().mean()


@pytest.mark.parametrize("choice", [None, "local"])
def test_parallelize_checks_over_its_data_parallel_ranks(choice: str | None) -> None:
    from parity import CONFIG, batch

    from shardwise.models import GPT

    def body(comm: sw.Communicator) -> str | None:
        gpt = GPT(CONFIG, seed=0)
        block = gpt.blocks[0]
        block.tracker = Tracker()
        block.register_forward_pre_hook(lambda module, args: module.tracker(args[0]))
        model = sw.parallelize(gpt, sw.Mesh(comm, dp=2, tp=1, pp=1), buffer_writes=choice)
        return value_error_text(lambda: model.step(*batch(0, comm.rank, comm.size)))

    for text in sw.launch(body, 2):
        if choice is None:
            # named as the pipeline stage holds it ('1.tracker.seen')
            assert text is not None and "tracker.seen' differs across the 2 data-parallel ranks" in text
        else:
            assert text is None
