"""torch.distributed's flat-tensor collectives under their current names, back to torch 2.4.

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
`reduce_scatter_single` (the old names warn); the torch backend and the shared-memory channel's handshake call
whichever this torch has. `abort_group` aborts a process group's communicators by the function torch has had since
2.5, or the group's own method before.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["all_gather_flat", "reduce_scatter_flat", "abort_group"]

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def abort_group(group: dist.ProcessGroup | None) -> None:
    """Abort `group`'s backend communicators (None: the default group)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        abort(group)
    else:  # older torch: the process group object itself
        (group or dist.distributed_c10d._get_default_group()).abort()
