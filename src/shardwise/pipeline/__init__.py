"""Pipeline parallelism: partition a model into stages, schedules as data, an executor, and a simulator.

    from shardwise import pipeline as pp
    stages = pp.partition(model.pipeline_layers(), n_stages=4, balance="params")
    pipe = pp.Pipeline(stages, mesh.pp, schedule="1f1b", n_microbatches=8, loss_fn=lm_loss)
    loss = pipe.step(inputs, targets)              # then opt.step() over pipe.parameters()
    logits = pipe.eval().predict(inputs)           # forward-only, the last stage's output on every rank
    pp.simulate("zb_h1", n_stages=4, n_microbatches=8).bubble

Schedules ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1"; "forward_only" for predict) are per-rank lists of
actions (`Action`, text form ``0F3``, ``1B2``, ``1I2``, ``1W2``, ``0SEND_F3``...) that the executor runs and the
simulator dry-runs. Stages may take and return a tensor, a tuple or a dict of tensors. See docs/pipeline.md.
"""

from .actions import Action, Op, Schedule, ScheduleError
from .executor import Pipeline
from .partition import Stage, partition
from .schedules import FORWARD_SCHEDULES, SCHEDULES, add_communication, build_schedule
from .simulate import DeadlockError, SimResult, check_schedule, simulate
from .timeline import Event, Timeline

__all__ = [
    "Action",
    "DeadlockError",
    "Event",
    "FORWARD_SCHEDULES",
    "Op",
    "Pipeline",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "Stage",
    "Timeline",
    "add_communication",
    "build_schedule",
    "check_schedule",
    "partition",
    "simulate",
]
