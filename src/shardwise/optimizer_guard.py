"""The optimizer guard: an optimizer that cannot train the wrapped model raises at its first step, naming the fix.

Two mistakes train nothing, silently, in plain PyTorch: an optimizer built before ZeRO / FSDP wrapped the model
(it holds the original parameters, which the engine replaced by its shards), and an optimizer over another model's
parameters (an unwrapped copy). Wrapping marks the parameters it replaces and registers the wrapped model with this
thread; one global optimizer step pre-hook (`torch.optim.optimizer.register_optimizer_step_pre_hook`, installed at
the first wrap, never at import) then checks each step:

* the optimizer holds a replaced parameter -> ValueError: build the optimizer after wrapping;
* none of the optimizer's parameters has a gradient while a model wrapped in this thread holds gradients -> the
  optimizer is over something else -> ValueError naming the wrapped model.

The first check is a few attribute reads per parameter and is cached per optimizer (re-done when its parameter
list changes); the second runs only when the optimizer has no gradient at all (a step that would do nothing). A step
post-hook bumps the version counters of an optimizer's pieces of sharded parameters after each step (`mark_updated`:
fused kernels write without bumping them, and the sharding engine tells stale gathered copies by them).

An optimizer over pieces of sharded parameters (ZeRO / FSDP shards, tensor-parallel slices) also gets, at its first
step, torch's state-dict hooks (whole/optim_state.py says why): `state_dict()` raises, naming
`sw.full_optimizer_state_dict`, since it would hold this rank's pieces only; `load_state_dict()` of a full dict (a
one-process optimizer's, or a saved `full_optimizer_state_dict`) slices it into this rank's pieces; state loaded in
full before that first step is sliced there. shardwise's own tools read the pieces inside
`whole.optim_state.local_state_dict()`.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.autograd.graph import increment_version
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch import nn

from . import layout
from .hf_save import guard_save_pretrained
from .optimizer_agreement import HyperparameterAgreement
from .whole.optim_state import localize_loaded_state, reading_pieces, to_local_optimizer_state

__all__ = ["mark_replaced", "register_wrapped", "check_step", "mark_updated"]

_MARK = "_shardwise_replaced_by"
_local = threading.local()  # the models wrapped in this thread (thread ranks each have their own)
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_checks: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, list]] = weakref.WeakKeyDictionary()
_over_pieces: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # holding pieces of sharded parameters
_installed = False
_lock = threading.Lock()
_agreement = HyperparameterAgreement()
_DATA_PARALLEL = ("ddp", "zero", "fsdp")  # the strategies whose group holds the same parameters and optimizer


def mark_replaced(params: list[nn.Parameter], wrapper: str) -> None:
    """Record that `wrapper` replaced these parameter objects (an optimizer holding them trains nothing)."""
    for p in params:
        setattr(p, _MARK, wrapper)


def register_wrapped(model: nn.Module) -> None:
    """Remember `model` (weakly) as wrapped in this thread, and install the step hook once. A HuggingFace model also
    gets its `save_pretrained` guarded (hf_save.py): every strategy registers here."""
    global _installed
    guard_save_pretrained(model)
    models = getattr(_local, "models", None)
    if models is None:  # in wrapping order, the same on every rank: the checks' collectives run in one order
        models = _local.models = weakref.WeakValueDictionary()
    models.setdefault(id(model), model)
    with _lock:
        if not _installed:
            register_optimizer_step_pre_hook(check_step)
            register_optimizer_step_post_hook(mark_updated)
            _installed = True


def _models() -> list[nn.Module]:
    """The models wrapped in this thread and still alive, in the order they were first wrapped."""
    models = getattr(_local, "models", None)
    return list(models.values()) if models is not None else []


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _sharded_model(params: list[torch.Tensor]) -> nn.Module | None:
    """The model wrapped in this thread that holds one of `params` as a piece of a larger tensor, if any."""
    ids = {id(p) for p in params}
    for model in _models():
        for pl in layout.placements(model).values():
            if id(pl.param) in ids and pl.sharded_over:
                return model
    return None


def _refuse_added(params: list[torch.Tensor]) -> None:
    """A parameter inside a model wrapped in this thread that no strategy placed was added after wrapping (an
    adapter such as PEFT's LoRA attached to the wrapped model): no bucket or unit holds it, so its gradient would
    stay this rank's. ValueError naming it. Runs when the optimizer's parameter list changes."""
    ids = {id(p) for p in params}
    models = _models()
    # Placed by any of them: a later strategy on a containing module (ZeRO over tensor-parallel stages) replaces
    # the parameters an earlier one placed.
    placed = {id(pl.param) for model in models for pl in layout.placements(model).values()}
    for model in models:
        added = [name for name, p in model.named_parameters() if id(p) in ids and id(p) not in placed]
        if added:
            names = " + ".join(r.name for r in layout.strategies(model))
            raise ValueError(f"optimizer.step(): {added[:4]}{' ...' if len(added) > 4 else ''} joined the model "
                             f"after {names} wrapped it (an adapter attached to the wrapped model?): no gradient "
                             f"reduction covers them, so each rank would train its own; add them before wrapping "
                             f"(get_peft_model(model, config), then wrap)")


def _watch_state_dicts(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    def refuse_save(opt: torch.optim.Optimizer) -> None:
        if not reading_pieces():
            raise RuntimeError("optimizer.state_dict(): this optimizer holds this rank's pieces of sharded "
                               "parameters, so its state dict would be one rank's slices under full parameter "
                               "indices; call sw.full_optimizer_state_dict(model, optimizer) on every rank "
                               "(collective; torch's format, full shapes) and save that on rank 0, or sw.save for a "
                               "sharded checkpoint")

    def slice_on_load(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any] | None:
        if reading_pieces():
            return None
        return to_local_optimizer_state(model, opt, state_dict)

    optimizer.register_state_dict_pre_hook(refuse_save)
    optimizer.register_load_state_dict_pre_hook(slice_on_load)
    localize_loaded_state(model, optimizer)  # state loaded in full before this first step (no hooks yet)


def check_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The step pre-hook (see the module docstring)."""
    params = _params(optimizer)
    if _checked.get(optimizer) != len(params):
        stale = [p for p in params if getattr(p, _MARK, None)]
        if stale:
            raise ValueError(f"optimizer.step(): the optimizer holds {len(stale)} parameter(s) that "
                             f"{getattr(stale[0], _MARK)} replaced when it wrapped the model (shape "
                             f"{tuple(stale[0].shape)}, ...): it would train nothing; build the optimizer after "
                             f"wrapping, over model.parameters()")
        _refuse_added(params)
        if optimizer not in _checked:
            model = _sharded_model(params)
            if model is not None:
                _watch_state_dicts(optimizer, model)
                _over_pieces.add(optimizer)
        _checked[optimizer] = len(params)
    _before_step(optimizer, params)
    if any(p.grad is not None for p in params):
        return
    for model in _models():
        if any(pl.param.grad is not None for pl in layout.placements(model).values()):
            names = " + ".join(r.name for r in layout.strategies(model))
            raise ValueError(f"optimizer.step(): none of the optimizer's {len(params)} parameters has a gradient, "
                             f"while the {names} model wrapped in this thread ({type(model).__name__}) holds "
                             f"gradients: the optimizer is over other parameters; build it over the wrapped "
                             f"model's parameters()")


def _before_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Each strategy of a model wrapped in this thread that declared a `before_step` check, over the parameters
    this optimizer holds (DDP: every gradient is one it averaged), and the hyperparameter agreement over each
    data-parallel group among them (optimizer_agreement.py). The checks run in the order the models were wrapped,
    the same on every rank (a check's collectives must match its peers'), each once with the union of the
    parameters it was found for (a check several pipeline stages declare). Which models the optimizer holds
    parameters of is cached with the parameter count, as the first check is."""
    cached = _checks.get(optimizer)
    if cached is None or cached[0] != len(params):
        ids = {id(p) for p in params}
        checks: dict[int, tuple[Any, set[int]]] = {}
        groups, order_groups = {}, {}
        for model in _models():
            held = {id(pl.param) for pl in layout.placements(model).values()} & ids
            if not held:
                continue
            for s in layout.strategies(model):
                if s.before_step is not None:
                    checks.setdefault(id(s.before_step), (s.before_step, set()))[1].update(held)
                if s.world is not None and s.world.size > 1 and s.name.startswith(_DATA_PARALLEL):
                    groups[id(s.world)] = s.world
                    for comm in s.comms() if callable(s.comms) else s.comms:  # the groups its collectives run on
                        if comm.size > 1:
                            order_groups.setdefault(id(comm), comm)
        cached = _checks[optimizer] = (len(params), list(checks.values()), list(groups.values()),
                                       list(order_groups.values()))
    for check, held in cached[1]:
        check(held)
    if cached[2]:
        _agreement.check(optimizer, cached[2], cached[3])


def mark_updated(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The step post-hook: an optimizer over pieces of sharded parameters has changed them in place, so their
    version counters are bumped, as torch's own in-place kernels bump them. The sharding engine tells a stale
    gathered copy (ZeRO-1/2, `reshard_after_forward=False`, an offloaded optimizer's device shard) by the master's
    version counter, and fused kernels (`AdamW(fused=True)`, nanoGPT's choice on a GPU; bitsandbytes' and apex's)
    write the parameters without bumping it: the next forward computed with the old values of the other ranks'
    pieces, silently (0.025 off one process after three steps of ZeRO-1 over 2 ranks)."""
    if optimizer in _over_pieces:
        increment_version(_params(optimizer))
