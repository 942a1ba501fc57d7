"""Every process group this process created is destroyed as its world is left, not when the interpreter finalizes.

Why. A gloo worker thread that drops the last reference to a finished Work frees the Work's tensors, which takes the
GIL; in an interpreter that is already finalizing, taking the GIL ends the thread by a forced unwind, which the
Work's noexcept destructor turns into std::terminate: "terminate called without an active exception", SIGABRT after
a job that succeeded (pytorch#190489; about 1 run in 40 of examples/train.py on 2 gloo ranks of a loaded 2-core
machine, rank 0 aborting in ``ProcessGroupGloo::AsyncWork::~AsyncWork`` on a worker thread). torch's
``destroy_process_group`` forgets its groups but does not stop gloo's threads; a group's destructor does, joining
them with the GIL released (pytorch#154976), once nothing references the group. The world group has no other
holder; the sub-groups live in the communicators split from it, their caches, the gloo ring and the shared-memory
barrier. So every TorchCommunicator registers here when made, and `release_process_groups` (run by
rendezvous.leave_world after destroy_process_group, at exit or before an elastic world is joined) has each drop its
groups (`TorchCommunicator.release_groups`) and collects the cycles that held any. One more holder is torch's own:
``torch.distributed.nn.functional`` defines ``broadcast(tensor, src, group=group.WORLD)`` and five more, so when it is
first imported after the world exists (torch imports it lazily during training) their default arguments keep the
world group alive after ``destroy_process_group`` (train.py's rank then still ran gloo's three threads at exit); such
defaults are reset to None, torch's "the default group", which is also right for an elastic world joined later.
"""

from __future__ import annotations

import gc
import sys
import types
import weakref
from typing import Any

import torch.distributed as dist

__all__ = ["track", "release_process_groups"]

_LIVE: weakref.WeakSet = weakref.WeakSet()  # every TorchCommunicator of this process


def track(comm: Any) -> None:
    """Register a communicator whose groups `release_process_groups` drops."""
    _LIVE.add(comm)


def release_process_groups() -> None:
    """Have every registered communicator drop its process groups, then collect the cycles that held any: each group
    is destroyed, its threads joined, now (module docstring)."""
    for comm in list(_LIVE):
        comm.release_groups()
    _reset_captured_defaults()
    gc.collect()


def _reset_captured_defaults() -> None:
    """Default arguments of torch.distributed's functions that hold a process group (module docstring) become None."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed") or module is None:
            continue
        for fn in list(vars(module).values()):
            defaults = getattr(fn, "__defaults__", None) if isinstance(fn, types.FunctionType) else None
            if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
                fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)
