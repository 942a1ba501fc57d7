"""DeepSeek-V3's multi-head latent attention under tensor parallel (the "llama" plan).

Multi-head latent attention (DeepSeek-AI 2024, "DeepSeek-V2", arXiv 2405.04434, section 2.1) projects the hidden
states down to small latents shared by every head -- ``q_a_proj`` (then ``q_a_layernorm``) for the queries and
``kv_a_proj_with_mqa`` for the keys and values, whose output is ``[latent | rope key]`` -- and up again per head:
``q_b_proj`` (or ``q_proj`` without a query latent) gives every head's query, ``kv_b_proj`` every head's key part
without position and its value; ``o_proj`` reads every head's output. Split as Megatron-LM splits it: the up
projections column-parallel (whole heads per rank: their outputs are per-head blocks), ``o_proj`` row-parallel, the
down projections and their norms replicated. A replicated tensor feeding a column-parallel layer gets its full
gradient from that layer's backward (Megatron's ``f``), so the down projections train as one process's -- except the
rope key: it is one key of ``qk_rope_head_dim`` shared by every head (broadcast, not projected per head), so rank r's
backward gives only its heads' part of its gradient. `share_rope_key` mixes into each ``kv_a_proj_with_mqa`` a forward
that passes the rope key through ``f`` (identity forward, all-reduce of the gradient backward), which makes it the sum
over every head, as in one process.

Only `LATENT_ATTENTIONS` are split, and attentions whose forward is, byte for byte, theirs (GLM-4-MoE-Lite's,
Youtu's) or DeepSeek-V2's or MiniCPM3's (which rotate the rope parts their own way: a complex product, no interleaved
layout) with DeepSeek-V3's ``expand_kv``: these forwards reshape the up projections' outputs with ``-1`` heads, so a
rank's share of the heads flows through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._mixin import mix_in
from ..comm.base import Communicator
from .linear import ColumnParallelLinear
from .mappings import copy_to_region
from .styles import Colwise, Style, check_divides

__all__ = ["LATENT_ATTENTIONS", "RopeKeyGradientSummed", "is_latent_attention", "latent_attention_plan",
           "share_rope_key"]

#: attention classes of multi-head latent attention whose forward the module docstring describes.
LATENT_ATTENTIONS = ("DeepseekV3Attention",)
_KNOWN = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
          "o_proj")


def is_latent_attention(module: nn.Module, up: type[nn.Module] = nn.Linear) -> bool:
    """Whether `module` is a latent attention whose ``kv_b_proj`` is an `up` (nn.Linear before the split,
    ColumnParallelLinear after it)."""
    return isinstance(getattr(module, "kv_b_proj", None), up) and hasattr(module, "kv_a_proj_with_mqa")


def _runs_a_known_forward(attn: nn.Module) -> bool:
    """Whether `attn`'s forward is, byte for byte, that of one of `LATENT_ATTENTIONS` (a family transformers generates
    from DeepSeek-V3: GLM-4-MoE-Lite's, Youtu's) or DeepSeek-V2's or MiniCPM3's, with DeepSeek-V3's ``expand_kv`` (the
    module docstring); its parameters are then checked as theirs are."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention
    from transformers.models.minicpm3.modeling_minicpm3 import MiniCPM3Attention

    from ..experts.hf_kinds import model_forward, same_code

    forward = model_forward(attn)
    return any(same_code(forward, vars(known)["forward"]) for known in
               (DeepseekV3Attention, DeepseekV2Attention, MiniCPM3Attention)) \
        and same_code(getattr(type(attn), "expand_kv", None), DeepseekV3Attention.expand_kv)


def latent_attention_plan(name: str, attn: nn.Module, tp: int) -> dict[str, Style]:
    """The up projections of one latent attention, column-parallel; ValueError naming what the plan cannot split."""
    kind = type(attn).__name__
    if kind not in LATENT_ATTENTIONS and not _runs_a_known_forward(attn):
        raise ValueError(f"tensor parallel plan 'llama': {name} ({kind}) is a latent attention the plan does not know "
                         f"(it splits {', '.join(LATENT_ATTENTIONS)}); pass a plan dict, or use tp=1 for this model")
    check_divides(f"the number of attention heads of {name} (num_heads)", attn.num_heads, tp)
    extra = [n for n, _ in attn.named_parameters() if n.split(".")[0] not in _KNOWN]
    if extra:
        raise ValueError(f"tensor parallel plan 'llama': {name}.{extra[0]} is a parameter of the latent attention "
                         f"{name} ({kind}) besides its projections and norms; pass a plan dict")
    query = "q_proj" if isinstance(getattr(attn, "q_proj", None), nn.Linear) else "q_b_proj"
    return {query: Colwise(), "kv_b_proj": Colwise()}


class RopeKeyGradientSummed:
    """Mixed into a latent attention's ``kv_a_proj_with_mqa``: the last `_sw_rope` output features (the rope key
    every head shares) pass through ``f``, so their gradient is summed over the tensor-parallel group."""

    _sw_rope: int
    _sw_comm: Communicator

    def forward(self, x: torch.Tensor) -> Any:
        out = super().forward(x)
        latent, rope = out.split([out.shape[-1] - self._sw_rope, self._sw_rope], dim=-1)
        return torch.cat([latent, copy_to_region(rope, self._sw_comm)], dim=-1)


def share_rope_key(model: nn.Module, comm: Communicator) -> None:
    """After a plan (the llama plan, or a dict naming the same splits) split `model`'s latent attentions over `comm`:
    sum the rope key's gradient over it."""
    if comm.size == 1:
        return
    for attn in model.modules():
        if is_latent_attention(attn, ColumnParallelLinear):
            down = attn.kv_a_proj_with_mqa
            object.__setattr__(down, "_sw_rope", int(attn.qk_rope_head_dim))
            object.__setattr__(down, "_sw_comm", comm)
            mix_in(down, RopeKeyGradientSummed, "RopeKeySummed")
