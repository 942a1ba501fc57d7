"""``parallelize(model, comm, plan)``: apply a tensor-parallel plan in place, and gather a full state dict back.

Mechanism. The plan (see `plans.py`) is resolved against ``model.named_modules()``; every module matched by
``colwise`` / ``rowwise`` / ``vocab`` is replaced, in its parent, by the tensor-parallel layer built from it with
``from_dense`` (this rank keeps its slice of the weights; the dense tensors are dropped), so the parallelised
model starts equal to the original and keeps its parameter names. Then, under sequence parallel, the parameters of
``sequence`` modules get gradient all-reduce hooks. Every rank of `comm` must call ``parallelize`` on the same
model (same weights, same plan): nothing is communicated at wrap time, each rank just keeps its slice.

Tied parameters. A weight shared by two replaced modules (the GPT's tok_emb / head, a Llama with
tie_word_embeddings) becomes one shared shard when both styles split it the same way (vocabulary rows = output
rows); a tie between styles that split differently is a ValueError naming both modules. A replaced module's
parameter also registered on a module the plan leaves alone (BERT's LM head: ``self.bias = self.decoder.bias``)
follows it: that registration is pointed at the new (possibly sharded) parameter, so the two names stay one
tensor, train together and gather as one; but when that module is itself a dense layer that computes with it (an
nn.Linear, an nn.Embedding left out of the plan), the tie is a ValueError naming both (the dense user would
silently train a stale copy, or compute with a slice).

Plan "gpt" also installs the GPT's tensor-parallel forward (vocabulary-parallel loss, sequence-parallel position
embeddings; see `gpt.py`). Plan "llama" divides the per-rank head counts (``num_heads``, ``num_key_value_heads``,
``hidden_size``) of attention modules that store them (older HuggingFace versions; newer ones infer the local head
count from the projection width), and does not support sequence parallel: HuggingFace's LlamaModel builds the
causal mask and positions from the embedding output, which would be a sequence shard. Plan "gpt2" (HuggingFace
GPT-2) splits its ``Conv1D`` layers as the Linears they equal and divides its attention's per-rank sizes (see
`hf_gpt2.py`); no sequence parallel either, for the same reason.

Dropout. A model split over more than one rank draws its dropout masks from a stream the group shares
(`dropout_stream.py`): the replicated regions drop the same activations on every rank, whatever each rank seeded
torch with, and an activation-checkpointing recompute draws the masks its forward drew; under sequence parallel,
where every region is a shard, each rank's stream is its own.

Order with other strategies (torchtitan's): pipeline split first, then tensor parallel, then data parallel or
sharding over the dp axis of the Mesh; build the optimizer after the last wrap.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .. import layout
from ..agreement import check_agreement, describe_parameters, fingerprints
from ..comm.base import Communicator, is_communicator
from ..compiled import refuse_compiled
from ..dropout_functions import install as install_dropout_stream
from ..dropout_regions import mark_regions
from ..dropout_stream import group_seed
from ..optimizer_guard import register_wrapped
from ..param_hooks import carry_grad_hooks
from ..placement import to_comm_device
from ..sharded_tensor import spec_of
from ..whole.gather import gather_full
from ..whole.state_dict import load_full_into_pieces
from .declare import tensor_parallel_placements
from .fused_qkv import use_local_heads
from .gpt import install_gpt_forward
from .hf_gpt2 import (GPT2_ATTENTION_SIZES, Conv1DColumnParallelLinear, Conv1DRowParallelLinear, conv1d_as_linear,
                      is_conv1d)
from .latent_attention import share_rope_key
from .layer_base import name_slices
from .layers import ColumnParallelLinear, RowParallelLinear, TensorParallelLayer, VocabParallelEmbedding
from .head_rows import slice_head_rows
from .plans import (Colwise, HeadRows, Heads, Rowwise, Sequence, SplitNorm, Style, Vocab, builtin_plan,
                    has_own_forward, match_plan)
from .replica_grads import ReplicatedGradCheck
from .split_norm import SplitRMSNorm
from .hf_sequence import HFSequence, install_hf_sequence, plan_hf_sequence
from .sequence_parallel import reduce_sequence_parallel_grads

__all__ = ["parallelize", "full_state_dict", "TensorParallelState"]


@dataclasses.dataclass(frozen=True)
class TensorParallelState:
    """What parallelize recorded on the model (``model._shardwise_tp``).

    comm: the tensor-parallel group. sequence_parallel, sequence_dim: as passed. plan: the plan's name, or "custom".
    styles: the resolved ``{module name: style}``.
    """

    comm: Communicator
    sequence_parallel: bool
    sequence_dim: int
    plan: str
    styles: dict[str, Style]


def _layout(style: Style) -> tuple:
    """How a style splits a weight's rows/columns: equal layouts may share one shard."""
    if isinstance(style, Vocab) or (isinstance(style, Colwise) and style.fused == 1):
        return ("rows",)
    if isinstance(style, Colwise):
        return ("fused rows", style.fused)
    if isinstance(style, SplitNorm):
        return ("features",)
    return ("columns",)


def _qualified(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _build(name: str, module: nn.Module, style: Style, comm: Communicator, sp: bool, dim: int,
           hf_seq: HFSequence | None = None) -> TensorParallelLayer:
    if isinstance(style, SplitNorm):
        return SplitRMSNorm.from_dense(module, comm, name)
    if isinstance(style, (Colwise, Rowwise)):
        column, row = ColumnParallelLinear, RowParallelLinear
        if is_conv1d(module):  # HuggingFace GPT-2's transposed Linear: split the Linear it equals (hf_gpt2.py)
            column, row, module = Conv1DColumnParallelLinear, Conv1DRowParallelLinear, conv1d_as_linear(module)
        if not isinstance(module, nn.Linear):  # the class's full path: PEFT's LoRA layer is also called "Linear"
            raise ValueError(f"parallelize: module {name!r} is a {_qualified(module)}, not a torch.nn.Linear (or a "
                             f"HuggingFace Conv1D), which style {style} needs; an adapter layer (PEFT's LoRA) is not "
                             f"split: train adapters under data parallel (sw.DDP, sw.ZeRO, sw.FSDP)")
        _refuse_own_forward(name, module, nn.Linear)
        if isinstance(style, Colwise):
            # a HuggingFace decoder's split attention / MLP gathers their input, its final norm its output
            layer = column.from_dense(module, comm, gather_output=style.gather_output,
                                      sequence_parallel=sp and hf_seq is None, sequence_dim=dim, fused=style.fused)
            layer.input_gathered = hf_seq is not None and name in hf_seq.gathered_inputs
            return layer
        whole = hf_seq is not None and name in hf_seq.whole_projections  # a shared expert: plain tensor parallel
        return row.from_dense(module, comm, input_is_parallel=style.input_is_parallel,
                              sequence_parallel=sp and not whole, sequence_dim=dim)
    if not isinstance(module, nn.Embedding):
        raise ValueError(f"parallelize: module {name!r} is a {_qualified(module)}, not the torch.nn.Embedding style "
                         f"{style} needs")
    _refuse_own_forward(name, module, nn.Embedding)  # a HuggingFace decoder's embedding output stays whole
    return VocabParallelEmbedding.from_dense(module, comm, sequence_parallel=sp and hf_seq is None, sequence_dim=dim)


def _refuse_own_forward(name: str, module: nn.Module, base: type[nn.Module]) -> None:
    """A subclass of nn.Linear / nn.Embedding with a forward of its own (transformers' GemmaTextScaledWordEmbedding
    multiplies its output by sqrt(hidden size)) cannot be split: the tensor-parallel layer that replaces it runs the
    base class's computation, so the model would compute something else, without an error."""
    if has_own_forward(module, base):
        raise ValueError(f"parallelize: module {name!r} is a {type(module).__name__}, an nn.{base.__name__} with a "
                         f"forward of its own, which the tensor-parallel layer replacing it would not run (a different "
                         f"result); leave {name!r} out of the plan (it then stays whole on every rank)")


def _adjust_head_counts(model: nn.Module, tp: int, proj: str = "q_proj",
                        attrs: tuple[str, ...] = ("num_heads", "num_key_value_heads", "hidden_size")) -> None:
    for module in model.modules():
        if isinstance(getattr(module, proj, None), ColumnParallelLinear):
            for attr in attrs:
                value = getattr(module, attr, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    setattr(module, attr, value // tp)


def parallelize(model: nn.Module, comm: Communicator, plan: str | dict[str, object] = "gpt", *,
                sequence_parallel: bool = False, sequence_dim: int = 1) -> nn.Module:
    """Split `model` across the tensor-parallel group `comm` in place (Megatron style) and return it.

    model: the dense model, identical on every rank of `comm`.
    comm: the tensor-parallel Communicator (e.g. ``mesh.tp``); a group of one leaves the math unchanged.
    plan: "gpt" (the shardwise GPT), "llama" (HuggingFace Llama module names), "gpt2" (HuggingFace GPT-2, its
        Conv1D layers split as Linears), "hf" (the plan a HuggingFace model's config carries, hf_plan.py), or a
        dict of module-name pattern -> style ("colwise", "rowwise", "vocab", "sequence" or a Colwise / Rowwise /
        Vocab / Sequence object).
    sequence_parallel: run the LayerNorm / dropout / residual regions on sequence shards (Korthikanti et al.
        2022): colwise layers all-gather their input along `sequence_dim`, rowwise and vocab layers reduce-scatter
        their output, and "sequence" modules' parameters get their gradients all-reduced. Under plan "llama" the
        shards run from the first decoder layer to the head and each split attention / MLP gathers (hf_sequence.py).
    sequence_dim: the sequence dimension of the activations (1 for batch-first (B, T, d)).

    Train the result with a plain loop and an optimizer built over ``model.parameters()`` afterwards; every rank
    feeds the same batch. ``full_state_dict(model)`` gathers the original names and shapes.
    Raises ValueError (at wrap time) for a tp size that does not divide the heads, hidden sizes or vocabulary, for a
    plan pattern that matches nothing, a style on the wrong module type, or a model already parallelised.
    """
    refuse_compiled(model, "tensor_parallel.parallelize")
    from ..models.gpt import GPT

    if not isinstance(model, nn.Module):
        raise ValueError(f"parallelize: model must be a torch.nn.Module, got {type(model).__name__}")
    if layout.is_wrapped(model):
        applied = " + ".join(r.name for r in layout.strategies(model))
        raise ValueError(f"parallelize: the model is already wrapped ({applied}); apply tensor parallel to the plain "
                         f"model first, then DDP / ZeRO / FSDP over the data-parallel axis (the documented order)")
    if not is_communicator(comm):
        raise ValueError(f"parallelize: comm must be a Communicator (e.g. mesh.tp), got {type(comm).__name__}")
    if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
        raise ValueError(f"parallelize: sequence_dim={sequence_dim!r} must be an int")
    plan_name = plan if isinstance(plan, str) else "custom"
    if isinstance(plan, str):
        if plan == "gpt" and not isinstance(model, GPT):
            raise ValueError(f"parallelize: plan='gpt' needs a shardwise GPT, got {type(model).__name__}; pass a dict "
                             f"plan for other models")
        if plan == "gpt2" and sequence_parallel:
            raise ValueError("parallelize: plan='gpt2' does not support sequence_parallel=True (HuggingFace's "
                             "GPT2Model adds the position embeddings of the whole sequence to the embedding output "
                             "and builds its causal mask from it, which would be a shard)")
        plan = builtin_plan(plan, model, comm.size)
    if sequence_parallel and plan_name in ("custom", "hf") and type(model).__module__.startswith("transformers."):
        raise ValueError(f"parallelize: sequence_parallel=True with a HuggingFace {type(model).__name__}: its forward "
                         f"builds positions and attention masks from the whole sequence between the layers, which "
                         f"would be a shard (a shape error at the first forward, or wrong masks); use plan "
                         f"'llama' (sequence parallel from the first decoder layer on) or sequence_parallel=False")
    styles = match_plan(model, plan)
    sp = bool(sequence_parallel)
    hf_seq = plan_hf_sequence(model, styles) if sp and plan_name == "llama" else None  # adds "sequence" regions
    if sp:
        _share_sequence_split(model, styles, comm)
    # Every rank slices its own copy of the dense model: the copies must be equal (values too), or the slices are
    # pieces of different models.
    check_agreement(comm, "parallelize", {
        "parameters": describe_parameters(model), "fingerprints": fingerprints(model), "plan": plan_name,
        "styles": {name: repr(style) for name, style in styles.items()}, "sequence_parallel": sp,
        "sequence_dim": sequence_dim})
    to_comm_device(model, comm, "parallelize")  # after the fingerprints (read on the host); slices go to comm.device

    originals: dict[int, tuple[nn.Parameter, str, tuple]] = {}  # id(dense weight) -> (shard, module name, layout)
    replaced: dict[int, tuple[nn.Parameter, str]] = {}  # id(any dense parameter replaced) -> (new one, its name)
    keep_alive = []  # the dense parameters, so their ids stay unique while we compare them
    for name, style in styles.items():
        if isinstance(style, (Sequence, Heads, HeadRows)):
            continue
        dense = model.get_submodule(name)
        layer = _build(name, dense, style, comm, sp, sequence_dim, hf_seq)
        source, split = dense.weight, _layout(style)
        if id(source) in originals:
            shard, other, other_layout = originals[id(source)]
            if other_layout != split or shard.shape != layer.weight.shape:
                raise ValueError(f"parallelize: {name}.weight is tied to {other}.weight, but the plan splits them "
                                 f"differently ({split[0]} vs {other_layout[0]}); give both the same split")
            layer.weight = shard
        else:
            originals[id(source)] = (layer.weight, name, split)
            keep_alive.append(source)
        for attr, old in dense.named_parameters(recurse=False):
            new = getattr(layer, "weight" if old is source else attr, None)
            if isinstance(new, nn.Parameter) and id(old) not in replaced:
                replaced[id(old)] = (new, f"{name}.{attr}")
                keep_alive.append(old)
                carry_grad_hooks(old, new, f"{name}.{attr}", "parallelize")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    head_rows = {}  # id(this rank's rows) -> every rank's boxes
    for name, style in styles.items():
        if isinstance(style, HeadRows):
            keep_alive += [p for _, p in model.get_submodule(name).named_parameters(recurse=False)]
            head_rows.update(slice_head_rows(model.get_submodule(name), name, comm, replaced))
    _follow_ties(model, replaced)
    del keep_alive
    # Replicated parameters whose rank computes on part of the activations get partial gradients, summed over tp:
    # "sequence" regions under sequence parallel, "heads" regions always.
    tp_params = {id(p) for m in model.modules() if isinstance(m, TensorParallelLayer) for p in m.parameters()}
    for name, style in styles.items():
        if isinstance(style, Heads) or (sp and isinstance(style, Sequence)):
            params = [p for p in model.get_submodule(name).parameters() if id(p) not in tp_params]
            reduce_sequence_parallel_grads(params, comm, name)
    if plan_name == "llama":
        _adjust_head_counts(model, comm.size)
    if hf_seq is not None and comm.size > 1:
        install_hf_sequence(model, hf_seq, comm, sequence_dim)
    # What a split attention needs besides its projections, whichever plan split them: Phi-3's local head counts
    # (fused_qkv.py), DeepSeek-V3's rope key summed over the group (latent_attention.py)
    use_local_heads(model, comm.size)
    share_rope_key(model, comm)
    if plan_name == "gpt2":
        _adjust_head_counts(model, comm.size, "c_attn", GPT2_ATTENTION_SIZES)
    name_slices(model)  # the split parameters answer for the dense ones (layer_base.py), under their model names
    if comm.size > 1:  # replicated activations need the same dropout masks on every rank (dropout_stream.py)
        install_dropout_stream(model, group_seed(comm, distinct=sp))
        if not sp:  # split ones each rank's own (dropout_regions.py); under sp every draw is (group_seed)
            layers = list(model.modules())
            mark_regions([m for m in layers if isinstance(m, ColumnParallelLinear) and not m.gather_output],
                         [m for m in layers if isinstance(m, RowParallelLinear)], comm.rank)
    object.__setattr__(model, "_shardwise_tp", TensorParallelState(comm, sp, sequence_dim, plan_name, styles))
    layout.declare(model, layout.Parallelized(
        "tensor_parallel", (comm,), tensor_parallel_placements(model, comm, head_rows), world=comm,
        options={"plan": plan_name, "sequence_parallel": sp, "tp": comm.size},
        before_step=ReplicatedGradCheck(lambda: layout.placements(model), comm) if comm.size > 1 else None))
    if plan_name == "gpt":
        install_gpt_forward(model)
    register_wrapped(model)  # the optimizer guard: its state dicts hold slices (optimizer_guard.py)
    load_full_into_pieces(model)  # torch's load_state_dict of a full (one-process) state dict: each rank's slices
    return model


def _share_sequence_split(model: nn.Module, styles: dict[str, Style], comm: Communicator) -> None:
    """Tell each module that sums statistics over the tokens it sees (a MoE layer's balance loss: `set_sequence_group`)
    that `comm` splits every sequence; such a module outside a "sequence" style would train its parameters on a
    partial gradient, so it is a ValueError naming it."""
    regions = [name for name, style in styles.items() if isinstance(style, Sequence)]
    setters = [(name, m) for name, m in model.named_modules() if callable(getattr(m, "set_sequence_group", None))]
    for name, module in setters:
        if not any(name == r or name.startswith(r + ".") for r in regions):
            raise ValueError(f"parallelize: {name!r} ({type(module).__name__}) runs on sequence shards under "
                             f"sequence_parallel=True but the plan leaves it out; add it to the plan as \"sequence\" "
                             f"(its gradients are then summed over the group), or use sequence_parallel=False")
    for _, module in setters:
        module.set_sequence_group(comm)


_DENSE_LAYERS = (nn.Linear, nn.Embedding, nn.EmbeddingBag, nn.modules.conv._ConvNd)


def _follow_ties(model: nn.Module, replaced: dict[int, tuple[nn.Parameter, str]]) -> None:
    """Point every other registration of a replaced dense parameter at its replacement (see the module docstring),
    or raise ValueError naming both when the other owner is a dense layer that computes with it."""
    for owner_name, owner in model.named_modules():
        for attr, p in list(owner._parameters.items()):
            if p is None or id(p) not in replaced or isinstance(owner, TensorParallelLayer):
                continue
            new, new_name = replaced[id(p)]
            pname = f"{owner_name}.{attr}" if owner_name else attr
            if isinstance(owner, _DENSE_LAYERS) or is_conv1d(owner):
                raise ValueError(f"parallelize: parameter {pname} is tied to {new_name}, which the plan splits, but "
                                 f"{owner_name or 'the model'} is a {type(owner).__name__} left dense; add it to the "
                                 f"plan with the same split, or untie them")
            owner._parameters[attr] = new  # bypasses __setattr__: the registration keeps its place and name


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every tensor-parallel parameter gathered to its original name and shape.

    Collective over each tensor-parallel layer's group: every rank calls it and every rank gets the full tensors
    (copies). Tensors outside tensor-parallel layers (replicated) are copied as they are; a tied parameter is
    gathered once and appears under each of its names, as in ``state_dict()``. Works on any model (a model with no
    tensor-parallel layer just gets a detached copy of its state dict).
    """
    gathered: dict[int, torch.Tensor] = {}
    layers = {id(p): (m, attr) for m in model.modules() if isinstance(m, TensorParallelLayer)
              for attr, p in m.named_parameters(recurse=False)}  # a tied name elsewhere gathers through its layer
    rows = {id(pl.param): pl for pl in layout.placements(model).values()
            if spec_of(pl.param) is not None and id(pl.param) not in layers}  # "head_rows" pieces (head_rows.py)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in layers:
            if id(value) not in gathered:
                owner, attr = layers[id(value)]
                gathered[id(value)] = owner.full_tensor(attr)
            out[key] = gathered[id(value)]
        elif id(value) in rows:
            out[key] = gathered.setdefault(id(value), gather_full(rows[id(value)]))
        else:
            out[key] = value.detach().clone()
    return out
