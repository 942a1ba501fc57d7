"""Training that does not wait for the slowest rank at every step: local SGD / DiLoCo (workers meet every H steps)
and a parameter server with bounded staleness. See docs/async.md."""

from .diloco import DiLoCo
from .local_sgd import LocalSGD, LocalSGDModule

__all__ = ["DiLoCo", "LocalSGD", "LocalSGDModule"]
