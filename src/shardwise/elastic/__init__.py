"""Elastic training: workers leave and join, the job goes on with the same global batch and sample order.

See docs/elastic.md. `Sampler` keeps one global sample order and position whatever the world size;
`ElasticState` commits the training state in memory (and on disk every K steps), rolls back to the last commit,
and reshards it onto a new world from the survivors' commits.
"""

from .reshard import StateLost
from .sampler import Sampler, StepPlan
from .state import SUPPORTED, ElasticState, check_supported

__all__ = ["ElasticState", "SUPPORTED", "Sampler", "StateLost", "StepPlan", "check_supported"]
