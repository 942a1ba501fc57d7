"""Where this process sits in a job: rank, world size, local rank and rendezvous address, read from the launcher.

Launchers announce a process's place through environment variables, each family its own way:

* torchrun / torch.distributed.run: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
* Open MPI's mpirun: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK (and _LOCAL_SIZE).
* PMI (MPICH, Intel MPI, Hydra): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID (and MPI_LOCALNRANKS).
* Slurm's srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_NODELIST / SLURM_JOB_NODELIST, SLURM_JOB_ID.

`detect_environment()` reads them (first match in that order) into one `LaunchEnvironment`. MPI and Slurm do not
name a rendezvous address for torch.distributed: MASTER_ADDR / MASTER_PORT win when set; otherwise a job whose ranks
*provably* all live on this node (the launcher's local size equals the world size) uses 127.0.0.1, a job inside a
Slurm allocation (srun, or mpirun / Hydra started in one) uses the first host of the step's node list
(SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST / SLURM_NODELIST, compressed forms such as `gpu[01-04,07]` expanded as
Slurm does), and the port defaults to 29500 (Slurm: derived from the job id so that two jobs sharing a node do not
collide). A launcher that does not say how many ranks share this node (PMI without MPI_LOCALNRANKS) is never assumed
to be a one-node job: without MASTER_ADDR or a node list the address is unknown (None) and `init()` asks for it.

GPUs. `cuda_device_index()` picks this rank's GPU among the ones it can see: the local rank's, or, when the launcher
bound GPUs per task (srun --gpus-per-task / --gpu-bind, or a CUDA_VISIBLE_DEVICES narrowed per rank, so that every
task sees only its own GPUs and the local rank is beyond the visible count), the first visible one.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

__all__ = ["LaunchEnvironment", "cuda_device_index", "detect_environment", "expand_slurm_hostlist", "first_slurm_host"]

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


_MAX_HOSTS = 1_000_000  # a node list that expands beyond this is a typo, not a cluster


def _split_top_level(text: str) -> list[str]:
    """Split a hostlist at the commas that are not inside brackets: 'a[1,2],b' -> ['a[1,2]', 'b']."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"cannot read the Slurm node list {text!r}: ']' without '['")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"cannot read the Slurm node list {text!r}: '[' without ']'")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_range(text: str, nodelist: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7']: zero padding kept from the range's lower bound, as Slurm does."""
    out = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"cannot read the Slurm node list {nodelist!r}: {part!r} is not a number or a range")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"cannot read the Slurm node list {nodelist!r}: range {part!r} runs backwards")
        if int(hi) - int(lo) >= _MAX_HOSTS:
            raise ValueError(f"the Slurm node list {nodelist!r} expands to more than {_MAX_HOSTS} hosts")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def expand_slurm_hostlist(nodelist: str) -> list[str]:
    """Every host of a Slurm hostlist, in Slurm's order (what `scontrol show hostnames` prints).

    'gpu[003-005,9],cpu1' -> ['gpu003', 'gpu004', 'gpu005', 'gpu9', 'cpu1']; several bracket groups in one name
    expand as a product, leftmost slowest: 'rack[1-2]-n[1-2]' -> ['rack1-n1', 'rack1-n2', 'rack2-n1', 'rack2-n2'].
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        names = [""]
        for text, ranges in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", item):
            if not text and not ranges:
                continue
            names = [name + text for name in names]
            if ranges:
                names = [name + n for name in names for n in _expand_range(ranges, nodelist)]
            if len(hosts) + len(names) > _MAX_HOSTS:
                raise ValueError(f"the Slurm node list {nodelist!r} expands to more than {_MAX_HOSTS} hosts")
        hosts.extend(names)
    if not hosts:
        raise ValueError(f"cannot read the Slurm node list {nodelist!r}: it names no host")
    return hosts


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm hostlist: 'gpu[003-005,9],cpu1' -> 'gpu003'; 'node7' -> 'node7'."""
    return expand_slurm_hostlist(nodelist)[0]


def _slurm_nodelist(env: Mapping[str, str]) -> str | None:
    """The step's node list (the nodes this job step runs on), else the allocation's."""
    return env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")


def _mpi_address(env: Mapping[str, str], addr: str | None, local_size: int | None, size: int) -> str | None:
    """Where rank 0 of an MPI-launched job listens: MASTER_ADDR; loopback only when the launcher says every rank is on
    this node; the first node of the Slurm allocation the job runs in; else unknown (None)."""
    if addr:
        return addr
    if local_size is not None and local_size == size:
        return "127.0.0.1"
    nodelist = _slurm_nodelist(env)
    return first_slurm_host(nodelist) if nodelist else None


def cuda_device_index(local_rank: int, device_count: int, environ: Mapping[str, str] | None = None) -> int:
    """The index, among the GPUs this process sees, of the one this rank uses.

    `local_rank` when it is a visible GPU (torchrun, mpirun, srun with every GPU of the node visible to every task).
    When the launcher bound GPUs per task, every task sees only its own, and numbering restarts at 0 in each: one
    visible GPU is the rank's own (srun --gpus-per-task=1, --gpu-bind=single:1, a per-rank CUDA_VISIBLE_DEVICES);
    with several visible and a local rank beyond them, the binding is per task (SLURM_GPUS_PER_TASK or
    CUDA_VISIBLE_DEVICES set) and the rank takes the first. Anything else is an error naming the numbers, never a
    silent second rank on one GPU.
    """
    env = os.environ if environ is None else environ
    if device_count < 1:
        raise ValueError(f"NCCL needs a GPU but this process sees none (CUDA_VISIBLE_DEVICES="
                         f"{env.get('CUDA_VISIBLE_DEVICES')!r}); use backend='gloo' on CPU")
    if device_count == 1:
        return 0
    if 0 <= local_rank < device_count:
        return local_rank
    if env.get("SLURM_GPUS_PER_TASK") or env.get("CUDA_VISIBLE_DEVICES"):
        return 0
    raise ValueError(
        f"local rank {local_rank} has no GPU of its own: this process sees {device_count} GPUs (0..{device_count - 1}) "
        f"and no per-task binding; start at most {device_count} ranks per node, or bind one GPU per task "
        f"(srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES per rank)"
    )


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
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") if "OMPI_COMM_WORLD_LOCAL_SIZE" in env else None
        found = LaunchEnvironment(
            "openmpi",
            _int(env, "OMPI_COMM_WORLD_RANK"),
            size,
            _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", _int(env, "SLURM_LOCALID", 0)),
            _mpi_address(env, addr, local_size, size),
            port or DEFAULT_PORT,
        )
    elif "PMI_RANK" in env:
        size = _int(env, "PMI_SIZE")
        # Hydra (MPICH, Intel MPI) says how many ranks share this node in MPI_LOCALNRANKS; a PMI launcher that does
        # not (srun --mpi=pmi2, older Hydra) may be spreading the job over many nodes: never assume one.
        local_size = _int(env, "MPI_LOCALNRANKS") if "MPI_LOCALNRANKS" in env else None
        found = LaunchEnvironment(
            "pmi",
            _int(env, "PMI_RANK"),
            size,
            _int(env, "MPI_LOCALRANKID", _int(env, "SLURM_LOCALID", 0)),
            _mpi_address(env, addr, local_size, size),
            port or DEFAULT_PORT,
        )
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = _slurm_nodelist(env)
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
