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

import torch

from .cross_entropy import vocab_parallel_cross_entropy
from .mappings import gather_from_region

__all__ = ["TensorParallelGPTMixin", "install_gpt_forward"]

_CLASS_CACHE: dict[type, type] = {}


class TensorParallelGPTMixin:
    """Forward of a tensor-parallel GPT: vocabulary-parallel embedding, head and loss (see the module docstring)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Loss (scalar) with targets, else the full logits (B, T, V); same contract as GPT.forward."""
        tp = self._shardwise_tp
        comm = tp.comm
        if idx.dim() != 2 or idx.is_floating_point() or idx.is_complex():
            raise ValueError(f"idx must be an integer tensor of shape (B, T), got {idx.dtype} {tuple(idx.shape)}")
        T, seq_len = idx.shape[1], self.pos_emb.num_embeddings
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
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, V/tp): this rank's vocabulary slice
        if targets is None:
            return gather_from_region(logits, comm, -1)
        return vocab_parallel_cross_entropy(logits, targets, comm)

    def pipeline_layers(self):  # noqa: ANN201
        raise NotImplementedError(
            "pipeline_layers() of a tensor-parallel GPT is not supported: its head returns vocabulary-parallel "
            "logits that need vocab_parallel_cross_entropy; split the dense model into stages before parallelize"
        )


def install_gpt_forward(model: torch.nn.Module) -> None:
    """Swap `model`'s class for a subclass with the tensor-parallel forward (cached per class)."""
    cls = type(model)
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"TensorParallel{cls.__name__}", (TensorParallelGPTMixin, cls),
                                 {"__module__": cls.__module__})
    model.__class__ = _CLASS_CACHE[cls]
