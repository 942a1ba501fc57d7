"""Blockwise attention whose key/value blocks go straight to the ranks that need them: the ring for sparse reach.

The ring (ring.py) passes every rank's keys and values through every other rank: right for causal attention over
zigzag chunks, where every rank's queries see some keys of every rank. When some ranks' queries see nothing of
another rank's keys (blocks.py: `Blocks.needs`), the ring still carries those blocks, and relays them through
ranks that do not need them either:

* a sliding window much shorter than the sequence (Mistral's 4096 tokens, Gemma 2/3's local layers, GPT-OSS's
  sliding layers at long context): a query chunk sees the chunk before it and no further;
* packed documents (documents.py): a query sees only its own document, so chunks of different documents need
  nothing of each other;
* the contiguous split: rank r's queries see no key of a later rank.

Here each rank works out, from the same window and document ids as every other rank, which ranks need its block
and which blocks it needs, and posts all those sends and receives as one group (NCCL's rule, comm/base.py). It
computes its own block while they travel, then the blocks it received, in the ring's order (so with every pair
needed it would merge as the ring does). The backward exchanges the blocks again (nothing of them is kept), computes
each block's key/value gradients, and sends each back to its owner, who adds them up. Bytes per rank: forward
``needed x |K|+|V|``, backward ``needed x (|K|+|V|) + needing x (|dK|+|dV|)``, against the ring's ``(cp-1) x`` and
``(2cp-1) x``; for a window within one chunk, one block each way instead of cp - 1.
"""

from __future__ import annotations

import torch

from ..comm.base import Communicator, P2POp
from ..graph_gradients import refuse_second_order
from .blocks import Blocks, backward_start, finish, sinks_grad, start

__all__ = ["DirectAttention", "wait_all"]


def _peers(blocks: Blocks, comm: Communicator) -> tuple[list[int], list[int]]:
    """(ranks whose blocks this rank needs, ranks that need this rank's block), in the ring's order."""
    me, n = comm.rank, comm.size
    ring = [(me - step) % n for step in range(1, n)]
    return [src for src in ring if blocks.needs(me, src)], [dst for dst in ring if blocks.needs(dst, me)]


def _post(comm: Communicator, send: dict[int, torch.Tensor], receive: dict[int, torch.Tensor]) -> list:
    """One group of point-to-point operations: `send[peer]` to each peer, each `receive[peer]` from its peer."""
    ops = [P2POp.recv(t, peer) for peer, t in receive.items()] + [P2POp.send(t, peer) for peer, t in send.items()]
    return comm.batch_isend_irecv(ops) if ops else []


def wait_all(works: list) -> None:
    """Wait for every operation of a group (what `batch_isend_irecv` returned)."""
    for w in works:
        w.wait()


class DirectAttention(torch.autograd.Function):
    """Blockwise causal attention with each key/value block sent only to the ranks that need it (module
    docstring). Call through :func:`~shardwise.context_parallel.ring_attention`, which chooses it."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, comm, split, blocks):  # noqa: ANN001, ANN205
        acc, _, qs, out, lse = start(q, v, split.chunks_per_rank)
        kv = torch.cat([k, v], dim=-1).to(acc)
        sources, targets = _peers(blocks, comm)
        received = {src: torch.empty_like(kv) for src in sources}
        works = _post(comm, {dst: kv for dst in targets}, received)
        blocks.forward(comm.rank, comm.rank, kv, qs, out, lse)  # while the blocks travel
        wait_all(works)
        for src in sources:
            blocks.forward(comm.rank, src, received[src], qs, out, lse)
        o, lse = finish(out, lse, sinks, q.dtype)
        ctx.save_for_backward(q, k, v, o, lse, sinks)
        ctx.comm, ctx.blocks, ctx.peers = comm, blocks, (sources, targets)
        return o

    @staticmethod
    def backward(ctx, do):  # noqa: ANN001, ANN205
        refuse_second_order("context parallel's ring attention")
        q, k, v, o, lse, sinks = ctx.saved_tensors
        comm, blocks = ctx.comm, ctx.blocks
        qs, dos, lses, deltas, delta, dq = backward_start(q, o, lse, do, blocks.c)
        kv = torch.cat([k, v], dim=-1).to(lse.dtype)
        sources, targets = ctx.peers  # the forward's plan
        received = {src: torch.empty_like(kv) for src in sources}
        works = _post(comm, {dst: kv for dst in targets}, received)
        dkv = torch.zeros_like(kv)
        blocks.backward(comm.rank, comm.rank, kv, qs, dos, lses, deltas, dq, dkv)
        wait_all(works)
        grads = {}
        for src in sources:
            grads[src] = torch.zeros_like(kv)
            blocks.backward(comm.rank, src, received[src], qs, dos, lses, deltas, dq, grads[src])
        returned = {dst: torch.empty_like(kv) for dst in targets}
        wait_all(_post(comm, grads, returned))
        for dst in targets:
            dkv += returned[dst]
        dk = k.shape[-1]
        return (torch.cat(dq, dim=2).to(q.dtype), dkv[..., :dk].to(k.dtype), dkv[..., dk:].to(v.dtype),
                sinks_grad(sinks, lse, delta), None, None, None)
