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

from ..comm.base import Communicator, P2POp, Work
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


def encode(spec: Spec, where: str, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """[header] for a single tensor, else [header, body] (see the module docstring), on `device` (the
    communicator's). `where` names the producer (e.g. "stage 2") in the ValueError raised for a leaf that cannot be
    sent or too many leaves."""
    if spec.container == SINGLE and spec.leaves[0].dtype is not None:
        return [torch.tensor(_record(where, spec, spec.leaves[0]), dtype=torch.int64, device=device)]
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
    return [torch.tensor(header, dtype=torch.int64, device=device), torch.tensor(body, dtype=torch.int64, device=device)]


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

    The executor hands it each batch of SEND/RECV actions (`batches.host_steps`: the sends of one compute action
    and the receives of the next) through `send_*` / `expect_*` calls followed by one `post()`, which posts them
    with `comm.batch_isend_irecv`, so that NCCL's unbuffered, in-order point-to-point cannot deadlock. Messages
    between two ranks match in posting order (no tags): both sides post the same sequence, because they derive it
    from the same schedule and the same Spec. Receives whose shapes come with the metadata of this batch are
    posted in a second batch once the metadata is here (the sender posts it right before the data, in its one
    batch). Receives are waited for by the compute action that consumes them (`take_*`), sends in `finish`
    (completed ones are dropped earlier). Every buffer is allocated on `comm.device`.
    """

    def __init__(self, comm: Communicator, rank_of: Callable[[int], int], n_microbatches: int) -> None:
        self.comm, self.rank_of, self.m = comm, rank_of, n_microbatches
        self.device = comm.device
        self.in_spec: dict[int, Spec] = {}  # stage -> the Spec of its input, from the metadata
        self._sent_spec: dict[int, Spec] = {}  # receiving stage -> the Spec sent to it
        self._recvs: dict[tuple[int, int, int], list[tuple[int, torch.Tensor, Work]]] = {}
        self._sends: list[tuple[Work, torch.Tensor]] = []
        self._flags: dict[int, list[bool]] = {}  # stage -> per grad-carrying output leaf: does its gradient count
        self._sent_flags: dict[int, list[bool]] = {}  # stage -> flags sent for its input leaves
        self._ops: list[P2POp] = []  # the batch being built: sends and receives of known shape
        self._keys: list[tuple[int, int, int, int] | None] = []  # per op: (kind, stage, mb, leaf) of a receive
        self._meta: list[tuple[int, torch.Tensor]] = []  # (stage, header buffer) of this batch's metadata
        self._shaped_later: list[tuple[int, int]] = []  # (stage, microbatch) activations posted once it is here
        self._flag_bufs: dict[int, torch.Tensor] = {}

    def tag(self, kind: int, stage: int, microbatch: int, leaf: int = 0) -> int:
        """A distinct tag per message (buffered backends only: matching relies on posting order, not on tags)."""
        return ((stage * (self.m + 1) + microbatch) * MAX_LEAVES + leaf) * 4 + kind

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        self._ops.append(P2POp.send(tensor, dst))
        self._keys.append(None)

    def _recv(self, buf: torch.Tensor, src: int, key: tuple[int, int, int, int]) -> None:
        self._ops.append(P2POp.recv(buf, src))
        self._keys.append(key)

    # ---- building a batch ------------------------------------------------------------------------------------------
    def send_activation(self, value: Any, s: int, mb: int) -> None:
        """SEND_F: stage s's output for microbatch mb to the rank of stage s + 1 (its Spec first, once per run)."""
        spec, dst = spec_of(value), self.rank_of(s + 1)
        first = self._sent_spec.get(s + 1)
        if first is None:
            for t in encode(spec, f"stage {s}", self.device):
                self._send(t, dst)
            self._sent_spec[s + 1] = spec
        elif spec != first:
            raise ValueError(f"Pipeline: stage {s} returned {spec} for microbatch {mb} but {first} for the first "
                             f"microbatch; every microbatch of a step must give the same structure, dtypes and shapes")
        leaves = flatten(value)[2]
        for i in spec.tensor_indices:
            self._send(leaves[i].detach().contiguous(), dst)

    def expect_activation(self, s: int, mb: int) -> None:
        """RECV_F: stage s's input for microbatch mb (after its metadata, the first time in the run)."""
        if s in self.in_spec:
            self._post_leaves(self.in_spec[s], self.in_spec[s].tensor_indices, _ACT, s, mb, s - 1)
            return
        if all(stage != s for stage, _ in self._meta):
            header = torch.zeros(WORDS, dtype=torch.int64, device=self.device)
            self._recv(header, self.rank_of(s - 1), (_META, s, 0, 0))
            self._meta.append((s, header))
        self._shaped_later.append((s, mb))

    def send_gradients(self, grads: list[torch.Tensor | None], s: int, mb: int) -> None:
        """SEND_B: the gradients of stage s's input leaves that carry one (`in_spec[s].grad_indices` order, None for an
        unused leaf) to the rank of stage s - 1.

        A structured input first sends, once per step, one flag per such leaf (1: the leaf was used), so the sender
        leaves unused outputs out of its backward exactly as one process would (their parameters keep no gradient).
        Every leaf is sent (zeros when unused), so the receiver knows the messages before any arrives.
        """
        spec, dst = self.in_spec[s], self.rank_of(s - 1)
        flags = [True] * len(spec.grad_indices)
        if spec.container != SINGLE and spec.grad_indices:
            if (flags := self._sent_flags.get(s)) is None:
                flags = self._sent_flags[s] = [g is not None for g in grads]
                self._send(torch.tensor(flags, dtype=torch.int64, device=self.device), dst)
        for i, g, flag in zip(spec.grad_indices, grads, flags, strict=True):
            leaf = spec.leaves[i]
            if not flag and g is not None:
                raise ValueError(f"Pipeline: stage {s} input{key_text(spec.container, leaf.key)} got a gradient "
                                 f"for microbatch {mb} but none for the first microbatch of the step; every "
                                 f"microbatch must use the same inputs")
            g = torch.zeros(leaf.shape, dtype=leaf.dtype, device=self.device) if g is None else g
            self._send(g.contiguous(), dst)

    def expect_gradients(self, s: int, mb: int, spec: Spec) -> None:
        """RECV_B: the gradients of stage s's output leaves (`spec`), preceded once per step by the flags of a
        structured output."""
        if spec.container != SINGLE and spec.grad_indices and s not in self._flags and s not in self._flag_bufs:
            buf = torch.zeros(len(spec.grad_indices), dtype=torch.int64, device=self.device)
            self._flag_bufs[s] = buf
            self._recv(buf, self.rank_of(s + 1), (_GRAD, s, self.m, 0))
        self._post_leaves(spec, spec.grad_indices, _GRAD, s, mb, s + 1)

    def _post_leaves(self, spec: Spec, indices: list[int], kind: int, s: int, mb: int, peer: int) -> None:
        for i in indices:
            leaf = spec.leaves[i]
            self._recv(torch.empty(leaf.shape, dtype=leaf.dtype, device=self.device), self.rank_of(peer),
                       (kind, s, mb, i))

    # ---- posting ---------------------------------------------------------------------------------------------------
    def post(self) -> None:
        """Post the batch built since the last post; where it received metadata, wait for it and post the shaped
        receives it announced in a second batch (the sender sent everything in its one batch)."""
        self._post_ops()
        if not self._meta:
            return
        meta, self._meta = self._meta, []
        later, self._shaped_later = self._shaped_later, []
        for s, header in meta:
            self._take((_META, s, 0))
            body = None
            if n := body_length(header):
                body = torch.zeros(n, dtype=torch.int64, device=self.device)
                self.comm.batch_isend_irecv([P2POp.recv(body, self.rank_of(s - 1))])[0].wait()
            self.in_spec[s] = decode(header, body)
        for s, mb in later:
            self._post_leaves(self.in_spec[s], self.in_spec[s].tensor_indices, _ACT, s, mb, s - 1)
        self._post_ops()

    def _post_ops(self) -> None:
        if not self._ops:
            return
        ops, keys, self._ops, self._keys = self._ops, self._keys, [], []
        for op, key, work in zip(ops, keys, self.comm.batch_isend_irecv(ops), strict=True):
            if key is None:
                self._sends.append((work, op.tensor))
            else:
                self._recvs.setdefault(key[:3], []).append((key[3], op.tensor, work))
        if len(self._sends) > 8:  # keep the list short; a sent buffer may be freed once its send completed
            self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]

    def _take(self, key: tuple[int, int, int]) -> list[tuple[int, torch.Tensor]]:
        if key not in self._recvs:
            raise RuntimeError(f"Pipeline: rank {self.comm.rank} consumes message {key} that no RECV posted")
        posted = self._recvs.pop(key)
        for _, _, work in posted:
            work.wait()
        return [(i, buf) for i, buf, _ in posted]

    # ---- consuming -------------------------------------------------------------------------------------------------
    def take_activation(self, s: int, mb: int) -> Any:
        """Wait for stage s's input of microbatch mb; return it rebuilt (None leaves included)."""
        got = self._take((_ACT, s, mb)) if self.in_spec[s].tensor_indices else []
        spec = self.in_spec[s]
        leaves: list[Any] = [None] * len(spec.leaves)
        for i, buf in got:
            leaves[i] = buf
        return unflatten(spec.container, spec.keys, leaves)

    def take_gradients(self, s: int, mb: int, spec: Spec) -> list[torch.Tensor | None]:
        """Wait for the gradients of stage s's output leaves, one per `spec.grad_indices` (None: the consumer did
        not use that leaf, so it carries no gradient)."""
        if s in self._flag_bufs:
            buf = self._flag_bufs.pop(s)
            self._take((_GRAD, s, self.m))
            self._flags[s] = [bool(f) for f in buf.tolist()]
        got = dict(self._take((_GRAD, s, mb))) if spec.grad_indices else {}
        flags = self._flags.get(s, [True] * len(spec.grad_indices))
        return [got[i] if flag else None for i, flag in zip(spec.grad_indices, flags)]

    def finish(self) -> None:
        """Wait for every send of the run."""
        for work, _ in self._sends:
            work.wait()
        self._sends = []
