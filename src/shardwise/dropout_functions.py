"""torch's dropout functions, drawing their masks from the tensor-parallel dropout stream where one is active.

Why here. torch's dropout draws from the global generator, and none of its functions takes a generator. The masks a
tensor-parallel group must share (dropout_stream.py) are drawn by the model's own code (``nn.Dropout``, a
HuggingFace attention calling ``nn.functional.dropout`` or ``scaled_dot_product_attention``), in forward and again in
an activation-checkpointing recompute in backward, which no module hook or TorchFunctionMode of the forward reaches.
So `patch_torch` replaces those functions in ``torch.nn.functional`` (and ``torch.dropout``) with the ones below, once,
when the first model gets a stream: each asks `generator_for` for a generator and, given None (no stream: any other
code, eval, p of 0 or 1), calls torch's original unchanged. Calls are looked up at call time (``F.dropout(...)``), so
every caller is served; a name bound before (``from torch.nn.functional import dropout``) is not.

With a generator, each draws as torch does (aten/native/Dropout.cpp): noise ``bernoulli_(1 - p)`` in the input's
dtype, divided by ``1 - p``, times the input; feature dropout one draw per (sample, channel); attention runs torch's
math form (``_scaled_dot_product_attention_math``: the probabilities materialised, then masked), which gives up
the fused kernels' memory saving where one would have run. Alpha dropout under a stream is a
ValueError (its affine correction is not reproduced).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .compiled import eager_while_traced
from .dropout_stream import DropoutStream, attach, generator_for, use_own_stream
from .random_functions import patch_random

__all__ = ["install", "patch_torch", "rank_thread_stream", "ORIGINALS"]

ORIGINALS: dict[str, Callable] = {}


def _drawing(p: Any, training: Any) -> bool:
    """A draw is needed: training with 0 < p < 1 (p = 1 zeroes everything; torch checks a bad p)."""
    return bool(training) and isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p < 1


@eager_while_traced
def _stream_noise(input: torch.Tensor, kind: str, p: float, shape: tuple | None = None) -> torch.Tensor | None:
    """torch's dropout noise, drawn from this thread's stream: bernoulli(1 - p) divided by 1 - p, shaped like
    `input` (or `shape`); None where no stream serves the draw (torch's own function then runs)."""
    generator = generator_for(input, kind, input.device)
    if generator is None:
        return None
    noise = torch.empty_like(input) if shape is None else input.new_empty(shape)
    return noise.bernoulli_(1 - p, generator=generator).div_(1 - p)


def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    noise = _stream_noise(input, "dropout", p) if _drawing(p, training) else None
    if noise is None:
        return ORIGINALS["dropout"](input, p, training, inplace)
    return input.mul_(noise) if inplace else input * noise


def torch_dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    noise = _stream_noise(input, "dropout", p) if _drawing(p, train) else None
    if noise is None:
        return ORIGINALS["torch.dropout"](input, p, train)
    return input * noise


def _feature(name: str, one_d: bool, input: torch.Tensor, p: float = 0.5, training: bool = True,
             inplace: bool = False) -> torch.Tensor:
    """dropout1d/2d/3d: torch's make_feature_noise, one draw per (sample, channel); dropout1d takes an unbatched
    (C, L) input as a batch of one, dropout2d/3d take the first two dimensions as they come (as torch does)."""
    shaped = input.dim() >= 2 and (not one_d or input.dim() in (2, 3))
    batched = input.unsqueeze(0) if one_d and input.dim() == 2 else input
    noise = (_stream_noise(batched, name, p, (*batched.shape[:2], *([1] * (batched.dim() - 2))))
             if shaped and _drawing(p, training) else None)
    if noise is None:
        return ORIGINALS[name](input, p, training, inplace)  # torch's own checks and messages for the shape
    if batched is not input:
        noise = noise.squeeze(0)
    return input.mul_(noise) if inplace else input * noise


@eager_while_traced
def _served(input: torch.Tensor, kind: str) -> bool:
    return generator_for(input, kind, input.device) is not None


def _alpha(name: str, input: torch.Tensor, p: float = 0.5, training: bool = False,
           inplace: bool = False) -> torch.Tensor:
    if _drawing(p, training) and _served(input, name):
        raise ValueError(f"{name}(p={p}) in training under tensor parallelism: its mask would come from torch's "
                         f"generator, which the ranks of the group do not share; allowed: dropout, dropout1d/2d/3d "
                         f"and attention dropout, or {name} with p=0")
    return ORIGINALS[name](input, p, training, inplace)


@eager_while_traced
def _stream_keep(query: torch.Tensor, key: torch.Tensor, p: float, enable_gqa: bool) -> torch.Tensor | None:
    """Which attention probabilities are kept (True), drawn from this thread's stream; None where none serves."""
    generator = generator_for(query, "attention", query.device)
    if generator is None:
        return None
    lead_k = (*key.shape[:-3], query.shape[-3]) if enable_gqa else key.shape[:-2]
    shape = (*torch.broadcast_shapes(query.shape[:-2], lead_k), query.shape[-2], key.shape[-2])
    return torch.empty(shape, device=query.device).bernoulli_(1 - p, generator=generator).bool()


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    keep = _stream_keep(query, key, dropout_p, enable_gqa) if _drawing(dropout_p, True) else None
    if keep is None:
        return ORIGINALS["scaled_dot_product_attention"](query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                         is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return _attention_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, keep)


def _attention_math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                    p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
                    keep: torch.Tensor) -> torch.Tensor:
    """torch's math attention (``_scaled_dot_product_attention_math``) with the kept probabilities given: scores
    scaled by 1/sqrt(head dim) unless `scale`, causal and given masks, softmax (a row with every score masked gives
    zeros, as torch's), the dropped probabilities zeroed and the rest divided by 1 - p."""
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    if enable_gqa and key.dim() >= 3 and key.size(-3) != query.size(-3):
        repeat = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    scores = (query * scale) @ key.transpose(-2, -1)
    if is_causal:
        causal = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask)
    probs = _safe_softmax(scores)
    return (probs.masked_fill(~keep, 0.0) / (1 - p)) @ value


def _safe_softmax(scores: torch.Tensor) -> torch.Tensor:
    if hasattr(torch.ops.aten, "_safe_softmax"):  # torch >= 2.5: what the math kernel uses (an op torch.compile traces)
        return torch.ops.aten._safe_softmax(scores, -1)
    probs = torch.softmax(scores, -1)
    return probs.masked_fill(torch.isneginf(scores).all(-1, keepdim=True), 0.0)


_REPLACEMENTS: dict[str, Callable] = {
    "dropout": dropout,
    "dropout1d": functools.partial(_feature, "dropout1d", True),
    "dropout2d": functools.partial(_feature, "dropout2d", False),
    "dropout3d": functools.partial(_feature, "dropout3d", False),
    "alpha_dropout": functools.partial(_alpha, "alpha_dropout"),
    "feature_alpha_dropout": functools.partial(_alpha, "feature_alpha_dropout"),
    "scaled_dot_product_attention": scaled_dot_product_attention,
}


_lock = threading.Lock()


def install(model: nn.Module, seed: int) -> DropoutStream:
    """Make `model`'s dropout, and its other random ops, draw from a stream seeded with `seed` (dropout_stream.py),
    equal on every rank that must draw the same numbers: torch's functions replaced (once; random_functions.py for
    the others), the model's modules hooked."""
    patch_torch()
    patch_random()
    return attach(model, seed)


def rank_thread_stream(rank: int) -> contextlib.AbstractContextManager[DropoutStream]:
    """For the length of thread rank `rank`: its dropout masks from a stream of its own (dropout_stream.py's
    `use_own_stream`), torch's functions replaced (once)."""
    patch_torch()
    return use_own_stream(rank)


def patch_torch() -> None:
    """Put the functions above in place of torch's (idempotent; torch's stay in ORIGINALS)."""
    with _lock:  # thread ranks parallelise at once
        if not ORIGINALS:
            _patch()


def _patch() -> None:
    for name, replacement in _REPLACEMENTS.items():
        ORIGINALS[name] = getattr(F, name)
        if isinstance(replacement, functools.partial):
            replacement = functools.update_wrapper(functools.partial(replacement.func, *replacement.args),
                                                   ORIGINALS[name])
        else:
            functools.update_wrapper(replacement, ORIGINALS[name])
        setattr(F, name, replacement)
    ORIGINALS["torch.dropout"] = torch.dropout
    torch.dropout = functools.update_wrapper(torch_dropout, ORIGINALS["torch.dropout"])
