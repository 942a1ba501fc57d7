"""Attentions with one fused ``qkv_proj`` (Phi-3, Phi-4-mini) under tensor parallel.

Phi-3 computes ``qkv = qkv_proj(x)`` with its output laid out ``[q | k | v]``: num_attention_heads x head_dim query
features, then num_key_value_heads x head_dim for keys and the same for values (Abdin et al. 2024, "Phi-3 Technical
Report", arXiv 2404.14219; Phi-4-mini uses the same module). Under grouped-query attention the three blocks differ in
size, so the projection is split block by block (a column-parallel layer with uneven output blocks): rank r keeps its
slice of each, ``[q_r | k_r | v_r]``, whole heads of each kind, as Megatron-LM splits its fused
``linear_qkv`` by query groups.

The attention then slices its output by head counts it reads in its forward: ``self.config.num_attention_heads``
(the model's config, shared by every module) and ``self.num_key_value_heads``. The attribute is divided by tp once;
the config cannot be (it is the model's, and saved with it), so the attention's class is swapped for one whose
forward sees, for the duration of the call, a view of the config whose head counts are this rank's
(`LocalHeadsForward`), everything else read through to the model's config.

Only attentions known to slice their fused output this way are split (`FUSED_QKV_ATTENTIONS`): a slice by global
offsets of a split output would read the wrong features without an error, so any other fused qkv_proj is refused
by name in the plan.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .._mixin import mix_in
from .linear import ColumnParallelLinear

__all__ = ["FUSED_QKV_ATTENTIONS", "LocalHeadsForward", "qkv_blocks", "use_local_heads"]

#: attention classes whose forward slices qkv_proj's output by config.num_attention_heads and
#: self.num_key_value_heads (x head_dim), in [q | k | v] order.
FUSED_QKV_ATTENTIONS = ("Phi3Attention",)


def _counts(attn: nn.Module) -> tuple[int, int, int]:
    config = attn.config
    return config.num_attention_heads, attn.num_key_value_heads, attn.head_dim


def qkv_blocks(attn: nn.Module, name: str) -> tuple[int, int, int]:
    """(q, k, v) output sizes of `attn`'s qkv_proj; ValueError when they do not fill its output."""
    heads, kv_heads, head_dim = _counts(attn)
    blocks = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    if sum(blocks) != attn.qkv_proj.out_features:
        raise ValueError(f"tensor parallel plan 'llama': {name}.qkv_proj has {attn.qkv_proj.out_features} outputs, "
                         f"not [q | k | v] = {blocks} from {heads} heads, {kv_heads} key/value heads of {head_dim}")
    return blocks


class _HeadsView:
    """The model's config with this rank's head counts: every other attribute read through."""

    def __init__(self, config: Any, **local: int) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_local", local)

    def __getattr__(self, name: str) -> Any:
        local = object.__getattribute__(self, "_local")
        return local[name] if name in local else getattr(object.__getattribute__(self, "_config"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the config view of a tensor-parallel attention is read-only (set {name} on the "
                             f"model's config)")


class LocalHeadsForward:
    """Mixed into a fused-qkv attention: its forward reads this rank's head counts from `self.config`."""

    _sw_tp: int

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        config = self.__dict__["config"]
        view = _HeadsView(config, num_attention_heads=config.num_attention_heads // self._sw_tp,
                          num_key_value_heads=config.num_key_value_heads // self._sw_tp)
        object.__setattr__(self, "config", view)
        try:
            return super().forward(*args, **kwargs)
        finally:
            object.__setattr__(self, "config", config)


def use_local_heads(model: nn.Module, tp: int) -> None:
    """After a plan split the fused qkv_proj of `model`'s known attentions over `tp` ranks: divide each one's own
    kv-head count and swap in the local view of its config. ValueError when the split's blocks are not the
    attention's [q | k | v] (a plan dict's ``Colwise(fused=3)`` under grouped-query attention would mix q and k)."""
    if tp == 1:
        return
    for name, attn in model.named_modules():
        qkv = getattr(attn, "qkv_proj", None)
        if (isinstance(qkv, ColumnParallelLinear) and not qkv.gather_output  # gathered: the attention sees all heads
                and type(attn).__name__ in FUSED_QKV_ATTENTIONS):
            blocks = qkv_blocks(attn, name)
            if tuple(qkv.blocks) != blocks:
                raise ValueError(f"parallelize: {name}.qkv_proj is split in blocks {tuple(qkv.blocks)}, but its "
                                 f"output is [q | k | v] = {blocks}; split it with Colwise(fused={blocks}) (plan "
                                 f"'llama' does)")
            attn.num_key_value_heads //= tp
            object.__setattr__(attn, "_sw_tp", tp)
            mix_in(attn, LocalHeadsForward, "LocalHeads")
