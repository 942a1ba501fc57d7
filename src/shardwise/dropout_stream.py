"""Dropout masks drawn from a stream the ranks of a tensor-parallel group share, not from torch's global generator.

Why. Between a row-parallel layer (its output all-reduced) and the next column-parallel one, every rank of a
tensor-parallel group holds the same activations and must compute the same thing on them: the embedding dropout, the
residual dropout after each block's output projection. A rank that draws another mask there trains its copy of the
replicated parameters (the norms, the position embedding) on other numbers, and the copies drift apart with no error:
thread ranks share torch's one generator, a script that seeds torch with its rank (nanoGPT's ``1337 + rank``) seeds
them apart, and a split that draws different amounts per rank desynchronises them. Megatron-LM asks every script to
seed torch's generator alike on the tp ranks and forks a separate tracked generator for the parallel regions
(Shoeybi et al. 2019, "Megatron-LM", section 3; Korthikanti et al. 2022 for the sequence-parallel regions).

Mechanism. `attach` (called by dropout_functions.install) gives a model a `DropoutStream` (a base seed the group
agreed, and a counter) and hooks its modules: while the outermost module call of the model runs in training (the
model, a pipeline stage, a layer), the stream is this thread's. Every dropout call with 0 < p < 1 made meanwhile
(dropout_functions.py: ``F.dropout`` and so ``nn.Dropout``, ``dropout1d/2d/3d``, ``torch.dropout``,
``scaled_dot_product_attention``'s ``dropout_p``) takes the stream's next seed, the same number on every rank since
every rank runs the same forward, and draws its mask from a generator seeded with it. Without a stream (any other
model, or eval) torch's own function runs.

Activation checkpointing. A checkpointed module runs its forward again in backward (torch.utils.checkpoint, whoever
calls it: shardwise, HuggingFace's gradient checkpointing, the model itself) and must draw the masks it drew the
first time. Each draw in forward records its seed under a fingerprint of its input (its bits, summed row by row with
position weights) with its shape and dtype; a draw in backward is a recompute, which reproduces its input bit for bit,
and takes the seed recorded for that fingerprint (once: the record is used up, but for a second recompute of the same
forward before the next one draws on that input -- a zero-bubble pipeline's weight pass recomputes what its input
pass did; an optimizer step forgets the rest, whose backward has run or never will). A recompute inside the model
whose fingerprint has no record, or two records (two forwards since the last step dropped out the same numbers), is
a RuntimeError, never another mask.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from typing import Any, Iterator

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import dropout_regions
from .compiled import break_graph_here, eager_while_traced, graph_tracing

__all__ = ["DropoutStream", "attach", "generator_for", "generator_for_random", "group_seed",
           "stream_of", "use_own_stream"]

_ATTR = "_shardwise_dropout_stream"
_RECORDS = 1 << 16  # forward draws remembered for a recompute (pipelines keep many microbatches in flight)
_MASK64 = (1 << 64) - 1
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _mix(a: int, b: int) -> int:
    """splitmix64 of a combined with b: neighbouring counters give unrelated seeds (Steele et al. 2014)."""
    z = (a + 0x9E3779B97F4A7C15 * ((b & _MASK64) + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class DropoutStream:
    """A base seed and a counter: the n-th dropout draw of the model's forwards gets seed mix(base, n).

    `records` maps a draw's input (fingerprint, shape, dtype, kind) to the seeds forwards drew for it and have not
    yet replayed, the most recent `_RECORDS` of them; `replayed` the seeds replayed since, for a recompute again."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed) & _MASK64
        self.counter = 0
        self.records: collections.OrderedDict[tuple, list[int]] = collections.OrderedDict()
        self.replayed: dict[tuple, int] = {}
        self.size = 0
        self.thread = 0  # the thread that drew last: an optimizer step on it ends what it may recompute
        _live.add(self)

    def next_seed(self) -> int:
        """The stream's next seed, mix(base, n), the same on every rank that makes the same draws in order."""
        self.counter += 1
        return _mix(self.seed, self.counter)

    def draw(self, key: tuple, place: int = 0) -> int:
        """The next seed, mixed with `place` when not 0 (a rank's own in a parallel region: dropout_regions.py),
        recorded under `key` (a dropout input's) for a recompute to replay."""
        self.thread = threading.get_ident()
        seed = self.next_seed() if not place else _mix(self.next_seed(), place)
        self.replayed.pop(key, None)  # a new forward on this input: a recompute is of it now
        self.records.setdefault(key, []).append(seed)
        self.records.move_to_end(key)
        self.size += 1
        while self.size > _RECORDS:
            _, dropped = self.records.popitem(last=False)
            self.size -= len(dropped)
        return seed

    def replay(self, key: tuple) -> int | None:
        """The seed a forward drew for this input, used up (kept in `replayed` for a recompute of the same forward
        again); None if none did. Two is a RuntimeError."""
        seeds = self.records.get(key)
        if not seeds:
            return self.replayed.get(key)
        if len(seeds) > 1:
            raise RuntimeError(f"a dropout recomputed in backward (activation checkpointing) under the tensor-parallel "
                               f"dropout stream matches {len(seeds)} forwards still awaiting their backward (equal "
                               f"inputs of shape {list(key[1])}), so which masks it drew is unknown; give those "
                               f"microbatches different data, or run each backward before the next forward")
        self.size -= 1
        del self.records[key]
        self.replayed[key] = seeds[0]
        return seeds[0]

    def knows(self, key: tuple) -> bool:
        return key in self.records or key in self.replayed

    def forget(self) -> None:
        self.records.clear()
        self.replayed.clear()
        self.size = 0

    def __setstate__(self, state: dict[str, Any]) -> None:  # a deep copy of a model: its copy's stream is live too
        self.__dict__.update(state)
        self.__dict__.setdefault("replayed", {})
        _live.add(self)


_live: weakref.WeakSet[DropoutStream] = weakref.WeakSet()
_step_hook: list = []
_install_lock = threading.Lock()


def _forget_drawn_on_this_thread(optimizer: Any, args: Any, kwargs: Any) -> None:
    """After an optimizer step no recompute of an earlier forward can come (its backward ran, or never will: a
    forward without backward, one whose backward failed), so their records would only make later ones ambiguous.
    Only this thread's: thread ranks step their own optimizers while the others may still be in backward."""
    thread = threading.get_ident()
    for stream in list(_live):
        if stream.thread == thread:
            stream.forget()


def stream_of(module: nn.Module) -> DropoutStream | None:
    return module.__dict__.get(_ATTR)


def attach(model: nn.Module, seed: int) -> DropoutStream:
    """Give `model` a stream seeded with `seed` (equal on every rank that must draw the same masks) and hook all its
    modules so their forwards' dropout draws from it (a second call reseeds the stream). The draws reach the stream
    through the functions dropout_functions.py puts in torch's place: call its `install`, which calls this."""
    with _install_lock:  # thread ranks parallelise at once: one hook
        if not _step_hook:
            _step_hook.append(register_optimizer_step_post_hook(_forget_drawn_on_this_thread))
    stream = stream_of(model)
    if stream is not None:
        stream.seed, stream.counter = int(seed) & _MASK64, 0
        return stream
    stream = DropoutStream(seed)
    for module in model.modules():
        object.__setattr__(module, _ATTR, stream)
        module.register_forward_pre_hook(_enter, prepend=True)
        module.register_forward_hook(_leave, always_call=True)
    return stream


class _Local(threading.local):
    def __init__(self) -> None:
        self.stream: DropoutStream | None = None  # draws come from it: the model whose module runs in training
        self.calls: list[nn.Module] = []  # hooked module calls running on this thread, outermost first
        self.since = 0  # len(calls) when `stream` was set (a module in training inside an evaluated model)
        self.own: DropoutStream | None = None  # a thread rank's stream for every other draw (use_own_stream)


_local = _Local()


def _enter_now(module: nn.Module) -> None:
    stream = stream_of(module)
    calls = _local.calls
    if stream is None or (_local.stream is not None and stream is not _local.stream):
        return  # not a hooked module, or another model's inside one that draws: the drawing one's stream serves
    calls.append(module)
    if _local.stream is None and module.training:
        _local.stream, _local.since = stream, len(calls)
        dropout_regions.leave()  # a model's forward starts outside its parallel regions


def _leave_now(module: nn.Module) -> None:
    calls = _local.calls
    if not calls or calls[-1] is not module:
        return  # a call this thread did not enter eagerly (dynamo traced its hook), or one `_enter_now` passed over
    if _local.stream is not None and _local.since == len(calls):
        _local.stream = None
        dropout_regions.leave()
    calls.pop()


# Under torch.compile the hooks are traced, and the thread-local state must not enter a graph: only the outermost
# hooked module a compiled region enters acts (the model given to torch.compile, or a block compiled in place with
# `block.compile()` inside an eager model, as torchtitan compiles its blocks), through a graph break that runs its
# hook eagerly; the modules inside it do nothing. Which one is outermost is read from `_local.calls`, which dynamo
# guards (empty, or the one module that entered). An eager leave undoes only the call it finds last entered: a hook
# dynamo ran eagerly (past its recompile limit) whose enter was traced changes nothing.
_enter_eagerly, _leave_eagerly = eager_while_traced(_enter_now), eager_while_traced(_leave_now)


def _enter(module: nn.Module, args: tuple) -> None:
    if not torch.compiler.is_dynamo_compiling():
        _enter_now(module)
    elif not _local.calls:
        _enter_eagerly(module)


def _leave(module: nn.Module, args: tuple, output: Any) -> None:
    if not torch.compiler.is_dynamo_compiling():
        _leave_now(module)
    elif len(_local.calls) == 1 and _local.calls[0] is module:
        _leave_eagerly(module)


def _fingerprint(t: torch.Tensor) -> int:
    """A hash of `t`'s bits that a recompute reproduces: row sums of the integer view, weighted by row position
    (so reordered rows differ). One pass over `t`; a host sync on an accelerator."""
    if t.numel() == 0:
        return 0
    if t.is_complex():
        t = torch.view_as_real(t)
    bits = t.detach().contiguous().view(_INTS[t.element_size()])
    rows = bits.reshape(-1, bits.shape[-1] if bits.dim() else 1).sum(1, dtype=torch.int64)
    weights = torch.arange(rows.numel(), dtype=torch.int64, device=rows.device) * 0x9E3779B1 + 0x632BE5AB
    return int((rows * weights).sum())


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def generator_for(input: torch.Tensor, kind: str, device: torch.device) -> torch.Generator | None:
    """The generator one dropout draw on `input` takes its mask from, or None where torch's own draw is right (no
    stream on this thread, or a recompute of a draw no stream made)."""
    stream = _local.stream or _local.own
    backward = _in_backward()
    if stream is None and not backward:
        return None
    traced = graph_tracing()  # under torch.compile: compiled.graph_tracing says why neither may trace a draw
    if traced == "graph":
        return None  # torch's own op traced: inductor's patterns; a call dynamo kept, found with no stream serving
    if traced == "example":
        break_graph_here()  # dynamo keeps this call out of its graph and runs it eagerly, drawing from the stream
    key = _key(input, kind)
    if not backward:
        seed = stream.draw(key, dropout_regions.place() if stream is _local.stream else 0)
    else:
        found = _recorded(key)
        if found is not None:
            seed = found.replay(key)
        elif stream is not None:
            whose = "the tensor-parallel group's" if _local.stream is not None else "this thread rank's"
            raise RuntimeError(f"a {kind} drawn from {whose} dropout stream ran in backward (an activation-"
                               f"checkpointing recompute) on an input no forward dropped out since the last "
                               f"optimizer step (shape {list(input.shape)}), so its masks cannot be the forward's; "
                               f"recompute only what the forward computed, before the next optimizer step and within "
                               f"{_RECORDS} dropout calls of it")
        else:
            return None  # a draw of some other model's recompute
    return _seeded(device, seed)


def _seeded(device: torch.device | str, seed: int) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def generator_for_random(device: torch.device | str | None, kind: str) -> torch.Generator | None:
    """The generator a random op other than dropout (``torch.rand``, ``Tensor.uniform_``: a MoE router's jitter
    noise, stochastic depth) takes inside a tensor-parallel model's forward, from the group's stream so that every
    rank draws the same numbers; None elsewhere (torch's own generator). Such a draw cannot be replayed in a recompute
    (its output is all there is to recognise it by): one in backward is a RuntimeError."""
    stream = _local.stream
    if stream is None:
        return None
    traced = graph_tracing()  # as in generator_for
    if traced == "graph":
        return None
    if traced == "example":
        break_graph_here()
    if _in_backward():
        raise RuntimeError(f"{kind} in a model under the tensor-parallel dropout stream ran in backward (an activation-"
                           f"checkpointing recompute): only dropout's masks can be replayed, so the recompute would "
                           f"draw other numbers than its forward; pass it a generator= of your own seeded alike on "
                           f"every rank, or leave the module it runs in out of activation checkpointing")
    return _seeded(device if device is not None else "cpu", stream.next_seed())


def _recorded(key: tuple) -> DropoutStream | None:
    """The stream that recorded `key`: the model's whose module runs, else one this thread drew from (thread ranks
    share the process, and a replicated activation has the same fingerprint on every tp rank), else any (on an
    accelerator, backward runs on autograd's device thread)."""
    if _local.stream is not None:
        return _local.stream if _local.stream.knows(key) else None
    streams = list(_live)
    thread = threading.get_ident()
    for candidates in ([s for s in streams if s.thread == thread], streams):
        for stream in candidates:
            if stream.knows(key):
                return stream
    return None


@contextlib.contextmanager
def use_own_stream(rank: int) -> Iterator[DropoutStream]:
    """Thread rank `rank` draws every dropout mask outside a tensor-parallel model from a stream of its own, as a
    process draws from its own generator: thread ranks share torch's one generator, so a recompute under activation
    checkpointing (torch.utils.checkpoint restores that generator's state, which the other ranks keep drawing from)
    drew other masks than its forward, and the gradients were another model's. Seeded from ``torch.initial_seed()``
    and the rank: a script seeded before the launch is reproducible."""
    stream = DropoutStream(_mix(_mix(torch.initial_seed() & _MASK64, 0x5EED0F7), rank))
    _local.own = stream
    try:
        yield stream
    finally:
        _local.own = None


def _key(input: torch.Tensor, kind: str) -> tuple:
    return _fingerprint(input), tuple(input.shape), input.dtype, kind


def group_seed(comm: Any, distinct: bool = False) -> int:
    """The base seed of a group's stream: rank 0's ``torch.initial_seed()`` (the script's seed; nothing is drawn from
    its generator), mixed with the group's first world rank (each pipeline stage's group gets its own stream) and,
    when `distinct`, with this rank's place in the group (sequence parallelism: every region a rank drops out is its
    own shard, so its masks should be its own, as Megatron's tracker gives). Collective over `comm` (one broadcast)."""
    seed = torch.tensor([torch.initial_seed() & ((1 << 63) - 1)], dtype=torch.int64, device=comm.device)
    comm.broadcast(seed, 0)
    base = _mix(int(seed.item()), comm.global_ranks[0])
    return _mix(base, comm.rank + 1) if distinct else base


def _streams(model: nn.Module) -> list[DropoutStream]:
    """The distinct streams attached to `model`'s modules, in module order."""
    found: list[DropoutStream] = []
    for module in model.modules():
        stream = stream_of(module)
        if stream is not None and all(stream is not s for s in found):
            found.append(stream)
    return found


def stream_positions(model: nn.Module) -> dict[str, Any]:
    """Where `model`'s streams and this thread rank's own stand, for a checkpoint's RNG entry: a resumed run then
    draws the masks the uninterrupted one would have (torch's generator states are saved beside them)."""
    return {"models": [s.counter for s in _streams(model)], "own": _local.own.counter if _local.own else None}


def check_positions(saved: Any) -> dict[str, Any]:
    """A checkpoint's stream positions, checked (ValueError naming what is wrong); {} for a checkpoint without."""
    if saved is None:
        return {}
    models, own = (saved.get("models"), saved.get("own")) if isinstance(saved, dict) else (None, None)
    if (not isinstance(models, list) or not all(isinstance(c, int) and c >= 0 for c in models)
            or not (own is None or (isinstance(own, int) and own >= 0))):
        raise ValueError(f"dropout stream positions must be {{'models': [counters >= 0], 'own': counter or None}}, "
                         f"got {saved!r}")
    return saved


def restore_positions(model: nn.Module, saved: dict[str, Any]) -> None:
    """Put `model`'s streams (matched in module order, when the counts agree) and this thread rank's own back where
    `check_positions`' result says."""
    streams = _streams(model)
    if len(streams) == len(saved.get("models", ())):
        for stream, counter in zip(streams, saved["models"]):
            stream.counter = counter
            stream.forget()
    if _local.own is not None and saved.get("own") is not None:
        _local.own.counter = saved["own"]
        _local.own.forget()
