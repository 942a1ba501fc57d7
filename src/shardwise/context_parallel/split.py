"""How a sequence is cut over a context-parallel group: contiguous chunks, or zigzag chunks for causal balance.

Context parallelism gives each of the `cp` ranks of a group a share of every sequence's tokens (all layers, all
heads, all batch rows); only attention needs tokens of other ranks (ring.py, ulysses.py). The share is a list of
*chunks* of the sequence, each ``T / n_chunks`` tokens long, concatenated in the order listed:

* contiguous (``zigzag=False``): ``n_chunks = cp``, rank r holds chunk r. Under a causal mask the last rank's
  queries see the whole sequence and the first rank's see one chunk, so the work per rank grows with r.
* zigzag (``zigzag=True``, the default): ``n_chunks = 2 cp``, rank r holds chunks r and ``2cp - 1 - r`` (one early,
  one late). Every rank then has the same number of (query chunk, key chunk) pairs below the diagonal: the ring's
  steps take equal time on every rank. This is the load balancing of Striped Attention (Brandon et al. 2023,
  arXiv 2311.09431), in the two-chunk form Megatron-LM and torchtitan use ("zigzag" / "head-tail").

`split_sequence` cuts a batch ``(x, y)`` (targets already shifted, as :mod:`shardwise.data` gives them) into this
rank's part; `sequence_positions` gives the global positions of those tokens (what a position embedding or rotary
embedding must see); `gather_sequence` puts the parts back in sequence order (logits for a check or for inference).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TypeVar

import torch

from ..comm.base import Communicator

__all__ = ["SequenceSplit", "split_sequence", "gather_sequence", "sequence_positions", "hidden_keys"]

Batch = TypeVar("Batch", torch.Tensor, Sequence[torch.Tensor], Mapping[str, torch.Tensor])


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """Which chunks of a sequence each rank of a context-parallel group holds.

    Attributes:
        cp: the group size (ranks sharing one sequence).
        zigzag: True: rank r holds chunks r and 2cp-1-r of 2cp (causal load balance); False: chunk r of cp.
    """

    cp: int
    zigzag: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.cp, bool) or not isinstance(self.cp, int) or self.cp < 1:
            raise ValueError(f"SequenceSplit: cp={self.cp!r} must be a positive int")
        if not isinstance(self.zigzag, bool):
            raise ValueError(f"SequenceSplit: zigzag={self.zigzag!r} must be a bool")

    @property
    def n_chunks(self) -> int:
        """Chunks the whole sequence is cut into: 2 cp (zigzag) or cp."""
        return 2 * self.cp if self.zigzag else self.cp

    @property
    def chunks_per_rank(self) -> int:
        return 2 if self.zigzag else 1

    def chunks(self, rank: int) -> tuple[int, ...]:
        """The chunk indices rank `rank` holds, in the order they are concatenated locally."""
        return (rank, 2 * self.cp - 1 - rank) if self.zigzag else (rank,)

    def check_length(self, length: int, who: str) -> int:
        """The chunk length for a global sequence `length`; ValueError naming what is allowed otherwise."""
        if length % self.n_chunks:
            how = f"2 x cp = {self.n_chunks} (zigzag: 2 chunks per rank)" if self.zigzag else f"cp = {self.cp}"
            raise ValueError(f"{who}: sequence length T={length} is not divisible by {how}; allowed: multiples of "
                             f"{self.n_chunks}")
        return length // self.n_chunks

    def chunk_len(self, local_len: int, who: str) -> int:
        """The chunk length for `local_len` tokens held by one rank; ValueError if they do not split in chunks."""
        return self.check_length(local_len * self.cp, who)

    def positions(self, rank: int, local_len: int, device: torch.device | None = None) -> torch.Tensor:
        """Global positions (0..T-1) of rank `rank`'s `local_len` tokens, in local order: int64 (local_len,)."""
        c = self.chunk_len(local_len, "positions")
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in self.chunks(rank)])

    def gather_order(self, local_len: int, device: torch.device | None = None) -> torch.Tensor:
        """Indices putting the concatenation of ranks 0..cp-1's local tokens into sequence order (T,)."""
        where = torch.cat([self.positions(r, local_len, device) for r in range(self.cp)])
        return torch.argsort(where)


def _check_comm(comm: Communicator, who: str) -> None:
    if not hasattr(comm, "rank") or not hasattr(comm, "size"):
        raise ValueError(f"{who}: comm={comm!r} is not a Communicator (pass the context-parallel group, e.g. mesh.cp)")


def _check_dim(x: torch.Tensor, dim: int, who: str) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{who}: dim={dim!r} is not a dimension of a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def split_sequence(batch: Batch, comm: Communicator, *, zigzag: bool = True, dim: int = 1) -> Batch:
    """This rank's chunks of `batch` (a tensor, or a tuple / list / dict of tensors cut alike) along `dim`.

    For ``(x, y)`` of shape (B, T) each rank gets (B, T / cp): chunks r and 2cp-1-r concatenated (zigzag) or chunk
    r. A dict (a HuggingFace batch: ``{"input_ids": ..., "position_ids": ...}``) keeps its keys. Pass the same
    `zigzag` as to :func:`shardwise.context_parallel.apply`. ValueError if T is not a multiple of 2 cp (zigzag) or
    cp, or if the tensors' lengths differ.
    """
    _check_comm(comm, "split_sequence")
    if isinstance(batch, Mapping):
        return dict(zip(batch, split_sequence(tuple(batch.values()), comm, zigzag=zigzag, dim=dim)))
    split = SequenceSplit(comm.size, zigzag)
    tensors = [batch] if isinstance(batch, torch.Tensor) else list(batch)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError(f"split_sequence: batch must be a tensor or a tuple/list/dict of tensors, got "
                         f"{type(batch).__name__}")
    dims = [_check_dim(t, dim, "split_sequence") for t in tensors]
    lengths = {t.shape[d] for t, d in zip(tensors, dims)}
    if len(lengths) != 1:
        raise ValueError(f"split_sequence: the tensors have sequence lengths {sorted(lengths)} along dim {dim}; "
                         f"allowed: one length")
    c = split.check_length(lengths.pop(), "split_sequence")
    out = [torch.cat([t.narrow(d, i * c, c) for i in split.chunks(comm.rank)], dim=d)
           for t, d in zip(tensors, dims)]
    return out[0] if isinstance(batch, torch.Tensor) else type(batch)(out)


def gather_sequence(local: torch.Tensor, comm: Communicator, *, zigzag: bool = True, dim: int = 1) -> torch.Tensor:
    """Every rank's part of a sequence (what `split_sequence` gave, or outputs computed from it), reassembled
    along `dim` in sequence order on every rank. One all_gather; not differentiable (for checks and inference)."""
    _check_comm(comm, "gather_sequence")
    d = _check_dim(local, dim, "gather_sequence")
    split = SequenceSplit(comm.size, zigzag)
    split.chunk_len(local.shape[d], "gather_sequence")
    moved = local.detach().movedim(d, 0).contiguous()
    full = torch.empty((comm.size * moved.shape[0], *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    comm.all_gather(full, moved)
    order = split.gather_order(local.shape[d], device=moved.device)
    return full.index_select(0, order).movedim(0, d)


def sequence_positions(local_len: int, comm: Communicator, *, zigzag: bool = True,
                       device: torch.device | None = None) -> torch.Tensor:
    """Global positions (int64, (local_len,)) of this rank's `local_len` tokens: the position ids to give a
    position or rotary embedding (e.g. a HuggingFace model's ``position_ids``)."""
    _check_comm(comm, "sequence_positions")
    return SequenceSplit(comm.size, zigzag).positions(comm.rank, local_len, device)


def hidden_keys(queries: torch.Tensor, keys: torch.Tensor, window: int | None = None, causal: bool = True
                ) -> torch.Tensor:
    """(len(queries), len(keys)) True where the key position is hidden from the query position under causal
    attention: a later key, or under a sliding window one ``window`` or more positions back (a key k is visible to a
    query q iff ``q - window < k <= q``, HuggingFace's sliding window). Bidirectional attention (`causal` False, no
    window) hides nothing. The one rule of the ring's blocks, Ulysses' local attention and the HuggingFace stages'
    masks."""
    q, k = queries.unsqueeze(-1), keys.unsqueeze(0)
    if not causal:
        return torch.zeros(q.shape[0], k.shape[1], dtype=torch.bool, device=queries.device)
    return (k > q) | (k <= q - window) if window is not None else k > q
