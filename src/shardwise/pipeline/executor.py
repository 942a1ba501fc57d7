"""The executor: runs this rank's actions of a schedule, one training step at a time.

    stages = pp.partition(model.pipeline_layers(), n_stages=4)
    pipe = pp.Pipeline(stages, mesh.pp, schedule="1f1b", n_microbatches=8, loss_fn=lm_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-4)
    loss = pipe.step(inputs, targets); opt.step(); opt.zero_grad()

Mechanism of one `step`
-----------------------
* The batch is cut along dim 0 into m equal microbatches (the rank of stage 0 needs `inputs`, the rank of the last
  stage `targets`; other ranks may pass None).
* This rank's actions run in order (see `actions.py`): F runs the stage on its input and keeps the output with its
  autograd graph; SEND_F isends the output; RECV_F posts an irecv whose buffer becomes, at the consuming F, the
  stage's input leaf (requires_grad, so the backward yields its gradient). The last stage applies
  `loss_fn(output, target)` and backpropagates loss / m, so the accumulated gradients are those of the mean loss
  over the whole batch, as in one process.
* B backpropagates the received output gradient through the stage (input and weight gradients) and frees the
  microbatch's graph; SEND_B isends the input gradient. For zero-bubble schedules I computes only the input
  gradient and W the weight gradients later (`split_backward.py`); W frees the graph.
* Shapes are exchanged, not declared: before a stage's first activation of a step its rank sends a small
  metadata message (dtype and shape; every microbatch of a step has the same), and gradient buffers take the shape
  of the stage's own output. Messages are told apart by tag (direction, stage, microbatch).
* Sends never block the schedule; they are waited for at the end of the step (completed ones are dropped
  earlier). Then tied parameters' gradients are summed over the ranks holding them (`tied.py`), and the mean loss
  is broadcast from the last stage's rank, so `step` returns it on every rank.

Only this rank's stages are kept (`Pipeline` is an nn.Module whose submodules are those stages, trained in place:
they share parameters with the model they came from); the other stages of the list are dropped. With
`record_timeline=True` each step records this rank's compute actions as a `Timeline` (`pipe.timeline`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..comm.base import Communicator, Work
from .actions import Action, Op, Schedule
from .schedules import SCHEDULES, build_schedule, check_schedule_args
from .simulate import check_schedule
from .split_backward import WeightGrad, backward_input
from .tied import TiedParameters
from .timeline import Event, Timeline

__all__ = ["Pipeline"]

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
_MAX_DIMS = 8
_ACT, _GRAD, _META = 0, 1, 2


def _encode(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in _DTYPES or t.dim() > _MAX_DIMS:
        raise ValueError(f"Pipeline: a stage output of {t.dtype} with {t.dim()} dims cannot be sent; allowed dtypes "
                         f"{_DTYPES}, at most {_MAX_DIMS} dims")
    meta = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
    meta[0], meta[1] = _DTYPES.index(t.dtype), t.dim()
    meta[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return meta


def _decode(meta: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    values = meta.tolist()
    return torch.Size(values[2 : 2 + values[1]]), _DTYPES[values[0]]


@dataclasses.dataclass
class _StepState:
    """What one step keeps between actions, by (stage, microbatch) or by message key (kind, stage, microbatch)."""

    x_mb: list[torch.Tensor] | None
    y_mb: list[torch.Tensor] | None
    inputs: dict[tuple[int, int], torch.Tensor] = dataclasses.field(default_factory=dict)  # input leaves
    outputs: dict[tuple[int, int], torch.Tensor] = dataclasses.field(default_factory=dict)  # outputs / scaled losses
    grads: dict[tuple[int, int], torch.Tensor] = dataclasses.field(default_factory=dict)  # input gradients to send
    weight: dict[tuple[int, int], WeightGrad] = dataclasses.field(default_factory=dict)  # pending W passes
    recvs: dict[tuple[int, int, int], tuple[torch.Tensor, Work] | None] = dataclasses.field(default_factory=dict)
    meta_recv: dict[int, tuple[torch.Tensor, Work]] = dataclasses.field(default_factory=dict)
    in_meta: dict[int, tuple[torch.Size, torch.dtype]] = dataclasses.field(default_factory=dict)
    out_meta: dict[int, tuple[torch.Size, torch.dtype]] = dataclasses.field(default_factory=dict)
    meta_sent: set[int] = dataclasses.field(default_factory=set)
    sends: list[tuple[Work, torch.Tensor]] = dataclasses.field(default_factory=list)
    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)
    events: list[Event] = dataclasses.field(default_factory=list)


class Pipeline(nn.Module):
    """Pipeline-parallel training of `stages` over the ranks of `comm` (see the module docstring).

    stages: the full list from `partition` (p * v stages; stage s runs on rank s % p of `comm`).
    comm: the pipeline Communicator (e.g. `mesh.pp`); its size is the number of pipeline ranks p.
    schedule: a name from SCHEDULES ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1") or a Schedule.
    n_microbatches: m, the microbatches each step's batch is cut into (default: 8, or the given Schedule's).
    loss_fn: `loss_fn(output, target) -> scalar`, the mean loss of one microbatch (e.g. `lm_loss`).
    record_timeline: record each step's compute actions with their times (`pipe.timeline`).
    Raises ValueError naming the argument for a stage count that is not a multiple of p, a schedule that does not
    fit (see `build_schedule`), or a missing loss_fn.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        comm: Communicator,
        schedule: str | Schedule = "1f1b",
        n_microbatches: int | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        *,
        record_timeline: bool = False,
    ) -> None:
        super().__init__()
        stages = list(stages)
        p = comm.size
        if not stages or any(not isinstance(s, nn.Module) for s in stages):
            raise ValueError("Pipeline: stages must be a non-empty list of nn.Modules (use partition(...))")
        if len(stages) % p:
            raise ValueError(
                f"Pipeline: {len(stages)} stages cannot be spread over {p} pipeline ranks; pass the full list from "
                f"partition(layers, n_stages={p}, virtual_stages=v), which has {p} x v stages"
            )
        v = len(stages) // p
        if n_microbatches is None:
            n_microbatches = schedule.n_microbatches if isinstance(schedule, Schedule) else 8
        if isinstance(schedule, Schedule):
            for what, want, have in (("ranks", p, schedule.n_ranks), ("virtual stages", v, schedule.virtual_stages),
                                     ("microbatches", n_microbatches, schedule.n_microbatches)):
                if want != have:
                    raise ValueError(f"Pipeline: schedule {schedule.name!r} was made for {have} {what}, but this "
                                     f"pipeline has {want}")
            check_schedule(schedule)
        elif isinstance(schedule, str):
            check_schedule_args("Pipeline", schedule, p, n_microbatches, v)
            schedule = build_schedule(schedule, p, n_microbatches, v)
        else:
            raise ValueError(f"Pipeline: schedule={schedule!r} must be one of {list(SCHEDULES)} or a Schedule")
        if loss_fn is None or not callable(loss_fn):
            raise ValueError(f"Pipeline: loss_fn={loss_fn!r} must be a callable loss_fn(output, target) -> scalar")
        self.comm = comm
        self.schedule = schedule
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.record_timeline = record_timeline
        self.timeline: Timeline | None = None
        self.actions: tuple[Action, ...] = schedule.actions[comm.rank]
        self.local_stages: list[int] = schedule.stages_of(comm.rank)
        self.n_stages = len(stages)
        self.tied = TiedParameters(stages, comm, schedule.rank_of)
        self.stages = nn.ModuleDict({str(s): stages[s] for s in self.local_stages})
        self._stage_params = {s: [q for q in stages[s].parameters() if q.requires_grad] for s in self.local_stages}
        self._last_rank = schedule.rank_of(self.n_stages - 1)
        self._st: _StepState | None = None

    # ---- public ----------------------------------------------------------------------------------------------------
    def forward(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Same as `step`."""
        return self.step(inputs, targets)

    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Run one training step's forward and backward passes; return the mean loss (a 0-dim tensor) on every rank.

        Gradients are accumulated into the local stages' parameters (call `opt.step()` / `opt.zero_grad()` as
        usual). Raises ValueError when this rank needs `inputs` (it holds stage 0) or `targets` (the last stage) and
        did not get them, or when the batch does not split into n_microbatches equal microbatches.
        """
        m = self.n_microbatches
        st = self._st = _StepState(self._split("inputs", inputs, 0 in self.local_stages),
                                   self._split("targets", targets, self.n_stages - 1 in self.local_stages))
        try:
            for action in self.actions:
                if action.is_compute:
                    start, end = self._compute(action)
                    if self.record_timeline:
                        st.events.append(Event(self.comm.rank, str(action), start, end))
                else:
                    self._communicate(action)
                if len(st.sends) > 8:
                    st.sends = [(w, t) for w, t in st.sends if not w.is_completed()]
            for work, _ in st.sends:
                work.wait()
            leftovers = [k for d in (st.inputs, st.outputs, st.grads, st.weight) for k in d]
            if leftovers:
                raise RuntimeError(f"Pipeline: the schedule left work for (stage, microbatch) {leftovers} undone")
        finally:
            self._st = None  # drops every buffer, graph and pending message of the step
        if self.record_timeline:
            self.timeline = Timeline(st.events, self.schedule.n_ranks)
        self.tied.all_reduce_grads()
        loss = torch.zeros(1)
        if st.losses:
            loss.copy_(torch.stack(st.losses).sum() / m)
        self.comm.broadcast(loss, src=self._last_rank)
        return loss[0]

    # ---- helpers ---------------------------------------------------------------------------------------------------
    def _split(self, name: str, batch: Any, needed: bool) -> list[torch.Tensor] | None:
        m = self.n_microbatches
        if batch is None:
            if needed:
                held = "stage 0" if name == "inputs" else f"the last stage ({self.n_stages - 1})"
                raise ValueError(f"Pipeline.step: rank {self.comm.rank} holds {held} and needs {name}, got None")
            return None
        if not isinstance(batch, torch.Tensor) or batch.dim() == 0:
            raise ValueError(f"Pipeline.step: {name} must be a tensor with a batch dimension, got {batch!r}")
        if batch.shape[0] % m:
            raise ValueError(
                f"Pipeline.step: {name} has a batch of {batch.shape[0]} rows (dim 0), which does not split into "
                f"n_microbatches={m} equal microbatches; use a batch size that is a multiple of {m}"
            )
        return list(batch.chunk(m)) if needed else None

    def _tag(self, kind: int, stage: int, microbatch: int) -> int:
        return (stage * (self.n_microbatches + 1) + microbatch) * 3 + kind

    def _post_recv(self, key: tuple[int, int, int]) -> None:
        """Post the receive of an activation (kind _ACT) or gradient (_GRAD) if its shape is known, else later."""
        kind, s, mb = key
        if kind == _ACT:
            src = self.schedule.rank_of(s - 1)
            if s not in self._st.in_meta and s not in self._st.meta_recv:
                meta = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
                self._st.meta_recv[s] = (meta, self.comm.irecv(meta, src, self._tag(_META, s - 1, self.n_microbatches)))
            if s not in self._st.in_meta and self._st.meta_recv[s][1].is_completed():
                self._meta_done(s)
            shape = self._st.in_meta.get(s)
        else:
            src = self.schedule.rank_of(s + 1)
            shape = self._st.out_meta.get(s)
        if shape is None:
            self._st.recvs[key] = None
            return
        buf = torch.empty(shape[0], dtype=shape[1])
        self._st.recvs[key] = (buf, self.comm.irecv(buf, src, self._tag(kind, s, mb)))

    def _meta_done(self, s: int) -> None:
        meta, work = self._st.meta_recv.pop(s)
        work.wait()
        self._st.in_meta[s] = _decode(meta)

    def _take(self, key: tuple[int, int, int]) -> torch.Tensor:
        if key not in self._st.recvs:
            raise RuntimeError(f"Pipeline: rank {self.comm.rank} consumes message {key} that no RECV posted")
        if self._st.recvs[key] is None:
            if key[0] == _ACT and key[1] not in self._st.in_meta:
                self._meta_done(key[1])
            self._post_recv(key)
        buf, work = self._st.recvs.pop(key)
        work.wait()
        return buf

    def _communicate(self, a: Action) -> None:
        s, mb = a.stage, a.microbatch
        if a.op is Op.RECV_F:
            self._post_recv((_ACT, s, mb))
        elif a.op is Op.RECV_B:
            self._post_recv((_GRAD, s, mb))
        elif a.op is Op.SEND_F:
            out = self._st.outputs[(s, mb)].detach().contiguous()
            dst = self.schedule.rank_of(s + 1)
            if s not in self._st.meta_sent:
                self._st.meta_sent.add(s)
                meta = _encode(out)
                self._st.sends.append((self.comm.isend(meta, dst, self._tag(_META, s, self.n_microbatches)), meta))
            self._st.sends.append((self.comm.isend(out, dst, self._tag(_ACT, s + 1, mb)), out))
        else:  # SEND_B
            grad = self._st.grads.pop((s, mb)).contiguous()
            self._st.sends.append((self.comm.isend(grad, self.schedule.rank_of(s - 1), self._tag(_GRAD, s - 1, mb)), grad))

    def _output_grad(self, s: int, mb: int) -> torch.Tensor | None:
        if s == self.n_stages - 1:
            return None
        if self.schedule.rank_of(s + 1) == self.comm.rank:  # local hand-over (p = 1)
            return self._st.grads.pop((s + 1, mb))
        return self._take((_GRAD, s, mb))

    def _compute(self, a: Action) -> tuple[float, float]:
        s, mb = a.stage, a.microbatch
        if a.op is Op.FORWARD:
            if s == 0:
                x = self._st.x_mb[mb]
            elif self.schedule.rank_of(s - 1) == self.comm.rank:
                x = self._st.outputs[(s - 1, mb)].detach()
            else:
                x = self._take((_ACT, s, mb))
            if s > 0:  # the batch itself (stage 0's input) needs no gradient
                if not x.is_floating_point():
                    raise ValueError(f"Pipeline: stage {s} gets a {x.dtype} input; activations passed between stages "
                                     f"must be floating point (they carry gradients back)")
                x.requires_grad_(True)
            start = time.perf_counter()
            out = self.stages[str(s)](x)
            if not isinstance(out, torch.Tensor):
                raise ValueError(f"Pipeline: stage {s} returned a {type(out).__name__}; stages must return one tensor")
            if s == self.n_stages - 1:
                loss = self.loss_fn(out, self._st.y_mb[mb])
                self._st.losses.append(loss.detach())
                out = loss / self.n_microbatches
            elif s not in self._st.out_meta:
                self._st.out_meta[s] = (out.shape, out.dtype)
            self._st.outputs[(s, mb)] = out
            if x.requires_grad:
                self._st.inputs[(s, mb)] = x
            return start, time.perf_counter()
        if a.op is Op.WEIGHT:
            start = time.perf_counter()
            self._st.weight.pop((s, mb)).run()
            return start, time.perf_counter()
        grad = self._output_grad(s, mb)
        start = time.perf_counter()
        out = self._st.outputs.pop((s, mb))
        x = self._st.inputs.pop((s, mb), None)
        if a.op is Op.BACKWARD:
            torch.autograd.backward(out, grad)
            if s > 0 and x is not None:
                self._st.grads[(s, mb)] = x.grad
        else:  # INPUT
            grad_input, self._st.weight[(s, mb)] = backward_input(out, grad, x, self._stage_params[s])
            if s > 0 and grad_input is not None:
                self._st.grads[(s, mb)] = grad_input
        return start, time.perf_counter()
