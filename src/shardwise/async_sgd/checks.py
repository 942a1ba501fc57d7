"""What local SGD and the parameter server accept: a module every rank holds whole, asked through layout.py.

Both algorithms move whole parameters between ranks (a worker's delta, a worker's gradient for a server's shard),
so every rank must hold every parameter of the model in full. Tensor parallel (a rank holds a slice), pipeline
(a rank holds some layers) and ZeRO-3 / FSDP (a rank holds a flat shard) are refused, as is a data-parallel
strategy already synchronising over the same ranks (it would average every step, which is what these algorithms
exist to avoid). DDP over *other* ranks (the GPUs of one site, with local SGD across sites) is allowed: its
parameters are whole on every rank.
"""

from __future__ import annotations

from torch import nn

from .. import layout
from ..compiled import refuse_compiled
from ..comm.base import Communicator, is_communicator

__all__ = ["check_whole_model", "check_comm", "check_positive_int", "check_anchor_names"]


def check_comm(comm: object, who: str) -> Communicator:
    if not is_communicator(comm):
        raise ValueError(f"{who}: comm must be a shardwise Communicator (sw.init(), sw.launch's argument, mesh.dp), "
                         f"got {type(comm).__name__}")
    return comm  # type: ignore[return-value]


def check_positive_int(value: object, name: str, who: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{who}: {name}={value!r} must be a positive int (1, 2, ...)")
    return value


def check_anchor_names(anchors: dict, names: list[str], who: str) -> None:
    """ValueError unless a saved outer state's anchors are keyed by exactly the model's trainable parameter names."""
    keys = set(anchors)
    if sorted(anchors) != sorted(names):
        missing = sorted(set(names) - keys)
        extra = sorted(keys - set(names))
        raise ValueError(f"{who}: anchors do not match the model's trainable parameters (missing {missing[:5]}, "
                         f"unexpected {extra[:5]})")


def check_whole_model(module: object, comm: Communicator, who: str) -> None:
    """ValueError unless every rank holds `module`'s parameters whole and nothing synchronises it over `comm`."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"{who}: module must be a torch.nn.Module, got {type(module).__name__}")
    refuse_compiled(module, who)
    allowed = (f"allowed: a plain module, or one wrapped by DDP over other ranks than {who}'s comm (every parameter "
               f"whole on every rank)")
    records = layout.strategies(module)
    applied = " + ".join(r.name for r in records)
    if layout.is_partitioned(module):
        raise ValueError(f"{who}: the module is a pipeline stage ({applied}): this rank holds only some of its layers; "
                         f"{allowed}")
    for name, pl in layout.placements(module).items():
        if pl.sharded_over:
            raise ValueError(f"{who}: parameter {name!r} is sharded across ranks by {applied} (tensor parallel, "
                             f"ZeRO-3 or FSDP): this rank holds a slice of it; {allowed}")
    mine = set(comm.global_ranks)
    for record in records:
        for group in layout.record_comms(record):
            shared = mine & set(group.global_ranks)
            if len(shared) > 1:
                raise ValueError(f"{who}: the module is already synchronised every step by {record.name} over ranks "
                                 f"{sorted(shared)} of {who}'s comm; {allowed}")
