"""The executor: runs this rank's actions of a schedule, one training step at a time.

    stages = pp.partition(model.pipeline_layers(), n_stages=4)
    pipe = pp.Pipeline(stages, mesh.pp, schedule="1f1b", n_microbatches=8, loss_fn=lm_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-4)
    loss = pipe.step(inputs, targets); opt.step(); opt.zero_grad()

Mechanism of one `step`
-----------------------
* The batch is cut along dim 0 into m equal microbatches (the rank of stage 0 needs `inputs`, the rank of the last
  stage `targets`; other ranks may pass None). Inputs and stage outputs may be structures (a tensor, a tuple/list
  or a dict of str -> tensor; `structure.py`): every tensor leaf is cut, and a tuple is splatted into the next
  stage's positional arguments, a dict into its keyword arguments, so HF-style decoder layers taking (hidden states,
  attention mask, position ids) can be pipelined.
* This rank's actions run in order (see `actions.py`): F runs the stage on its input and keeps the output with its
  autograd graph; SEND_F isends each tensor leaf of the output; RECV_F posts irecvs whose buffers become, at the
  consuming F, the stage's input. Leaves that carry a gradient (floating and requiring grad at the sender) become
  leaves requiring grad, so the backward yields their gradients; integer leaves (masks, position ids) are sent
  but carry none. The last stage applies `loss_fn(output, target)` and backpropagates loss / m, so the
  accumulated gradients are those of the mean loss over the whole batch, as in one process.
* B backpropagates the received gradients of the output leaves that carry one (input and weight gradients) and
  frees the microbatch's graph; SEND_B isends one gradient per input leaf that carries one. An input leaf the stage
  did not use has no gradient: a structured input says so with per-step flags, and the sender leaves that output
  out of its backward, so its parameters get no gradient, as in one process (a single tensor sends zeros). For
  zero-bubble schedules I computes only the input gradients and W the weight gradients later
  (`split_backward.py`); W frees the graph.
* Shapes are exchanged, not declared: before a stage's first activation of a step its rank sends the output's
  structure as integer metadata (container, keys, dtype, shape and gradient flag of each leaf: `messages.py`;
  a single tensor costs one 10-word message, as before structures existed), and every microbatch of a step must
  match it. Both sides derive from it which messages flow, so they always agree. Gradient buffers take the
  shapes of the stage's own output. Messages are told apart by tag (direction, stage, microbatch, leaf).
* Sends never block the schedule; they are waited for at the end of the step (completed ones are dropped
  earlier). Then tied parameters' gradients are summed over the ranks holding them (`tied.py`), and the mean loss
  is broadcast from the last stage's rank, so `step` returns it on every rank.

`predict(inputs, to="all" | rank)` runs the forward-only schedule the same way under torch.no_grad() (F, SEND_F and
RECV_F only; an output is dropped once sent) and returns the last stage's outputs, concatenated over
microbatches, on every rank or on one (`predict.py`).

Only this rank's stages are kept (`Pipeline` is an nn.Module whose submodules are those stages, trained in place:
they share parameters with the model they came from); the other stages of the list are dropped. With
`record_timeline=True` each step records this rank's compute actions as a `Timeline` (`pipe.timeline`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..batch_norm_split import MicrobatchStatistics
from ..buffer_writes import check_buffer_writes_option
from ..comm.base import Communicator
from ..profiler_ranges import profiler_range
from .actions import Action, Op, Schedule
from .batches import host_steps
from .messages import Messenger, Spec, spec_of
from .microbatch_writes import MicrobatchBufferWrites
from .predict import check_destination, deliver
from .schedules import FORWARD_SCHEDULES, SCHEDULES, build_schedule, check_schedule_args
from .simulate import check_schedule
from .split_backward import WeightGrad, backward_inputs
from .structure import call, concat, flatten, split, unflatten
from .declare import declare_pipeline
from .tied import TiedParameters
from .stage_grads import grads_answer_for_stages
from .timeline import Event, Timeline

__all__ = ["Pipeline"]


@dataclasses.dataclass
class _StepState:
    """What one run (a training step or a forward-only pass) keeps between actions, by (stage, microbatch)."""

    forward_only: bool
    messenger: Messenger
    x_mb: list[Any] | None
    y_mb: list[Any] | None
    inputs: dict[tuple[int, int], list[torch.Tensor]] = dataclasses.field(default_factory=dict)  # grad-carrying leaves
    outputs: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)  # outputs / scaled losses
    out_spec: dict[int, Spec] = dataclasses.field(default_factory=dict)  # stage -> Spec of its first output
    grads: dict[tuple[int, int], list[torch.Tensor | None]] = dataclasses.field(default_factory=dict)  # input grads
    weight: dict[tuple[int, int], WeightGrad] = dataclasses.field(default_factory=dict)  # pending W passes
    results: dict[int, Any] = dataclasses.field(default_factory=dict)  # forward-only: last stage output by microbatch
    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)
    events: list[Event] = dataclasses.field(default_factory=list)


class Pipeline(nn.Module):
    """Pipeline-parallel training of `stages` over the ranks of `comm` (see the module docstring).

    stages: the full list from `partition` (p * v stages; stage s runs on rank s % p of `comm`).
    comm: the pipeline Communicator (e.g. `mesh.pp`); its size is the number of pipeline ranks p.
    schedule: a name from SCHEDULES ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1") or a Schedule (with backward
    passes: "forward_only" is what `predict` runs).
    n_microbatches: m, the microbatches each step's batch is cut into (default: 8, or the given Schedule's).
    loss_fn: `loss_fn(output, target) -> scalar`, the mean loss of one microbatch (e.g. `lm_loss`); output is the
    last stage's output, whatever its structure, and target the microbatch of `targets`.
    record_timeline: record each step's compute actions with their times (`pipe.timeline`).
    buffer_writes: None (a buffer a stage's forward writes under more than one microbatch raises at the first step)
        or "local" (accepted knowingly; microbatch_writes.py).
    Raises ValueError naming the argument for a stage count that is not a multiple of p, a schedule that does not
    fit (see `build_schedule`), or a missing loss_fn.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        comm: Communicator,
        schedule: str | Schedule = "1f1b",
        n_microbatches: int | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        *,
        record_timeline: bool = False,
        buffer_writes: str | None = None,
    ) -> None:
        super().__init__()
        check_buffer_writes_option(buffer_writes, "Pipeline")
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
            if schedule.forward_only:
                raise ValueError(f"Pipeline: schedule {schedule.name!r} has no backward pass, so it cannot train; "
                                 f"forward-only runs are pipe.predict(...)")
        elif isinstance(schedule, str):
            if schedule in FORWARD_SCHEDULES:
                raise ValueError(f"Pipeline: schedule={schedule!r} is not a training schedule (pipe.predict(...) runs "
                                 f"it); allowed {list(SCHEDULES)}")
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
        self._batch_norms = MicrobatchStatistics(stages, dict(self.stages.items()), n_microbatches, comm, "Pipeline")
        self._buffer_writes = MicrobatchBufferWrites(dict(self.stages.items()), n_microbatches, comm, "Pipeline",
                                                     buffer_writes)
        declare_pipeline(self, dict(self.stages.items()), comm, self.tied.groups, {
            "schedule": schedule.name, "n_microbatches": n_microbatches, "n_stages": self.n_stages,
            "virtual_stages": schedule.virtual_stages, "stage_sizes": [sum(p.numel() for p in st.parameters())
                                                                       for st in stages]})
        self._last_rank = schedule.rank_of(self.n_stages - 1)
        self._forward_schedules: dict[int, Schedule] = {}  # predict's forward-only schedule by microbatch count
        self._st: _StepState | None = None
        self._grad_specs: dict = {}  # stage_grads.py's descriptions, by parameter

    # ---- public ----------------------------------------------------------------------------------------------------
    def forward(self, inputs: Any = None, targets: Any = None) -> torch.Tensor:
        """`step`; under ``torch.no_grad()`` (a validation loop), `evaluate`."""
        return self.step(inputs, targets) if torch.is_grad_enabled() else self.evaluate(inputs, targets)

    def step(self, inputs: Any = None, targets: Any = None, *,
             around_action: Callable[[Action], contextlib.AbstractContextManager] | None = None) -> torch.Tensor:
        """Run one training step's forward and backward passes; return the mean loss (a 0-dim tensor) on every rank.

        inputs: stage 0's input, a tensor, a tuple/list or a dict of str -> tensor (tensors with the batch on dim 0;
        other leaves go to every microbatch unchanged); targets: a tensor (or the same kinds of structure), cut the
        same way, each microbatch given to `loss_fn` with the last stage's output. Gradients are accumulated into
        the local stages' parameters (call `opt.step()` / `opt.zero_grad()` as usual). Raises ValueError when this
        rank needs `inputs` (it holds stage 0) or `targets` (the last stage) and did not get them, or when the batch
        does not split into n_microbatches equal microbatches.
        around_action: a context entered around each compute action of this rank (forward, backward, ...): how
        `sw.parallelize` runs all but one microbatch under a data-parallel stage's `no_sync()`.
        """
        m = self.n_microbatches
        self._batch_norms.check()
        self._buffer_writes.before()
        self.tied.begin_step()  # accumulated tied gradients are summed already: this step sums only its own
        try:
            st = self._run(self.actions, m, "Pipeline.step", inputs, targets, forward_only=False,
                           around=around_action)
        except BaseException:
            self.tied.abandon_step()
            raise
        self._buffer_writes.after()
        self.tied.all_reduce_grads()
        loss = self._mean_loss(st.losses, m)
        self.grads_answer_for_stages()
        return loss

    def evaluate(self, inputs: Any = None, targets: Any = None) -> torch.Tensor:
        """The mean loss `step` would return for this batch, without training: the forward-only schedule under
        ``torch.no_grad()`` (no graph, no gradient touched), each microbatch's ``loss_fn(output, target)`` at the
        last stage, on every rank. What a validation loop needs; raises as `step` does."""
        m = self.n_microbatches
        with torch.no_grad():
            where = "Pipeline.evaluate"
            st = self._run(self._forward_schedule(m, where).actions[self.comm.rank], m, where, inputs, targets,
                           forward_only=True, losses=True)
        return self._mean_loss(st.losses, m)

    def _mean_loss(self, losses: list[torch.Tensor], m: int) -> torch.Tensor:
        """The mean of the last stage's microbatch losses on every rank. Broadcast in float64 (on the communicator's
        device), returned in the stages' parameter dtype, at least fp32: a float64 model's loss keeps its digits."""
        loss = torch.zeros(1, dtype=torch.float64, device=self.comm.device)
        if losses:
            loss.copy_(torch.stack([x.double() for x in losses]).sum() / m)
        self.comm.broadcast(loss, src=self._last_rank)
        dtype = next((p.dtype for p in self.stages.parameters() if p.is_floating_point()), torch.float32)
        return loss[0].to(torch.promote_types(dtype, torch.float32))

    def grads_answer_for_stages(self) -> None:
        """Make this rank's gradients refuse torch's clip and GradScaler when other ranks hold other layers
        (stage_grads.py); `sw.parallelize` calls it again after its data-parallel reduction."""
        if self.comm.size > 1:
            grads_answer_for_stages(((f"stage {s}: {n}", p) for s in self.local_stages
                                     for n, p in self.stages[str(s)].named_parameters()), self.comm.size,
                                    self._grad_specs)

    def predict(self, inputs: Any = None, *, to: str | int = "all", n_microbatches: int | None = None) -> Any:
        """Inference: the last stage's output for the whole batch, on every rank (``to="all"``) or on rank `to` of
        the pipeline communicator only (None elsewhere).

        Runs the "forward_only" schedule (every microbatch's F on each stage, sends and receives only) under
        ``torch.no_grad()``, so no graph is kept and no gradient is touched; concatenates the last stage's
        per-microbatch outputs along dim 0, leaf by leaf for a tuple or dict (see `predict.py` for how they reach the
        other ranks). `inputs` is needed on stage 0's rank (as for `step`); n_microbatches defaults to the
        pipeline's. The module's mode is left as it is: call `pipe.eval()` first to disable dropout. Raises
        ValueError for a `to` that is neither "all" nor a rank (naming the allowed ranks) and as `step` does.
        """
        dst = check_destination(to, self.comm.size)
        m = self.n_microbatches if n_microbatches is None else n_microbatches
        schedule = self._forward_schedule(m, "Pipeline.predict")
        with torch.no_grad():
            st = self._run(schedule.actions[self.comm.rank], m, "Pipeline.predict", inputs, None, forward_only=True)
            return deliver(self.comm, lambda: concat("the last stage", [st.results[mb] for mb in range(m)]),
                           self._last_rank, dst, lambda kind, leaf: st.messenger.tag(kind, self.n_stages, 0, leaf))

    # ---- helpers ---------------------------------------------------------------------------------------------------
    def _forward_schedule(self, m: int, where: str) -> Any:
        if m not in self._forward_schedules:
            p, v = self.comm.size, self.schedule.virtual_stages
            check_schedule_args(where, FORWARD_SCHEDULES[0], p, m, v)
            self._forward_schedules[m] = build_schedule(FORWARD_SCHEDULES[0], p, m, v)
        return self._forward_schedules[m]

    def _run(self, actions: Sequence[Action], m: int, where: str, inputs: Any, targets: Any, *,
             forward_only: bool, around: Callable[[Action], contextlib.AbstractContextManager] | None = None,
             losses: bool | None = None) -> _StepState:
        """One run of `actions`; `losses` (default: not forward_only): the last stage computes each microbatch's
        loss of `targets` (forward-only: without keeping it for a backward pass)."""
        losses = not forward_only if losses is None else losses
        st = self._st = _StepState(
            forward_only, Messenger(self.comm, self.schedule.rank_of, m),
            self._split(where, "inputs", inputs, 0 in self.local_stages, m),
            self._split(where, "targets", targets, self.n_stages - 1 in self.local_stages, m) if losses else None,
        )
        try:
            for step in host_steps(actions):
                if isinstance(step, Action):
                    around_step = around(step) if around is not None else contextlib.nullcontext()
                    with around_step, profiler_range("pipeline", step):
                        start, end = self._compute(step)
                    if self.record_timeline:
                        st.events.append(Event(self.comm.rank, str(step), start, end))
                else:
                    with profiler_range("pipeline_p2p", step):
                        self._communicate(step)
            st.messenger.finish()
            leftovers = [k for d in (st.inputs, st.outputs, st.grads, st.weight) for k in d]
            if leftovers:
                raise RuntimeError(f"Pipeline: the schedule left work for (stage, microbatch) {leftovers} undone")
        finally:
            self._st = None  # drops every buffer, graph and pending message of the run
        if self.record_timeline:
            self.timeline = Timeline(st.events, self.schedule.n_ranks)
        return st

    def _split(self, where: str, name: str, batch: Any, needed: bool, m: int) -> list[Any] | None:
        if batch is None:
            if needed:
                held = "stage 0" if name == "inputs" else f"the last stage ({self.n_stages - 1})"
                raise ValueError(f"{where}: rank {self.comm.rank} holds {held} and needs {name}, got None")
            return None
        parts = split(where, name, batch, m)  # checked on every rank, so a bad batch fails everywhere alike
        return parts if needed else None

    def _communicate(self, batch: tuple[Action, ...]) -> None:
        """Post one batch of SEND/RECV actions together (batches.py: NCCL's pairing, no reliance on tags)."""
        st = self._st
        for a in batch:
            s, mb = a.stage, a.microbatch
            if a.op is Op.RECV_F:
                st.messenger.expect_activation(s, mb)
            elif a.op is Op.RECV_B:
                if s not in st.out_spec:
                    raise RuntimeError(f"Pipeline: rank {self.comm.rank} posts {a} before stage {s}'s forward ran")
                st.messenger.expect_gradients(s, mb, st.out_spec[s])
            elif a.op is Op.SEND_F:  # forward-only: nothing needs the output once it is sent
                st.messenger.send_activation(st.outputs.pop((s, mb)) if st.forward_only else st.outputs[(s, mb)], s,
                                             mb)
            else:  # SEND_B
                st.messenger.send_gradients(st.grads.pop((s, mb)), s, mb)
        st.messenger.post()

    def _stage_input(self, s: int, mb: int) -> Any:
        """Stage s's input for microbatch mb; the leaves that carry a gradient become leaves requiring grad."""
        st = self._st
        if s == 0:
            return st.x_mb[mb]  # the batch itself needs no gradient
        if self.schedule.rank_of(s - 1) == self.comm.rank:  # local hand-over (p = 1)
            key = (s - 1, mb)
            container, keys, leaves = flatten(st.outputs.pop(key) if st.forward_only else st.outputs[key])
            leaves = [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves]
            carrying = st.out_spec[s - 1].grad_indices
        else:
            container, keys, leaves = flatten(st.messenger.take_activation(s, mb))
            carrying = st.messenger.in_spec[s].grad_indices
        if carrying and not st.forward_only:
            st.inputs[(s, mb)] = [leaves[i].requires_grad_(True) for i in carrying]
        return unflatten(container, keys, leaves)

    def _output_grads(self, s: int, mb: int) -> list[torch.Tensor | None] | None:
        st = self._st
        if s == self.n_stages - 1:
            return None
        if self.schedule.rank_of(s + 1) == self.comm.rank:  # local hand-over (p = 1)
            return st.grads.pop((s + 1, mb))
        return st.messenger.take_gradients(s, mb, st.out_spec[s])

    def _compute(self, a: Action) -> tuple[float, float]:
        st, s, mb = self._st, a.stage, a.microbatch
        if a.op is Op.FORWARD:
            x = self._stage_input(s, mb)
            start = time.perf_counter()
            out = call(self.stages[str(s)], x)
            if s < self.n_stages - 1:
                if s not in st.out_spec:
                    st.out_spec[s] = spec_of(out)
                st.outputs[(s, mb)] = out
            elif st.y_mb is None:  # forward-only (predict): the output itself
                st.results[mb] = out
            else:
                loss = self.loss_fn(out, st.y_mb[mb])
                st.losses.append(loss.detach())
                if not st.forward_only:
                    st.outputs[(s, mb)] = loss / self.n_microbatches
            return start, time.perf_counter()
        if a.op is Op.WEIGHT:
            start = time.perf_counter()
            st.weight.pop((s, mb)).run()
            return start, time.perf_counter()
        grads = self._output_grads(s, mb)
        start = time.perf_counter()
        out = st.outputs.pop((s, mb))
        xs = st.inputs.pop((s, mb), [])
        if s == self.n_stages - 1:
            roots = [out]
        else:  # only leaves that got a gradient take part (masks and position ids carry none; unused leaves get none)
            leaves = flatten(out)[2]
            pairs = [(leaves[i], g) for i, g in zip(st.out_spec[s].grad_indices, grads) if g is not None]
            roots, grads = [t for t, _ in pairs], [g for _, g in pairs]
        if a.op is Op.BACKWARD:
            if roots:
                torch.autograd.backward(roots, grads)
            input_grads = [x.grad for x in xs]
        else:  # INPUT
            trainable = [q for q in self.stages[str(s)].parameters() if q.requires_grad]  # now: a script may freeze
            input_grads, st.weight[(s, mb)] = backward_inputs(roots, grads, xs, trainable)
        if s > 0:  # None for an unused input leaf (see Messenger.send_gradients)
            st.grads[(s, mb)] = list(input_grads)
        return start, time.perf_counter()
