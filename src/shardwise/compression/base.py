"""The Compressor interface: compress -> payload, reduce it over a communicator, decompress into the average.

A data-parallel strategy hands each gradient bucket (a flat buffer, and the shapes of the tensors that tile it) to
`Compressor.reduce(key, flat, comm, shapes)`. On return of the Work's `wait()` the buffer holds what every rank
agrees on as the averaged gradient: the average, over ranks, of each rank's *compressed* contribution. Compression
is lossy, so each lossy method keeps an **error-feedback memory** per bucket on each rank (Seide et al. 2014;
Karimireddy et al., "Error Feedback Fixes SignSGD", 2019; Stich et al. 2018): what a rank did not transmit this
step is added to its next gradient, so the sum of transmitted updates tracks the sum of true gradients and the
error does not accumulate into a drift.

Warm-up: the first `start_iter` reductions of each bucket are exact fp32 averages (a plain all-reduce; the residual
stays empty), then the method takes over. PowerSGD (`start_powerSGD_iter`), DGC (its warm-up epochs) and 1-bit Adam
(`freeze_step`) all begin so: early gradients are large and change fast, and a backlog that error feedback builds
then arrives stale. Measured on the demo GPT under AdamW (docs/compression.md), 50 exact steps of 200 cut TopK(0.01)'s
final gap from +18% to +6% and OneBit(block_size=64)'s from +15% to +3-5%; 20 exact steps together with Adam's beta1
0.3 (error feedback's delayed sums are a momentum of their own) brought TopK(0.01) and OneBit within 3% on five seeds.

Mechanism, as the generic `reduce` runs it (PowerSGD overrides it: it needs two rounds):
1. `compress(key, flat, shapes, world)` reads the bucket (plus the memory), updates the memory and returns a `Payload`:
   the tensors to put on the wire and whether they are summed (`all_reduce`) or concatenated (`all_gather`).
2. the payload's collectives are issued asynchronously over `comm` (so backward keeps computing meanwhile);
3. `Work.wait()` waits for them and calls `decompress(payload, received, flat, world)`, which writes the average.

State is per rank (each rank's residual is its own) and per bucket `key`. A compressor given to a strategy is a
configuration: the strategy calls `fresh()` to get this rank's own instance with empty state, so one object built
before `sw.launch` serves every thread rank without sharing memory between them. `state_dict()` /
`load_state_dict()` carry the state as a flat {name: tensor} dict (safetensors-ready) so that a resumed run
continues exactly.

The state follows the step (transaction.py): a reduction stages its new state beside the old, `settle(taken)` keeps
it or restores the old (`sw.ShardedGradScaler(model)` settles at each step, so a skipped step leaves the state
exactly as before), and state that is not finite raises NonFiniteStateError naming it. Residuals are kept in
gradient units (`set_loss_scale`), so a changed loss scale finds them right.

Every method states its bytes on the wire per step as a formula, `wire_bytes(shapes, world)`, built from the ring
cost of each collective it issues (`comm.base.wire_bytes`), which the tests compare with `CommStats`.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import math
import zlib
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal

import torch

from ..comm.base import Communicator, ReduceOp, Work
from .transaction import StagedState

__all__ = ["Compressor", "Payload", "PendingWork", "tile", "check_ratio", "check_start_iter", "shared_generator",
           "Shapes", "with_start_iter"]

Shapes = Sequence[torch.Size | Sequence[int]] | int


@dataclasses.dataclass
class Payload:
    """What one rank puts on the wire for one bucket.

    tensors: the tensors sent, each in its own collective. collective: "all_reduce" (summed over ranks, in place)
    or "all_gather" (every rank's tensor concatenated, in rank order). context: whatever decompress needs besides
    the received tensors (indices, shapes), never sent.
    """

    tensors: tuple[torch.Tensor, ...]
    collective: Literal["all_reduce", "all_gather"]
    context: Any = None


class PendingWork(Work):
    """A Work made of collectives already issued and a `finish` step run once, in `wait()`, after them."""

    def __init__(self, works: Sequence[Work | None], finish: Callable[[], None]) -> None:
        self.works = [w for w in works if w is not None]
        self.finish = finish
        self.done = False

    def wait(self, timeout: float | None = None) -> None:
        if self.done:
            return
        for work in self.works:
            work.wait(timeout)
        self.finish()
        self.done = True

    def is_completed(self) -> bool:
        return self.done


def tile(shapes: Shapes | None, numel: int) -> list[tuple[int, torch.Size]]:
    """(offset, shape) of each tensor tiling a flat buffer of `numel` elements, in order. A bucket's tail not covered
    by `shapes` (padding of a sharded unit) is one more 1-D tensor; no shapes means one 1-D tensor."""
    if shapes is None or isinstance(shapes, int):
        return [(0, torch.Size([numel]))] if numel else []
    out, offset = [], 0
    for shape in shapes:
        shape = torch.Size(shape)
        out.append((offset, shape))
        offset += shape.numel()
    if offset > numel:
        raise ValueError(f"compression: the shapes cover {offset} elements but the buffer has only {numel}")
    if offset < numel:
        out.append((offset, torch.Size([numel - offset])))
    return out


def check_ratio(method: str, ratio: float) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"{method}: ratio={ratio!r} must be a number in (0, 1]: the fraction of elements sent")
    return float(ratio)


def check_start_iter(method: str, start_iter: int) -> int:
    if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
        raise ValueError(f"{method}: start_iter={start_iter!r} must be an int >= 0 (the reductions of each bucket "
                         f"done exactly before compressing)")
    return start_iter


def with_start_iter(config: dict[str, Any], start_iter: int) -> dict[str, Any]:
    """`config` naming start_iter only when there is a warm-up, so checkpoints saved before it existed still match."""
    return {**config, "start_iter": start_iter} if start_iter else config


def shared_generator(seed: int, key: str, step: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator every rank seeds identically for (seed, bucket key, step): random choices that must agree
    across ranks (RandomK's indices, PowerSGD's initial Q) without sending them. A key that names the rank gives
    each rank its own repeatable stream instead (BF16's stochastic rounding)."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(key.encode()) * 7919 + step) % (2**63 - 1))
    return g


def nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * (torch.finfo(dtype).bits // 8 if dtype.is_floating_point else torch.iinfo(dtype).bits // 8)


class Compressor(StagedState, abc.ABC):
    """See the module docstring. Subclasses implement `compress`, `decompress` and `wire_bytes`; lossy ones keep
    their residual in `self.memory[key]` (one flat tensor per bucket), which `state_dict` saves. State is written
    through `_stage` (a new tensor per step, never one the state before the step refers to: transaction.py)."""

    name: str = "compressor"
    # Reductions of each bucket done exactly (a plain fp32 all-reduce) before compressing: the warm-up that
    # PowerSGD (start_powerSGD_iter), DGC (its warm-up epochs) and 1-bit Adam (freeze_step) all start with, because
    # early gradients are large and change fast, and an error-feedback backlog built then arrives stale.
    start_iter: int = 0

    def __init__(self) -> None:
        self.memory: dict[str, torch.Tensor] = {}  # error feedback: per bucket, what was not sent yet
        self.iterations: dict[str, int] = {}  # reductions done per bucket (PowerSGD's start_iter, RandomK's seed)
        self.comm_rank = 0  # this rank in the current reduction's communicator (set by `reduce`: per-rank randomness)
        self.loss_scale = 1.0  # what the gradients are multiplied by (set_loss_scale); residuals are kept without it
        self._reset_transaction()

    # ---- configuration ----------------------------------------------------------------------------------------
    def fresh(self) -> Compressor:
        """A copy of this configuration with empty state: what a strategy keeps for one rank."""
        clone = copy.copy(self)
        Compressor.__init__(clone)
        clone._reset_extra_state()
        return clone

    def _reset_extra_state(self) -> None:
        """Subclasses holding more state than memory/iterations clear it here."""

    def state_kinds(self) -> tuple[str, ...]:
        """The attributes holding state, each a {bucket: value} dict (what a skipped step restores)."""
        return ("memory", "iterations", *self._extra_kind_names())

    def config(self) -> dict[str, Any]:
        """The options, as plain values (what ranks compare at wrap time and logs show)."""
        return {"method": self.name}

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "method")
        return f"{type(self).__name__}({options})"

    # ---- the three steps --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def compress(self, key: str, flat: torch.Tensor, shapes: Shapes | None, world: int) -> Payload:
        """This rank's payload for bucket `key` reduced over `world` ranks; updates the error-feedback memory."""

    @abc.abstractmethod
    def decompress(self, payload: Payload, received: Sequence[torch.Tensor], out: torch.Tensor, world: int) -> None:
        """Write the average over `world` ranks of their compressed contributions into `out` (the bucket)."""

    @abc.abstractmethod
    def wire_bytes(self, shapes: Shapes, world: int, element_size: int = 4) -> int:
        """Per-rank ring bytes one compressed reduction of a bucket of `shapes` (or a flat count) puts on the wire
        (a warm-up reduction, before `start_iter`, costs the fp32 all-reduce's instead)."""

    # Whether `reduce_scatter` is available: a method whose compressed contributions can be summed chunk by chunk
    # (the 16-bit casts). The sharding engine asks, so that ZeRO and FSDP keep their reduce-scatter.
    reduces_scatter: bool = False
    # Whether a 0/1 element added to what `reduce_scatter` reduces comes out zero exactly when every rank sent 0
    # (each element rounded on its own, with no memory): the sharding engine's "used" flags (sharding/grad_layout.py)
    # may then ride in this method's reduce-scatter instead of an all-reduce of their own.
    keeps_flags: bool = False

    def reduce_scatter(self, key: Hashable, flat: torch.Tensor, out: torch.Tensor, comm: Communicator) -> Work:
        """Start the compressed average of `flat` over `comm`, keeping only chunk `comm.rank` (in `out`, of
        flat.numel() / comm.size elements), for methods with `reduces_scatter`."""
        raise NotImplementedError(f"{self.name} has no reduce-scatter (reduces_scatter is False)")

    def _check_bucket(self, flat: torch.Tensor) -> None:
        if not flat.is_floating_point() or not flat.is_contiguous() or flat.dim() != 1:
            raise ValueError(f"{self.name}: the bucket must be a flat contiguous floating-point tensor, got "
                             f"shape {tuple(flat.shape)} {flat.dtype}")

    def reduce(self, key: Hashable, flat: torch.Tensor, comm: Communicator, shapes: Shapes | None = None) -> Work:
        """Start the compressed average of `flat` over `comm`; after `wait()` it holds the result in place."""
        self._check_bucket(flat)
        key = str(key)
        if self._warming_up(key):
            return comm.all_reduce(self._exact(key, flat, comm.size), ReduceOp.AVG, async_op=True)
        self.comm_rank = comm.rank
        payload = self.compress(key, flat, shapes, comm.size)
        works, received = [], []
        for t in payload.tensors:
            if payload.collective == "all_reduce":
                works.append(comm.all_reduce(t, ReduceOp.SUM, async_op=True))
                received.append(t)
            else:
                gathered = torch.empty(t.numel() * comm.size, dtype=t.dtype, device=t.device)
                works.append(comm.all_gather(gathered, t.reshape(-1), async_op=True))
                received.append(gathered)

        def finish() -> None:
            self.decompress(payload, received, flat, comm.size)
            self._observe(key, received)

        return PendingWork(works, finish)

    def _warming_up(self, key: str) -> bool:
        """Count this reduction of bucket `key`; True while it is one of the first `start_iter`, which are exact
        fp32 averages (the residual stays empty: nothing was left out)."""
        self._begin(key)
        iteration = self.iterations.get(key, 0)
        self.iterations[key] = iteration + 1
        return iteration < self.start_iter

    def _exact(self, key: str, flat: torch.Tensor, world: int) -> torch.Tensor:
        """What a warm-up reduction averages: the bucket itself, unless the method transforms gradients before
        compressing them (TopK's DGC momentum correction: its velocity, so the warm-up is momentum SGD too)."""
        return flat

    # ---- error feedback ---------------------------------------------------------------------------------------
    def _with_memory(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        """A new tensor: the bucket plus what this rank has not sent of earlier steps (kept in gradient units: times
        the loss scale here, in the bucket's)."""
        residual = self.memory.get(key)
        if residual is None:
            return flat.detach().clone()
        if residual.shape != flat.shape:
            raise ValueError(f"{self.name}: bucket {key!r} has {flat.numel()} elements but its error-feedback memory "
                             f"{residual.numel()}: the model's buckets changed after a resume")
        return torch.add(flat.detach(), residual, alpha=self.loss_scale)

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's state as {name: tensor}: 'memory/<bucket>', 'iterations/<bucket>', and subclasses' own."""
        state = {f"memory/{k}": v.detach().clone() for k, v in self.memory.items()}
        state.update({f"iterations/{k}": torch.tensor(v, dtype=torch.int64) for k, v in self.iterations.items()})
        return state

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """ValueError naming the first entry of `state` that `load_state_dict` could not take; changes nothing."""
        if not isinstance(state, dict):
            raise ValueError(f"{self.name}.load_state_dict: the state must be a dict, got {type(state).__name__}")
        allowed = f"allowed memory/<bucket>, iterations/<bucket>{self._extra_kinds()}"
        for name, value in state.items():
            kind, _, key = str(name).partition("/")
            if kind not in ("memory", "iterations", *self._extra_kind_names()) or not key:
                raise ValueError(f"{self.name}.load_state_dict: unknown entry {name!r}; {allowed}")
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"{self.name}.load_state_dict: entry {name!r} must be a tensor, got "
                                 f"{type(value).__name__}")
            if kind == "iterations" and (value.numel() != 1 or value.is_floating_point() or int(value) < 0):
                raise ValueError(f"{self.name}.load_state_dict: entry {name!r} must be one non-negative integer, "
                                 f"got {value.numel()} elements of {value.dtype}")
            if kind != "iterations" and (value.dim() != 1 or not value.is_floating_point()):
                raise ValueError(f"{self.name}.load_state_dict: entry {name!r} must be a 1-D floating-point "
                                 f"tensor, got shape {tuple(value.shape)} {value.dtype}")

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what `state_dict` returned (on this rank: the residuals are per rank); {} resets the state.
        All or nothing: the whole dict is checked first."""
        self.check_state_dict(state)
        self.memory, self.iterations = {}, {}
        self._reset_extra_state()
        self._close()  # nothing of an open step survives a load
        self._deferred = None
        for name, value in state.items():
            kind, _, key = name.partition("/")
            if kind == "memory":
                self.memory[key] = value.detach().clone()
            elif kind == "iterations":
                self.iterations[key] = int(value)
            else:
                self._load_extra(kind, key, value)

    def extra_state(self, group: Communicator, follows_gradients: bool = True, **config: Any) -> Any:
        """This rank's state declared for checkpoints (a `layout.ExtraState`, per rank: the residuals are each
        rank's own), valid under this method's configuration and the strategy's `config` (its bucket sizes).
        follows_gradients: the compressor reduces the loss-scaled gradients of the model's optimizer step (DDP,
        ZeRO, FSDP): the record then lets `sw.ShardedGradScaler(model)` settle each step and announce the scale;
        False for other reductions (local SGD's outer gradients, 1-bit Adam's momentum), which settle themselves."""
        from ..whole.grad_scaler import StepBoundState

        hooks = {"settle": self.settle, "loss_scale": self.set_loss_scale} if follows_gradients else {}
        return StepBoundState("compressor", "per_rank", self.state_dict, self.load_state_dict, self.check_state_dict,
                              config={"compressor": self.config(), **config}, group=group, **hooks)

    def _load_extra(self, kind: str, key: str, value: torch.Tensor) -> bool:
        return False

    def _extra_kinds(self) -> str:
        return "".join(f", {kind}/<bucket>" for kind in self._extra_kind_names())

    def _extra_kind_names(self) -> tuple[str, ...]:
        """The kinds of entries a subclass adds to the state dict (PowerSGD: "q")."""
        return ()


def ring_all_reduce(numel: int, element_size: int, world: int) -> int:
    """Per-rank ring bytes of one all-reduce of `numel` elements (CommStats' formula, floor per call)."""
    from ..comm.base import wire_bytes

    return wire_bytes("all_reduce", numel * element_size, world) if numel else 0


def ring_all_gather(numel_per_rank: int, element_size: int, world: int) -> int:
    """Per-rank ring bytes of one all-gather of `numel_per_rank` elements from each rank."""
    from ..comm.base import wire_bytes

    return wire_bytes("all_gather", numel_per_rank * element_size * world, world) if numel_per_rank else 0


def total_numel(shapes: Shapes) -> int:
    if isinstance(shapes, int):
        return shapes
    return sum(math.prod(s) for s in shapes)
