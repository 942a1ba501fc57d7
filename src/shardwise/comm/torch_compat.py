"""torch.distributed's flat-tensor collectives under their current names, back to torch 2.4.

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
`reduce_scatter_single` (the old names warn); the torch backend and the shared-memory channel's handshake call
whichever this torch has.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["all_gather_flat", "reduce_scatter_flat"]

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
