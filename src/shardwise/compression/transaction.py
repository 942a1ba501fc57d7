"""A compressor's state follows the step: staged during the reduction, committed when the optimizer step is taken,
restored when it is skipped; state that is not finite raises, naming the tensor.

Why: a loss scaler decides to skip a step (an inf or NaN gradient on any rank) only after the gradients were
reduced, and a lossy method has by then written this step's error-feedback residual, PowerSGD's Q or DGC's velocity.
Kept, a NaN in a residual comes back in every later gradient: every later step is skipped, the scale collapses, and
nothing says why (issue 33: TopK, RandomK, PowerSGD, OneBit and BF16 with error feedback, 16k-119k non-finite
entries in one rank's residual after one NaN loss).

Mechanism (a transaction per step, no copy of the state):
* The first reduction of a step (`Compressor._begin`) keeps a *shallow* copy of each state dict (memory, iterations,
  and a method's own: PowerSGD's q, TopK's velocity): references to the current tensors, not their data.
* A reduction never writes into a tensor that copy refers to: it puts a new tensor (or, PowerSGD, the other of two
  buffers it alternates) under the bucket's key. The step's state is therefore the live dicts, and the state
  before it is the copy, side by side until the step is settled.
* `settle(taken)`: taken -> the copy is dropped (commit); skipped -> the dicts get the copy's references back
  (rollback: exact, bit for bit, and free). `sw.ShardedGradScaler(model)` settles every compressor of the model at
  its `step()`, on every rank alike, since its skip decision is one all-reduced flag: a rank whose own gradients
  were finite rolls back too. A second reduction of a bucket before the step is settled (accumulating without
  `no_sync`) continues the same transaction.
* Nobody settling (no scaler, or a scaler built from a communicator, which does not know the model): the next
  step's first reduction of a bucket already reduced commits the previous step, after the check below. From then
  on nothing can be rolled back, so nothing is kept: each bucket's old state is let go as its new one is written.

Non-finite state raises (`NonFiniteStateError`, naming the method, the tensor, the bucket, how many values and the
step) instead of being kept. Each new state tensor's sum is computed when it is written (a sum is non-finite when any
element is: one pass over the new state, on the device), and, for methods whose payload does not carry its own NaN
to every rank, that sum times 0 rides in the payload (TopK's and RandomK's values). A sum over what each rank
received makes the verdict the same on every rank, so every rank raises at the same point instead of one rank
raising and the others waiting in their next collective. The host reads one flag per settled step: right after the
scaler's own read when a scaler settles (nothing new to wait for); else at the next step's first reduction, where on
CUDA the flag was copied to pinned memory without waiting and is read one step later, so no host sync is added to
the step. A failed check restores the state before the step (when it still can) and raises.

Cost: settled by a scaler, each rank holds a bucket's new state beside its old one from the bucket's reduction to
the scaler's `step()` (at most one more residual set, the size of the compressed gradients, during backward, let go
before the optimizer steps); unsettled, nothing more than before. PowerSGD keeps its residual in two alternating
buffers at all times (one residual more). Per step: a sum over each new state tensor and over what the bucket
received (device passes), one host read as above, no collective and no byte on the wire.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["NonFiniteStateError", "StagedState", "count_nonfinite", "first_nonfinite"]

_WHAT = {"memory": "error-feedback memory", "q": "Q", "velocity": "velocity (DGC's momentum correction)"}


class NonFiniteStateError(FloatingPointError):
    """State that a strategy carries from step to step (a compressor's residual or Q, 1-bit Adam's momentum, DiLoCo's
    outer gradient) holds inf or NaN values; the message names the method, the tensor, how many values and the step."""


def count_nonfinite(tensor: torch.Tensor) -> int:
    """How many values of `tensor` are inf or NaN (a host read: for error messages, not the training path)."""
    return int(torch.logical_not(torch.isfinite(tensor)).sum()) if tensor.is_floating_point() else 0


def first_nonfinite(tensors: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """(index, count) of the first of `tensors` holding a non-finite value, else None. One host read of one stacked
    sum on the good path (a sum is non-finite when any value is); the counts only on the bad path."""
    if not tensors or bool(torch.isfinite(torch.stack([t.sum().float() for t in tensors]).sum())):
        return None
    for i, t in enumerate(tensors):
        count = count_nonfinite(t)
        if count:
            return i, count
    return None  # only a sum overflowed: every value is finite


class _HostFlag:
    """A 0-dim device value read on the host later without a sync: on CUDA copied to pinned memory behind an event."""

    def __init__(self, value: torch.Tensor) -> None:
        self.event = None
        if value.device.type == "cuda":
            self.value = torch.empty((), dtype=value.dtype, pin_memory=True)
            self.value.copy_(value, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.value = value

    def finite(self) -> bool:
        if self.event is not None:
            self.event.synchronize()  # recorded a step ago: long done
        return bool(torch.isfinite(self.value))


class StagedState:
    """The transaction of the module docstring, mixed into `Compressor`. Subclasses name their state dicts in
    `state_kinds()` (attribute names), write new tensors with `_stage` and never modify a staged-over tensor."""

    loss_scale: float
    iterations: dict[str, int]

    def state_kinds(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _reset_transaction(self) -> None:
        self._before: dict[str, dict[str, Any]] | None = None  # the state dicts before the open step (references)
        self._reduced: set[str] = set()  # buckets reduced in the open step
        self._sums: dict[tuple[str, str], torch.Tensor] = {}  # (kind or "received", bucket) -> sum, open step
        self._settled_by_caller = False  # a scaler settles each step: a bucket reduced again is accumulation
        self._unsettled = False  # a step ended unsettled: nobody settles, so nothing needs keeping for a rollback
        self._deferred: tuple[_HostFlag, dict[tuple[str, str], torch.Tensor], dict[str, int]] | None = None

    # ---- the step's transaction -------------------------------------------------------------------------------
    def _begin(self, key: str) -> None:
        """Called first by every reduction of bucket `key`: open the step's transaction, or close the last one
        when nobody settled it and this bucket was already reduced in it (a new step began)."""
        if self._before is not None and key in self._reduced and not self._settled_by_caller:
            self._unsettled = True
            self._finish(taken=True, settled=False)
        if self._before is None:
            self._before = {kind: dict(getattr(self, kind)) for kind in self.state_kinds()}
            self._reduced = set()
        self._reduced.add(key)

    def _stage(self, kind: str, key: str, value: torch.Tensor, scaled: bool = False) -> torch.Tensor:
        """Make `value` (a tensor no earlier state refers to) the state `kind` of bucket `key`; `scaled`: it is in the
        loss scale's units, divided here (in place) so that the state is kept in gradient units. Returns its sum
        (non-finite when any value is), which the check reads and which a payload may carry (times 0)."""
        if scaled and self.loss_scale != 1.0:
            value.mul_(1.0 / self.loss_scale)
        getattr(self, kind)[key] = value
        if self._unsettled and self._before is not None:
            # Nobody settles these steps, so nothing will be restored: let the old tensor go now (no memory kept
            # beyond the old single residual), and let PowerSGD's next step alternate buffers from this one.
            self._before[kind][key] = value
        total = value.sum()
        self._sums[(kind, key)] = total
        return total

    def _observe(self, key: str, received: Sequence[torch.Tensor]) -> None:
        """Note the sum of what bucket `key` received from every rank, for a state-holding reduction: non-finite on
        every rank alike when any rank sent a non-finite value, so every rank's check agrees."""
        if any(k == key for _, k in self._sums):
            floats = [r.sum() for r in received if r.is_floating_point() and r.numel()]
            if floats:
                self._sums[("received", key)] = torch.stack([f.float() for f in floats]).sum()

    def set_loss_scale(self, scale: float) -> None:
        """The factor the gradients this compressor reduces are multiplied by (the loss scale; set by
        `sw.ShardedGradScaler(model)` whenever it changes). Residuals are kept in gradient units: multiplied by it
        when added to a gradient, divided by it when stored, so a changed scale (a skipped step halves it) or a
        resumed run finds them right. 1 (the default) when no scaler says otherwise."""
        if not scale > 0:
            raise ValueError(f"{type(self).__name__}.set_loss_scale: scale={scale!r} must be > 0")
        self.loss_scale = float(scale)

    def settle(self, taken: bool, checks: Sequence[tuple[torch.Tensor, Callable[[int], str]]] = ()) -> None:
        """End the step: `taken` (its optimizer update was applied) keeps the state the step's reductions wrote,
        after checking it is finite; not taken (skipped) restores the state of before the step, exactly.
        `sw.ShardedGradScaler(model)` calls it at each `step()`; deciding by hand after backward, call it at every
        step (once called, a bucket reduced again before its step is settled is accumulation into that step).
        checks: (tensor, message of its non-finite count) pairs of the caller's own, read in the same host read
        (1-bit Adam's momentum); a failure there restores this state too. Raises NonFiniteStateError."""
        self._settled_by_caller, self._unsettled = True, False
        self._finish(taken, settled=True, checks=checks)

    def _finish(self, taken: bool, settled: bool,
                checks: Sequence[tuple[torch.Tensor, Callable[[int], str]]] = ()) -> None:
        if not taken:
            self._restore()
            return
        if self._before is None and not checks:
            return
        sums = dict(self._sums)
        step = {key: self.iterations.get(key, 0) for _, key in sums}
        if not settled and sums and next(iter(sums.values())).device.type == "cuda":
            # Read last step's flag, copied to the host a step ago; start this step's copy; commit now.
            previous = self._deferred
            self._deferred = (_HostFlag(torch.stack(list(sums.values())).sum()), sums, step)
            self._close()
            if previous is not None and not previous[0].finite():
                found = self._offenders(previous[1], previous[2])
                if found:
                    raise NonFiniteStateError(self._message(found, settled, restored=False))
            return
        totals = [t.sum() for t, _ in checks] + list(sums.values())
        if not totals or bool(torch.isfinite(torch.stack([t.float() for t in totals]).sum())):
            self._close()
            return
        for tensor, message in checks:
            count = count_nonfinite(tensor)
            if count:
                self._restore()
                raise NonFiniteStateError(message(count))
        found = self._offenders(sums, step)
        if not found:  # only a sum overflowed: every value is finite
            self._close()
            return
        restored = not self._unsettled  # unsettled steps keep no state to go back to
        self._restore() if restored else self._close()
        raise NonFiniteStateError(self._message(found, settled, restored=restored))

    def _restore(self) -> None:
        if self._before is not None:
            for kind, saved in self._before.items():
                live = getattr(self, kind)
                live.clear()
                live.update(saved)
        self._close()

    def _close(self) -> None:
        self._before, self._reduced, self._sums = None, set(), {}

    def _offenders(self, sums: dict[tuple[str, str], torch.Tensor], step: dict[str, int]) -> list[str]:
        """What is not finite: the live tensors of `sums`' entries, else what a bucket received from another rank."""
        method = type(self).__name__
        found = []
        for kind, key in sums:
            tensor = getattr(self, kind).get(key) if kind != "received" else None
            count = count_nonfinite(tensor) if isinstance(tensor, torch.Tensor) else 0
            if count:
                found.append(f"{method}'s {_WHAT.get(kind, kind)} of bucket {key!r} holds {count} non-finite values "
                             f"after step {step[key]}")
        if not found:
            found = [f"{method}: bucket {key!r} received non-finite values from another rank at step {step[key]} "
                     f"(that rank's state is not finite)" for (kind, key), total in sums.items()
                     if kind == "received" and not bool(torch.isfinite(total))]
        return found

    @staticmethod
    def _message(found: list[str], settled: bool, restored: bool) -> str:
        head = "; ".join(found[:3]) + ("; ..." if len(found) > 3 else "")
        if settled:
            why = (" although its step was taken: a step whose gradients are not finite must be skipped (sw."
                   "ShardedGradScaler(model) skips it and leaves this state as it was before the step)")
        else:
            why = (": nothing settled that step (taken or skipped). With a loss scaler, build it from the model, "
                   "sw.ShardedGradScaler(model), which restores this state when it skips a step (a scaler built "
                   "from a communicator does not know the model); without one, the step was taken with gradients "
                   "that were not finite, and the state would carry them into every later step")
        return head + why + "." + (" The state is as it was before that step." if restored else "")
