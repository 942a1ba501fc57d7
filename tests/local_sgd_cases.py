"""The inner training loop shared by the local SGD / DiLoCo / Streaming DiLoCo tests: a wrapped model trained on
this rank's slice of each global batch, with every outer synchronisation's traffic measured."""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch
from parity import batch


@dataclasses.dataclass
class InnerStep:
    """One step: the rank's loss, the CommStats of the wrapper's `step()` (the synchronisation, if any), and what
    `step()` returned (True when it synchronised)."""

    loss: float
    measured: Any
    synced: Any


def state_of(model) -> dict[str, torch.Tensor]:
    """A detached copy of `model.state_dict()`."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def inner_step(model, opt, comm, step: int):
    """One inner step on this rank's slice of global batch `step`: forward, backward, the inner optimizer's step,
    then the wrapper's `model.step()`, whose result (True when it synchronised) is returned."""
    x, y = batch(step, comm.rank, comm.size)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    return model.step()


def outer_state_run(model, comm, opt, steps: int, resume_from: list[bytes] | None = None,
                    save_at: int | None = None) -> tuple[dict[str, torch.Tensor], bytes | None, dict[str, Any]]:
    """Train `model` (a LocalSGD-family wrapper) with the inner optimizer `opt` for `steps` steps, from scratch or
    from `resume_from` (each rank's bytes of {model, inner, outer}: `state_dict()`, the inner optimizer's,
    `outer_state_dict()`), keeping such a checkpoint after step `save_at`. Returns the final state, this rank's
    checkpoint bytes (None if none was taken) and the final `outer_state_dict()`."""
    start, checkpoint = 0, None
    if resume_from is not None:
        saved = torch.load(io.BytesIO(resume_from[comm.rank]), weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["inner"])
        model.load_outer_state_dict(saved["outer"])
        start = model.inner_steps
    for step in range(start, start + steps):
        inner_step(model, opt, comm, step)
        if step + 1 == save_at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "inner": opt.state_dict(), "outer": model.outer_state_dict()},
                       buf)
            checkpoint = buf.getvalue()
    return state_of(model), checkpoint, model.outer_state_dict()


def inner_optimizer(params, inner: str) -> torch.optim.Optimizer:
    """'adamw' (lr 3e-3) or 'sgd' (lr 0.1, no momentum: updates add up exactly, for parity with averaging)."""
    params = list(params)
    return torch.optim.AdamW(params, lr=3e-3) if inner == "adamw" else torch.optim.SGD(params, lr=0.1)


def train_inner_steps(model, comm, steps: int, inner: str = "adamw") -> list[InnerStep]:
    """`steps` steps: forward, backward, then the inner optimizer step (which counts the inner step and synchronises
    when one is due) and `model.step()` (returning whether it did) under `comm.stats.measure()`."""
    opt = inner_optimizer(model.parameters(), inner)
    out = []
    for step in range(steps):
        x, y = batch(step, comm.rank, comm.size)
        loss = model(x, y)
        loss.backward()
        with comm.stats.measure() as measured:
            opt.step()
            synced = model.step()
        opt.zero_grad()
        out.append(InnerStep(float(loss.detach()), measured, synced))
    return out


def checkpointed_run(model, comm, path: str, steps: int, save_at: int | None, resume: bool, *, reset: bool = False,
                     before_save=None) -> None:
    """Train `model` with a stateless inner SGD (lr 0.1: the checkpoint then holds every piece of state) from its
    checkpoint at `path` when `resume` (resetting the strategy state with `reset`), saving through
    sw.save_checkpoint after step `save_at`; `before_save(model, synced)` may assert what the save sees."""
    import shardwise as sw

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = 0
    if resume:
        sw.load_checkpoint(path, model, opt, comm=comm, reset_strategy_state=reset)
        start = model.inner_steps
    for step in range(start, steps):
        synced = inner_step(model, opt, comm, step)
        if step + 1 == save_at:
            if before_save is not None:
                before_save(model, synced)
            sw.save_checkpoint(path, model, opt, step=step + 1, comm=comm)
