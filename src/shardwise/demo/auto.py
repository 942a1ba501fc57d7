"""`shardwise demo --strategy auto`: the planner picks the demo's data-parallel strategy before any rank starts.

The demo knows everything the planner asks for without a running job: the preset's parameter count (counted on the
meta device), fp32 AdamW (what the demo trains with), the dp size of the mesh, and the memory per rank (given with
`--memory-gb`, else this host's available RAM divided by the ranks, as `sw.distribute` measures it). The planner
(`shardwise.planner.plan`) then compares the data-parallel strategies by estimated memory and bytes per step and
returns the fastest that fits; its explanation is printed with the run, and the chosen strategy is used as if named.
Tensor and pipeline parallelism are the mesh's business (`--tp/--pp`), so only data-parallel candidates compete,
each over the dp ranks after the tp x pp split.
"""

from __future__ import annotations

import torch

from ..models.gpt import GPT, GPTConfig
from ..planner import Links, Workload, model_facts, plan
from ..planner.machine import available_ram

__all__ = ["choose_strategy"]

GB = 1024**3


def choose_strategy(preset: str, dp: int, tp: int, pp: int, memory_gb: float | None, *,
                    config: GPTConfig | None = None) -> tuple[str, str]:
    """(the chosen data-parallel strategy, the planner's explanation) for the demo GPT `preset` (or `config`, the
    preset with experts) on dp x tp x pp; dp: the ranks the data-parallel strategy spans (dp x cp under context
    parallel)."""
    with torch.device("meta"):  # counts parameters without allocating them
        model = GPT(config or GPTConfig.preset(preset))
        num_params, experts = model.num_parameters(), model_facts(model).expert_params
    ranks = dp * tp * pp
    if memory_gb is not None:
        memory: float | None = memory_gb * GB
    else:
        ram = available_ram()
        memory = ram / ranks if ram else None
    # A rank's share of the model: tp x pp split the dense parameters, pp alone the experts (whole on each tp rank).
    work = Workload((num_params - experts) / (tp * pp) + experts / pp, dtype="fp32", optimizer="adamw")
    links = Links(dp, dp, memory=memory)
    chosen = plan(work, links, tensor_parallel=False, pipeline=False, offload=False)
    return chosen.chosen.candidate.dp_strategy, chosen.explain()
