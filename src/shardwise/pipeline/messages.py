"""What crosses a stage boundary: the structure of a stage's output described as integers, and the messages of a run.

Structure metadata (no pickle: int64 tensors only)
--------------------------------------------------
A `Spec` describes one stage output: its container (a single value, tuple, list or dict; see `structure.py`) and,
per leaf, its key, and for a tensor its dtype, shape and whether it *carries a gradient* back (floating point and
requiring grad at the sender: hidden states do, attention masks and position ids do not). It is encoded as

* a header of ``WORDS`` = 10 int64. A single tensor (the common case) is described by the header alone:
  ``[2 * dtype index + carries_grad, ndim, size_0, ..., size_7]`` (a *leaf record*).
  Anything else: ``[-1 - container, number of leaves, body length, 0, ...]``, followed by
* a body of int64: for each leaf in order, for a dict its key (UTF-8 byte count, then one word per byte), then
  its leaf record (a None leaf is ``[-1, 0, ...]``).

Both sides derive from the same Spec which leaves are sent (tensors; None leaves are rebuilt by the receiver) and
which may carry gradients back (the flags below say which do), so they always agree on the messages of a step.
A leaf that is neither a tensor nor None cannot be sent: `encode` raises ValueError naming the stage and the key.

Messages of a run (`Messenger`)
-------------------------------
Before a stage's first activation of a run its rank sends the Spec (header, and body if any); every microbatch
then sends one message per tensor leaf. Backward, one message per leaf that carries a gradient, preceded once
per step, for a structured input, by one int64 flag per such leaf saying whether its gradient is sent at all (an
unused leaf has none: the sender then leaves that output out of its backward). Tags are
``((stage * (m + 1) + microbatch) * MAX_LEAVES + leaf) * 4 + kind`` with `stage` the receiving stage, `kind` one
of activation, gradient, header, body, and microbatch m for the metadata and the flags (of kind gradient), so
every message of a step has its own tag (MAX_LEAVES = 16 leaves at most per stage output).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..comm.base import Communicator, Work
from .structure import DICT, SINGLE, flatten, key_text, unflatten

__all__ = ["Leaf", "Spec", "Messenger", "spec_of", "encode", "body_length", "decode", "WORDS", "MAX_LEAVES"]

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.int16, torch.int8, torch.uint8]
_MAX_DIMS = 8
WORDS = 2 + _MAX_DIMS
MAX_LEAVES = 16
_ACT, _GRAD, _META, _BODY = range(4)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One leaf of a stage output. `dtype` is None for a None leaf and for any other non-tensor (`obj` names its
    type: such a leaf stays within its rank). `grad`: a floating tensor that requires grad, so it carries a gradient
    back to the sender."""

    key: int | str
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    grad: bool = False
    obj: str | None = None

    def __str__(self) -> str:
        if self.dtype is None:
            return self.obj or "None"
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}" + (" (grad)" if self.grad else "")


@dataclasses.dataclass(frozen=True)
class Spec:
    """The structure of a stage output: container code (structure.py) and its leaves in order."""

    container: int
    leaves: tuple[Leaf, ...]

    @property
    def keys(self) -> tuple[int | str, ...]:
        return tuple(leaf.key for leaf in self.leaves)

    @property
    def tensor_indices(self) -> list[int]:
        return [i for i, leaf in enumerate(self.leaves) if leaf.dtype is not None]

    @property
    def grad_indices(self) -> list[int]:
        return [i for i, leaf in enumerate(self.leaves) if leaf.grad]

    def __str__(self) -> str:
        if self.container == SINGLE:
            return str(self.leaves[0])
        return ", ".join(f"{key_text(self.container, leaf.key)}: {leaf}" for leaf in self.leaves)


def spec_of(value: Any) -> Spec:
    """The Spec of `value` (any leaves allowed; `encode` rejects those that cannot be sent)."""
    container, keys, leaves = flatten(value)
    out = []
    for key, leaf in zip(keys, leaves):
        if isinstance(leaf, torch.Tensor):
            out.append(Leaf(key, leaf.dtype, tuple(leaf.shape), leaf.is_floating_point() and leaf.requires_grad))
        else:
            out.append(Leaf(key, obj=None if leaf is None else type(leaf).__name__))
    return Spec(container, tuple(out))


def _record(where: str, spec: Spec, leaf: Leaf) -> list[int]:
    name = f"{where} output{key_text(spec.container, leaf.key)}"
    if leaf.dtype is None:
        if leaf.obj is not None:
            raise ValueError(f"Pipeline: {name} is a {leaf.obj}, which cannot be sent to another rank; leaves passed "
                             f"between ranks must be tensors or None")
        return [-1] + [0] * (WORDS - 1)
    if leaf.dtype not in _DTYPES or len(leaf.shape) > _MAX_DIMS:
        raise ValueError(f"Pipeline: {name} is a {leaf.dtype} tensor with {len(leaf.shape)} dims, which cannot be "
                         f"sent; allowed dtypes {_DTYPES}, at most {_MAX_DIMS} dims")
    padding = [0] * (_MAX_DIMS - len(leaf.shape))
    return [2 * _DTYPES.index(leaf.dtype) + leaf.grad, len(leaf.shape), *leaf.shape, *padding]


def encode(spec: Spec, where: str) -> list[torch.Tensor]:
    """[header] for a single tensor, else [header, body] (see the module docstring). `where` names the producer
    (e.g. "stage 2") in the ValueError raised for a leaf that cannot be sent or too many leaves."""
    if spec.container == SINGLE and spec.leaves[0].dtype is not None:
        return [torch.tensor(_record(where, spec, spec.leaves[0]), dtype=torch.int64)]
    if len(spec.leaves) > MAX_LEAVES:
        raise ValueError(f"Pipeline: {where} output has {len(spec.leaves)} leaves; at most {MAX_LEAVES} can be sent "
                         f"between ranks")
    body: list[int] = []
    for leaf in spec.leaves:
        if spec.container == DICT:
            raw = list(str(leaf.key).encode())
            body += [len(raw), *raw]
        body += _record(where, spec, leaf)
    header = [-1 - spec.container, len(spec.leaves), len(body)] + [0] * (WORDS - 3)
    return [torch.tensor(header, dtype=torch.int64), torch.tensor(body, dtype=torch.int64)]


def body_length(header: torch.Tensor) -> int:
    """Words of the body that follows `header` (0 for a single tensor described by the header alone)."""
    code, _, length = header[:3].tolist()
    return 0 if code >= 0 else length


def _leaf(key: int | str, words: list[int]) -> Leaf:
    code, ndim = words[0], words[1]
    if code < 0:
        return Leaf(key)
    return Leaf(key, _DTYPES[code // 2], tuple(words[2 : 2 + ndim]), bool(code % 2))


def decode(header: torch.Tensor, body: torch.Tensor | None = None) -> Spec:
    """The Spec that `encode` turned into `header` (and `body`)."""
    words = header.tolist()
    if words[0] >= 0:
        return Spec(SINGLE, (_leaf(0, words),))
    container, n = -1 - words[0], words[1]
    data = [] if body is None else body.tolist()
    leaves, at = [], 0
    for i in range(n):
        key: int | str = i
        if container == DICT:
            length = data[at]
            key, at = bytes(data[at + 1 : at + 1 + length]).decode(), at + 1 + length
        leaves.append(_leaf(key, data[at : at + WORDS]))
        at += WORDS
    return Spec(container, tuple(leaves))


class Messenger:
    """The point-to-point messages of one run of a schedule on one rank (see the module docstring).

    Sends are isends waited for in `finish` (completed ones are dropped earlier); receives are posted by the
    schedule's RECV actions and waited for by the compute action that consumes them. A receive posted before its
    shapes are known (the metadata has not arrived, or this stage has not produced the output whose gradient it
    is) is posted when it is consumed instead.
    """

    def __init__(self, comm: Communicator, rank_of: Callable[[int], int], n_microbatches: int) -> None:
        self.comm, self.rank_of, self.m = comm, rank_of, n_microbatches
        self.in_spec: dict[int, Spec] = {}  # stage -> the Spec of its input, from the metadata
        self._sent_spec: dict[int, Spec] = {}  # receiving stage -> the Spec sent to it
        self._meta: dict[int, tuple[torch.Tensor, Work]] = {}
        self._recvs: dict[tuple[int, int, int], list[tuple[int, torch.Tensor, Work]] | None] = {}
        self._sends: list[tuple[Work, torch.Tensor]] = []
        self._flags: dict[int, list[int]] = {}  # stage -> its output leaves whose gradient comes back
        self._flag_recv: dict[int, tuple[torch.Tensor, Work]] = {}
        self._sent_flags: dict[int, list[bool]] = {}  # stage -> flags sent for its input leaves

    def tag(self, kind: int, stage: int, microbatch: int, leaf: int = 0) -> int:
        return ((stage * (self.m + 1) + microbatch) * MAX_LEAVES + leaf) * 4 + kind

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._sends.append((self.comm.isend(tensor, dst, tag), tensor))
        if len(self._sends) > 8:  # keep the list short; a sent buffer may be freed once its send completed
            self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]

    # ---- activations (forward) -------------------------------------------------------------------------------------
    def send_activation(self, value: Any, s: int, mb: int) -> None:
        """Send stage s's output for microbatch mb to the rank of stage s + 1 (with the Spec the first time)."""
        spec, dst = spec_of(value), self.rank_of(s + 1)
        first = self._sent_spec.get(s + 1)
        if first is None:
            for kind, t in zip((_META, _BODY), encode(spec, f"stage {s}")):
                self._isend(t, dst, self.tag(kind, s + 1, self.m))
            self._sent_spec[s + 1] = spec
        elif spec != first:
            raise ValueError(f"Pipeline: stage {s} returned {spec} for microbatch {mb} but {first} for the first "
                             f"microbatch; every microbatch of a step must give the same structure, dtypes and shapes")
        leaves = flatten(value)[2]
        for i in spec.tensor_indices:
            self._isend(leaves[i].detach().contiguous(), dst, self.tag(_ACT, s + 1, mb, i))

    def post_activation(self, s: int, mb: int) -> None:
        """Post the receive of stage s's input for microbatch mb (RECV_F)."""
        if s not in self.in_spec:
            if s not in self._meta:
                header = torch.zeros(WORDS, dtype=torch.int64)
                self._meta[s] = (header, self.comm.irecv(header, self.rank_of(s - 1), self.tag(_META, s, self.m)))
            if self._meta[s][1].is_completed():
                self._meta_done(s)
        spec = self.in_spec.get(s)
        self._recvs[(_ACT, s, mb)] = None if spec is None else self._post(spec, spec.tensor_indices, _ACT, s, mb, s - 1)

    def take_activation(self, s: int, mb: int) -> Any:
        """Wait for stage s's input of microbatch mb; return it rebuilt (None leaves included)."""
        key = (_ACT, s, mb)
        self._check_posted(key)
        if self._recvs[key] is None:
            if s not in self.in_spec:
                self._meta_done(s)
            spec = self.in_spec[s]
            self._recvs[key] = self._post(spec, spec.tensor_indices, _ACT, s, mb, s - 1)
        spec = self.in_spec[s]
        leaves: list[Any] = [None] * len(spec.leaves)
        for i, buf, work in self._recvs.pop(key):
            work.wait()
            leaves[i] = buf
        return unflatten(spec.container, spec.keys, leaves)

    def _meta_done(self, s: int) -> None:
        header, work = self._meta.pop(s)
        work.wait()
        body = None
        if n := body_length(header):
            body = torch.zeros(n, dtype=torch.int64)
            self.comm.recv(body, self.rank_of(s - 1), self.tag(_BODY, s, self.m))  # sent with the header
        self.in_spec[s] = decode(header, body)

    # ---- gradients (backward) --------------------------------------------------------------------------------------
    def _carried(self, s: int, spec: Spec, wait: bool) -> list[int] | None:
        """The leaves of stage s's output whose gradient comes back: every grad-carrying one for a single tensor,
        else those flagged by the consumer's first gradient message of the step (None while it is not here)."""
        if spec.container == SINGLE or not spec.grad_indices:
            return spec.grad_indices
        if s not in self._flags:
            if s not in self._flag_recv:
                buf = torch.zeros(len(spec.grad_indices), dtype=torch.int64)
                self._flag_recv[s] = (buf, self.comm.irecv(buf, self.rank_of(s + 1), self.tag(_GRAD, s, self.m)))
            buf, work = self._flag_recv[s]
            if not wait and not work.is_completed():
                return None
            work.wait()
            del self._flag_recv[s]
            self._flags[s] = [i for i, flag in zip(spec.grad_indices, buf.tolist()) if flag]
        return self._flags[s]

    def post_gradients(self, s: int, mb: int, spec: Spec | None) -> None:
        """Post the receives of the gradients of stage s's output (RECV_B); `spec` is that output's, if known yet."""
        carried = None if spec is None else self._carried(s, spec, wait=False)
        self._recvs[(_GRAD, s, mb)] = None if carried is None else self._post(spec, carried, _GRAD, s, mb, s + 1)

    def take_gradients(self, s: int, mb: int, spec: Spec) -> list[torch.Tensor | None]:
        """Wait for the gradients of stage s's output leaves, one per `spec.grad_indices` (None: no gradient)."""
        key = (_GRAD, s, mb)
        self._check_posted(key)
        if self._recvs[key] is None:
            self._recvs[key] = self._post(spec, self._carried(s, spec, wait=True), _GRAD, s, mb, s + 1)
        got = {}
        for i, buf, work in self._recvs.pop(key):
            work.wait()
            got[i] = buf
        return [got.get(i) for i in spec.grad_indices]

    def send_gradients(self, grads: list[torch.Tensor | None], s: int, mb: int) -> None:
        """Send the gradients of stage s's input leaves that carry one (`in_spec[s].grad_indices` order, None for an
        unused leaf) to the rank of stage s - 1 (SEND_B).

        A structured input first sends, once per step, one flag per such leaf (1: a gradient follows, 0: the leaf
        was unused), so the sender leaves unused outputs out of its backward exactly as one process would (their
        parameters keep no gradient). A single tensor sends zeros when unused (no flags, one message per microbatch).
        """
        spec, dst = self.in_spec[s], self.rank_of(s - 1)
        if spec.container == SINGLE or not spec.grad_indices:
            flags = [True] * len(spec.grad_indices)
        elif (flags := self._sent_flags.get(s)) is None:
            flags = self._sent_flags[s] = [g is not None for g in grads]
            self._isend(torch.tensor(flags, dtype=torch.int64), dst, self.tag(_GRAD, s - 1, self.m))
        for i, g, flag in zip(spec.grad_indices, grads, flags, strict=True):
            leaf = spec.leaves[i]
            if not flag:
                if g is not None:
                    raise ValueError(f"Pipeline: stage {s} input{key_text(spec.container, leaf.key)} got a gradient "
                                     f"for microbatch {mb} but none for the first microbatch of the step; every "
                                     f"microbatch must use the same inputs")
                continue
            g = torch.zeros(leaf.shape, dtype=leaf.dtype) if g is None else g
            self._isend(g.contiguous(), dst, self.tag(_GRAD, s - 1, mb, i))

    # ---- both ------------------------------------------------------------------------------------------------------
    def _post(self, spec: Spec, indices: list[int], kind: int, s: int, mb: int, peer: int):
        posted = []
        for i in indices:
            leaf = spec.leaves[i]
            buf = torch.empty(leaf.shape, dtype=leaf.dtype)
            posted.append((i, buf, self.comm.irecv(buf, self.rank_of(peer), self.tag(kind, s, mb, i))))
        return posted

    def _check_posted(self, key: tuple[int, int, int]) -> None:
        if key not in self._recvs:
            raise RuntimeError(f"Pipeline: rank {self.comm.rank} consumes message {key} that no RECV posted")

    def finish(self) -> None:
        """Wait for every send of the run."""
        for work, _ in self._sends:
            work.wait()
        self._sends = []
