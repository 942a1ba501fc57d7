"""The server side of `AsyncSGD`: apply pushed gradients to this server's shard, answer with fresh parameters.

Mechanism (Dean et al. 2012, DistBelief / Downpour SGD; Ho et al. 2013, Stale Synchronous Parallel)
------------------------------------------------------------------------------------------------------
* The server owns some of the model's parameters (its *shard*; `assign_shards` balances them by size) and one
  torch.optim optimizer over them: any optimizer, its state lives here only.
* It takes pushes in arrival order (receive from any source, mailbox.py). Each worker's *clock* counts its pushes.
* Asynchronous (staleness > 0): each gradient is applied at once, in one optimizer step with lr x `lr_scale(tau)`,
  tau the gradient's *staleness* (updates applied since the worker read the parameters it used). The default
  scale is 1 / n_workers: a push is one N-th of a synchronous step. Scaling the lr rather than the gradient is
  what makes that hold for every optimizer: for SGD the two are the same, but Adam-like optimizers are invariant to
  the gradient's scale, so a gradient / N would still take a full-lr step per push, N x the synchronous step per
  sample seen (measured on the benchmark's GPT: ~10% higher loss at equal samples), and decoupled weight decay would
  also act N times per synchronous step. `lr_scaling="staleness"` uses lr / (1 + tau) instead (Zhang et al. 2016,
  "Staleness-aware Async-SGD"): with workers arriving in turn tau is about N - 1, so it is about lr / N on average,
  smaller for a straggler's staler gradients. Every applied gradient's (worker, clock, tau) is recorded.
* Synchronous (staleness = 0): the gradients of one clock tick are summed until every live worker has pushed, then
  their mean is applied in one optimizer step: exactly synchronous SGD on the same data, whatever the optimizer.
* Bounded staleness: a worker that pushed is answered (it may start its next step) only while its clock is at most
  `staleness` ahead of the slowest live worker's; otherwise its answer waits. s = 0 is bulk synchronous, s = inf
  never waits. The answer carries the shard's parameters and version at the time it is sent.
* Ending and failures: a worker's DONE message, or a failed receive from it (it died; gloo sees the connection
  close), or its silence past the timeout while the server waits for it, removes it: the others go on, the gate
  and the synchronous rounds then count only the live workers. `serve()` returns when no worker is left.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

import torch
from torch import nn

from ..comm.base import CommError, Communicator, Work
from .mailbox import Gone, Inbox, Message, Silence
from .protocol import DONE, PARAMS, PULL_TAG, PUSH, PUSH_TAG, decode_into, encode, header, message_bytes

__all__ = ["ServerReport", "Applied", "Server", "assign_shards"]

log = logging.getLogger("shardwise.async_sgd")


def assign_shards(sizes: list[int], n_servers: int) -> list[list[int]]:
    """Indices of the tensors each server owns: largest first, each to the least loaded server (ties: lowest
    index), then in model order within a shard. Whole tensors, so any optimizer (also shape-aware ones) applies."""
    load = [0] * n_servers
    shards: list[list[int]] = [[] for _ in range(n_servers)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(range(n_servers), key=lambda k: (load[k], k))
        shards[s].append(i)
        load[s] += sizes[i]
    return [sorted(shard) for shard in shards]


@dataclasses.dataclass(frozen=True)
class Applied:
    """One applied gradient: the worker (rank of the communicator), its clock, its staleness tau (updates applied
    since it read the parameters), and how many clock ticks it was ahead of the slowest live worker."""

    worker: int
    clock: int
    staleness: int
    ahead: int


@dataclasses.dataclass
class ServerReport:
    """What `serve()` returns: updates applied (optimizer steps), every applied gradient, the workers that finished
    and those lost (died or silent past the timeout), and the seconds served."""

    updates: int
    applied: list[Applied]
    finished: list[int]
    lost: list[int]
    seconds: float

    @property
    def staleness(self) -> list[int]:
        return [a.staleness for a in self.applied]


class Server:
    """One server rank's state (built at wrap time, so it can be checkpointed before `run()`)."""

    def __init__(self, comm: Communicator, params: list[nn.Parameter], names: list[str], workers: list[int],
                 optimizer: torch.optim.Optimizer, staleness: float, lr_scale: Callable[[int], float]) -> None:
        self.comm = comm
        self.params = params
        self.names = names
        self.workers = workers
        self.optimizer = optimizer
        self.staleness = staleness
        self.lr_scale = lr_scale
        self.version = 0
        self.pushes = 0  # gradients taken from all workers: what a budget of samples counts
        self.clock = {w: 0 for w in workers}
        self.size = message_bytes(params)

    # ---- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"version": self.version, "pushes": self.pushes,
                "params": {n: p.detach().clone() for n, p in zip(self.names, self.params)},
                "optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if sorted(state["params"]) != sorted(self.names):
            raise ValueError(f"load_server_state_dict: the saved shard holds {sorted(state['params'])[:5]}... but this "
                             f"server holds {sorted(self.names)[:5]}...; load it on the server that saved it (same "
                             f"n_servers and model)")
        for n, p in zip(self.names, self.params):
            p.copy_(state["params"][n])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.pushes = int(state.get("pushes", 0))  # absent in states saved before pushes were counted

    # ---- the loop ---------------------------------------------------------------------------------------------
    def run(self) -> ServerReport:
        start = time.monotonic()
        inbox = Inbox(self.comm, self.workers, self.size, PUSH_TAG)
        active = set(self.workers)
        waiting: set[int] = set()  # workers that pushed and wait for their answer
        finished: list[int] = []
        lost: list[int] = []
        silent: set[int] = set()  # lost by silence: their listeners may still be receiving
        applied: list[Applied] = []
        sends: dict[int, tuple[Work, torch.Tensor]] = {}  # the last answer to each worker, and its buffer
        grads = [torch.empty_like(p) for p in self.params]
        round_sum = [torch.zeros_like(p) for p in self.params] if self.staleness == 0 else None
        round_from: set[int] = set()
        updates = 0

        def remove(w: int, why: str | None) -> None:
            if w not in active:
                return
            active.discard(w)
            waiting.discard(w)
            inbox.close(w)
            (finished if why is None else lost).append(w)
            if why is not None:
                log.warning("parameter server rank %d: worker rank %d lost (%s); %d worker(s) go on", self.comm.rank,
                            w, why, len(active))

        while active:
            event = inbox.next(self.comm.timeout)
            if isinstance(event, Gone):
                remove(event.source, str(event.error))
            elif isinstance(event, Silence):
                owing = sorted(active - waiting)
                for w in owing or sorted(active):  # nobody owes a message: a bug, but never wait forever
                    silent.add(w)
                    remove(w, f"silent for {self.comm.timeout:g}s")
            else:
                assert isinstance(event, Message)
                w = event.source
                kind, clock, read = header(event.data)
                if w not in active:
                    continue  # a message from a worker already counted as lost: it is late; drop it
                if kind == DONE:
                    remove(w, None)
                elif kind == PUSH:
                    decode_into(event.data, grads)
                    slowest = min(self.clock[a] for a in active)
                    record = Applied(w, clock, self.version - read, self.clock[w] - slowest)
                    self.clock[w] += 1
                    self.pushes += 1
                    if round_sum is not None:
                        for acc, g in zip(round_sum, grads):
                            acc.add_(g)
                        round_from.add(w)
                        applied.append(dataclasses.replace(record, staleness=0))
                    else:
                        self._apply(grads, 1.0, float(self.lr_scale(record.staleness)))
                        updates += 1
                        applied.append(record)
                    waiting.add(w)
                else:
                    raise CommError(f"parameter server rank {self.comm.rank}: message of unknown kind {kind} from "
                                    f"rank {w} (a worker of another protocol version?)", op="recv",
                                    rank=self.comm.rank, peers=[w])
            if round_sum is not None and round_from and active <= round_from:
                self._apply(round_sum, 1.0 / len(round_from), 1.0)  # the mean, at the optimizer's lr
                updates += 1
                for acc in round_sum:
                    acc.zero_()
                round_from.clear()
            self._answer(waiting, active, sends)
        for work, _ in sends.values():  # the last answers; a lost worker's may fail
            try:
                work.wait()
            except CommError:
                pass
        inbox.join([w for w in self.workers if w not in silent], self.comm.timeout)  # no listener left in torch
        return ServerReport(updates, applied, finished, lost, time.monotonic() - start)

    @torch.no_grad()
    def _apply(self, grads: list[torch.Tensor], scale: float, factor: float) -> None:
        """One optimizer step on `grads` x `scale`, with every group's lr x `factor` for this step only."""
        for p, g in zip(self.params, grads):
            p.grad = g * scale
        saved = [group.get("lr") for group in self.optimizer.param_groups]
        if factor != 1.0:
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * factor
        self.optimizer.step()
        if factor != 1.0:
            for group, lr in zip(self.optimizer.param_groups, saved):
                group["lr"] = lr
        for p in self.params:
            p.grad = None
        self.version += 1

    def _answer(self, waiting: set[int], active: set[int], sends: dict[int, tuple[Work, torch.Tensor]]) -> None:
        """Answer every waiting worker whose clock is within `staleness` of the slowest live one."""
        if not waiting:
            return
        slowest = min(self.clock[a] for a in active)
        for w in sorted(waiting):
            if self.clock[w] - slowest <= self.staleness:
                waiting.discard(w)
                previous = sends.pop(w, None)
                if previous is not None:  # the worker received it before pushing again: done, its buffer is free
                    previous[0].wait()
                    message = previous[1]
                else:
                    message = torch.empty(self.size, dtype=torch.uint8, device=self.comm.device)
                encode(message, PARAMS, self.version, self.pushes, self.params, self.params)
                sends[w] = (self.comm.isend(message, w, PULL_TAG), message)


def full_lr(tau: int) -> float:
    """The optimizer's lr for every push (lr_scaling=None)."""
    return 1.0


def per_worker_scale(n_workers: int) -> Callable[[int], float]:
    """lr / n_workers whatever the staleness: one push is one N-th of a synchronous step (the default)."""
    return lambda tau: 1.0 / n_workers


def staleness_scale(tau: int) -> float:
    """lr / (1 + tau): the staleness-aware learning rate of Zhang et al. 2016."""
    return 1.0 / (1 + tau)


INF = math.inf
