"""Where this process sits in a job: rank, world size, local rank and rendezvous address, read from the launcher.

Launchers announce a process's place through environment variables, each family its own way:

* torchrun / torch.distributed.run: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
* Open MPI's mpirun: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK (and _LOCAL_SIZE).
* PMI (MPICH, Intel MPI, Hydra): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID (and MPI_LOCALNRANKS).
* Slurm's srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_NODELIST / SLURM_JOB_NODELIST, SLURM_JOB_ID.

`detect_environment()` reads them (first match in that order) into one `LaunchEnvironment`. MPI and Slurm do not
name a rendezvous address for torch.distributed: MASTER_ADDR / MASTER_PORT win when set; otherwise a job whose ranks
all live on this node uses 127.0.0.1, Slurm uses the first node of the step's node list, and the port defaults to
29500 (Slurm: derived from the job id so that two jobs sharing a node do not collide).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

__all__ = ["LaunchEnvironment", "detect_environment", "first_slurm_host"]

DEFAULT_PORT = 29500


@dataclasses.dataclass(frozen=True)
class LaunchEnvironment:
    """This process's place in the job.

    source: which launcher family was found: "torchrun", "openmpi", "pmi", "slurm", or "none" (a world of one).
    rank / world_size / local_rank: as the launcher numbered them.
    master_addr / master_port: where rank 0 hosts the rendezvous store; None when the launcher gives no way to know.
    """

    source: str
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm hostlist: 'gpu[003-005,9],cpu1' -> 'gpu003'; 'node7' -> 'node7'."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot read the Slurm node list {nodelist!r}")
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def detect_environment(environ: Mapping[str, str] | None = None) -> LaunchEnvironment:
    """Read the launcher's variables from `environ` (default os.environ). See the module docstring for the rules."""
    env = os.environ if environ is None else environ
    addr = env.get("MASTER_ADDR")
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None

    if "RANK" in env and "WORLD_SIZE" in env:
        found = LaunchEnvironment(
            "torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK", 0), addr, port
        )
    elif "OMPI_COMM_WORLD_RANK" in env:
        size = _int(env, "OMPI_COMM_WORLD_SIZE")
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", size)
        found = LaunchEnvironment(
            "openmpi",
            _int(env, "OMPI_COMM_WORLD_RANK"),
            size,
            _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
            addr or ("127.0.0.1" if local_size == size else None),
            port or DEFAULT_PORT,
        )
    elif "PMI_RANK" in env:
        size = _int(env, "PMI_SIZE")
        local_size = _int(env, "MPI_LOCALNRANKS", size)
        found = LaunchEnvironment(
            "pmi",
            _int(env, "PMI_RANK"),
            size,
            _int(env, "MPI_LOCALRANKID", 0),
            addr or ("127.0.0.1" if local_size == size else None),
            port or DEFAULT_PORT,
        )
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if addr is None and nodelist:
            addr = first_slurm_host(nodelist)
        if port is None:
            port = 10000 + _int(env, "SLURM_JOB_ID", DEFAULT_PORT - 10000) % 20000
        found = LaunchEnvironment(
            "slurm", _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"), _int(env, "SLURM_LOCALID", 0), addr, port
        )
    else:
        found = LaunchEnvironment("none", 0, 1, 0, addr, port)

    if found.world_size < 1 or not 0 <= found.rank < found.world_size:
        raise ValueError(
            f"{found.source} environment gives rank {found.rank} in a world of {found.world_size}; "
            f"the rank must be in 0..world_size-1"
        )
    if found.master_port is not None and not 0 < found.master_port < 65536:
        raise ValueError(f"MASTER_PORT={found.master_port} is not a TCP port (1..65535)")
    return found
