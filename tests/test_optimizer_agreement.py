"""The data-parallel ranks' optimizers must step with the same hyperparameters (optimizer_agreement.py): a learning
rate set from each rank's own loss (ReduceLROnPlateau) is refused by name within EVERY steps under every wrapper, the
same scheduler fed the loss reduced over the ranks trains as one process, and between checks a step communicates
nothing extra.

References are computed: the same model, optimizer and scheduler in one process on the global batch."""

from __future__ import annotations

import pytest
import torch
from parity import assert_state_close, mlp_batch, small_mlp, value_error_text

import shardwise as sw
from shardwise.optimizer_agreement import EVERY

WRAPS = {
    "ddp": lambda m, c: sw.DDP(m, c),
    "zero2": lambda m, c: sw.ZeRO(m, c, stage=2),
    "zero3": lambda m, c: sw.ZeRO(m, c, stage=3),
    "fsdp": lambda m, c: sw.FSDP(m, c),
}
STEPS = EVERY + 3


def train(model: torch.nn.Module, comm: sw.Communicator | None = None, reduce_metric: bool = True,
          steps: int = STEPS) -> tuple[torch.nn.Module, int]:
    """AdamW and ReduceLROnPlateau(patience=0) stepped on the training loss; returns the model and the steps done."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    rank, world = (comm.rank, comm.size) if comm is not None else (0, 1)
    for step in range(steps):
        x, y = mlp_batch(step % 6, rank, world)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        metric = loss.detach().clone()
        if comm is not None and reduce_metric:
            comm.all_reduce(metric, sw.ReduceOp.AVG)  # equal slices: the global batch's loss
        plateau.step(float(metric))
    return model, steps


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_a_rate_from_each_ranks_own_loss_is_refused(wrap: str) -> None:
    def body(comm: sw.Communicator) -> str | None:
        model = WRAPS[wrap](small_mlp(), comm)
        return value_error_text(lambda: train(model, comm, reduce_metric=False))

    for text in sw.launch(body, 2):
        assert text is not None and f"AdamW.step() (step {EVERY}): the ranks of its group disagree" in text
        assert "param_groups[0].lr is" in text and "ReduceLROnPlateau" in text


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_the_rate_from_the_reduced_loss_trains_as_one_process(wrap: str) -> None:
    want = {k: v.clone() for k, v in train(small_mlp())[0].state_dict().items()}

    def body(comm: sw.Communicator) -> dict[str, torch.Tensor]:
        model, _ = train(WRAPS[wrap](small_mlp(), comm), comm)
        return {k: v.clone() for k, v in sw.full_state_dict(model).items()}

    for got in sw.launch(body, 2):
        assert_state_close(got, want)


def test_different_options_fail_at_the_first_step_and_checks_are_spaced() -> None:
    def differing(comm: sw.Communicator) -> str | None:
        model = sw.ZeRO(small_mlp(), comm, stage=2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1 * (comm.rank + 1))
        x, y = mlp_batch(0, comm.rank, comm.size)
        ((model(x) - y) ** 2).mean().backward()
        return value_error_text(opt.step)

    for text in sw.launch(differing, 2):
        assert text is not None and "AdamW.step() (step 1)" in text and "weight_decay is 0.1 on rank 0" in text

    def counted(comm: sw.Communicator) -> tuple[list[int], list[dict]]:
        model = sw.DDP(small_mlp(), comm)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gathers, issue = [], comm.all_gather
        comm.all_gather = lambda *a, **k: (gathers.append(len(per_step)), issue(*a, **k))[1]  # a spy: DDP gathers none
        per_step = []
        for step in range(EVERY):
            x, y = mlp_batch(step % 6, comm.rank, comm.size)
            ((model(x) - y) ** 2).mean().backward()
            with comm.stats.measure() as stepped:
                opt.step()
            per_step.append(stepped.as_dict())
        return [gathers.count(i) for i in range(EVERY)], per_step

    for gathers, per_step in sw.launch(counted, 2):
        assert gathers == [1] + [0] * (EVERY - 2) + [1]  # steps 1 and EVERY: one 8-byte digest all-gather each
        assert per_step == [{}] * EVERY  # control traffic, not counted in comm.stats
