"""The tensor-parallel forward of the shardwise GPT, installed by ``parallelize(model, comm, plan="gpt")``.

The plan replaces the GPT's modules in place (see `plans.gpt_plan`); what it cannot express as a module swap is the
model's own forward, which adds the position embedding to the token embedding and computes ``F.cross_entropy`` over
full logits. ``parallelize`` therefore swaps the model's class for a subclass whose ``forward`` is
:meth:`TensorParallelGPTMixin.forward` (the technique shardwise.DDP uses): same modules, same parameter names, same
call signature; models/gpt.py is not edited.

Tied embedding and head. With ``tie_weights`` the GPT uses one (V, d) matrix twice. Under the plan both uses are
split by vocabulary rows, so they share ONE Parameter, this rank's (V/tp, d) shard: ``tok_emb`` is a
VocabParallelEmbedding (rank r looks up the ids it owns; an all-reduce, or a reduce-scatter under sequence parallel,
assembles the embeddings) and ``head`` is a ColumnParallelLinear over the same rows, so rank r computes the logits of
its own V/tp ids only. The loss is :func:`vocab_parallel_cross_entropy` over those local logits (3 x tokens floats
of all-reduce instead of gathering tokens x V logits). Both uses accumulate into the one shard's gradient, exactly
as the two uses of the dense tied matrix do. ``model(idx)`` without targets gathers and returns the full logits.

Sequence parallel. The token embedding is reduce-scattered along the sequence, each rank adds the position
embeddings of its own positions (``pos_emb`` is then a sequence-parallel parameter: gradient all-reduced), and the
residual stream stays a (B, T/tp, d) shard through every block; ``head`` all-gathers the sequence again. T must be
divisible by tp.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .._mixin import mix_in
from .cross_entropy import vocab_parallel_cross_entropy
from .mappings import gather_from_region

__all__ = ["TensorParallelGPTMixin", "install_gpt_forward"]


class TensorParallelGPTMixin:
    """Forward of a tensor-parallel GPT: vocabulary-parallel embedding, head and loss (see the module docstring)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Loss (scalar) with targets, else the full logits (B, T, V); same contract as GPT.forward."""
        comm = self._shardwise_tp.comm
        x = _tp_embed(self, idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, V/tp): this rank's vocabulary slice
        if targets is None:
            return gather_from_region(logits, comm, -1)
        loss = vocab_parallel_cross_entropy(logits, targets, comm)
        if self.config.n_experts and self.config.moe_aux_loss_coef:  # the MoE balance loss, as GPT.forward adds it
            loss = loss + self.config.moe_aux_loss_coef * sum(b.mlp.aux_loss for b in self.blocks)
        return loss

    def pipeline_layers(self, *, gather_logits: bool = False) -> list[nn.Module]:
        """The parallelised model as pipeline stages: ``[embedding, *blocks, head]`` holding its own modules.

        The head stage returns this rank's vocabulary slice of the logits, for :meth:`pipeline_loss`
        (vocabulary-parallel cross entropy: the logits are never gathered); with ``gather_logits=True`` it returns
        full logits, for a loss of your own. Under sequence parallel the activations passed between stages are
        sequence shards (B, T/tp, d): tp times less pipeline traffic.
        """
        return [_EmbeddingStage(self), *self.blocks, _HeadStage(self.ln_f, self.head, self._shardwise_tp.comm,
                                                                 gather_logits)]

    def pipeline_loss(self):  # noqa: ANN201 - a loss_fn(logits, targets) -> scalar
        """The loss matching ``pipeline_layers()``: vocabulary-parallel cross entropy over local logits."""
        return functools.partial(_vocab_parallel_lm_loss, comm=self._shardwise_tp.comm)


def _tp_embed(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """drop(tok_emb(idx) + pos_emb(positions)); under sequence parallel, this rank's sequence shard only."""
    tp = model._shardwise_tp
    comm = tp.comm
    if idx.dim() != 2 or idx.is_floating_point() or idx.is_complex():
        raise ValueError(f"idx must be an integer tensor of shape (B, T), got {idx.dtype} {tuple(idx.shape)}")
    T, seq_len = idx.shape[1], model.pos_emb.num_embeddings
    if T > seq_len:
        raise ValueError(f"sequence length T={T} exceeds config.seq_len={seq_len}")
    if tp.sequence_parallel:
        if T % comm.size:
            raise ValueError(f"sequence parallel: sequence length T={T} is not divisible by the tensor-parallel "
                             f"size {comm.size}")
        chunk = T // comm.size
        pos = torch.arange(comm.rank * chunk, (comm.rank + 1) * chunk, device=idx.device)
    else:
        pos = torch.arange(T, device=idx.device)
    return model.drop(model.tok_emb(idx) + model.pos_emb(pos))


def _vocab_parallel_lm_loss(logits: torch.Tensor, targets: torch.Tensor, comm) -> torch.Tensor:  # noqa: ANN001
    return vocab_parallel_cross_entropy(logits, targets, comm)


class _EmbeddingStage(nn.Module):
    """First stage of a tensor-parallel GPT: the vocabulary-parallel embedding plus (sharded) positions."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        object.__setattr__(self, "_shardwise_tp", model._shardwise_tp)  # read by _tp_embed; not a submodule

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return _tp_embed(self, idx)


class _HeadStage(nn.Module):
    """Last stage: ln_f then the column-parallel head; local vocabulary logits, or gathered ones."""

    def __init__(self, ln_f: nn.Module, head: nn.Module, comm, gather_logits: bool) -> None:  # noqa: ANN001
        super().__init__()
        self.ln_f, self.head = ln_f, head
        self.comm, self.gather_logits = comm, gather_logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.ln_f(x))
        return gather_from_region(logits, self.comm, -1) if self.gather_logits else logits


def install_gpt_forward(model: torch.nn.Module) -> None:
    """Swap `model`'s class for a subclass with the tensor-parallel forward (cached per class)."""
    mix_in(model, TensorParallelGPTMixin, "TensorParallel")
