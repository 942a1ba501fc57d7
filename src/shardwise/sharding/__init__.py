"""Sharded data parallelism: ZeRO stages 1/2/3 and the FSDP strategies, as configurations of one engine."""

from .api import FSDP, SHARDING_STRATEGIES, ShardedModule, ZeRO
from .policy import MixedPrecision

__all__ = ["FSDP", "MixedPrecision", "SHARDING_STRATEGIES", "ShardedModule", "ZeRO"]
