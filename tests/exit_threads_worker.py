"""A `shardwise run` rank that leaves gloo's threads nothing to do at exit (tests/test_exit_threads.py).

Rank 0 and 1 share a sub-group (its own process group), every rank runs a large all-reduce (the shared-memory
channel) and a small one, and torch.distributed.nn.functional is first imported while the world exists, as torch
imports it lazily during training: its default arguments then hold the world group. A hook registered before
`sw.init` runs after init's own exit hook left the world and prints how many native (non-Python) threads remain:
gloo's workers and socket loop, unless every group was destroyed.
"""

import atexit
import os
import threading

import torch

import shardwise as sw


def _report() -> None:
    native = len(os.listdir("/proc/self/task")) - threading.active_count()
    print(f"native threads left at exit: {native}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)  # no intra-op pool threads
    atexit.register(_report)  # before init: atexit runs it after init's hook
    comm = sw.init()
    import torch.distributed.nn.functional  # noqa: F401,E402 - first imported with a live world

    pair = comm.split(0 if comm.rank < 2 else None)
    if pair is not None:
        pair.all_reduce(torch.ones(4))
    comm.all_reduce(torch.ones(512 * 512))
    comm.all_reduce(torch.ones(4))
