"""The plain training loop is enough: local SGD, DiLoCo and Streaming DiLoCo count their inner steps on the inner
optimizer's own `step()`, and an AsyncSGD worker's optimizer refuses to step.

A loop written for one process (`loss.backward(); opt.step(); opt.zero_grad()`) used to need `model.step()` after
`opt.step()`; forgetting it trained independent replicas with no error (2 ranks, LocalSGD(sync_every=1), 3 SGD
steps: replicas 0.042 apart, issue 29). As torchft's LocalSGD / DiLoCo wrappers do, one global optimizer step
post-hook (`torch.optim.optimizer.register_optimizer_step_post_hook`, installed at the first wrap) now counts the
step for the wrapped model whose trainable parameters the optimizer holds, and synchronises when one is due.
`model.step()` remains, for loops that call it: right after an optimizer step it returns what that step's count
returned instead of counting again (so old loops keep their schedule), and without one (a hand-written update) it
counts as before. After a step `sw.ShardedGradScaler(model)` skipped (`mark_skipped`), it counts nothing.

An AsyncSGD worker has no inner optimizer: the servers step. A torch optimizer over a worker's parameters would
train it alone, away from the servers: its step raises, naming `model.step()`.

Which model an optimizer steps is found once per optimizer (again when its parameter count changes): the
registered model all of whose trainable parameters it holds. An optimizer holding only some of them (one of two
optimizers over parts of the model) counts nothing: such a loop calls `model.step()` once per iteration itself.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

__all__ = ["mark_skipped", "register_counting", "register_refusing", "take_counted"]

_COUNTED = "_shardwise_counted_step"  # on the model: what the hook's count returned, until model.step() takes it
_counting: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_refusing: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_owner: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, Any]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_installed = False


def _install() -> None:
    global _installed
    with _lock:
        if not _installed:
            register_optimizer_step_pre_hook(_pre_step)
            register_optimizer_step_post_hook(_post_step)
            _installed = True


def register_counting(model: nn.Module) -> None:
    """`model` (a LocalSGDModule) counts an inner step at each step of an optimizer holding its parameters."""
    _counting.add(model)
    _install()


def register_refusing(model: nn.Module) -> None:
    """An optimizer over `model`'s (an AsyncSGD worker's) parameters raises at its step."""
    _refusing.add(model)
    _install()


def mark_skipped(model: nn.Module) -> None:
    """The optimizer step of this iteration was skipped (a loss scaler found inf/nan): a following `model.step()`
    returns False without counting, as if the hook had counted nothing (a skipped step is not an inner step)."""
    model.__dict__[_COUNTED] = False


def take_counted(model: nn.Module) -> bool | None:
    """What the hook's count of the last optimizer step returned, if model.step() has not taken it yet (then None)."""
    return model.__dict__.pop(_COUNTED, None)


def _model_of(optimizer: torch.optim.Optimizer) -> tuple[str, nn.Module] | None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    cached = _owner.get(optimizer)
    if cached is not None and cached[0] == len(params):
        found = cached[1]
        return None if found is None else (found[0], found[1]())  # type: ignore[misc]
    held = {id(p) for p in params}
    found = None
    for kind, models in (("count", _counting), ("refuse", _refusing)):
        for model in list(models):
            trainable = [id(p) for p in model.parameters() if p.requires_grad]
            if trainable and all(i in held for i in trainable):
                found = (kind, weakref.ref(model))
                break
        if found is not None:
            break
    _owner[optimizer] = (len(params), found)
    return None if found is None else (found[0], found[1]())


def _pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _refusing:
        return
    found = _model_of(optimizer)
    if found is not None and found[0] == "refuse" and found[1] is not None:
        raise ValueError("optimizer.step(): this optimizer holds an AsyncSGD worker's parameters, which the parameter "
                         "servers train (with the optimizer given to AsyncSGD): stepping it would train this worker "
                         "alone. Call model.step() after backward instead (it pushes the gradients and takes the "
                         "servers' parameters)")


def _post_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _counting:
        return
    found = _model_of(optimizer)
    if found is not None and found[0] == "count" and found[1] is not None:
        model = found[1]
        model.__dict__[_COUNTED] = model._advance()
