"""What a check feeds the model: seeded copies of it, the global batch and its data-parallel slices, the loss and
the optimizer, each checked before any rank starts.

Batches are nested tuples, lists and dicts whose tensor leaves are split along dim 0: data-parallel rank d of D
takes rows [d*b, (d+1)*b) of every tensor with at least one dim (b = rows / D); 0-dim tensors and other leaves are
passed whole; tensor-parallel ranks of one data-parallel group take the same slice. `batch(step)` is called once
per step, before the ranks start, and the same batches go to the reference and to every rank.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["batch_rows", "build_seeded", "resolve_batches", "slice_batch", "check_divides", "default_loss",
           "compute_loss", "default_optimizer", "make_optimizer", "describe_optimizer", "check_picklable"]

#: Thread ranks share torch's global RNG: every copy of the model is built under this lock and the same seed.
_BUILD_LOCK = threading.Lock()


def build_seeded(build_model: Callable[[], nn.Module], seed: int) -> nn.Module:
    """`build_model()` under `torch.manual_seed(seed)`, holding the process-wide build lock; the caller's global RNG
    state is restored afterwards."""
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model()
    if not isinstance(model, nn.Module):
        raise ValueError(f"check: build_model() returned {type(model).__name__}; it must return a fresh "
                         f"torch.nn.Module")
    return model


def resolve_batches(batch: Any, steps: int) -> list[Any]:
    """The global batch of every step: `batch(step)` for a callable, else `batch` itself each step."""
    out = [batch(step) if callable(batch) else batch for step in range(steps)]
    for step, b in enumerate(out):
        rows = batch_rows(b)
        if not rows:
            raise ValueError(f"check: the batch{f' of step {step}' if callable(batch) else ''} holds no tensor with "
                             f"a batch dim; pass a tensor, a tuple/list or dict of tensors, or batch(step) returning "
                             f"one (got {type(b).__name__})")
    return out


def batch_rows(b: Any) -> list[int]:
    """The dim-0 size of every tensor of a batch (nested tuples, lists and dicts), in order."""
    if isinstance(b, torch.Tensor):
        return [b.shape[0]] if b.dim() else []
    if isinstance(b, (tuple, list)):
        return [n for x in b for n in batch_rows(x)]
    if isinstance(b, dict):
        return [n for x in b.values() for n in batch_rows(x)]
    return []


def check_divides(batches: list[Any], dp: int) -> None:
    """ValueError naming the batch size and the data-parallel size when a tensor's rows do not split evenly."""
    for step, b in enumerate(batches):
        bad = sorted({n for n in batch_rows(b) if n % dp})
        if bad:
            raise ValueError(f"check: a batch of {bad[0]} rows (step {step}) does not split evenly over the {dp} "
                             f"data-parallel ranks: every tensor's dim 0 must be a multiple of dp={dp}")


def slice_batch(b: Any, index: int, parts: int, device: torch.device | None = None) -> Any:
    """Rank `index` of `parts`'s contiguous slice of every tensor along dim 0 (moved to `device` when given), a copy
    of its own: a model may write its inputs in place (FSMT replaces -100 in its input_ids with masked_fill_), which
    must neither reach the other run's or rank's batch nor, through the version counter views of one tensor share,
    fail another thread rank's backward ("modified by an inplace operation") as separate processes never would."""
    if isinstance(b, torch.Tensor):
        if b.dim() and parts > 1:
            if b.shape[0] % parts:
                raise ValueError(f"check: a batch of {b.shape[0]} rows does not split evenly over the {parts} "
                                 f"data-parallel ranks")
            size = b.shape[0] // parts
            b = b[index * size:(index + 1) * size]
        return b.to(device if device is not None else b.device, copy=True)
    if isinstance(b, (tuple, list)):
        return type(b)(slice_batch(x, index, parts, device) for x in b)
    if isinstance(b, dict):
        return {k: slice_batch(v, index, parts, device) for k, v in b.items()}
    return b


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """`model(*batch)` for a tuple/list, `model(**batch)` for a dict, `model(batch)` for a tensor; the result if it
    is a scalar tensor, else its `.loss` (a HuggingFace output given labels)."""
    if isinstance(batch, (tuple, list)):
        out = model(*batch)
    elif isinstance(batch, dict):
        out = model(**batch)
    else:
        out = model(batch)
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
    raise ValueError(f"check: the model returned {got}, not a scalar loss (nor an output with a scalar .loss); pass "
                     f"loss_fn(model, batch) -> scalar tensor, the mean over the batch's examples")


def compute_loss(loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None, model: nn.Module,
                 batch: Any) -> torch.Tensor:
    loss = (loss_fn or default_loss)(model, batch)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"check: loss_fn returned {got}; it must return a scalar tensor")
    return loss


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    """AdamW(lr=1e-3, weight_decay=0.1, eps=1e-5). Weight decay on purpose: SGD without it steps a zero gradient as
    it skips a None one, and would hide that difference. eps=1e-5 rather than torch's 1e-8: Adam divides each step
    by sqrt(v) + eps, so a gradient that is zero in exact arithmetic but carries rounding noise (an attention key
    bias: softmax ignores a constant added to every score) is stepped by up to lr x noise / eps; splitting the batch
    changes the noise, and eps=1e-8 would turn it into differences of ~1e-5 the strategy did not cause. eps=1e-6
    still let a CPU's rounding (Qwen3's embeddings, 1.2e-6 against atol 1e-6) through as a false difference."""
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-5)


def make_optimizer(optimizer: Callable[[Any], torch.optim.Optimizer] | None, model: nn.Module) -> torch.optim.Optimizer:
    opt = (optimizer or default_optimizer)(model.parameters())
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(f"check: optimizer(params) returned {type(opt).__name__}; it must return a "
                         f"torch.optim.Optimizer built over the parameters it is given")
    return opt


def describe_optimizer(opt: torch.optim.Optimizer) -> str:
    """"AdamW(lr=0.001, weight_decay=0.1, eps=1e-06)": the class and the defaults a reader tunes."""
    shown = [f"{k}={opt.defaults[k]:g}" for k in ("lr", "weight_decay", "eps", "momentum")
             if isinstance(opt.defaults.get(k), (int, float)) and not isinstance(opt.defaults.get(k), bool)]
    return f"{type(opt).__name__}({', '.join(shown)})"


def check_picklable(**named: Any) -> None:
    """For gloo processes: every function must pickle by reference (a top-level function of an importable module)."""
    for name, value in named.items():
        if value is None:
            continue
        try:
            pickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - any pickling failure: say which argument and why
            raise ValueError(f"check: backend='gloo' runs real processes, so {name} must be picklable: a top-level "
                             f"function of an importable module (not a lambda or a local function); {value!r} is "
                             f"not ({type(exc).__name__}: {exc}). Use backend='thread' or move it to a module.") \
                from None
