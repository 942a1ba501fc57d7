"""How ranks talk: the Communicator protocol and its backends. The only package that calls torch.distributed; the one
file beside it that imports from it is benchmarks/peers.py, which wraps models in torch's own DDP and FSDP2 (the
peers we measure against) over the process group that rendezvous.py's `torch_process_group` gives it."""

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
