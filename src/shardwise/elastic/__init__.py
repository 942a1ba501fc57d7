"""Elastic training: workers leave and join, the job goes on with the same global batch and sample order.

See docs/elastic.md. `Sampler` keeps one global sample order and position whatever the world size.
"""

from .sampler import Sampler, StepPlan

__all__ = ["Sampler", "StepPlan"]
