"""One-file exports: `export_full` writes the plain state dict as a single safetensors file that plain PyTorch loads
without shardwise (`model.load_state_dict(safetensors.torch.load_file(path))`); `import_full` loads such a file (or
a plain state dict) into a model wrapped with any strategy."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_save
from torch import nn

from ..comm.base import Communicator
from ..whole.state_dict import full_state_dict, load_full_state_dict
from .barrier import DEFAULT_IO_TIMEOUT, io_barrier
from .save import model_comm
from .storage import CheckpointError, write_bytes_durably

__all__ = ["export_full", "import_full"]


def export_full(path: str | os.PathLike, model: nn.Module, *, comm: Communicator | None = None,
                timeout: float = DEFAULT_IO_TIMEOUT) -> Path:
    """Gather the full state dict (collective) and write it from rank 0, atomically, to one safetensors file.

    timeout: seconds the other ranks wait for rank 0's write (the checkpoint's I/O timeout, see barrier.py)."""
    comm = model_comm(model, comm)
    state = full_state_dict(model)
    target = Path(path)
    if comm.rank == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        # safetensors refuses tensors sharing storage (tied weights): full_state_dict already returns copies.
        write_bytes_durably(target, safetensors_save({k: v.contiguous() for k, v in state.items()}))
    io_barrier(comm, timeout)
    return target


def import_full(source: str | os.PathLike | dict[str, torch.Tensor], model: nn.Module, *, strict: bool = True) -> None:
    """Load a full safetensors file (or a plain state dict) into `model`, whatever its strategy. No communication."""
    if isinstance(source, dict):
        state = source
    else:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"import_full: {path} does not exist")
        try:
            state = load_file(str(path))
        except Exception as exc:
            raise CheckpointError(f"{path} cannot be read as safetensors: {exc}") from None
    load_full_state_dict(model, state, strict=strict)
