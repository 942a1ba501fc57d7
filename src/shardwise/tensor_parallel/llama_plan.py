"""The built-in tensor-parallel plan of HuggingFace decoders with Llama's module names (``plan="llama"``).

Attention projections split by heads, the MLP Megatron style, the embedding by vocabulary rows, the head with
gathered logits; what else lives inside a split attention or MLP is placed by what it is (per-head norms, a norm over
the projection's whole width, one row per head, an activation's scalars) or refused by name. See `llama_plan`.
"""

from __future__ import annotations

import torch
from torch import nn

from .latent_attention import is_latent_attention, latent_attention_plan
from .styles import Colwise, HeadRows, Heads, Rowwise, SplitNorm, Style, Vocab, check_divides, has_own_forward

__all__ = ["llama_plan"]


#: The llama plan's projections that hold heads: (module name, attributes or config fields naming their head count,
#: what they are called in messages).
_HEAD_COUNTS = (("q_proj", ("num_heads", "num_attention_heads"), "attention heads"),
                ("k_proj", ("num_key_value_heads",), "key/value heads"))


def _heads_of(attn: nn.Module, proj: nn.Linear, *names: str) -> int | None:
    """Number of heads a projection holds: from the attention module's attributes or its config."""
    head_dim = getattr(attn, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0:
        return proj.out_features // head_dim
    config = getattr(attn, "config", None)
    for name in names:
        value = getattr(attn, name, None) or getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def holds_moe_block(module: nn.Module) -> bool:
    """Whether `module` holds a mixture-of-experts block, which plan "llama" keeps whole (expert_parallel may split
    it over ep): a HuggingFace experts module (MixtralExperts, GptOssExperts, Llama4TextExperts,
    GraniteMoeParallelExperts ...) or a ...SparseMoeBlock."""
    return any(type(m).__name__.endswith(("Experts", "SparseMoeBlock")) for m in module.modules())


def llama_plan(model: nn.Module, tp: int) -> dict[str, Style]:
    """The plan of Llama-style models with HuggingFace module names.

    q/k/v_proj colwise and o_proj rowwise (heads, and key/value heads under grouped-query attention, split across
    ranks), gate/up_proj colwise (a fused gate_up_proj Linear, GLM-4's, as two blocks) and down_proj rowwise
    (StarCoder2's c_fc colwise and c_proj rowwise; a MoE block without them, Mixtral's, stays whole),
    embed_tokens vocabulary-parallel, lm_head colwise with gathered output (the model computes its own loss over full
    logits); a tied lm_head shares the embedding's shard; per-head norms (Qwen3's q_norm / k_norm) and an MLP
    activation's scalars (Apertus's xIELU) are "heads" regions (their gradients summed over the group); a q_norm /
    k_norm over the projection's whole width (OLMo 2 / 3, OLMoE) is split with it ("split_norm"). An embedding with
    a forward of its own (Gemma's scales its output by sqrt(hidden size)) stays whole on every rank, and so does an
    lm_head tied to it: the parallel embedding would not run that forward (parallelize refuses to split such a
    module).
    Phi-3's fused ``qkv_proj`` is split block by block ([q | k | v], uneven under grouped-query attention) and its
    attention reads this rank's head counts (fused_qkv.py); any other fused qkv_proj is refused by name. DeepSeek-V3's
    latent attention splits its up projections (q_b_proj, kv_b_proj) and keeps the down projections whole
    (latent_attention.py).
    Raises ValueError naming the numbers when `tp` does not divide the attention or key/value heads.
    """
    fused_qkv: set[tuple[int, ...]] = set()
    latent: dict[str, Style] = {}
    for name, module in model.named_modules():
        if isinstance(getattr(module, "qkv_proj", None), nn.Linear) and not hasattr(module, "q_proj"):
            fused_qkv.add(_fused_qkv_blocks(name, module, tp))
        if is_latent_attention(module):
            latent.update(latent_attention_plan(name, module, tp))  # DeepSeek-V3 (latent_attention.py)
            continue
        for proj, attrs, what in _HEAD_COUNTS:
            child = getattr(module, proj, None)
            if isinstance(child, nn.Linear):
                heads = _heads_of(module, child, *attrs)
                if heads is not None:
                    check_divides(f"the number of {what} of {name or 'the model'} ({attrs[-1]})", heads, tp)
    modules = [(name.rsplit(".", 1)[-1], module) for name, module in model.named_modules()]
    names = {n for n, _ in modules}
    whole = [m for n, m in modules if n == "embed_tokens" and has_own_forward(m, nn.Embedding)]
    if len(fused_qkv) > 1:
        raise ValueError(f"tensor parallel plan 'llama': the fused qkv_proj layers have different [q | k | v] blocks "
                         f"{sorted(fused_qkv)}; pass a plan dict")
    attention: dict[str, Style] = ({"qkv_proj": Colwise(fused=fused_qkv.pop())} if fused_qkv else latent or
                                   {"q_proj": Colwise(), "k_proj": Colwise(), "v_proj": Colwise()})
    plan: dict[str, Style] = {**({} if whole else {"embed_tokens": Vocab()}), **attention, "o_proj": Rowwise()}
    # A mixture-of-experts MLP (Mixtral's fused experts: no gate/up/down_proj modules) stays whole on every rank, as
    # the GPT plan keeps its MoE layers; expert parallel may split it over ep afterwards.
    fused_mlp = any(n == "gate_up_proj" and isinstance(m, nn.Linear) for n, m in modules)  # GLM-4, Phi-3: [gate|up]
    # StarCoder2's MLP: c_fc -> activation -> c_proj, two nn.Linear (GPT-2's namesakes are Conv1D: its own plan)
    two_layer = {n for n, m in modules if n in ("c_fc", "c_proj") and isinstance(m, nn.Linear)} == {"c_fc", "c_proj"}
    mlp = {k: v for k, v in (("gate_proj", Colwise()), ("up_proj", Colwise()), ("down_proj", Rowwise()),
                             ("gate_up_proj", Colwise(fused=2)), ("c_fc", Colwise()), ("c_proj", Rowwise()))
           if k in names and (k != "gate_up_proj" or fused_mlp) and (k not in ("c_fc", "c_proj") or two_layer)}
    if not mlp and not holds_moe_block(model):
        raise ValueError("tensor parallel plan 'llama': the model has neither gate_proj / up_proj / down_proj (or "
                         "c_fc / c_proj) MLPs nor a mixture-of-experts block; pass a plan dict naming its MLP's "
                         "modules")
    plan.update(mlp)
    plan.update(_mlp_regions(model, set(mlp)))
    tied_to_whole = any(getattr(m, "weight", None) is e.weight for n, m in modules if n == "lm_head" for e in whole)
    plan.update(_head_regions(model))
    if "lm_head" in names and not tied_to_whole:
        plan["lm_head"] = Colwise(gather_output=True)
    return plan


def _fused_qkv_blocks(name: str, attn: nn.Module, tp: int) -> tuple[int, ...]:
    """The [q | k | v] block sizes of a known fused-qkv attention (fused_qkv.py), after checking that tp divides its
    heads and that it has no parameter outside its projections; ValueError naming it otherwise."""
    from .fused_qkv import FUSED_QKV_ATTENTIONS, qkv_blocks

    kind = type(attn).__name__
    if kind not in FUSED_QKV_ATTENTIONS:
        raise ValueError(f"tensor parallel plan 'llama': {name}.qkv_proj ({kind}) fuses q, k and v in one Linear, "
                         f"which the attention slices in a way the plan does not know; the plan splits the fused "
                         f"qkv_proj of {', '.join(FUSED_QKV_ATTENTIONS)} and separate q_proj / k_proj / v_proj; "
                         f"pass a plan dict, or use tp=1 for this model")
    blocks = qkv_blocks(attn, name)
    head_dim = attn.head_dim
    check_divides(f"the number of attention heads of {name} (num_attention_heads)", blocks[0] // head_dim, tp)
    check_divides(f"the number of key/value heads of {name} (num_key_value_heads)", blocks[1] // head_dim, tp)
    extra = [n for n, _ in attn.named_parameters() if n.split(".")[0] not in ("qkv_proj", "o_proj")]
    if extra:
        raise ValueError(f"tensor parallel plan 'llama': {name}.{extra[0]} is a parameter of the attention {name} "
                         f"({kind}) besides its projections; the plan does not know how it relates to the heads; "
                         f"pass a plan dict")
    return blocks


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_PER_HEAD_NORMS = {"q_norm": "q_proj", "k_norm": "k_proj"}  # a norm -> the projection whose heads it normalizes
_COUNT_ATTRS = {proj: attrs for proj, attrs, _ in _HEAD_COUNTS}


def _head_regions(model: nn.Module) -> dict[str, Style]:
    """The llama plan's "heads" regions: per-head norms inside an attention (Qwen3's, Gemma3's q_norm / k_norm, a
    weight of head_dim), which run on this rank's heads (partial gradients); "split_norm" for a q_norm / k_norm over
    the projection's whole width (OLMo 2 / 3, OLMoE); and "head_rows" for an attention whose
    own parameters have one row per query head (GPT-OSS's `sinks`). Any other module with parameters inside an
    attention runs on the split heads too, in a way the plan cannot know (StableLM's list of one LayerNorm per head
    would apply the first heads' norms to this rank's heads), and so does any other parameter of the attention
    itself: a ValueError naming it."""
    regions: dict[str, Style] = {}
    for name, attn in model.named_modules():
        if not all(isinstance(getattr(attn, proj, None), nn.Linear) for proj in ("q_proj", "k_proj", "o_proj")):
            continue
        heads = _heads_of(attn, attn.q_proj, *_COUNT_ATTRS["q_proj"])
        for param_name, param in attn.named_parameters(recurse=False):
            if heads is None or param.dim() == 0 or param.shape[0] != heads:
                raise ValueError(f"tensor parallel plan 'llama': {name}.{param_name} {tuple(param.shape)} is a "
                                 f"parameter of the attention {name} ({type(attn).__name__}), whose heads tensor "
                                 f"parallel splits, and not one row per query head ({heads}); the plan does not "
                                 f"know how it relates to the heads; pass a plan dict")
            regions[name] = HeadRows()
        for child_name, child in attn.named_children():
            if child_name in _PROJECTIONS or not any(True for _ in child.parameters()):
                continue
            proj = _PER_HEAD_NORMS.get(child_name)
            linear, weight = getattr(attn, proj) if proj else None, getattr(child, "weight", None)
            heads = None if linear is None else _heads_of(attn, linear, *_COUNT_ATTRS[proj])
            if heads is not None and isinstance(weight, torch.Tensor) and weight.numel() == linear.out_features:
                regions[f"{name}.{child_name}"] = SplitNorm()  # OLMo 2's: over all of the projection's heads
                continue
            if heads is None or not isinstance(weight, torch.Tensor) or weight.numel() * heads != linear.out_features:
                raise ValueError(f"tensor parallel plan 'llama': {name}.{child_name} ({type(child).__name__}) has "
                                 f"parameters and runs on the heads of {name}, which tensor parallel splits, but it "
                                 f"is neither a per-head norm of q_proj or k_proj (weight of head_dim) nor a norm "
                                 f"over its whole width; pass a plan dict")
            regions[f"{name}.{child_name}"] = Heads()
    return regions


def _mlp_regions(model: nn.Module, projections: set[str]) -> dict[str, Style]:
    """The llama plan's regions inside a split MLP: its activation `act_fn` with scalar parameters (Apertus's xIELU
    alpha_p / alpha_n), applied to every hidden feature of which this rank holds its split, is a "heads" region (each
    rank's gradient is its features' part: summed over the group). Any other parameter in an MLP whose projections
    the plan splits (of the MLP itself, of another child, or a non-scalar one of the activation) may run on the split
    features or on the whole input in a way the plan cannot tell (a partial gradient, or a full one summed tp times):
    a ValueError naming it."""
    regions: dict[str, Style] = {}
    for name, mlp in model.named_modules():
        if not any(isinstance(getattr(mlp, proj, None), nn.Linear) for proj in projections):
            continue
        where = f"{name}.{{}} in the MLP {name} ({type(mlp).__name__}), whose hidden features tensor parallel splits,"
        for param_name, param in mlp.named_parameters(recurse=False):
            raise ValueError(f"tensor parallel plan 'llama': {where.format(param_name)} is a parameter of the MLP "
                             f"itself {tuple(param.shape)}; the plan does not know how it relates to the split; "
                             f"pass a plan dict")
        for child_name, child in mlp.named_children():
            params = list(child.parameters())
            if child_name in projections or not params:
                continue
            if child_name != "act_fn" or any(p.numel() != 1 for p in params):
                raise ValueError(f"tensor parallel plan 'llama': {where.format(child_name)} "
                                 f"({type(child).__name__}) has parameters that are not the activation's scalars; "
                                 f"the plan does not know whether it runs on the split features or the whole "
                                 f"input; pass a plan dict")
            regions[f"{name}.{child_name}"] = Heads()
    return regions
