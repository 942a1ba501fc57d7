"""Checkpoints: sharded save/load that reshards across strategies and world sizes, atomic and pickle-free; full
single-file export/import. See docs/checkpoints.md."""

from .full import export_full, import_full
from .load import load_checkpoint, read_metadata, read_tensors
from .save import SaveHandle, save_checkpoint
from .storage import CheckpointError, CheckpointMismatch

__all__ = ["CheckpointError", "CheckpointMismatch", "SaveHandle", "export_full", "import_full", "load_checkpoint",
           "read_metadata", "read_tensors", "save_checkpoint"]
