"""What `context_parallel.apply` records on a model and its attention modules: the group, the method, the split.

Kept apart from apply.py so the GPT and HuggingFace halves (apply.py, hf.py) both read it without importing each
other.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..comm.base import Communicator
from .ring import ring_attention
from .split import SequenceSplit
from .ulysses import ulysses_attention

__all__ = ["ContextParallelState", "get_state", "set_state"]


@dataclasses.dataclass(frozen=True)
class ContextParallelState:
    """What `apply` recorded on the model and its attention modules: the group, the method and the split;
    sequence_shards: the tensor-parallel size when sequence parallel splits each chunk over tp (else 1)."""

    comm: Communicator
    method: str
    zigzag: bool
    sequence_shards: int = 1

    @property
    def split(self) -> SequenceSplit:
        return SequenceSplit(self.comm.size, self.zigzag)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
               softcap: float | None = None, sinks: torch.Tensor | None = None,
               window: int | None = None, documents: torch.Tensor | None = None,
               causal: bool = True) -> torch.Tensor:
        fn = ring_attention if self.method == "ring" else ulysses_attention
        return fn(q, k, v, self.comm, zigzag=self.zigzag, scale=scale, softcap=softcap, sinks=sinks, window=window,
                  documents=documents, causal=causal)

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        return self.split.positions(self.comm.rank, local_len, device)


def get_state(obj: Any) -> ContextParallelState | None:
    """The state `apply` set on `obj` (a model or one of its attention modules), or None."""
    return obj.__dict__.get("_shardwise_cp")


def set_state(obj: Any, state: ContextParallelState) -> None:
    object.__setattr__(obj, "_shardwise_cp", state)  # not a submodule or parameter: plain instance state
