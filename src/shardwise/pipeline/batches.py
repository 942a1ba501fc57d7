"""How one rank posts its point-to-point messages: in batches, one batch between two compute actions.

NCCL runs a pair of ranks' sends and receives on one stream, in the order they were issued, with no tags and no
buffering: a send completes only while the matching receive runs, and an operation starts only when the ones
issued before it on that stream have finished. Posting independent isend/irecv calls in schedule order therefore
deadlocks as soon as two ranks post them in crossed orders: in 1F1B, rank 0 posting recv(grad) before
send(act) while rank 1 posts recv(act) before send(grad). Megatron-LM and torch.distributed.pipelining avoid it by
posting the sends and receives one step needs *together*, as one `batch_isend_irecv` group (one fused operation
on the stream whose parts progress concurrently).

This module is the one rule both the executor and the simulator follow: a rank's action list is cut into *host
steps*, each either one compute action or one batch (the maximal run of SEND/RECV actions between two compute
actions: the sends of the action just run and the receives of the next one, see `schedules.add_communication`).
A batch is posted as one group; a compute action waits for the batches that hold the receives it consumes.

Messages are matched *without tags*: the n-th message rank a sends to rank b is the n-th one rank b receives
from rank a (posting order per pair). `message_of` names what an action carries so that the simulator can check
that both sides agree. Before the first activation a stage receives in a run, its rank receives the structure of
that activation (metadata, `messages.py`); the sender sends it in the same place, so both sides post one
*metadata batch* before the batch holding that first activation (`needs_metadata`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .actions import Action, Op

__all__ = ["host_steps", "message_of", "consumed_message", "metadata_stages"]


def host_steps(actions: Sequence[Action]) -> list[Action | tuple[Action, ...]]:
    """This rank's actions as host steps: a compute Action, or a tuple of the SEND/RECV actions posted together."""
    steps: list[Action | tuple[Action, ...]] = []
    batch: list[Action] = []
    for a in actions:
        if a.is_compute:
            if batch:
                steps.append(tuple(batch))
                batch = []
            steps.append(a)
        else:
            batch.append(a)
    if batch:
        steps.append(tuple(batch))
    return steps


def message_of(a: Action, n_ranks: int) -> tuple[str, int, int, int]:
    """(direction, producing stage, microbatch, peer rank) of a SEND/RECV action: "F" for an activation of the
    producing stage, "B" for the input gradient it sends back; `peer` is the rank at the other end."""
    if a.op is Op.SEND_F:
        return ("F", a.stage, a.microbatch, (a.stage + 1) % n_ranks)
    if a.op is Op.RECV_F:
        return ("F", a.stage - 1, a.microbatch, (a.stage - 1) % n_ranks)
    if a.op is Op.SEND_B:
        return ("B", a.stage, a.microbatch, (a.stage - 1) % n_ranks)
    if a.op is Op.RECV_B:
        return ("B", a.stage + 1, a.microbatch, (a.stage + 1) % n_ranks)
    raise ValueError(f"message_of: {a} is a compute action, which carries no message")


def consumed_message(a: Action, n_stages: int) -> tuple[str, int, int] | None:
    """(direction, producing stage, microbatch) of the message a compute action consumes, None if it consumes none
    (stage 0's forward, the last stage's backward, a W pass)."""
    if a.op is Op.FORWARD and a.stage > 0:
        return ("F", a.stage - 1, a.microbatch)
    if a.op in (Op.BACKWARD, Op.INPUT) and a.stage < n_stages - 1:
        return ("B", a.stage + 1, a.microbatch)
    return None


def metadata_stages(batch: Sequence[Action], seen: set[int]) -> list[tuple[Action, int]]:
    """The actions of `batch` that carry the first activation of a run to their receiving stage, with that stage
    (the SEND_F to it or the RECV_F of it), in batch order; `seen` (receiving stages already described in this run)
    is updated. Both ranks of a message call this on their own actions and get the same answer."""
    first = []
    for a in batch:
        if a.op in (Op.SEND_F, Op.RECV_F):
            receiving = a.stage + 1 if a.op is Op.SEND_F else a.stage
            if receiving not in seen:
                seen.add(receiving)
                first.append((a, receiving))
    return first
