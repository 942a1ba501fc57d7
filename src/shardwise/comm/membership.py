"""Membership of an elastic job: who is in, in which rank order, and a fresh torch.distributed world per epoch.

Mechanism. An elastic job's coordinator is its rendezvous store (a TCPStore hosted by `shardwise run`, or by any
process: comm/rendezvous.py), under the job's token (`job_store`): a worker that does not present the token writes
into another key space and is never seen. Every key below lives under `elastic/` there.

* A worker registers once: a member id from a counter (`ids`), and a heartbeat of its own (comm/heartbeat.py
  `Heartbeat`, keyed by member id under `elastic/m/`) that beats while the process lives, whatever epoch it is in,
  and says "done" or "failed" when it leaves. Its silence for `silence` seconds (seconds, not the collective
  timeout) is how a worker that died, froze or lost its host is told apart from one that is slow to arrive.
* An epoch is a member list in rank order and the world built over it. Round e decides epoch e: participants write
  `round/<e>/who/<k>` (arrival order), and the decision `round/<e>/members` is written with compare_set, so the
  first participant whose view satisfies the rule below decides for everyone (no leader to lose). The rule:
  round 0 waits for `initial` workers (or for `min_workers` and no new arrival for `last_call` seconds); a later
  round, opened by a member of the previous epoch (after a CommError, or because joiners wait), waits until every
  previous member whose heartbeat is alive has arrived (at most `timeout + silence` seconds: one blocked in a
  collective arrives when its own wait fails), then takes the survivors in their previous rank order followed by
  the joiners in arrival order, at most `max_workers`. Fewer than `min_workers` alive: the round waits up to
  `wait_timeout` seconds for joiners, then the decision is an error, and every participant raises MembershipError
  naming the counts (no process is left waiting). A participant left out (a joiner beyond `max_workers`, a
  survivor that was presumed dead) tries the next round as a joiner.
* Joining a running job: a joiner arrives at round e+1 and registers under `join/<k>`; the members ask the store at
  a step boundary (`poll`, one broadcast from rank 0 so that all of them agree on the step) and open round e+1.
* The world of epoch e is a new default process group over a store prefixed `elastic/epoch/<e>/`, built in
  process: the survivors are not restarted. What works with gloo after a peer was SIGKILLed (torch 2.13, measured):
  the ranks next to the dead peer fail at once ("connection reset"), but a rank waiting for a live peer that failed
  keeps waiting its whole timeout, and neither `ProcessGroupGloo.abort()` nor `shutdown()` interrupts that wait.
  `destroy_process_group()` then `init_process_group` over the next prefix works in the same process. In a
  standalone script, freeing the failed group (`destroy_process_group()` once nothing holds its works,
  `gc.collect()`) closes its sockets and the waiting peers fail within 0.4 s ("connection closed by peer"). In a
  training job torch.distributed.nn.functional's default arguments and the split communicators held it; leaving
  the world drops them (group_release.py). A wait on a peer that froze without dying still ends at the collective
  `timeout` (its heartbeat's silence names it): keep that timeout short for elastic jobs.

Anchors: torchelastic's dynamic rendezvous (c10d store, rounds, last call, min/max nodes; every worker restarts),
torchft's per-step quorum (healthy replicas keep going), Horovod elastic's host discovery.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import json
import os
import socket
import time
from typing import Any

import torch.distributed as dist

from . import rendezvous
from .base import CommError
from .group_release import release_process_groups
from .heartbeat import Activity, Board, Heartbeat, RankWatch
from .torch_backend import TorchCommunicator

__all__ = ["ELASTIC_ENV", "Membership", "MembershipError", "job_finished"]

ELASTIC_ENV = "SHARDWISE_ELASTIC"  # "MIN:MAX", set by `shardwise run --min --max`
_POLL_S = 0.05


def job_finished(store: Any) -> bool:
    """Whether a worker of the elastic job whose key space is `store` (`rendezvous.job_store`) finished its training
    (`Membership.close("done")`): a worker that arrives now has nothing left to join. The supervisor asks it about a
    restarted worker that failed to join (launch/restarts.py)."""
    return bool(dist.PrefixStore("elastic", store).check(["finished"]))


class MembershipError(RuntimeError):
    """The elastic job cannot go on: fewer than `min_workers` workers within `wait_timeout`, or no place for a
    joiner. Not a CommError: it is not retried."""


def _seconds(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"Membership: {what}={value!r} must be a positive number of seconds")
    return float(value)


class Membership:
    """This worker's view of an elastic job's membership (module docstring), over the job's `store`.

    min_workers / max_workers: bounds of the world. initial: workers round 0 waits for (default max_workers).
    backend: "gloo" (CPU) or "nccl". timeout: seconds of every collective of an epoch's world (and of building it).
    silence: seconds without a heartbeat after which a worker counts as gone (interval: silence / 4, at most 0.5).
    wait_timeout: seconds a round waits below min_workers, and a joiner waits for a place, before MembershipError.
    last_call: seconds round 0 waits for more workers once min_workers arrived but fewer than `initial`.
    local: every worker runs on this host (gloo stays on the loopback interface).

        membership = Membership.from_env()        # under `shardwise run --min 2 --max 4`
        comm = membership.start()                 # epoch 0, or the next epoch of a running job
        ...                                       # on CommError: comm = membership.next_epoch(str(exc))
        membership.close()
    """

    def __init__(self, store: Any, *, min_workers: int, max_workers: int, initial: int | None = None,
                 backend: str = "gloo", timeout: float = 60.0, silence: float = 5.0, wait_timeout: float = 60.0,
                 last_call: float = 2.0, local: bool = True) -> None:
        for name, value in (("min_workers", min_workers), ("max_workers", max_workers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Membership: {name}={value!r} must be an int >= 1")
        if min_workers > max_workers:
            raise ValueError(f"Membership: min_workers={min_workers} must be <= max_workers={max_workers}")
        initial = max_workers if initial is None else initial
        if isinstance(initial, bool) or not isinstance(initial, int) or not min_workers <= initial <= max_workers:
            raise ValueError(f"Membership: initial={initial!r} must be an int in min_workers..max_workers = "
                             f"{min_workers}..{max_workers}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"Membership: backend={backend!r} is not supported; allowed 'gloo' or 'nccl'")
        self.min_workers, self.max_workers, self.initial, self.backend = min_workers, max_workers, initial, backend
        self.timeout = _seconds(timeout, "timeout")
        self.silence = _seconds(silence, "silence")
        self.wait_timeout = _seconds(wait_timeout, "wait_timeout")
        self.last_call = _seconds(last_call, "last_call")
        self.local = bool(local)
        self.store = dist.PrefixStore("elastic", store)
        self.store.set_timeout(datetime.timedelta(seconds=max(self.timeout, 10.0)))
        self.id: int | None = None
        self.epoch: int = -1  # the epoch this worker is in (-1: none yet)
        self.members: list[int] = []
        self.previous: list[int] = []  # the members of the epoch before this one
        self.comm: TorchCommunicator | None = None
        self._beat: Heartbeat | None = None
        self._board = Board(dist.PrefixStore("m", self.store), self.silence)
        self._watch: RankWatch | None = None
        self._closed = False

    @classmethod
    def from_env(cls, **options: Any) -> Membership:
        """The membership of a worker started by `shardwise run --min MIN --max MAX` (or with MASTER_ADDR,
        MASTER_PORT, SHARDWISE_ELASTIC=MIN:MAX and, across hosts, SHARDWISE_JOB_TOKEN set by hand). `options` go to
        the constructor and take precedence (initial defaults to WORLD_SIZE)."""
        spec = os.environ.get(ELASTIC_ENV, "")
        try:
            lo, hi = (int(x) for x in spec.split(":"))
        except ValueError:
            if "min_workers" not in options or "max_workers" not in options:
                raise ValueError(f"Membership.from_env: {ELASTIC_ENV}={spec!r} must be 'MIN:MAX' (shardwise run "
                                 f"--min/--max sets it), or pass min_workers= and max_workers=") from None
            lo, hi = options["min_workers"], options["max_workers"]
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            raise ValueError("Membership.from_env: MASTER_ADDR and MASTER_PORT must name the job's store "
                             "(shardwise run sets them)")
        timeout = float(options.get("timeout", 60.0))
        store = rendezvous.join_store(addr, int(port), timeout, rank=int(os.environ.get("RANK", 0)))
        store = rendezvous.job_store(store, os.environ.get(rendezvous.JOB_TOKEN_ENV))
        size = int(os.environ.get("WORLD_SIZE", hi))
        options = {"min_workers": lo, "max_workers": hi, "initial": min(max(size, lo), hi),
                   "local": rendezvous.is_loopback(addr), **options}
        return cls(store, **options)

    # ---- the public steps ------------------------------------------------------------------------------------------
    @property
    def newcomer(self) -> bool:
        """Whether this worker was not a member of the previous epoch (it holds no state of the job yet)."""
        return self.id not in self.previous

    @property
    def everyone_new(self) -> bool:
        """Whether no member of this epoch was in the previous one (the job's first epoch)."""
        return not set(self.members) & set(self.previous)

    def start(self) -> TorchCommunicator:
        """Register, then enter the job's first epoch (a fresh job) or its next one (a running job: join)."""
        if self.id is not None:
            raise RuntimeError("Membership.start: already started; use next_epoch()")
        self.id = int(self.store.add("ids", 1))
        interval = min(0.5, self.silence / 4)
        self._beat = Heartbeat(dist.PrefixStore("m", self.store), self.id, Activity(), interval).start()
        atexit.register(self.close, "failed")
        published = self._published_epoch()
        return self._enter(0 if published is None else published + 1, joining=published is not None,
                           reason="start")

    def next_epoch(self, reason: str = "") -> TorchCommunicator:
        """Leave the current world (a peer failed, or joiners wait) and enter the next epoch's. Every survivor calls
        it; returns the new world's Communicator. Raises MembershipError below min_workers after wait_timeout."""
        if self.id is None:
            raise RuntimeError("Membership.next_epoch: call start() first")
        self._leave_world()
        return self._enter(self.epoch + 1, joining=False, reason=reason)

    def poll(self) -> bool:
        """Whether workers wait to join and there is room (collective over the current world: rank 0 reads the
        store, every rank gets its answer, so all of them open the next round at the same step)."""
        import torch

        flag = torch.zeros(1, dtype=torch.int64, device=self.comm.device)
        if self.comm.rank == 0 and len(self.members) < self.max_workers:
            flag[0] = int(bool(self._waiting_joiners()))
        self.comm.broadcast(flag, 0)
        return bool(flag.item())

    def close(self, state: str = "done") -> None:
        """Leave the job: the world is destroyed, the heartbeat says `state` ("done": this worker finished, and
        joiners still waiting are told the job ended)."""
        if self._closed:
            return
        self._closed = True
        if state == "done" and self.id is not None:
            try:
                self.store.set("finished", "1")
            except Exception:  # noqa: BLE001 - a store already gone: nobody is left to tell
                pass
        self._leave_world(state)
        if self._beat is not None:
            self._beat.stop(state)

    # ---- rounds ----------------------------------------------------------------------------------------------------
    def _published_epoch(self) -> int | None:
        return int(self.store.get("epoch")) if self.store.check(["epoch"]) else None

    def _alive(self, member: int, *, unseen: bool = False) -> bool:
        """Whether `member`'s heartbeat says it runs; `unseen`: the answer for one with no heartbeat record yet (a
        joiner that registered a moment ago, whose first beat a loaded machine may delay past the members' poll)."""
        record = self._board.record(member)
        if record is None:
            return unseen
        return record.get("state") == "running" and self._board.silent_for(record) <= self.silence

    def _arrivals(self, e: int) -> list[int]:
        n = int(self.store.add(f"round/{e}/count", 0))
        if n == 0:
            return []
        return list(dict.fromkeys(int(v) for v in self.store.multi_get([f"round/{e}/who/{k}" for k in range(1, n + 1)])))

    def _waiting_joiners(self) -> list[int]:
        n = int(self.store.add("join/count", 0))
        if n == 0:
            return []
        ids = {int(v) for v in self.store.multi_get([f"join/{k}" for k in range(1, n + 1)])}
        return sorted(i for i in ids if i not in self.members and self._alive(i, unseen=True))

    def _arrive(self, e: int, joining: bool) -> None:
        k = int(self.store.add(f"round/{e}/count", 1))
        self.store.set(f"round/{e}/who/{k}", str(self.id))
        if joining:  # after arriving, so that the members who see the request find the joiner already there
            j = int(self.store.add("join/count", 1))
            self.store.set(f"join/{j}", str(self.id))
        elif e > 0:  # the round's clock starts when the first member opens it
            self.store.compare_set(f"round/{e}/open", "", repr(time.time()))

    def _enter(self, e: int, *, joining: bool, reason: str) -> TorchCommunicator:
        """Take part in rounds from `e` on until one admits this worker, then build that epoch's world."""
        began = time.monotonic()
        while True:
            self._arrive(e, joining)
            decision = self._decide(e, began)
            if "error" in decision:
                self.close("failed")
                raise MembershipError(decision["error"])
            if self.id in decision["members"]:
                break
            joining = True  # left out (no room, or presumed dead): try the next round as a joiner
            e += 1
        self.previous = decision["previous"]
        self.members, self.epoch = decision["members"], e
        self.store.set("epoch", str(e))
        return self._build(e, reason)

    def _decide(self, e: int, began: float) -> dict[str, Any]:
        """Wait for round e's decision, and write it when this worker's view satisfies the rule (docstring)."""
        key = f"round/{e}/members"
        previous = json.loads(self.store.get(f"round/{e - 1}/members"))["members"] if e > 0 else []
        last_count, last_change = 0, time.monotonic()
        while True:
            if self.store.check([key]):
                return json.loads(self.store.get(key))
            if e > 0 and self.id not in previous and not self.store.check([f"round/{e}/open"]):
                # A joiner waits for the members to open the round; the job may end meanwhile.
                if self.store.check(["finished"]):
                    return {"error": f"elastic: the job finished before worker {self.id} could join"}
                if time.monotonic() - began > self.wait_timeout:
                    return {"error": f"elastic: worker {self.id} found no place in the job within {self.wait_timeout:g}s"
                                     f" (it runs {len(previous)} of max_workers={self.max_workers} workers)"}
                time.sleep(_POLL_S)
                continue
            arrived = [i for i in self._arrivals(e) if self._alive(i)]
            if len(arrived) != last_count:
                last_count, last_change = len(arrived), time.monotonic()
            if e > 0:
                waited = time.time() - float(self.store.get(f"round/{e}/open"))
            else:
                waited = time.monotonic() - began
            decision = self._rule(e, previous, arrived, waited, time.monotonic() - last_change)
            if decision is not None:
                self.store.compare_set(key, "", json.dumps(decision))
                continue  # read back whichever decision won
            time.sleep(_POLL_S)

    def _rule(self, e: int, previous: list[int], arrived: list[int], waited: float,
              quiet: float) -> dict[str, Any] | None:
        """The decision of round e from this view, or None to keep waiting."""
        survivors = [m for m in previous if m in arrived]
        missing = [m for m in previous if m not in arrived and self._alive(m)]
        if e == 0:
            ready = len(arrived) >= self.initial or (len(arrived) >= self.min_workers and quiet >= self.last_call)
        else:
            ready = len(arrived) >= self.min_workers and (not missing or waited > self.timeout + self.silence)
        if ready:
            joiners = [i for i in arrived if i not in previous]
            return {"members": (survivors + joiners)[: self.max_workers], "previous": previous}
        if len(arrived) < self.min_workers and not missing and waited > self.wait_timeout:
            lost = [m for m in previous if m not in arrived]
            return {"error": f"elastic: only {len(arrived)} worker(s) alive for epoch {e} (members {arrived}), "
                             f"fewer than min_workers={self.min_workers}, after waiting {self.wait_timeout:g}s for "
                             f"joiners" + (f"; lost: {lost}" if lost else "")}
        return None

    # ---- the world of an epoch ---------------------------------------------------------------------------------------
    def _build(self, e: int, reason: str) -> TorchCommunicator:
        rank, size = self.members.index(self.id), len(self.members)
        store = dist.PrefixStore(f"epoch/{e}", self.store)
        if self.local and self.backend == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME"):
            # as init() does for a local job: gloo's device on the loopback interface, read when the group is made
            names = {name for _, name in socket.if_nameindex()}
            loopback = next((name for name in ("lo", "lo0") if name in names), None)
            if loopback is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = loopback
        try:
            dist.init_process_group(self.backend, store=store, rank=rank, world_size=size,
                                    timeout=datetime.timedelta(seconds=self.timeout))
        except Exception as exc:  # a member died between the decision and here: the next round drops it
            raise CommError(f"elastic: rank {rank} could not build the {size}-worker world of epoch {e} within "
                            f"{self.timeout:g}s: {exc}", op="init", rank=rank) from exc
        self._watch = RankWatch(store, rank, interval=min(0.5, self.silence / 4), silence=self.silence).start()
        self.comm = TorchCommunicator(None, timeout=self.timeout, _watch=self._watch)
        return self.comm

    def _leave_world(self, state: str = "failed") -> None:
        """Free the current world so that its sockets close (module docstring: what wakes peers stuck in a wait)."""
        if self._watch is not None:
            self._watch.stop(state, "" if state == "done" else "left for the next epoch")
            self._watch = None
        self.comm = None
        gc.collect()  # drops works of the failed step that reference cycles still hold
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a group broken by the failure is discarded all the same
                pass
        release_process_groups()  # what else held the old world's groups (group_release.py); collects too
