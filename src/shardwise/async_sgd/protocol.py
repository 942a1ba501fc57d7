"""The parameter server's messages: one flat byte tensor each, a 4 x int64 header then the tensors' bytes.

One message per (worker, server, step) in each direction, so a push can be received from any source in one
receive (`irecv_any` matches a whole message; a header and a separate payload could interleave with another
worker's). Every message to one server has the same size, the receive buffer's.

    push   worker -> server (tag PUSH_TAG): [PUSH, clock, version read, 0] + the gradients of the server's shard
    done   worker -> server (tag PUSH_TAG): [DONE, clock, 0, 0] + zeros          (this worker trains no more)
    reply  server -> worker (tag PULL_TAG): [PARAMS, version, pushes, 0] + the shard's current parameters
(version: optimizer steps the server took; pushes: gradients it took from all workers so far)
Each tensor's bytes start on an 8-byte boundary, so every piece can be viewed as its own dtype in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["PUSH", "DONE", "PARAMS", "PUSH_TAG", "PULL_TAG", "HEADER_BYTES", "message_bytes", "encode", "header",
           "decode_into", "is_done_message"]

PUSH, DONE, PARAMS = 1, 2, 3
PUSH_TAG, PULL_TAG = 0, 1  # torch backends' receive-from-any-source matches tag 0: pushes use it
HEADER_BYTES = 4 * 8


def _aligned(n: int) -> int:
    return (n + 7) // 8 * 8


def message_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return HEADER_BYTES + sum(_aligned(t.numel() * t.element_size()) for t in tensors)


def encode(out: torch.Tensor, kind: int, a: int, b: int, tensors: Sequence[torch.Tensor | None],
           like: Sequence[torch.Tensor]) -> torch.Tensor:
    """Write a message into the uint8 tensor `out`; a None entry of `tensors` (a parameter without gradient) is sent
    as zeros shaped like the matching entry of `like`."""
    out[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor([kind, a, b, 0], dtype=torch.int64))
    offset = HEADER_BYTES
    for t, ref in zip(tensors, like):
        n = ref.numel() * ref.element_size()
        piece = out[offset : offset + n].view(ref.dtype)
        if t is None:
            piece.zero_()
        else:
            piece.copy_(t.detach().reshape(-1))
        offset += _aligned(n)
    return out


def header(message: torch.Tensor) -> tuple[int, int, int]:
    kind, a, b, _ = message[:HEADER_BYTES].view(torch.int64).tolist()
    return kind, a, b


@torch.no_grad()
def decode_into(message: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
    """Copy the message's tensors into `targets` (shaped and ordered as encoded)."""
    offset = HEADER_BYTES
    for t in targets:
        n = t.numel() * t.element_size()
        t.copy_(message[offset : offset + n].view(t.dtype).view_as(t))
        offset += _aligned(n)


def is_done_message(message: torch.Tensor) -> bool:
    return header(message)[0] == DONE
