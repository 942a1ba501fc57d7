"""What `shardwise run` starts (RunConfig, validated when built) and what decides on a failure (the policies).

A policy is `policy(failure, job) -> STOP | CONTINUE`, called by the supervisor (supervise.py) once per rank that
failed, with a JobView of the job at that moment: `tear_down` (the default) stops the job as torchrun and mpirun do;
`keep_survivors` lets the other ranks run to their own end (asynchronous and elastic training). supervise.py
re-exports every name here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from .detector import Failure

__all__ = ["BACKEND_ENV", "CONTINUE", "RUN_BACKENDS", "STOP", "FailurePolicy", "JobView", "RunConfig",
           "keep_survivors", "tear_down"]

RUN_BACKENDS = ("gloo", "nccl", "mpi")
BACKEND_ENV = "SHARDWISE_BACKEND"
STOP, CONTINUE = "stop", "continue"


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What `shardwise run` starts.

    script / args: the user's script and its arguments. nproc: ranks on this node. backend: "gloo", "nccl" (each
    rank joins through the store; `sw.init()` picks it up from SHARDWISE_BACKEND) or "mpi" (ranks under mpirun;
    `sw.init()` returns an MPI Communicator). nnodes / node_rank: this node's place; ranks are numbered
    node_rank * nproc + local rank. master_addr / master_port: where node 0 hosts the store (port 0: the OS picks,
    one node only). timeout: seconds to reach the store, and of heartbeat silence before a rank counts as frozen.
    grace: seconds between SIGTERM and SIGKILL. settle: seconds to collect the other ranks' reports after a failure.
    elastic: (min_workers, max_workers) of an elastic job (workers use sw.elastic; survivors run on). join: add this
    node's workers to a running elastic job at master_addr:master_port. max_restarts: crashes of worker processes
    answered by a restart over the whole job (restarts.py: an elastic job replaces the worker, which joins the
    running job; a fixed-size job restarts every worker, as torchrun does); 0: none.
    """

    script: str
    args: tuple[str, ...] = ()
    nproc: int = 1
    backend: str = "gloo"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    timeout: float = 60.0
    grace: float = 3.0
    settle: float = 1.0
    elastic: tuple[int, int] | None = None
    join: bool = False
    max_restarts: int = 0

    def __post_init__(self) -> None:
        def bad(what: str) -> ValueError:
            return ValueError(f"run: {what}")

        for name in ("nproc", "nnodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(f"{name}={value!r} must be an int >= 1")
        if self.backend not in RUN_BACKENDS:
            raise bad(f"backend={self.backend!r} is not supported; allowed {RUN_BACKENDS}")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise bad(f"node_rank={self.node_rank!r} must be in 0..nnodes-1 = 0..{self.nnodes - 1}")
        if not isinstance(self.master_port, int) or not 0 <= self.master_port < 65536:
            raise bad(f"master_port={self.master_port!r} must be a TCP port (1..65535, or 0: the OS picks)")
        if self.nnodes > 1 and self.master_port == 0:
            raise bad(f"nnodes={self.nnodes} needs master_port (every node must know where node 0 listens)")
        if self.backend == "mpi" and self.nnodes > 1:
            raise bad("backend='mpi' places ranks on hosts through mpirun itself; give nnodes=1 and mpirun's -H, "
                      "or use backend='gloo' / 'nccl' with one `shardwise run` per node")
        for name in ("timeout", "grace", "settle"):
            if not getattr(self, name) > 0:
                raise bad(f"{name}={getattr(self, name)!r} must be a positive number of seconds")
        if self.elastic is not None:
            lo, hi = self.elastic
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise bad(f"elastic={self.elastic!r} must be (min_workers, max_workers) with 1 <= min <= max")
            if self.backend == "mpi" or self.nnodes > 1:
                raise bad("elastic jobs (--min/--max) run with backend gloo or nccl and one `shardwise run` per "
                          "group of workers (--join adds workers), not --nnodes or mpi")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise bad(f"max_restarts={self.max_restarts!r} must be an int >= 0")
        if self.max_restarts and self.elastic is None and self.nnodes > 1:
            raise bad(f"max_restarts={self.max_restarts} with nnodes={self.nnodes}: restarting a fixed-size group "
                      f"that spans nodes needs every node's supervisor to agree on the attempt, which shardwise run "
                      f"does not do; use an elastic job (--min/--max, one `shardwise run` per group of workers) or "
                      f"torchrun --max-restarts")
        if self.join and (self.elastic is None or self.master_port == 0):
            raise bad("join=True adds workers to a running elastic job: give elastic=(min, max) and the job's "
                      "master_addr / master_port")
        if not os.path.isfile(self.script):
            raise bad(f"script {self.script!r} is not a file")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc

    @property
    def first_rank(self) -> int:
        """The global rank of this node's local rank 0."""
        return self.node_rank * self.nproc


@dataclasses.dataclass(frozen=True)
class JobView:
    """What a policy sees when a rank fails: global ranks that failed, returned, or are still running (this node's
    ranks; with several nodes, `remote_failed` lists the other nodes' ranks known to have failed)."""

    world_size: int
    failed: tuple[int, ...]
    done: tuple[int, ...]
    running: tuple[int, ...]
    remote_failed: tuple[int, ...] = ()


#: A failure policy: called once per failed rank (the Failure carries its global rank), returns STOP or CONTINUE.
FailurePolicy = Callable[[Failure, JobView], str]


def tear_down(failure: Failure, job: JobView) -> str:
    """The default policy: any failure stops the whole job (torchrun's and MPI's behaviour)."""
    return STOP


def keep_survivors(failure: Failure, job: JobView) -> str:
    """Let the other ranks run to their own end (asynchronous / elastic training tolerates a lost worker). The job
    still exits non-zero and reports the failure."""
    return CONTINUE
