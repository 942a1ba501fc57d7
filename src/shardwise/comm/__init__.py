"""How ranks talk: the Communicator protocol and its backends. The only package that calls torch.distributed (torch's
own DDP and FSDP2, the peers `shardwise bench` measures against, are wrapped here too: torch_peers.py)."""

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
