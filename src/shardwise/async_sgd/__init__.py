"""Training that does not wait for the slowest rank at every step: local SGD / DiLoCo (workers meet every H steps;
Streaming DiLoCo: fragments of the model meet on a staggered schedule, overlapped with training)
and a parameter server with bounded staleness. See docs/async.md."""

from .diloco import DiLoCo
from .local_sgd import LocalSGD, LocalSGDModule
from .parameter_server import AsyncSGD, AsyncSGDModule
from .server import Applied, ServerReport, assign_shards
from .straggler import RotatingStraggler, Straggler
from .streaming import StreamingDiLoCo, StreamingDiLoCoModule

__all__ = ["Applied", "AsyncSGD", "AsyncSGDModule", "DiLoCo", "LocalSGD", "LocalSGDModule", "ServerReport",
           "RotatingStraggler", "Straggler", "StreamingDiLoCo", "StreamingDiLoCoModule", "assign_shards"]
