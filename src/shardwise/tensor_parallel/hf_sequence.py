"""Sequence parallelism for HuggingFace decoders under plan "llama" (Korthikanti et al. 2022, section 4.2.2).

Why not as for shardwise's GPT. Between its embedding and its first layer, HuggingFace's LlamaModel computes what
every layer takes besides the hidden states -- the causal mask and the rotary angles, from positions
``arange(T)`` with T read off the embedding output -- and each attention reads the sequence length off its own
input (``hidden_states.shape[:-1]``). A sequence shard in either place gives wrong masks and positions, or a shape
error; so the shards begin and end elsewhere than in the GPT (tensor_parallel/gpt.py).

What. The embedding output stays whole (the vocabulary-parallel embedding all-reduces it, as without sequence
parallel), so the model computes its mask and positions from the whole sequence. The first decoder layer's input is
cut to this rank's sequence shard (no traffic forward; the gradient all-gathered backward). Inside every layer the
norms and residual adds run on the shard ("sequence" regions: their replicated weights' gradients are summed over
the group); each split attention and MLP all-gathers its input along the sequence as it enters (Korthikanti's
f-bar: a reduce-scatter of the gradient backward), so it sees the whole sequence the mask and positions describe,
and its row-parallel output projection reduce-scatters (g-bar). The final norm runs on the shard and all-gathers
its output (its gradient split backward: the head after it, split or whole, gives every rank the whole one), so the
model's output is whole, as without sequence parallel. The projections inside a gathered module take that
input as it is and leave their input gradient partial (`ColumnParallelLinear.input_gathered`): the gather's one
reduce-scatter sums q's, k's and v's at once. The traffic is Megatron's sequence parallel's, with an all-reduce of
the embedding output in place of a reduce-scatter, and of the head's input gradient.

A mixture-of-experts block (Mixtral's, Qwen3-MoE's, GPT-OSS's, Llama 4's ...: plan "llama" keeps its router and
experts whole on every rank, as without sequence parallel) runs on the whole sequence: its input is all-gathered as
it enters (its gradient split backward: every rank computes the same whole gradient there) and its output cut to the
shard (the gradient all-gathered backward). So every rank routes every token, as without sequence parallel: the
router's logits, and the load-balancing loss HuggingFace's forward (or the pipeline stages, hf_router_loss.py)
computes from them over the whole sequence, are one process's; the replicated router and experts get the same whole
gradients on every rank, with no sum. A shared expert inside the block (Qwen2-MoE's, DeepSeek-V3's) is split as
plan "llama" splits any MLP, as plain tensor parallel (its row-parallel output all-reduced, not reduce-scattered).
Megatron-LM instead routes each rank's own shard (Korthikanti et al.'s layout carried into the MoE layer), which
saves the block's activations too; shardwise's GPT does that (models/moe.py).

A recurrent sequence mixer (Qwen3-Next's and Qwen3.5's Gated DeltaNet, `linear_attn`; Falcon-H1's Mamba-2 mixer,
`mamba`), which plan "llama" keeps whole, runs on the whole sequence the same way: its recurrence sees every token, as
in one process.

A latent attention (DeepSeek-V2 / V3's, MiniCPM3's: plan "llama" keeps its down projections q_a_proj and
kv_a_proj_with_mqa whole and splits the up projections that take their normed outputs) takes the whole sequence too,
its gradient split back: the replicated down projections give every rank the whole input gradient, the split up
projections sum theirs over the group themselves (Megatron's f, as without sequence parallel), and its row-parallel
o_proj reduce-scatters to the shard like any attention's.

Limits (ValueError at wrap time, naming the module): a module with parameters in a decoder layer, outside its
split attention and MLP, that is neither a norm, a mixture-of-experts block nor a recurrent mixer (an adapter); a
split projection that does not take the layer's hidden states, outside a latent attention; dropout between the
embedding and the first layer (its mask would differ on the ranks, which share that activation), or inside a block
that runs on the whole sequence. sw.parallelize's pipeline stages (models/hf_stages.py) rebuild the mask and
positions from the hidden states they receive: every decoder stage after the first is told it receives shards
(`sequence_split`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from ..comm.base import Communicator
from ..compiled import eager_while_traced
from .mappings import gather_from_region, gather_from_sequence_region, scatter_to_sequence_region
from .latent_attention import is_latent_attention
from .llama_plan import holds_moe_block
from .styles import Colwise, Rowwise, Sequence, Style

__all__ = ["HFSequence", "plan_hf_sequence", "install_hf_sequence"]

#: Projections that take a decoder layer's hidden states directly: their module's input is what the region gathers.
_INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "c_fc")


@dataclasses.dataclass
class HFSequence:
    """Where the shards begin and end and the gathers happen: `first_layer` cuts its input to the shard, each of
    `gathered` (a layer's split attention or MLP) all-gathers its input, the projections in `gathered_inputs` take
    it so, each of `whole` (a mixture-of-experts block) runs on the whole sequence, the split projections in
    `whole_projections` (its shared expert's) as plain tensor parallel, each of `whole_input` (a latent attention)
    takes the whole sequence with its gradient split back and reduce-scatters its output, and `final_norm`
    all-gathers its output."""

    first_layer: str
    gathered: list[str]
    gathered_inputs: set[str]
    final_norm: str
    whole: list[str] = dataclasses.field(default_factory=list)
    whole_projections: set[str] = dataclasses.field(default_factory=set)
    whole_input: list[str] = dataclasses.field(default_factory=list)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


def _holds_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _runs_whole(name: str, module: nn.Module) -> bool:
    """A module plan "llama" keeps whole on every rank that runs on the whole sequence under sequence parallel: a
    mixture-of-experts block, or a recurrent sequence mixer, whose recurrence runs along the whole sequence
    (Qwen3-Next's and Qwen3.5's Gated DeltaNet, `linear_attn`; Falcon-H1's Mamba-2 mixer, `mamba`)."""
    return holds_moe_block(module) or name.rpartition(".")[2] in ("linear_attn", "mamba") \
        or type(module).__name__.endswith(("GatedDeltaNet", "Mixer"))


def plan_hf_sequence(model: nn.Module, styles: dict[str, Style]) -> HFSequence:
    """Add the "sequence" regions of a Llama-style decoder to `styles` (every norm of its layers, and the norms beside
    them: the final one) and find where its shards begin and its gathers happen (module docstring). ValueError for
    what the module docstring's limits name."""
    modules = dict(model.named_modules())
    whole = [name for name, module in modules.items()  # a decoder layer's child (the cheap test first)
             if isinstance(modules.get(name.rpartition(".")[0].rpartition(".")[0]), nn.ModuleList)
             and _runs_whole(name, module)]
    inside = {name for name in styles if any(name.startswith(f"{block}.") for block in whole)}
    inputs = [name for name, style in styles.items()
              if isinstance(style, Colwise) and not style.gather_output and name not in inside]
    regions: dict[str, None] = {}
    latent: dict[str, None] = {}  # latent attentions: their projections take the gathered input as plain tp
    lists: dict[str, None] = {}
    for name in inputs:
        region, _, leaf = name.rpartition(".")
        layer, _, _ = region.rpartition(".")
        parent = layer.rpartition(".")[0]
        if isinstance(modules.get(parent), nn.ModuleList) and is_latent_attention(modules[region]):
            latent[region] = None
        elif not isinstance(modules.get(parent), nn.ModuleList) or leaf not in _INPUT_PROJECTIONS:
            raise ValueError(f"parallelize: sequence_parallel=True with plan 'llama' gathers the input of each split "
                             f"attention and MLP of a decoder layer, whose projections "
                             f"({', '.join(_INPUT_PROJECTIONS)}) take it directly; {name!r} is split and takes "
                             f"something else; use sequence_parallel=False")
        regions[region] = None
        lists[parent] = None
    inputs = [name for name in inputs if name.rpartition(".")[0] not in latent]
    if len(lists) != 1:
        raise ValueError(f"parallelize: sequence_parallel=True with plan 'llama' needs one list of decoder layers "
                         f"holding the split projections, found {sorted(lists) or 'none'}; use "
                         f"sequence_parallel=False")
    (layers,) = lists
    base = layers.rpartition(".")[0]
    for index, layer in enumerate(modules[layers]):
        prefix = f"{layers}.{index}"
        for child, module in layer.named_children():
            name = f"{prefix}.{child}"
            if name in regions or name in whole or not _holds_params(module):
                continue
            if not _is_norm(module):
                raise ValueError(f"parallelize: sequence_parallel=True with plan 'llama': {name!r} "
                                 f"({type(module).__name__}) holds parameters and would run on this rank's sequence "
                                 f"shard outside the split attention and MLP; only norms can, and mixture-of-experts "
                                 f"blocks and recurrent mixers run on the whole sequence; use "
                                 f"sequence_parallel=False")
            styles[name] = Sequence()
    finals = []
    for child, module in (modules[base].named_children() if base in modules else ()):
        name = f"{base}.{child}" if base else child
        if _is_norm(module):
            finals.append(name)
            if _holds_params(module):  # OLMo's norms have none
                styles[name] = Sequence()  # the final norm, after the last layer: on the shard
        if isinstance(module, nn.Dropout) and module.p > 0:
            _refuse_dropout(name)
    # StarCoder2 drops out its embedding output functionally, by a float of the base model's (`embedding_dropout`)
    for attr, value in vars(modules.get(base, model)).items():
        if ("dropout" in attr or "pdrop" in attr) and isinstance(value, float) and value > 0:
            _refuse_dropout(f"{base}.{attr}" if base else attr)
    if len(finals) != 1:
        raise ValueError(f"parallelize: sequence_parallel=True with plan 'llama' ends the shards at the final norm "
                         f"beside the decoder layers {layers!r}; found {finals or 'none'}; use sequence_parallel=False")
    for block in whole:  # every rank runs it on the same tokens, while sequence parallel draws masks per rank
        for name, module in modules[block].named_modules(prefix=block):
            rates = [module.p] if isinstance(module, nn.Dropout) else [
                value for attr, value in vars(module).items() if "dropout" in attr and isinstance(value, float)]
            if any(rate > 0 for rate in rates):
                raise ValueError(f"parallelize: sequence_parallel=True with plan 'llama': {name!r} drops out inside "
                                 f"{block!r} ({type(modules[block]).__name__}), which every rank runs on the whole "
                                 f"sequence, while sequence parallel draws each rank's own masks (the copies of its "
                                 f"parameters would train on other numbers); set its dropout to 0 or use "
                                 f"sequence_parallel=False")
    outside = [block for block in whole if not block.startswith(f"{layers}.")]
    if outside:
        raise ValueError(f"parallelize: sequence_parallel=True with plan 'llama': the blocks {outside} (mixture of "
                         f"experts, recurrent mixers) are not in the decoder layers {layers!r}, where the shards run; "
                         f"use sequence_parallel=False")
    projections = {name for name in inside if isinstance(styles[name], (Colwise, Rowwise))}
    gathered = [region for region in regions if region not in latent]
    return HFSequence(f"{layers}.0", gathered, set(inputs), finals[0], whole, projections, list(latent))


def _refuse_dropout(what: str) -> None:
    raise ValueError(f"parallelize: sequence_parallel=True with plan 'llama': {what!r} drops out the activations every "
                     f"rank holds whole before the first layer, with masks of its own on each rank under sequence "
                     f"parallel (the gradients would go through other ranks' masks); set it to 0 or use "
                     f"sequence_parallel=False")


def _replacing_hidden(change: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """A forward pre-hook (with kwargs) that passes `change(hidden_states)` on in its place, positional or named."""

    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}
        if args and isinstance(args[0], torch.Tensor):
            return (change(args[0]), *args[1:]), kwargs
        raise ValueError(f"sequence parallel: {type(module).__name__} was called without its hidden states (first "
                         f"argument or hidden_states=)")

    return hook


# Under torch.compile (a block compiled in place) the collectives run eagerly between the graphs, as the
# tensor-parallel layers do (compiled.py)
_scatter, _gather, _gather_out = (eager_while_traced(f) for f in (scatter_to_sequence_region,
                                                                  gather_from_sequence_region, gather_from_region))


def install_hf_sequence(model: nn.Module, where: HFSequence, comm: Communicator, dim: int) -> None:
    """Hook the first layer (cut its input to this rank's shard), every gathered module (all-gather its input), every
    mixture-of-experts block (whole sequence in, shard out) and the final norm (all-gather its output)."""
    model.get_submodule(where.first_layer).register_forward_pre_hook(
        _replacing_hidden(lambda h: _scatter(h, comm, dim)), with_kwargs=True)
    for name in where.gathered:
        model.get_submodule(name).register_forward_pre_hook(
            _replacing_hidden(lambda h: _gather(h, comm, dim)), with_kwargs=True)
    for name in where.whole_input:  # whole sequence in, the gradient split back; its o_proj reduce-scatters
        model.get_submodule(name).register_forward_pre_hook(
            _replacing_hidden(lambda h: _gather_out(h, comm, dim)), with_kwargs=True)
    for name in where.whole:  # whole sequence in (the gradient split back), this rank's shard out
        block = model.get_submodule(name)
        block.register_forward_pre_hook(_replacing_hidden(lambda h: _gather_out(h, comm, dim)), with_kwargs=True)
        block.register_forward_hook(_shard_of_output(comm, dim), with_kwargs=True)
    model.get_submodule(where.final_norm).register_forward_hook(lambda module, args, out: _gather_out(out, comm, dim))


def _shard_of_output(comm: Communicator, dim: int) -> Callable:
    """A forward hook (with kwargs) of a block that ran on the whole sequence: its output hidden states (the tensor,
    or the first of a tuple: a block that also returns its router logits, which stay whole) cut to this rank's
    shard, in the shape it returned them: (B, T, H) like its input, or flattened to (B x T, H) (Llama 4's)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any], out: Any) -> Any:
        given = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        hidden = out[0] if isinstance(out, tuple) else out
        if hidden.shape[:-1] == given.shape[:-1]:
            shard = _scatter(hidden, comm, dim)
        elif hidden.dim() == 2 and hidden.shape[0] == given.shape[:-1].numel():
            shard = _scatter(hidden.reshape(*given.shape[:-1], -1), comm, dim).reshape(-1, hidden.shape[-1])
        else:
            raise ValueError(f"sequence parallel: {type(module).__name__} returned hidden states of shape "
                             f"{tuple(hidden.shape)} for an input of {tuple(given.shape)}; a mixture-of-experts block "
                             f"runs on the whole sequence and its output is cut to this rank's shard, which needs the "
                             f"input's (B, T, H) or its rows flattened (B x T, H)")
        return (shard, *out[1:]) if isinstance(out, tuple) else shard

    return hook
