"""HuggingFace GPT-2 under tensor parallelism: its ``Conv1D`` layers and its per-rank attention sizes.

HuggingFace's GPT-2 (``transformers.GPT2LMHeadModel``) keeps OpenAI's ``Conv1D`` for every projection
(``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj``): a Linear with its weight transposed, shape
(in, out), computing ``y = x @ W + b``. A Conv1D is therefore split exactly like the nn.Linear whose weight is
``W.T``: :func:`conv1d_as_linear` gives that Linear (a transposed view, no copy), and ``parallelize`` builds the
column- or row-parallel layer from it with ``from_dense``. The built layer holds its shard in nn.Linear's (out, in)
layout, the one the parallel matmuls use; :class:`Conv1DColumnParallelLinear` / :class:`Conv1DRowParallelLinear`
only remember where the weight came from, so ``full_tensor("weight")`` (and with it ``tp.full_state_dict``)
returns the original Conv1D layout (in, out): the gathered state dict equals the dense model's, name for name and
shape for shape.

Attention. ``c_attn`` outputs the fused ``[q | k | v]`` and is split with ``fused=3`` (each rank keeps whole heads
of q, k and v); GPT2Attention then cuts its output with ``split(self.split_size)`` and reshapes with
``self.head_dim``, and older versions also with ``self.num_heads`` / ``self.embed_dim``. ``parallelize`` divides
those :data:`GPT2_ATTENTION_SIZES` by tp on every attention module whose ``c_attn`` was split (``head_dim`` and the
precomputed ``scaling`` stay as they are).

The rest of the plan (see ``plans.gpt2_plan``): ``wte`` vocabulary-parallel and the tied ``lm_head`` column-parallel
over the same rows (one shared shard), with gathered logits so HuggingFace's own loss runs on full logits; ``wpe``
and the LayerNorms stay replicated. transformers is not a dependency of shardwise: a module is a Conv1D only if
``transformers.pytorch_utils`` is already imported (a model that holds one imported it).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from .layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["Conv1DColumnParallelLinear", "Conv1DRowParallelLinear", "GPT2_ATTENTION_SIZES", "conv1d_as_linear",
           "is_conv1d"]


def is_conv1d(module: nn.Module) -> bool:
    """Whether `module` is a HuggingFace ``transformers.pytorch_utils.Conv1D`` (without importing transformers)."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return conv1d is not None and isinstance(module, conv1d)


def conv1d_as_linear(conv: nn.Module) -> nn.Linear:
    """The nn.Linear equal to `conv`: weight ``conv.weight.T`` (a view sharing its storage), bias ``conv.bias``."""
    in_features, out_features = conv.weight.shape
    linear = nn.Linear(in_features, out_features, bias=conv.bias is not None, device="meta", dtype=conv.weight.dtype)
    linear.weight = nn.Parameter(conv.weight.detach().t(), requires_grad=conv.weight.requires_grad)
    linear.bias = conv.bias
    return linear


class _Conv1DLayout:
    """Gathers the weight back in Conv1D's (in, out) layout; the shard itself is kept as (out, in) for the matmul."""

    def full_tensor(self, name: str) -> torch.Tensor:
        full = super().full_tensor(name)
        return full.t().contiguous() if name == "weight" else full

    def global_shape(self, name: str) -> tuple[int, ...]:
        shape = super().global_shape(name)
        return tuple(reversed(shape)) if name == "weight" else shape

    def boxes(self, name: str, rank: int):  # noqa: ANN201 - see TensorParallelLayer.boxes
        boxes = super().boxes(name, rank)
        if name != "weight" or boxes is None:
            return boxes
        return tuple(tuple(reversed(box)) for box in boxes)

    def local_layout(self, name: str) -> tuple[int, tuple[int, ...] | None]:
        # The (out, in) shard is the transpose of (in, out) boxes laid side by side along dim 1.
        return (1, (1, 0)) if name == "weight" else (0, None)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", from Conv1D (full weight gathered as (in, out))"


class Conv1DColumnParallelLinear(_Conv1DLayout, ColumnParallelLinear):
    """ColumnParallelLinear built from a HuggingFace Conv1D; ``full_tensor("weight")`` is (in, out)."""


class Conv1DRowParallelLinear(_Conv1DLayout, RowParallelLinear):
    """RowParallelLinear built from a HuggingFace Conv1D; ``full_tensor("weight")`` is (in, out)."""


# What GPT2Attention reads as per-rank sizes (split of c_attn's output, head count, width); divided by tp once
# c_attn is split (parallelize.py). head_dim and the precomputed scaling stay as they are.
GPT2_ATTENTION_SIZES = ("split_size", "num_heads", "embed_dim")
