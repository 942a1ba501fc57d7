"""CPU offload levels of the sharding engine: which model states live in host memory.

The levels follow the systems that made offload practical:

* ``"optimizer"`` (ZeRO-Offload, Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", ATC 2021;
  DeepSpeed's ``offload_optimizer``): the fp32 master shards, their gradients and therefore the optimizer state live
  on the host, and the optimizer steps there. The compute copies stay on the device: ZeRO-1/2 keep the whole
  parameters there (as without offload); ZeRO-3 keeps a device-resident shard in the compute dtype, refreshed from
  the master once per optimizer step, so each all-gather reads device memory (one host-to-device copy per step,
  not per gather).
* ``"full"`` (PyTorch FSDP's ``CPUOffload(offload_params=True)``; DeepSpeed's ``offload_param`` +
  ``offload_optimizer``): additionally, nothing of the parameters stays on the device between uses. ZeRO-3 copies the
  host master to the device at each gather and frees it after; ZeRO-1/2 hold the whole parameters on the device by
  definition of those stages (DeepSpeed allows ``offload_param`` with stage 3 only), so for them "full" places
  exactly what "optimizer" places.
* ``True`` means ``"full"`` (the behaviour before the levels existed); ``False`` / ``None`` / ``"none"``: nothing is
  offloaded.

Gradients reach the host as a copy of the reduced shard in every offloaded level, so a CPU-only run places the
tensors exactly as a GPU run does and `memory_stats().host` counts the same bytes.
"""

from __future__ import annotations

__all__ = ["OFFLOAD_LEVELS", "offload_level"]

#: The values `cpu_offload=` accepts, normalised by `offload_level`.
OFFLOAD_LEVELS = ("none", "optimizer", "full")


def offload_level(value: object) -> str:
    """Normalise a `cpu_offload=` argument to one of OFFLOAD_LEVELS, or raise naming what is allowed."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "full"
    if isinstance(value, str) and value in OFFLOAD_LEVELS:
        return value
    raise ValueError(f"cpu_offload={value!r} is not an offload level; allowed False/None (nothing), "
                     f"'optimizer' (master shards, gradients and optimizer state on the host), "
                     f"'full' (also no parameters kept on the device), or True (= 'full')")
