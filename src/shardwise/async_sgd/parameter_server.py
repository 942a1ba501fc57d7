"""`sw.AsyncSGD`: a parameter server with bounded staleness on the Communicator's point-to-point operations.

The last `n_servers` ranks of `comm` are servers; the others (ranks 0 .. n_workers - 1, so a worker's data slice is
its rank) are workers. Every rank wraps the same model; at wrap time rank 0's parameters are broadcast, so servers
and workers start equal, and each server builds `optimizer(its shard's parameters)`. Then:

    model = sw.AsyncSGD(model, comm, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-4), n_servers=1, staleness=8)
    if model.is_server:
        report = model.serve()                 # returns when every worker has finished (or is lost)
    else:
        for step in range(steps):
            x, y = data(step, model.worker_rank, model.n_workers)
            model(x, y).backward()
            model.step()                       # push the gradients, pull fresh parameters (may wait: staleness)
            model.zero_grad()
        model.finish()                         # tell the servers this worker is done

`step()` on a worker sends each server the gradients of its shard (one message each, no collective, no barrier)
and replaces the shard's parameters with the server's answer. The answer comes as soon as the server applied the
gradient, unless this worker is more than `staleness` steps ahead of the slowest live worker: then it waits for
that worker (Ho et al.'s Stale Synchronous Parallel). staleness = 0 is synchronous SGD on the same data (the server
applies the mean of one step's gradients in one optimizer step); staleness = math.inf never waits (Downpour SGD).
See server.py for what the server does, and docs/async.md.

Failures: a server that dies or hangs makes `step()` raise CommError naming it within the communicator's timeout;
a worker that dies is dropped by the servers, which go on with the others (run the job under `shardwise run` with
the keep-survivors policy, whose supervisor does not stop the survivors).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._mixin import MovesRefused, mix_in
from ..agreement import check_agreement, describe_parameters
from ..comm.base import CommError, Communicator, Work
from ..comm.coalesced import broadcast_coalesced
from ..placement import to_comm_device
from ..sharded_tensor import local
from ..requires_grad_at_wrap import RequiresGradAtWrap
from .checks import check_comm, check_whole_model
from .protocol import DONE, PULL_TAG, PUSH, PUSH_TAG, decode_into, encode, header, message_bytes
from .server import Server, ServerReport, assign_shards, full_lr, per_worker_scale, staleness_scale
from .step_hook import register_refusing

__all__ = ["AsyncSGD", "AsyncSGDModule"]

log = logging.getLogger("shardwise.async_sgd")

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class _Worker:
    """A worker's view: each server's rank and shard, message buffers, the versions it read, its clock."""

    def __init__(self, comm: Communicator, params: list[nn.Parameter], shards: list[list[int]],
                 server_ranks: list[int]) -> None:
        self.comm = comm
        self.server_ranks = server_ranks
        self.shards = [[params[i] for i in shard] for shard in shards]
        self.push = [torch.empty(message_bytes(s), dtype=torch.uint8, device=comm.device) for s in self.shards]
        self.pull = [torch.empty_like(b) for b in self.push]
        self.versions = [0] * len(shards)
        self.pushes = [0] * len(shards)
        self.clock = 0
        self.finished = False

    def step(self) -> None:
        if self.finished:
            raise RuntimeError("AsyncSGD: step() after finish(); this worker already told the servers it is done")
        works = self._send(PUSH)
        for k, rank in enumerate(self.server_ranks):
            self._receive(k, rank)
            kind, version, pushes = header(self.pull[k])
            self.versions[k] = version
            self.pushes[k] = pushes
            decode_into(self.pull[k], self.shards[k])
        self._wait(works, "push")
        self.clock += 1

    def finish(self) -> None:
        if not self.finished:
            self._wait(self._send(DONE), "done")
            self.finished = True

    def _send(self, kind: int) -> list[Work]:
        works = []
        for k, rank in enumerate(self.server_ranks):
            grads = [p.grad if kind == PUSH else None for p in self.shards[k]]
            encode(self.push[k], kind, self.clock, self.versions[k], grads, self.shards[k])
            works.append(self.comm.isend(self.push[k], rank, PUSH_TAG))
        return works

    def _receive(self, k: int, rank: int) -> None:
        try:
            self.comm.recv(self.pull[k], rank, PULL_TAG)
        except CommError as exc:
            g = self.comm.global_ranks[rank]
            raise CommError(f"AsyncSGD: parameter server rank {g} did not answer step {self.clock} of worker rank "
                            f"{self.comm.global_ranks[self.comm.rank]} within {self.comm.timeout:g}s (it died or "
                            f"hangs): {exc}", op="recv", rank=self.comm.global_ranks[self.comm.rank], peers=[g],
                            waited=exc.waited) from exc

    def _wait(self, works: list[Work], what: str) -> None:
        for work, rank in zip(works, self.server_ranks):
            try:
                work.wait()
            except CommError as exc:
                g = self.comm.global_ranks[rank]
                raise CommError(f"AsyncSGD: sending the {what} of step {self.clock} to parameter server rank {g} "
                                f"failed: {exc}", op="send", rank=self.comm.global_ranks[self.comm.rank], peers=[g],
                                waited=exc.waited) from exc


class AsyncSGDModule(MovesRefused):
    """Mixed into a module's class by `AsyncSGD`: the worker's `step()` / `finish()`, the server's `serve()`."""

    _async_sgd: dict[str, Any]

    @property
    def is_server(self) -> bool:
        return self._async_sgd["server"] is not None

    @property
    def is_worker(self) -> bool:
        return self._async_sgd["worker"] is not None

    @property
    def n_workers(self) -> int:
        return self._async_sgd["n_workers"]

    @property
    def worker_rank(self) -> int:
        """This worker's index, 0 .. n_workers - 1 (its rank in comm); ValueError on a server."""
        if not self.is_worker:
            raise ValueError("AsyncSGD: worker_rank asked on a server rank; servers hold no data slice")
        return self._async_sgd["comm"].rank

    @property
    def server_ranks(self) -> list[int]:
        return list(self._async_sgd["server_ranks"])

    @property
    def pushes_applied(self) -> int:
        """Worker: how many gradients (of all workers together) the servers had taken when they last answered this
        worker (the smallest count over servers; 0 before the first step). Each push is one worker batch, so this
        counts samples seen in units of the worker batch: stop at `steps * n_workers` to train for the samples of
        `steps` synchronous steps, whatever each worker's speed (a few pushes in flight may land after it)."""
        return min(self._role("worker", "pushes_applied").pushes)

    def step(self) -> None:
        """Worker: push this step's gradients to every server, take their fresh parameters (see the module doc)."""
        self._async_sgd["at_wrap"].check("AsyncSGD")
        self._role("worker", "step()").step()

    def finish(self) -> None:
        """Worker: tell the servers this worker trains no more (idempotent). Call it after the last step()."""
        self._role("worker", "finish()").finish()

    def serve(self) -> ServerReport:
        """Server: apply the workers' gradients until every worker finished or was lost; return what happened."""
        return self._role("server", "serve()").run()

    def server_state_dict(self) -> dict[str, Any]:
        """Server: its version, its shard's parameters (by name) and its optimizer's state_dict (tensors and plain
        values: `torch.save` / `torch.load(weights_only=True)` round-trip it)."""
        return self._role("server", "server_state_dict()").state_dict()

    def load_server_state_dict(self, state: dict[str, Any]) -> None:
        """Server: restore `server_state_dict()`'s output, before `serve()`."""
        self._role("server", "load_server_state_dict()").load_state_dict(state)

    def _role(self, role: str, what: str) -> Any:
        obj = self._async_sgd[role]
        if obj is None:
            mine = "server" if role == "worker" else "worker"
            raise ValueError(f"AsyncSGD: {what} is for {role} ranks; rank {self._async_sgd['comm'].rank} is a {mine} "
                             f"(servers are ranks {self._async_sgd['server_ranks']}: call serve() there)")
        return obj


def AsyncSGD(
    module: nn.Module,
    comm: Communicator,
    *,
    optimizer: OptimizerFactory,
    n_servers: int = 1,
    staleness: float = 0,
    lr_scaling: str | Callable[[int], float] | None = "workers",
) -> nn.Module:
    """Train `module` with a parameter server over `comm` and return it (the same object, names unchanged).

    optimizer: builds the servers' optimizer over the list of parameters of a shard (any torch.optim).
    n_servers: how many ranks (the last ones of comm) serve the parameters, 1 .. comm.size - 1; parameters are split
        across them by size (whole tensors).
    staleness: s, how many steps a worker may run ahead of the slowest live one: 0 (synchronous), a positive int,
        or math.inf (fully asynchronous).
    lr_scaling: the lr of each asynchronously applied gradient (staleness > 0; at 0 the server steps the mean of a
        round's gradients at the optimizer's lr): "workers" (lr / n_workers: a push is one N-th of a synchronous
        step, for any optimizer, Adam included), "staleness" (lr / (1 + tau), tau the gradient's staleness in
        updates; Zhang et al. 2016), None (the optimizer's full lr per push) or a callable tau -> factor of the lr.
    """
    comm = check_comm(comm, "AsyncSGD")
    check_whole_model(module, comm, "AsyncSGD")
    if isinstance(module, AsyncSGDModule):
        raise ValueError("AsyncSGD: the module is already wrapped by AsyncSGD; wrap the plain module once")
    if comm.size < 2:
        raise ValueError(f"AsyncSGD: comm has {comm.size} rank; a parameter server needs at least 2 (one server and "
                         f"one worker)")
    if isinstance(n_servers, bool) or not isinstance(n_servers, int) or not 1 <= n_servers <= comm.size - 1:
        raise ValueError(f"AsyncSGD: n_servers={n_servers!r} must be an int in 1..{comm.size - 1} (at least one rank "
                         f"of the {comm.size} must be a worker)")
    if isinstance(staleness, bool) or not (
            (isinstance(staleness, int) and staleness >= 0) or staleness == math.inf):
        raise ValueError(f"AsyncSGD: staleness={staleness!r} must be an int >= 0 (0 = synchronous) or math.inf "
                         f"(fully asynchronous)")
    n_workers = comm.size - n_servers
    if callable(lr_scaling):
        lr_scale = lr_scaling
    elif lr_scaling is None:
        lr_scale = full_lr
    elif lr_scaling == "staleness":
        lr_scale = staleness_scale
    elif lr_scaling == "workers":
        lr_scale = per_worker_scale(n_workers)
    else:
        raise ValueError(f"AsyncSGD: lr_scaling={lr_scaling!r} must be 'workers' (lr / n_workers, the default), "
                         f"'staleness' (lr / (1 + staleness)), None (full lr per push) or a callable staleness -> "
                         f"factor")
    if not callable(optimizer):
        raise ValueError(f"AsyncSGD: optimizer={optimizer!r} must be a callable building a torch.optim optimizer over "
                         f"a list of parameters (e.g. lambda ps: torch.optim.SGD(ps, lr=0.1))")
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("AsyncSGD: the module has no trainable parameter (requires_grad=True)")
    if n_servers > len(params):
        raise ValueError(f"AsyncSGD: n_servers={n_servers} exceeds the model's {len(params)} trainable tensors; "
                         f"allowed 1..{min(len(params), comm.size - 1)} (a server owns whole tensors)")
    to_comm_device(module, comm, "AsyncSGD")
    check_agreement(comm, "AsyncSGD", {"parameters": describe_parameters(module), "options": {
        "n_servers": n_servers, "staleness": str(staleness), "lr_scaling": str(lr_scaling)}})
    with torch.no_grad():
        broadcast_coalesced(comm, [local(p.data) for p in module.parameters()] + [b.data for b in module.buffers()])
    server_ranks = list(range(n_workers, comm.size))
    shards = assign_shards([p.numel() * p.element_size() for p in params], n_servers)
    server = worker = None
    if comm.rank >= n_workers:
        shard = shards[comm.rank - n_workers]
        opt = optimizer([params[i] for i in shard])
        if not isinstance(opt, torch.optim.Optimizer):
            raise ValueError(f"AsyncSGD: optimizer must return a torch.optim.Optimizer, got {type(opt).__name__}")
        server = Server(comm, [params[i] for i in shard], [names[i] for i in shard], list(range(n_workers)), opt,
                        staleness, lr_scale)
    else:
        worker = _Worker(comm, params, shards, server_ranks)
    mix_in(module, AsyncSGDModule, "AsyncSGD")
    module._async_sgd = {"comm": comm, "server": server, "worker": worker, "n_workers": n_workers,
                         "server_ranks": server_ranks, "at_wrap": RequiresGradAtWrap(module)}
    if worker is not None:
        register_refusing(module)  # a torch optimizer over a worker would train it alone (step_hook.py)
    log.debug("AsyncSGD over %d ranks: %d worker(s), servers %s, staleness %s", comm.size, n_workers, server_ranks,
              staleness)
    return module
