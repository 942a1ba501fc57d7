"""What the ranks of a job have to plan with: device memory per rank and ranks per node, agreed by all ranks.

Each rank reports its host name and the memory it may use: on CUDA the free bytes of its device
(`torch.cuda.mem_get_info`); on the CPU the host's available memory (MemAvailable in /proc/meminfo) divided by the
ranks that share the host, found by counting equal host names. The plan uses the smallest memory of any rank (the
tightest rank decides what fits) and the largest count of ranks on one host as the ranks per node.
"""

from __future__ import annotations

import dataclasses
import os
import socket

import torch

from ..comm.base import Communicator
from ..comm.objects import all_gather_json

__all__ = ["Machine", "probe", "available_ram"]


@dataclasses.dataclass(frozen=True)
class Machine:
    """memory: bytes per rank (None: unknown); devices_per_node: ranks on the busiest host; device: "cuda" or
    "cpu"; source: where the memory figure came from (for explain())."""

    memory: float | None
    devices_per_node: int
    device: str
    source: str


def available_ram() -> int | None:
    """Bytes of memory this host can still give out (MemAvailable), or None when the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def probe(comm: Communicator, memory_gb: float | None = None) -> Machine:
    """Every rank's host and memory, gathered (collective over `comm`). memory_gb: the memory per rank to plan for,
    in GB of 10^9 bytes, instead of what the devices report."""
    device = getattr(comm, "device", torch.device("cpu"))
    kind = "cuda" if device.type == "cuda" else "cpu"
    if memory_gb is not None:
        mine, source = memory_gb * 1e9, "memory_gb"
    elif kind == "cuda":
        mine, source = float(torch.cuda.mem_get_info(device)[0]), "torch.cuda.mem_get_info (free)"
    else:
        ram = available_ram()
        mine, source = (None if ram is None else float(ram)), "available RAM / ranks on the host"
    reports = all_gather_json(comm, {"host": socket.gethostname(), "memory": mine})
    per_host: dict[str, int] = {}
    for r in reports:
        per_host[r["host"]] = per_host.get(r["host"], 0) + 1
    memories = []
    for r in reports:
        if r["memory"] is None:
            continue
        # CPU memory is the host's to share among its ranks; a device's (or memory_gb) is the rank's own.
        share = per_host[r["host"]] if kind == "cpu" and memory_gb is None else 1
        memories.append(r["memory"] / share)
    memory = min(memories) if len(memories) == len(reports) else None
    return Machine(memory, max(per_host.values()), kind, source)
