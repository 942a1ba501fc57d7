"""What a collective is for, in its description: two collectives of one kind and size that ranks issue for different
purposes no longer pair silently.

Why. The ordering checks compare each rank's call by its description: the thread backend's signatures, gloo's and
MPI's descriptor exchange (collective_check.py), the shared-memory channel's in-band descriptors (shm_channel.py). A
description said only the kind and the element count, so when the ranks' control flow diverged between two
equal-sized pieces of work the checks passed and the data paired wrongly: a ZeRO-3 model whose ranks skip different
layers (LayerDrop drawn from each rank's own generator, a branch on the rank's data) gathered layer 2's shards on one
rank together with layer 1's on the other, and every rank trained on a layer of mixed halves, with no error (torch
FSDP hangs or mixes the same way on NCCL).

Mechanism. A caller names the work with `with collective_label("unit blocks.3"):` around the calls it issues (the
sharding engine names each unit's gathers and reductions); each backend appends the label to the description it
builds (`labelled`), so ranks that issue different units' collectives at one position now differ in the check and
raise a CommError naming both calls. The label is thread-local (thread ranks each have their own) and read when a
collective is issued, not when it completes. NCCL groups are not checked (collective_check.py says why), so there
the label changes nothing per call: `IssuedOrder` keeps there (and on gloo or MPI with
SHARDWISE_CHECK_COLLECTIVES=0) a running hash of every group collective's description in issue order, which the
optimizer guard compares across the data-parallel ranks at the first step and every 20th (optimizer_agreement.py):
a divergence is caught before the first optimizer step applies it, or within 20 steps, instead of never.
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections.abc import Iterator

__all__ = ["collective_label", "labelled", "IssuedOrder"]

_local = threading.local()


@contextlib.contextmanager
def collective_label(text: str) -> Iterator[None]:
    """Name the collectives this thread issues inside the block (nested labels: the innermost)."""
    outer = getattr(_local, "text", None)
    _local.text = text
    try:
        yield
    finally:
        _local.text = outer


def labelled(description: str) -> str:
    """`description` ("all_gather(numel=8)") with the current label appended inside its parentheses
    ("all_gather(numel=8, for=unit blocks.3)"); unchanged outside any label."""
    text = getattr(_local, "text", None)
    if text is None:
        return description
    if description.endswith(")"):
        return f"{description[:-1]}, for={text})"
    return f"{description} for={text}"


class IssuedOrder:
    """A running CRC-32 of the descriptions of a group's collectives, in the order this rank issued them: equal on
    every rank of the group exactly when their calls were (module docstring)."""

    def __init__(self) -> None:
        self.digest = 0

    def before(self, description: str, tensors: object = ()) -> None:
        """Add a collective about to be issued (the signature of CollectiveCheck.before, which it stands in for)."""
        self.digest = zlib.crc32(description.encode(), self.digest)
