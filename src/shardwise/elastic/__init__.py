"""Elastic training: workers leave and join, the job goes on with the same global batch and sample order.

See docs/elastic.md. `Sampler` keeps one global sample order and position whatever the world size;
`ElasticState` commits the training state in memory (and on disk every K steps), rolls back to the last commit,
and reshards it onto a new world from the survivors' commits; `Membership` (comm/membership.py) agrees on the
members of each epoch and builds its world in process; `run` ties them into a training loop; `plot_timeline` draws its
record (loss and world size against time).
"""

from ..comm.membership import Membership, MembershipError
from .loop import ElasticRun, run
from .reshard import StateLost
from .sampler import Sampler, StepPlan
from .state import SUPPORTED, ElasticState, check_supported
from .timeline import plot_timeline

__all__ = ["ElasticRun", "ElasticState", "Membership", "MembershipError", "SUPPORTED", "Sampler", "StateLost",
           "StepPlan", "check_supported", "plot_timeline", "run"]
