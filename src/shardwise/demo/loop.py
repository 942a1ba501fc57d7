"""The loop bookkeeping every demo rank body shares (plain_rank.py, mesh_rank.py, compare.py): the learning-rate
schedule (`lr_at`), rank 0's per-step records and progress bar (`StepLog`), the held-out split of the corpus
(`split_corpus`) and early stopping decided by every rank together (`EarlyStop`, through `sw.agree`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..comm.base import Communicator, ReduceOp
from ..consensus import agree
from .options import DemoOptions
from .progress import progress_bar

__all__ = ["lr_at", "StepLog", "VALIDATION_FRACTION", "split_corpus", "EarlyStop"]


def lr_at(step: int, options: DemoOptions) -> float:
    """Linear warmup to `lr` over the warmup steps, then cosine decay to lr / 10 at the last step."""
    warmup = options.warmup_steps
    if step < warmup:
        return options.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, options.steps - 1 - warmup)
    return options.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


class StepLog:
    """The bookkeeping every rank body shares: it sets each step's learning rate (`lr_at`); rank 0 also keeps one
    metrics record per step and draws the tqdm bar (when options.progress); close() returns rank 0's records."""

    def __init__(self, options: DemoOptions, rank: int, tokens_per_step: int) -> None:
        self.options, self.lead, self.tokens_per_step = options, rank == 0, tokens_per_step
        self.metrics: list[dict[str, Any]] = []
        self.bar = None
        if self.lead and options.progress:
            self.bar = progress_bar(options.steps, options.label)

    def set_lr(self, opt: torch.optim.Optimizer, step: int) -> float:
        lr = lr_at(step, self.options)
        for group in opt.param_groups:
            group["lr"] = lr
        return lr

    def record(self, step: int, loss: float, lr: float, seconds: float, **wire: int) -> None:
        """Rank 0 keeps {step, loss, lr, step_ms, tokens_per_s, **wire} and advances its bar."""
        if not self.lead:
            return
        record = {"step": step, "loss": loss, "lr": lr, "step_ms": seconds * 1e3,
                  "tokens_per_s": self.tokens_per_step / seconds, **wire}
        self.metrics.append(record)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
            self.bar.update(1)

    def close(self) -> list[dict[str, Any]] | None:
        if self.bar is not None:
            self.bar.close()
        return self.metrics if self.lead else None


#: The share of the corpus held out for validation when early stopping is on (its last bytes).
VALIDATION_FRACTION = 0.1


def split_corpus(corpus: Any, options: DemoOptions) -> tuple[Any, Any]:
    """(train, validation): without early stopping the whole corpus and None; with it, the first 90% to train on
    and the last 10% held out (copies of the corpus whose `tokens` are the two slices), so validation windows
    never overlap training ones."""
    if options.early_stop is None:
        return corpus, None
    import copy

    cut = int(len(corpus) * (1 - VALIDATION_FRACTION))
    train, held = copy.copy(corpus), copy.copy(corpus)
    train.tokens, held.tokens = corpus.tokens[:cut], corpus.tokens[cut:]
    return train, held


class EarlyStop:
    """Patience on a validation loss, decided by every rank together.

    Every `options.eval_every` steps the model is evaluated (eval mode, no gradients) on the same
    `options.eval_batches` held-out batches (this dp rank's rows of each), the mean is averaged over the dp group
    (`dp_comm`), and an evaluation that does not beat the best so far by more than `min_delta` counts as bad;
    after `options.early_stop` bad evaluations in a row the rank votes to stop. The vote goes through
    `sw.agree(..., comm, how="all")` over the world: every rank leaves the loop at the same step (a rank that
    stopped alone would leave its peers waiting in their next collective), and `history` keeps [step, loss].
    `evaluate(x, y)` returns the loss of one batch (the plain model's forward, or the 3-D model's predict + loss).
    """

    def __init__(self, options: DemoOptions, held: Any, comm: Communicator, dp_comm: Communicator, dp_rank: int,
                 seq_len: int, evaluate: Any) -> None:
        self.options, self.comm, self.dp_comm, self.evaluate = options, comm, dp_comm, evaluate
        self.batches = [held.batch(i, options.batch_size, seq_len, seed=options.seed, rank=dp_rank,
                                   world_size=options.dp) for i in range(options.eval_batches)] if held else []
        self.best = math.inf
        self.bad = 0
        self.history: list[list[float]] = []
        self.stopped_at: int | None = None

    @torch.no_grad()
    def validation_loss(self, model: nn.Module) -> float:
        model.eval()
        try:
            total = torch.stack([self.evaluate(x, y).detach().float() for x, y in self.batches]).mean().reshape(1)
        finally:
            model.train()
        self.dp_comm.all_reduce(total, ReduceOp.AVG)
        return float(total.item())

    def should_stop(self, step: int, model: nn.Module) -> bool:
        """After step `step`: evaluate when due, and return True (on every rank alike) when patience ran out."""
        patience = self.options.early_stop
        if patience is None or (step + 1) % self.options.eval_every:
            return False
        loss = self.validation_loss(model)
        self.history.append([step, loss])
        if loss < self.best - self.options.min_delta:
            self.best, self.bad = loss, 0
        else:
            self.bad += 1
        if agree(self.bad >= patience, self.comm, how="all"):
            self.stopped_at = step
            return True
        return False
