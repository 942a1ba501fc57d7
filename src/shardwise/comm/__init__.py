"""How ranks talk: the Communicator protocol and its backends. The only package that calls torch.distributed (besides
benchmarks/peers.py, which runs torch's own DDP and FSDP2 as the peers we measure against)."""

from .base import CommError, CommStats, Communicator, CompletedWork, OpCount, ReduceOp, Work, wire_bytes
from .thread_backend import ThreadCommunicator, ThreadWorld
from .throttled import Throttled

__all__ = [
    "CommError",
    "CommStats",
    "Communicator",
    "CompletedWork",
    "OpCount",
    "ReduceOp",
    "ThreadCommunicator",
    "ThreadWorld",
    "Throttled",
    "Work",
    "wire_bytes",
]
