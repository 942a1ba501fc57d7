"""Tensor-parallel plans: data that maps module-name patterns to parallel styles (no edits of model code).

A plan is a dict ``{pattern: style}``. A pattern is an ``fnmatch`` pattern (``*`` matches any characters, dots
included) over the dotted module names of ``model.named_modules()``; it matches a module whose whole name matches,
or whose name ends with ``"." + pattern`` (so ``"q_proj"`` matches ``"model.layers.3.self_attn.q_proj"``). A style
is one of the strings of `styles.STYLES` or a style object carrying options (styles.py lists them).

Built-in plans (``plan="gpt"`` / ``plan="llama"`` / ``plan="gpt2"`` / ``plan="hf"``) are computed from the model by
:func:`builtin_plan`, which also validates the head counts: a tensor-parallel size that does not divide them is a
ValueError naming both numbers. The llama plan is in llama_plan.py; plan "hf" (hf_plan.py) reads the plan a
HuggingFace model ships in its config.
"""

from __future__ import annotations

from torch import nn

from .hf_plan import hf_plan
from .llama_plan import llama_plan
from .styles import (STYLES, Colwise, HeadRows, Heads, Rowwise, Sequence, SplitNorm, Style, Vocab, as_style,
                     check_divides, has_own_forward, pattern_matches)

__all__ = ["Colwise", "Rowwise", "Vocab", "Sequence", "Heads", "HeadRows", "SplitNorm", "Style", "STYLES", "as_style",
           "match_plan", "builtin_plan", "gpt_plan", "llama_plan", "gpt2_plan", "hf_plan", "BUILTIN_PLANS",
           "has_own_forward"]


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
        hits = [name for name in names if pattern_matches(name, pattern)]
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
    check_divides("the number of attention heads n_heads", config.n_heads, tp,
                   " (tensor parallel splits whole heads across ranks)")
    if not config.n_experts:
        check_divides("the MLP hidden size d_ff", config.ff_dim, tp)
    check_divides("the vocabulary size vocab_size", config.vocab_size, tp,
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
    check_divides("the number of attention heads n_head", config.n_head, tp,
                   " (tensor parallel splits whole heads across ranks)")
    check_divides("the hidden size n_embd", config.n_embd, tp)
    check_divides("the MLP hidden size n_inner", n_inner, tp)
    check_divides("the vocabulary size vocab_size", config.vocab_size, tp,
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


BUILTIN_PLANS = {"gpt": gpt_plan, "llama": llama_plan, "gpt2": gpt2_plan, "hf": hf_plan}


def builtin_plan(name: str, model: nn.Module, tp: int) -> dict[str, Style]:
    if name not in BUILTIN_PLANS:
        raise ValueError(f"parallelize: plan={name!r} is not a built-in plan; allowed {sorted(BUILTIN_PLANS)} or a "
                         f"dict of pattern -> style")
    return BUILTIN_PLANS[name](model, tp)
