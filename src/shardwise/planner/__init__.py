"""The planner: memory per rank and bytes per step of every strategy, and a choice that explains itself.

    costs.py        the formulas (ZeRO model states, CPU offload, Korthikanti activations, ring wire bytes,
                    context and expert parallel)
    candidates.py   strategy strings and the layouts that apply to a world size
    choose.py       the fastest layout that fits, and why (`Plan.explain()`)
    model_facts.py  what a model says about itself (parameter count, geometry, experts, tensor-parallel plan)

Used by `sw.estimate_memory`, `sw.distribute` and `shardwise plan`.
"""

from .candidates import Candidate, STRATEGY_STRINGS, candidates, parse_strategy
from .choose import Estimate, Links, Plan, Workload, estimate, plan, smallest_world
from .costs import Activations, ModelStates
from .model_facts import ModelFacts, model_facts

__all__ = ["Activations", "Candidate", "Estimate", "Links", "ModelFacts", "ModelStates", "Plan", "STRATEGY_STRINGS",
           "Workload", "candidates", "estimate", "model_facts", "parse_strategy", "plan", "smallest_world"]
