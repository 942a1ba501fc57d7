"""Whole-model tools written once against the layout contract (shardwise.layout): full state dicts, gradient
clipping, the sharded grad scaler and memory statistics work for every strategy and every composition of them."""

from .clip import clip_grad_norm_, global_grad_norm
from .grad_scaler import ShardedGradScaler
from .memory import MemoryStats, memory_stats, peak_rss_bytes
from .optim_state import full_optimizer_state_dict, load_full_optimizer_state_dict
from .replicas import ReplicaMismatch, check_replicas
from .state_dict import full_state_dict, load_full_state_dict

__all__ = ["MemoryStats", "ReplicaMismatch", "ShardedGradScaler", "check_replicas", "clip_grad_norm_",
           "full_optimizer_state_dict", "full_state_dict", "global_grad_norm", "load_full_optimizer_state_dict",
           "load_full_state_dict", "memory_stats", "peak_rss_bytes"]
