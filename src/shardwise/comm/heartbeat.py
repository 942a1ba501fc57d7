"""Heartbeats: a cheap failure detector beside the data path, and how a rank whose wait failed names the culprit.

Mechanism. Each rank of a process job runs one daemon thread (`Heartbeat`) that writes a small JSON record under
`shardwise/beat/<rank>` in the job's rendezvous store every `interval` seconds, through its own clone of the store (one
more TCP connection: a store client is not shared between threads, and the data path never waits for a beat). The
record holds the beat's wall-clock time, the process id, the rank's state ("running", "done", or "failed" with a
one-line error) and what its communicators are doing, kept by `Activity`: the operation a wait is blocked in and its
group, since when; or, between waits, when the last wait ended. Communicators only update `Activity` (two attribute
writes per wait), so the data path pays nothing else. A launcher that watches the processes writes its verdict on a
rank under `shardwise/verdict/<rank>` ("killed by SIGKILL", "raised ValueError: ...").

Its own timeout. A record whose beat is older than `silence` seconds belongs to a process that died or froze
(SIGSTOP, a host gone): the heartbeat thread beats while the rank's main thread sleeps or computes, so silence means
the process itself stopped. A rank that beats but makes no progress is told apart differently: it is outside
communication while its peers wait for it (`Board.explain`).

Naming the culprit. When a wait fails, the communicator calls `Board.explain` with the peers the operation waited for.
Each is judged from its record and the launcher's verdict: died / silent / raised / already returned / outside
communication for X s / waiting in another group's operation are culprits; a peer waiting in, or failed in, an
operation of the same group is a fellow victim. When the backend failed early (gloo reports a dead peer as a broken
connection, at once), a peer's last beat may still look healthy: `explain` then polls the board until some peer's
fate is certain (a verdict, a silent or final record) or the deadline passes.

Clocks: records carry wall-clock time (time.time()); ranks on several hosts need clocks that agree to well within
`silence` seconds (NTP does). Nothing here changes what a collective computes.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["Activity", "Board", "Heartbeat", "PeerNote", "RankWatch"]

_BEAT = "shardwise/beat/{}"
_VERDICT = "shardwise/verdict/{}"
_STORE_TIMEOUT_S = 5.0  # a store call of the detector never blocks longer than this (_BoundedStore)


class Activity:
    """What this process's communicators are doing: the operation a wait is blocked in, or when the last one ended.

    `enter` / `leave` / `fail` are called by a communicator around each wait (attribute writes only: cheap, and atomic
    under the GIL); the heartbeat thread reads `snapshot()`.
    """

    def __init__(self) -> None:
        self.doing: tuple[str, tuple[int, ...], float] | None = None  # (operation, group, since)
        self.idle_since = time.time()
        self.last: tuple[str, tuple[int, ...]] | None = None  # the last operation that completed
        self.failed: tuple[str, tuple[int, ...], float] | None = None  # the last wait that raised CommError

    def enter(self, what: str, group: Sequence[int]) -> None:
        self.doing = (what, tuple(group), time.time())

    def leave(self) -> None:
        doing = self.doing
        if doing is not None:
            self.last = (doing[0], doing[1])
        self.doing, self.idle_since = None, time.time()

    def fail(self) -> None:
        doing = self.doing
        if doing is not None:
            self.failed = (doing[0], doing[1], time.time())
        self.doing, self.idle_since = None, time.time()

    def snapshot(self) -> dict[str, Any]:
        doing, last, failed = self.doing, self.last, self.failed
        return {
            "doing": None if doing is None else [doing[0], list(doing[1]), doing[2]],
            "idle_since": self.idle_since,
            "last": None if last is None else [last[0], list(last[1])],
            "failed": None if failed is None else [failed[0], list(failed[1]), failed[2]],
        }


def _clone(store: Any) -> Any:
    clone = store.clone()
    clone.set_timeout(datetime.timedelta(seconds=_STORE_TIMEOUT_S))
    return clone


class _Unreachable(Exception):
    """A store call of the detector failed or went unanswered: the store's host cannot be reached from this rank."""


class _BoundedStore:
    """The detector's own client of the job's store: every call returns within `limit` seconds or raises _Unreachable.

    torch's TCPStore client bounds the wait for a key, not a request whose answer never comes: across a cut link
    (tests/test_two_hosts.py: `ip link set ... down` between two hosts) `check()` on a clone with a 2 s timeout was
    still blocked after 35 s, as TCP keeps retransmitting for minutes. The detector must answer within its own
    timeout exactly then, so each call runs on a short-lived daemon thread and the caller waits at most `limit`. A
    call that overruns or fails leaves its connection in an unknown state: it is dropped, and the next call connects
    afresh (a partition that heals is used again). While an abandoned call is still blocked no new one starts, so a
    long partition costs one stuck thread, not one per beat.
    """

    def __init__(self, store: Any, limit: float | None = None) -> None:
        self._origin = store
        self.limit = float(_STORE_TIMEOUT_S if limit is None else limit)  # read now: tests shorten it
        self._client: Any = _clone(store)
        self._pending: threading.Thread | None = None  # an abandoned call that has not returned yet
        self._lock = threading.Lock()  # one call at a time: a store client is not shared between threads

    def call(self, method: str, *args: Any) -> Any:
        with self._lock:
            if self._pending is not None and self._pending.is_alive():
                raise _Unreachable(f"an earlier call got no answer from the job's store within {self.limit:g}s")
            client, box = self._client, {}

            def run() -> None:
                try:
                    box["client"] = c = client if client is not None else _clone(self._origin)
                    box["value"] = getattr(c, method)(*args)
                except Exception as exc:  # noqa: BLE001 - handed to the caller below
                    box["error"] = exc

            thread = threading.Thread(target=run, name="shardwise-store-call", daemon=True)
            thread.start()
            thread.join(self.limit)
            if thread.is_alive():
                self._client, self._pending = None, thread
                raise _Unreachable(f"no answer from the job's store within {self.limit:g}s")
            if "error" in box:
                self._client = None
                exc = box["error"]
                raise _Unreachable(str(exc).splitlines()[0][:150] if str(exc) else type(exc).__name__) from exc
            self._client = box["client"]
            return box["value"]

    def settle(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for an abandoned call to return (before the process exits: a daemon thread
        coming back from C++ into a finalizing interpreter aborts it); True when none is left."""
        pending = self._pending
        if pending is not None:
            pending.join(timeout)
        return pending is None or not pending.is_alive()


class Heartbeat:
    """The rank side: a daemon thread publishing this rank's record every `interval` seconds (module docstring).

    launcher_pid: when given, the process exits (code 1) once its parent is no longer that process, so the ranks of a
    launcher that was killed do not live on as orphans.
    """

    def __init__(self, store: Any, rank: int, activity: Activity, interval: float = 0.5,
                 *, launcher_pid: int | None = None) -> None:
        self.store = _BoundedStore(store)
        self.rank = rank
        self.activity = activity
        self.interval = float(interval)
        self.launcher_pid = launcher_pid
        self.state, self.error = "running", ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shardwise-heartbeat{rank}", daemon=True)

    def start(self) -> Heartbeat:
        self._publish()
        self._thread.start()
        return self

    def stop(self, state: str = "done", error: str = "") -> None:
        """Publish the final record (state "done", or "failed" with a one-line error) and end the thread. Only the
        first call counts."""
        if self._stop.is_set():
            return
        self.state, self.error = state, error[:500]
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.interval + _STORE_TIMEOUT_S)
        self._publish()
        self.store.settle(2 * self.store.limit)  # no store call left in flight when the process exits

    def _publish(self) -> None:
        record = {"t": time.time(), "pid": os.getpid(), "state": self.state, "error": self.error,
                  **self.activity.snapshot()}
        try:
            self.store.call("set", _BEAT.format(self.rank), json.dumps(record))
        except _Unreachable:  # a store that went away must not kill the rank; peers see silence
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.launcher_pid is not None and os.getppid() != self.launcher_pid:
                os._exit(1)  # the launcher died: nobody will collect this rank's result
            self._publish()


class PeerNote:
    """What `Board.explain` says about one peer: `text` (a clause for the error), whether it is a `culprit`, and
    whether that is `certain` (a verdict, silence, a final record) rather than a reading of a live record; for such
    a reading, `quiet` is the age of the record's beat in seconds."""

    __slots__ = ("rank", "text", "culprit", "certain", "quiet")

    def __init__(self, rank: int, text: str, culprit: bool, certain: bool = False, quiet: float | None = None) -> None:
        self.rank, self.text, self.culprit, self.certain, self.quiet = rank, text, culprit, certain, quiet

    def __repr__(self) -> str:
        return f"PeerNote({self.rank}, {self.text!r}, culprit={self.culprit}, certain={self.certain})"


class Board:
    """The reading side of the heartbeats: peers' records and the launcher's verdicts, in one store clone.

    silence: seconds without a beat after which a rank counts as dead or frozen (the detector's own timeout).
    """

    def __init__(self, store: Any, silence: float) -> None:
        self.store = _BoundedStore(store)  # serialises its calls: a launcher reads from a watcher thread and marks
        self.silence = float(silence)

    def _get(self, key: str, *, strict: bool = False) -> bytes | None:
        """The key's value, or None when it is absent; a store that cannot be reached is None too, or, with
        `strict`, raises _Unreachable (so that `explain` pays the store's timeout once, not once per key)."""
        try:
            return self.store.call("get", key) if self.store.call("check", [key]) else None
        except _Unreachable:  # an unreachable store is "unknown", never a second error
            if strict:
                raise
            return None

    def record(self, rank: int, *, strict: bool = False) -> dict[str, Any] | None:
        """The rank's last published record, or None before its first beat."""
        raw = self._get(_BEAT.format(rank), strict=strict)
        return None if raw is None else json.loads(raw)

    def verdict(self, rank: int, *, strict: bool = False) -> str | None:
        raw = self._get(_VERDICT.format(rank), strict=strict)
        return None if raw is None else raw.decode()

    def mark(self, rank: int, verdict: str) -> None:
        """The launcher's verdict on a rank ("killed by SIGKILL", ...), read by its peers' `explain`."""
        try:
            self.store.call("set", _VERDICT.format(rank), verdict)
        except _Unreachable:
            pass

    def silent_for(self, record: dict[str, Any], now: float | None = None) -> float:
        """Seconds since the record's beat."""
        return (time.time() if now is None else now) - record["t"]

    def note(self, rank: int, group: Sequence[int], since: float) -> PeerNote:
        """Judge peer `rank` for a wait in `group` that began at wall time `since` (see the module docstring)."""
        verdict = self.verdict(rank, strict=True)
        if verdict is not None:
            return PeerNote(rank, f"rank {rank} {verdict}", True, True)
        rec = self.record(rank, strict=True)
        if rec is None:
            return PeerNote(rank, f"rank {rank} never published a heartbeat", False)
        now = time.time()
        quiet = self.silent_for(rec, now)
        if rec["state"] == "failed":
            if rec["error"].startswith("CommError"):  # a fellow victim; its own error names whom it waited for
                return PeerNote(rank, f"rank {rank} failed with a CommError too", False, True)
            return PeerNote(rank, f"rank {rank} failed: {rec['error']}", True, True)
        if rec["state"] == "done":
            return PeerNote(rank, f"rank {rank} already returned from its function", True, True)
        if quiet > self.silence:
            return PeerNote(rank, f"rank {rank} sent no heartbeat for {quiet:.1f}s (its process died or froze)",
                            True, True)
        members = sorted(group)
        failed = rec.get("failed")
        if failed is not None and sorted(failed[1]) == members and failed[2] >= since:
            return PeerNote(rank, f"rank {rank} failed in {failed[0]} too", False, quiet=quiet)
        doing = rec.get("doing")
        if doing is not None:
            what, its_group, entered = doing
            if sorted(its_group) == members:
                return PeerNote(rank, f"rank {rank} waits in {what} too", False, quiet=quiet)
            return PeerNote(rank, f"rank {rank} waits in {what} of group {its_group} since {now - entered:.1f}s ago",
                            True, quiet=quiet)
        last = f"; its last finished operation: {rec['last'][0]}" if rec.get("last") else ""
        return PeerNote(rank, f"rank {rank} is outside communication for {now - rec['idle_since']:.1f}s (stalled "
                              f"or still computing{last})", True, quiet=quiet)

    def explain(self, peers: Sequence[int], group: Sequence[int], since: float, *, settle: float = 0.0,
                poll: float = 0.05) -> list[PeerNote]:
        """Notes on `peers` for a failed wait in `group` begun at wall time `since`.

        settle: for a wait that failed early (a broken connection), poll up to this many seconds until some peer's
        fate is certain; a wait that ran to its deadline passes 0 (the live records already tell who is missing).
        """
        end = time.monotonic() + settle
        while True:
            try:
                notes = [self.note(p, group, since) for p in peers]
            except _Unreachable as exc:
                # This rank is cut off from the store's host (a network partition, or that host is down): no peer's
                # state can be known, so every peer counts as not heard from. One failed store call, not one per
                # key: each would wait the store's timeout.
                notes = [PeerNote(p, f"rank {p} not heard from", True) for p in peers]
                if notes:
                    notes[0].text = f"the job's store is unreachable from this rank ({exc}); {notes[0].text}"
                return notes
            if any(n.certain and n.culprit for n in notes) or time.monotonic() >= end:
                return notes
            time.sleep(poll)


class RankWatch:
    """One rank's side of the detector, as its communicators hold it: Activity, Heartbeat and a Board together.

    `start()` begins beating; `explain()` names the culprits of a failed wait; `stop()` publishes the final state.
    """

    def __init__(self, store: Any, rank: int, *, interval: float = 0.5, silence: float = 10.0,
                 launcher_pid: int | None = None) -> None:
        self.rank = rank
        self.activity = Activity()
        self.heartbeat = Heartbeat(store, rank, self.activity, interval, launcher_pid=launcher_pid)
        self.board = Board(store, silence)

    def start(self) -> RankWatch:
        self.heartbeat.start()
        return self

    def stop(self, state: str = "done", error: str = "") -> None:
        self.heartbeat.stop(state, error)

    def culprits(self, peers: Sequence[int], group: Sequence[int], since: float, early: bool,
                 deadline: float) -> tuple[list[int], str]:
        """(the peers to blame, a clause describing every peer) for a failed wait; every peer when none stands out.

        early: the backend failed before the deadline (a broken connection), so wait for certainty until `deadline`
        (a time.monotonic() value) or `silence` + a beat, whichever comes first.
        """
        settle = min(max(0.0, deadline - time.monotonic()), self.board.silence + self.heartbeat.interval) if early else 0
        notes = self.board.explain(peers, group, since, settle=settle)
        # A peer whose beats stopped just before this wait began (a cut link, a host gone) has not yet been quiet for
        # `silence` seconds when the wait times out, so its stale record still reads "waits in ... too". Wait until
        # every such peer is judged, silent or beating again (at most `silence` + a beat), so that every peer cut off
        # is named, not only those whose last beat happened to be older.
        stale = 4 * self.heartbeat.interval
        end = time.monotonic() + self.board.silence + self.heartbeat.interval
        while (any(not n.certain and n.quiet is not None and n.quiet > stale for n in notes)
               and time.monotonic() < end):
            time.sleep(0.05)
            notes = self.board.explain(peers, group, since)
        certain = [n for n in notes if n.culprit and n.certain]
        blamed = certain or [n for n in notes if n.culprit]
        ranks = [n.rank for n in blamed] or list(peers)
        return ranks, "; ".join(n.text for n in (certain or notes))
