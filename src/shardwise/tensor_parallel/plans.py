"""Tensor-parallel plans: data that maps module-name patterns to parallel styles (no edits of model code).

A plan is a dict ``{pattern: style}``. A pattern is an ``fnmatch`` pattern (``*`` matches any characters, dots
included) over the dotted module names of ``model.named_modules()``; it matches a module whose whole name matches,
or whose name ends with ``"." + pattern`` (so ``"q_proj"`` matches ``"model.layers.3.self_attn.q_proj"``). A style
is one of the strings ``"colwise"``, ``"rowwise"``, ``"vocab"``, ``"sequence"`` or a style object carrying options:

=================================  =====================================================================================
``"colwise"`` / :class:`Colwise`    nn.Linear -> ColumnParallelLinear (split by output features; ``fused=k`` splits k
                                     side-by-side output blocks separately, ``fused=(sizes)`` uneven ones;
                                     ``gather_output=True`` returns full outputs)
``"rowwise"`` / :class:`Rowwise`    nn.Linear -> RowParallelLinear (split by input features; output all-reduced, or
                                     reduce-scattered along the sequence under sequence parallel)
``"vocab"`` / :class:`Vocab`        nn.Embedding -> VocabParallelEmbedding (split by vocabulary rows)
``"sequence"`` / :class:`Sequence`  a module with replicated parameters (LayerNorm, RMSNorm, a position embedding) that
                                     runs on sequence shards under sequence parallel: its parameters' gradients are
                                     all-reduced over the group. Without sequence parallel it is left as it is.
``"heads"`` / :class:`Heads`        a module with replicated parameters that runs on this rank's attention heads (a
                                     per-head norm: Qwen3's q_norm / k_norm) or MLP features (an activation's scalars:
                                     Apertus's xIELU): each rank's gradient is its part, so the gradients are
                                     all-reduced over the group, with or without sequence parallel
``"split_norm"`` / :class:`SplitNorm`  an RMSNorm over the whole output width of a colwise projection (OLMo 2's
                                     q_norm / k_norm): its weight split like the projection's output, its mean square
                                     summed over the group (split_norm.py)
=================================  =====================================================================================

Built-in plans (``plan="gpt"`` / ``plan="llama"`` / ``plan="gpt2"``) are computed from the model by
:func:`builtin_plan`, which also validates the head counts: a tensor-parallel size that does not divide them is a
ValueError naming both numbers.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Union

import torch
from torch import nn

__all__ = ["Colwise", "Rowwise", "Vocab", "Sequence", "Heads", "SplitNorm", "Style", "STYLES", "as_style", "match_plan",
           "builtin_plan", "gpt_plan", "llama_plan", "gpt2_plan", "BUILTIN_PLANS", "has_own_forward"]


@dataclasses.dataclass(frozen=True)
class Colwise:
    """Column-parallel Linear.

    gather_output: all-gather the output features (full output on every rank), e.g. a head whose logits go to a
        loss that needs the whole vocabulary. fused: number of equal output blocks side by side (3 for [q|k|v]), or
    their sizes (Phi-3's uneven [q|k|v] under grouped-query attention); each block is split on its own.
    """

    gather_output: bool = False
    fused: int | tuple[int, ...] = 1


@dataclasses.dataclass(frozen=True)
class Rowwise:
    """Row-parallel Linear. input_is_parallel: the input holds this rank's features (a colwise layer's output)."""

    input_is_parallel: bool = True


@dataclasses.dataclass(frozen=True)
class Vocab:
    """Vocabulary-parallel Embedding (rows split across ranks)."""


@dataclasses.dataclass(frozen=True)
class Sequence:
    """Replicated parameters used on sequence shards: gradients all-reduced under sequence parallel."""


@dataclasses.dataclass(frozen=True)
class Heads:
    """Replicated parameters used on this rank's attention heads (a per-head norm) or MLP features (an activation's
    scalars): gradients always all-reduced (torchtitan plans Qwen3's q_norm / k_norm as SequenceParallel over the heads
    dimension, to the same effect)."""


@dataclasses.dataclass(frozen=True)
class HeadRows:
    """The module's own parameters with one row per attention head (GPT-OSS's attention sinks): each rank keeps the
    rows of its heads (head_rows.py); their gradients are complete on the rank."""


@dataclasses.dataclass(frozen=True)
class SplitNorm:
    """An RMSNorm over the whole output width of a column-parallel projection (OLMo 2's q_norm / k_norm): each rank
    keeps its features' weights and the mean square is summed over the group (split_norm.py)."""


Style = Union[Colwise, Rowwise, Vocab, Sequence, Heads, HeadRows, SplitNorm]
STYLES = {"colwise": Colwise(), "rowwise": Rowwise(), "vocab": Vocab(), "sequence": Sequence(), "heads": Heads(),
          "head_rows": HeadRows(), "split_norm": SplitNorm()}


def as_style(pattern: str, style: object) -> Style:
    if isinstance(style, (Colwise, Rowwise, Vocab, Sequence, Heads, HeadRows, SplitNorm)):
        return style
    if isinstance(style, str) and style in STYLES:
        return STYLES[style]
    raise ValueError(f"parallelize: plan[{pattern!r}]={style!r} is not a style; allowed {sorted(STYLES)} or a "
                     f"Colwise / Rowwise / Vocab / Sequence / Heads / HeadRows / SplitNorm object")


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def match_plan(model: nn.Module, plan: dict[str, object]) -> dict[str, Style]:
    """Resolve a plan to ``{module name: style}`` in ``named_modules()`` order.

    Raises ValueError for a pattern that matches no module (a typo would otherwise silently leave a layer dense),
    for a module matched by two patterns with different styles, and for a style that is not a style.
    """
    if not isinstance(plan, dict) or not plan:
        raise ValueError(f"parallelize: plan must be a non-empty dict of pattern -> style or one of "
                         f"{sorted(BUILTIN_PLANS)}, got {plan!r}")
    styles = {pattern: as_style(pattern, style) for pattern, style in plan.items()}
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, Style] = {}
    by: dict[str, str] = {}
    for pattern, style in styles.items():
        hits = [name for name in names if _matches(name, pattern)]
        if not hits:
            raise ValueError(f"parallelize: plan pattern {pattern!r} matches no module of {type(model).__name__}; "
                             f"module names look like {names[:6]}")
        for name in hits:
            if name in resolved and resolved[name] != style:
                raise ValueError(f"parallelize: module {name!r} is matched by {by[name]!r} ({resolved[name]}) and "
                                 f"{pattern!r} ({style}); give it one style")
            resolved[name], by[name] = style, pattern
    order = {name: i for i, name in enumerate(names)}
    return dict(sorted(resolved.items(), key=lambda item: order[item[0]]))


def _check_divides(what: str, value: int, tp: int, hint: str = "") -> None:
    if value % tp:
        raise ValueError(f"parallelize: tp size {tp} does not divide {what}={value}{hint}")


def gpt_plan(model: nn.Module, tp: int) -> dict[str, Style]:
    """The plan of the shardwise GPT (Megatron's layout), after checking that `tp` divides its sizes.

    Attention heads are split across ranks (``qkv`` colwise with fused=3, so each rank keeps whole heads of q, k
    and v; ``proj`` rowwise over the same heads), the MLP is split Megatron style (``fc`` colwise, ``proj``
    rowwise), the tied token embedding / head are split by vocabulary rows (one shared shard, see parallelize.py),
    and the LayerNorms and the position embedding are sequence-parallel regions.

    A GPT with experts (``n_experts > 0``: each block's ``mlp`` is a MoE, models/moe.py) keeps its MoE layers whole
    on every rank (Megatron-core's expert-tensor-parallel size 1): the router and the experts are replicated over tp
    and each rank runs them on the tokens it holds. Without sequence parallel those are every tp rank's same tokens,
    so the ranks route and compute alike; under sequence parallel each rank routes its own sequence shard (the layer
    is token-wise), so the layer is a "sequence" region: its gradients are summed over tp, and its load-balancing
    statistics too (`MoE.set_sequence_group`). Expert parallel (shardwise.experts) splits the experts afterwards over
    the data-parallel ranks of each tp coordinate.
    """
    config = model.config
    _check_divides("the number of attention heads n_heads", config.n_heads, tp,
                   " (tensor parallel splits whole heads across ranks)")
    if not config.n_experts:
        _check_divides("the MLP hidden size d_ff", config.ff_dim, tp)
    _check_divides("the vocabulary size vocab_size", config.vocab_size, tp,
                   f"; pad the vocabulary to a multiple of {tp} (e.g. GPTConfig(vocab_size="
                   f"{-(-config.vocab_size // tp) * tp}))")
    return {
        "tok_emb": Vocab(),
        "pos_emb": Sequence(),
        "blocks.*.ln1": Sequence(),
        "blocks.*.attn.qkv": Colwise(fused=3),
        "blocks.*.attn.proj": Rowwise(),
        "blocks.*.ln2": Sequence(),
        **({"blocks.*.mlp": Sequence()} if config.n_experts else
           {"blocks.*.mlp.fc": Colwise(), "blocks.*.mlp.proj": Rowwise()}),
        "ln_f": Sequence(),
        "head": Colwise(),  # vocabulary-parallel logits, consumed by vocab_parallel_cross_entropy
    }


def has_own_forward(module: nn.Module, base: type[nn.Module]) -> bool:
    """Whether `module`, an instance of `base` (nn.Linear, nn.Embedding), overrides its forward: a parallel layer
    replacing it would compute `base`'s forward instead (transformers' GemmaTextScaledWordEmbedding scales its
    output)."""
    return type(module).forward is not base.forward


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


def llama_plan(model: nn.Module, tp: int) -> dict[str, Style]:
    """The plan of Llama-style models with HuggingFace module names.

    q/k/v_proj colwise and o_proj rowwise (heads, and key/value heads under grouped-query attention, split across
    ranks), gate/up_proj colwise (a fused gate_up_proj Linear, GLM-4's, as two blocks) and down_proj rowwise (a MoE
    block without them, Mixtral's, stays whole),
    embed_tokens vocabulary-parallel, lm_head colwise with gathered output (the model computes its own loss over full
    logits); a tied lm_head shares the embedding's shard; per-head norms (Qwen3's q_norm / k_norm) and an MLP
    activation's scalars (Apertus's xIELU) are "heads" regions (their gradients summed over the group); a q_norm /
    k_norm over the projection's whole width (OLMo 2 / 3, OLMoE) is split with it ("split_norm"). An embedding with
    a forward of its own (Gemma's scales its output by sqrt(hidden size)) stays whole on every rank, and so does an
    lm_head tied to it: the parallel embedding would not run that forward (parallelize refuses to split such a
    module).
    Phi-3's fused ``qkv_proj`` is split block by block ([q | k | v], uneven under grouped-query attention) and its
    attention reads this rank's head counts (fused_qkv.py); any other fused qkv_proj is refused by name.
    Raises ValueError naming the numbers when `tp` does not divide the attention or key/value heads.
    """
    fused_qkv: set[tuple[int, ...]] = set()
    for name, module in model.named_modules():
        if isinstance(getattr(module, "qkv_proj", None), nn.Linear) and not hasattr(module, "q_proj"):
            fused_qkv.add(_fused_qkv_blocks(name, module, tp))
        for proj, attrs, what in _HEAD_COUNTS:
            child = getattr(module, proj, None)
            if isinstance(child, nn.Linear):
                heads = _heads_of(module, child, *attrs)
                if heads is not None:
                    _check_divides(f"the number of {what} of {name or 'the model'} ({attrs[-1]})", heads, tp)
    modules = [(name.rsplit(".", 1)[-1], module) for name, module in model.named_modules()]
    names = {n for n, _ in modules}
    whole = [m for n, m in modules if n == "embed_tokens" and has_own_forward(m, nn.Embedding)]
    if len(fused_qkv) > 1:
        raise ValueError(f"tensor parallel plan 'llama': the fused qkv_proj layers have different [q | k | v] blocks "
                         f"{sorted(fused_qkv)}; pass a plan dict")
    attention: dict[str, Style] = ({"qkv_proj": Colwise(fused=fused_qkv.pop())} if fused_qkv else
                                   {"q_proj": Colwise(), "k_proj": Colwise(), "v_proj": Colwise()})
    plan: dict[str, Style] = {**({} if whole else {"embed_tokens": Vocab()}), **attention, "o_proj": Rowwise()}
    # A mixture-of-experts MLP (Mixtral's fused experts: no gate/up/down_proj modules) stays whole on every rank, as
    # the GPT plan keeps its MoE layers; expert parallel may split it over ep afterwards.
    fused_mlp = any(n == "gate_up_proj" and isinstance(m, nn.Linear) for n, m in modules)  # GLM-4, Phi-3: [gate|up]
    mlp = {k: v for k, v in (("gate_proj", Colwise()), ("up_proj", Colwise()), ("down_proj", Rowwise()),
                             ("gate_up_proj", Colwise(fused=2))) if k in names and (k != "gate_up_proj" or fused_mlp)}
    if not mlp and not any(type(m).__name__.endswith(("Experts", "SparseMoeBlock")) for m in model.modules()):
        raise ValueError("tensor parallel plan 'llama': the model has neither gate_proj / up_proj / down_proj MLPs "
                         "nor a mixture-of-experts block; pass a plan dict naming its MLP's modules")
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
    _check_divides(f"the number of attention heads of {name} (num_attention_heads)", blocks[0] // head_dim, tp)
    _check_divides(f"the number of key/value heads of {name} (num_key_value_heads)", blocks[1] // head_dim, tp)
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


def gpt2_plan(model: nn.Module, tp: int) -> dict[str, Style]:
    """The plan of HuggingFace GPT-2 (GPT2LMHeadModel, GPT2Model, ...), whose projections are ``Conv1D`` layers.

    ``attn.c_attn`` (fused [q|k|v]) colwise with fused=3 and ``attn.c_proj`` rowwise (whole heads per rank),
    ``mlp.c_fc`` colwise and ``mlp.c_proj`` rowwise, ``wte`` vocabulary-parallel and ``lm_head`` (when present,
    tied to ``wte``: one shared shard) colwise with gathered output, so HuggingFace's own loss sees full logits;
    ``wpe`` and the LayerNorms stay replicated. The Conv1D conversion and the per-rank head counts are in
    `hf_gpt2.py`. Raises ValueError for a model that is not a GPT-2, one with cross-attention, and a `tp` that does
    not divide n_head, n_embd, the MLP width (n_inner, default 4 * n_embd) or vocab_size.
    """
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "gpt2":
        raise ValueError(f"parallelize: plan='gpt2' needs a HuggingFace GPT-2 model (config.model_type == 'gpt2', "
                         f"e.g. transformers.GPT2LMHeadModel), got {type(model).__name__}; pass a dict plan for "
                         f"other models")
    if getattr(config, "add_cross_attention", False):
        raise ValueError("parallelize: plan='gpt2' does not support cross-attention (config.add_cross_attention="
                         "True); pass a dict plan")
    n_inner = config.n_inner if config.n_inner is not None else 4 * config.n_embd
    _check_divides("the number of attention heads n_head", config.n_head, tp,
                   " (tensor parallel splits whole heads across ranks)")
    _check_divides("the hidden size n_embd", config.n_embd, tp)
    _check_divides("the MLP hidden size n_inner", n_inner, tp)
    _check_divides("the vocabulary size vocab_size", config.vocab_size, tp,
                   f"; pad the vocabulary to a multiple of {tp} (model.resize_token_embeddings("
                   f"{-(-config.vocab_size // tp) * tp}))")
    plan: dict[str, Style] = {
        "wte": Vocab(),
        "h.*.attn.c_attn": Colwise(fused=3), "h.*.attn.c_proj": Rowwise(),
        "h.*.mlp.c_fc": Colwise(), "h.*.mlp.c_proj": Rowwise(),
    }
    if any(name.rsplit(".", 1)[-1] == "lm_head" for name, _ in model.named_modules()):
        plan["lm_head"] = Colwise(gather_output=True)
    return plan


BUILTIN_PLANS = {"gpt": gpt_plan, "llama": llama_plan, "gpt2": gpt2_plan}


def builtin_plan(name: str, model: nn.Module, tp: int) -> dict[str, Style]:
    if name not in BUILTIN_PLANS:
        raise ValueError(f"parallelize: plan={name!r} is not a built-in plan; allowed {sorted(BUILTIN_PLANS)} or a "
                         f"dict of pattern -> style")
    return BUILTIN_PLANS[name](model, tp)
