"""Pipeline schedules as data: an `Action` is one thing one rank does; a `Schedule` is every rank's ordered list.

The compact text form follows torch.distributed.pipelining: ``{stage}{op}{microbatch}``.

==========  ==========  ==========================================================================================
text        Op          meaning
==========  ==========  ==========================================================================================
``0F3``     FORWARD     forward of stage 0 on microbatch 3
``1B2``     BACKWARD    full backward of stage 1 on microbatch 2 (input and weight gradients together)
``1I2``     INPUT       backward for the stage's *input* gradient only (the Zero Bubble paper's "B" pass)
``1W2``     WEIGHT      backward for the stage's *weight* gradients only (the Zero Bubble paper's "W" pass)
``0SEND_F3``  SEND_F    send stage 0's output activation of microbatch 3 to the rank of stage 1
``1RECV_F3``  RECV_F    post the receive of stage 1's input activation of microbatch 3
``1SEND_B2``  SEND_B    send stage 1's input gradient of microbatch 2 to the rank of stage 0
``0RECV_B2``  RECV_B    post the receive of stage 0's output gradient of microbatch 2
==========  ==========  ==========================================================================================

Semantics shared by the executor and the simulator: a SEND never blocks (the message is buffered or sent
asynchronously); a RECV only *posts* the receive, and the compute action that consumes the message (the F or the
B/I of that stage and microbatch) waits for it. So a schedule is deadlock-free exactly when the simulator, which
implements these rules, can run it to the end.

Stage placement: with ``p`` ranks and ``v`` virtual stages per rank there are ``p * v`` stages and stage ``s``
lives on rank ``s % p`` (Megatron-LM's interleaved placement; v = 1 is the plain one-stage-per-rank pipeline).

A schedule without any backward pass is a forward-only (inference) schedule (`Schedule.forward_only`): it has
F, SEND_F and RECV_F actions only.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable, Sequence

__all__ = ["Op", "Action", "Schedule", "ScheduleError", "COMPUTE_OPS", "COMM_OPS"]


class ScheduleError(ValueError):
    """A schedule is malformed (a missing or repeated action, an action on the wrong rank, a broken order)."""


class Op(enum.Enum):
    """What an action does. The value is its text in the compact form."""

    FORWARD = "F"
    BACKWARD = "B"
    INPUT = "I"
    WEIGHT = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


COMPUTE_OPS = frozenset({Op.FORWARD, Op.BACKWARD, Op.INPUT, Op.WEIGHT})
COMM_OPS = frozenset({Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B})
_BACKWARD_OPS = frozenset({Op.BACKWARD, Op.INPUT, Op.WEIGHT})

# Longest alternatives first so "SEND_F" is not read as something shorter.
_TEXT = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


@dataclasses.dataclass(frozen=True)
class Action:
    """One step of one rank: `op` on `stage` (a global stage index) for `microbatch`."""

    op: Op
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """The Action written as `text` (e.g. ``"0F3"``, ``"1W2"``, ``"0SEND_F3"``)."""
        match = _TEXT.match(text.strip())
        if match is None:
            raise ScheduleError(
                f"Action.parse: {text!r} is not an action; write stage, op, microbatch as in '0F3' with op one of "
                f"{[op.value for op in Op]}"
            )
        return cls(Op(match.group(2)), int(match.group(1)), int(match.group(3)))

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Every rank's ordered actions for one training step, plus the shape they were made for.

    `actions[r]` is rank r's list. `n_ranks` is the pipeline size p, `virtual_stages` the number of stages per rank
    v (so there are p * v stages, stage s on rank s % p), `n_microbatches` the number m of microbatches per step.
    Build one with `shardwise.pipeline.build_schedule`, or by hand (`Schedule.from_text`) and check it with
    `shardwise.pipeline.simulate`.
    """

    name: str
    n_ranks: int
    n_microbatches: int
    virtual_stages: int
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        if len(self.actions) != self.n_ranks:
            raise ScheduleError(f"Schedule {self.name!r}: {len(self.actions)} action lists for {self.n_ranks} ranks")

    @property
    def n_stages(self) -> int:
        """Total number of stages, p * v."""
        return self.n_ranks * self.virtual_stages

    @property
    def forward_only(self) -> bool:
        """True for an inference schedule: no backward pass (B, I or W) on any rank."""
        return not any(a.op in _BACKWARD_OPS for acts in self.actions for a in acts)

    def rank_of(self, stage: int) -> int:
        return stage % self.n_ranks

    def stages_of(self, rank: int) -> list[int]:
        return list(range(rank, self.n_stages, self.n_ranks))

    def compute_only(self) -> Schedule:
        """The same schedule without its SEND/RECV actions."""
        lists = tuple(tuple(a for a in acts if a.is_compute) for acts in self.actions)
        return dataclasses.replace(self, actions=lists)

    def to_text(self) -> str:
        """One line per rank: ``rank r: 0F0 0F1 ...``."""
        return "\n".join(f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.actions))

    @classmethod
    def from_text(
        cls,
        lines: Sequence[str] | str,
        *,
        n_microbatches: int,
        virtual_stages: int = 1,
        name: str = "custom",
    ) -> Schedule:
        """Parse one line of space-separated actions per rank (an optional ``rank r:`` prefix is ignored)."""
        if isinstance(lines, str):
            lines = [line for line in lines.splitlines() if line.strip()]
        parsed = []
        for line in lines:
            body = line.split(":", 1)[1] if line.strip().startswith("rank") else line
            parsed.append(tuple(Action.parse(tok) for tok in body.split()))
        return cls(name, len(parsed), n_microbatches, virtual_stages, tuple(parsed))

    @classmethod
    def from_lists(
        cls, name: str, lists: Iterable[Iterable[Action]], *, n_microbatches: int, virtual_stages: int = 1
    ) -> Schedule:
        actions = tuple(tuple(acts) for acts in lists)
        return cls(name, len(actions), n_microbatches, virtual_stages, actions)
