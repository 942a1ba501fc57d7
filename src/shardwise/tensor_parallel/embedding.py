"""The vocabulary-parallel Embedding: rows split across ranks, the others' rows filled in by one reduction. See
`layers.py` for the overview."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.base import Communicator
from ..sharded_tensor import local
from .layer_base import TensorParallelLayer, as_param, check_split, seeded_generator
from .mappings import all_gather_along, reduce_from_region, reduce_scatter_to_sequence_region

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(TensorParallelLayer):
    """Embedding table split by vocabulary rows. Weight (V/tp, dim); rank r owns ids [r*V/tp, (r+1)*V/tp).

    Args:
        num_embeddings: vocabulary size V; must be divisible by tp (pad the vocabulary otherwise, e.g. a
            GPTConfig(vocab_size=...) rounded up to a multiple of tp, as Megatron's make-vocab-size-divisible-by).
        embedding_dim: width of a row.
        comm: the tensor-parallel group.
        padding_idx: as nn.Embedding (a global id; its row gets no gradient).
        sequence_parallel: reduce-scatter the output along ``sequence_dim`` instead of all-reducing it.
        sequence_dim: the sequence dimension of the output (1 for ids of shape (B, T)).
        seed: seed of the generator the full table is drawn from (N(0, 1), as nn.Embedding; None: global RNG).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, comm: Communicator, *,
                 padding_idx: int | None = None, sequence_parallel: bool = False, sequence_dim: int = 1,
                 seed: int | None = 0, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        check_split("VocabParallelEmbedding", "num_embeddings (vocabulary size)", num_embeddings, 1, comm.size)
        if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(f"VocabParallelEmbedding: padding_idx={padding_idx} is outside the vocabulary "
                             f"0..{num_embeddings - 1}")
        self.num_embeddings, self.embedding_dim, self.comm = num_embeddings, embedding_dim, comm
        self.padding_idx = None if padding_idx is None else padding_idx % num_embeddings
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), sequence_dim
        per = num_embeddings // comm.size
        self.vocab_start, self.vocab_end = comm.rank * per, (comm.rank + 1) * per
        owned = self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end
        self._local_padding_idx = self.padding_idx - self.vocab_start if owned else None
        self.weight = nn.Parameter(torch.empty(per, embedding_dim, device=device, dtype=dtype))
        if self.weight.device.type != "meta":
            full = torch.empty(num_embeddings, embedding_dim).normal_(generator=seeded_generator(seed))
            if self.padding_idx is not None:
                full[self.padding_idx] = 0.0
            with torch.no_grad():
                self.weight.copy_(self.shard(full))
        self.slices_answer_for_whole()

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, comm: Communicator, *, sequence_parallel: bool = False,
                   sequence_dim: int = 1) -> VocabParallelEmbedding:
        """This rank's rows of `embedding` (same dtype and device; `embedding` is left untouched)."""
        if embedding.max_norm is not None or embedding.sparse or embedding.scale_grad_by_freq:
            raise ValueError("VocabParallelEmbedding.from_dense: max_norm, sparse and scale_grad_by_freq are not "
                             "supported (they need the whole vocabulary on one rank)")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, comm, padding_idx=embedding.padding_idx,
                    sequence_parallel=sequence_parallel, sequence_dim=sequence_dim, device="meta",
                    dtype=embedding.weight.dtype)
        layer.weight = as_param(layer.shard(embedding.weight), embedding.weight)
        layer.slices_answer_for_whole()
        return layer

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full (V, ...) tensor."""
        return local(full).detach()[self.vocab_start:self.vocab_end].clone()

    def full_tensor(self, name: str) -> torch.Tensor:
        return all_gather_along(local(getattr(self, name)).detach(), 0, self.comm)

    def full_weight(self) -> torch.Tensor:
        """The dense (V, dim) table, gathered from every rank. Collective."""
        return self.full_tensor("weight")

    def global_shape(self, name: str) -> tuple[int, ...]:
        return (self.num_embeddings, self.embedding_dim)

    def boxes(self, name: str, rank: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        per = self.num_embeddings // self.comm.size
        return (((rank * per, per), (0, self.embedding_dim)),)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        weight = local(self.weight)  # this rank's rows (layer_base.py)
        if self.comm.size == 1:
            return F.embedding(ids, weight, self._local_padding_idx)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        own_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(own_ids, weight, self._local_padding_idx)
        # Rows this rank does not own contribute zeros; the reduction below fills them in from their owner.
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(out, self.comm, self.sequence_dim)
        return reduce_from_region(out, self.comm)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, tp={self.comm.size}, "
                f"rows={self.vocab_start}..{self.vocab_end - 1}, sequence_parallel={self.sequence_parallel}")
