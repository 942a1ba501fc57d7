"""What a pipeline tells the layout contract: which stages this rank holds, and which weights are tied across ranks.

Each local stage gets a "pipeline_stage" record: its parameters under pipeline-qualified names
(``stages.<s>.<name>``, the names ``Pipeline.named_parameters()`` gives), and, for a weight tied to a copy on another
pipeline rank (the GPT's embedding and head), the group of ranks holding the copies (`tied_over`). A data-parallel
strategy applied to the stage afterwards reads that and keeps the weight whole (the sharding engine makes it a
replicated parameter), so the executor can still sum the copies' gradients. The Pipeline module itself gets a live
"pipeline" record: the union of its stages' current placements (whatever wraps them later), partitioned over the
pipeline group, so clipping, full state dicts and checkpoints of a pipeline see every stage. The same record
gathers the extra state (layout.ExtraState) its local stages' strategies declare, such as each stage's gradient
compressor, renamed ``stages.<s>.<name>``: unique when a rank holds several stages, and the same name on every rank
holding that stage (its dp replicas and tp ranks), so a checkpoint matches each stage's state with its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from .. import layout
from ..agreement import check_agreement
from ..comm.base import Communicator

__all__ = ["declare_pipeline"]


def _stage_record(s: str, stage: nn.Module, tied: dict[int, Communicator]) -> layout.Parallelized:
    placements = {}
    for pl in layout.placements(stage).values():
        pl = dataclasses.replace(pl, names=tuple(f"stages.{s}.{n}" for n in pl.names), tied_over=tied.get(id(pl.param)))
        placements[pl.name] = pl
    return layout.Parallelized("pipeline_stage", (), placements, options={"stage": int(s)})


def declare_pipeline(pipe: nn.Module, stages: dict[str, nn.Module], comm: Communicator,
                     tied_groups: list[tuple[Any, list[nn.Parameter], Communicator]], options: dict[str, Any]) -> None:
    """Agree on the schedule with the other pipeline ranks, then declare the local stages and the pipeline (see the
    module docstring). Pipeline ranks hold different stages: they compare only what they share, the options."""
    check_agreement(comm, "Pipeline", options)
    tied = {id(p): group for _, params, group in tied_groups for p in params}
    for s, stage in stages.items():
        layout.declare(stage, _stage_record(s, stage, tied))

    def placements() -> dict[str, layout.Placement]:
        return {name: pl for stage in stages.values() for name, pl in layout.placements(stage).items()}

    def comms() -> tuple[Communicator, ...]:
        return tuple(c for stage in stages.values() for r in layout.strategies(stage) for c in layout.record_comms(r))

    def extra_state() -> tuple[layout.ExtraState, ...]:
        # Evaluated when asked: the stages are wrapped (DDP, ZeRO: their compressors declared) after this record.
        return tuple(dataclasses.replace(state, name=f"stages.{s}.{state.name}")
                     for s, stage in stages.items() for state in layout.extra_states(stage).values())

    layout.declare(pipe, layout.Parallelized(
        "pipeline", comms, placements, memory=lambda: layout.merged_memory(stages.values()), world=comm,
        partitioned_over=comm, options={"stages": [int(s) for s in stages]}, extra_state=extra_state))
