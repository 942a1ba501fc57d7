"""What init() would use on a cluster: rank, world, rendezvous address and GPU, read from launcher environments.

No cluster runs here: each test feeds the variables a launcher sets (torchrun, srun, Open MPI, Hydra/PMI, mpirun
inside a Slurm allocation) and checks what `detect_environment` and `cuda_device_index` make of them.
"""

from __future__ import annotations

import pytest

from shardwise.launch.environment import (
    cuda_device_index,
    detect_environment,
    expand_slurm_hostlist,
    first_slurm_host,
)


# ---- Slurm host lists ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nodelist, hosts", [
    ("node7", ["node7"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu[003-005,9],cpu1", ["gpu003", "gpu004", "gpu005", "gpu9", "cpu1"]),
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("node-[1-2].cluster", ["node-1.cluster", "node-2.cluster"]),
])
def test_slurm_hostlist_expands_as_scontrol_does(nodelist, hosts):
    assert expand_slurm_hostlist(nodelist) == hosts
    assert first_slurm_host(nodelist) == hosts[0]


@pytest.mark.parametrize("nodelist, match", [
    ("node[1-", "'\\[' without '\\]'"),
    ("node]1", "without '\\['"),
    ("node[b-c]", "not a number or a range"),
    ("node[5-2]", "runs backwards"),
    ("", "names no host"),
    ("n[0-99999999]", "more than"),
])
def test_bad_hostlist_is_a_clear_error(nodelist, match):
    with pytest.raises(ValueError, match=match):
        expand_slurm_hostlist(nodelist)


# ---- srun ---------------------------------------------------------------------------------------------------------
def _srun(procid: int, localid: int, **extra: str) -> dict[str, str]:
    return {"SLURM_PROCID": str(procid), "SLURM_NTASKS": "8", "SLURM_LOCALID": str(localid),
            "SLURM_JOB_ID": "4242", **extra}


def test_two_node_srun_rendezvous_at_the_first_node_of_the_step():
    env = detect_environment(_srun(5, 1, SLURM_STEP_NODELIST="gpu[07-08]", SLURM_JOB_NODELIST="gpu[01-08]"))
    assert (env.source, env.rank, env.world_size, env.local_rank) == ("slurm", 5, 8, 1)
    assert env.master_addr == "gpu07"  # the step's first node, not the allocation's
    assert env.master_port == 10000 + 4242 % 20000


def test_srun_falls_back_to_the_job_nodelist_and_master_addr_wins():
    assert detect_environment(_srun(0, 0, SLURM_JOB_NODELIST="c[3,5]")).master_addr == "c3"
    assert detect_environment(_srun(0, 0, SLURM_NODELIST="d9")).master_addr == "d9"
    env = detect_environment(_srun(0, 0, SLURM_STEP_NODELIST="c[3,5]", MASTER_ADDR="head", MASTER_PORT="29600"))
    assert (env.master_addr, env.master_port) == ("head", 29600)


# ---- MPI launchers across nodes -----------------------------------------------------------------------------------
def test_pmi_without_local_size_is_not_assumed_to_be_one_node():
    """The issue's bug: PMI without MPI_LOCALNRANKS handed out 127.0.0.1, so ranks on other nodes dialled their own
    loopback. Unknown locality is an unknown address (init then asks for MASTER_ADDR, or bootstraps over MPI)."""
    env = detect_environment({"PMI_RANK": "3", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1"})
    assert env.master_addr is None
    assert env.local_rank == 1


def test_pmi_on_one_node_uses_loopback_only_when_the_launcher_says_so():
    env = detect_environment({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"})
    assert env.master_addr == "127.0.0.1"
    env = detect_environment({"PMI_RANK": "2", "PMI_SIZE": "8", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"})
    assert env.master_addr is None


def test_mpi_launched_inside_a_slurm_allocation_uses_its_first_node():
    env = detect_environment({"PMI_RANK": "6", "PMI_SIZE": "8", "SLURM_JOB_NODELIST": "node[01-04,07]",
                              "SLURM_LOCALID": "2"})
    assert (env.source, env.master_addr, env.local_rank) == ("pmi", "node01", 2)
    env = detect_environment({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
                              "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                              "SLURM_JOB_NODELIST": "node[01-02]"})
    assert (env.source, env.master_addr, env.local_rank) == ("openmpi", "node01", 1)


def test_open_mpi_without_local_size_is_not_assumed_to_be_one_node():
    env = detect_environment({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"})
    assert env.master_addr is None


def test_torchrun_multi_node_keeps_its_own_address():
    env = detect_environment({"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "MASTER_ADDR": "node01",
                              "MASTER_PORT": "29500", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
                              "SLURM_STEP_NODELIST": "node[01-02]"})
    assert (env.source, env.rank, env.local_rank, env.master_addr) == ("torchrun", 9, 1, "node01")


# ---- which GPU ----------------------------------------------------------------------------------------------------
def test_every_gpu_visible_uses_the_local_rank():
    assert [cuda_device_index(r, 8, {}) for r in range(8)] == list(range(8))


def test_srun_with_one_gpu_bound_per_task_uses_the_visible_one():
    """srun --gpus-per-task=1: task 3 sees one GPU (its own, renumbered 0): set_device(3) would fail."""
    assert cuda_device_index(3, 1, {"CUDA_VISIBLE_DEVICES": "3", "SLURM_LOCALID": "3"}) == 0
    assert cuda_device_index(5, 1, {}) == 0


def test_per_task_binding_of_several_gpus_takes_the_first():
    assert cuda_device_index(3, 2, {"SLURM_GPUS_PER_TASK": "2"}) == 0
    assert cuda_device_index(2, 2, {"CUDA_VISIBLE_DEVICES": "4,5"}) == 0
    assert cuda_device_index(1, 2, {"CUDA_VISIBLE_DEVICES": "4,5"}) == 1  # within range: the local rank's


def test_more_local_ranks_than_gpus_is_a_clear_error():
    with pytest.raises(ValueError, match=r"local rank 4 has no GPU of its own: this process sees 4 GPUs"):
        cuda_device_index(4, 4, {})
    with pytest.raises(ValueError, match="sees none"):
        cuda_device_index(0, 0, {})


# ---- what init() does with it -------------------------------------------------------------------------------------
class _Recorder:
    def __init__(self):
        self.calls: list[tuple] = []


@pytest.fixture
def fake_nccl_node(monkeypatch):
    """A CUDA node with `visible` GPUs, as far as init() can tell; rendezvous and the process group are recorded."""
    import torch

    from shardwise.comm import rendezvous

    rec = _Recorder()
    state = {"visible": 1}
    monkeypatch.setattr(rendezvous, "world_initialized", lambda: False)
    monkeypatch.setattr(rendezvous, "distributed_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state["visible"])
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: rec.calls.append(("set_device", index)))
    monkeypatch.setattr(rendezvous, "rank_zero_store",
                        lambda addr, port, rank, timeout: rec.calls.append(("store", addr, port, rank)) or "store")
    monkeypatch.setattr(rendezvous, "join_world", lambda backend, rank, size, timeout, **kw: rec.calls.append(
        ("join", backend, rank, size, timeout, kw["backend_timeout"])) or "comm")
    for name in list(__import__("os").environ):
        if name.startswith(("SLURM_", "OMPI_", "PMI_", "MPI_LOCAL")) or name in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
                "SHARDWISE_JOB_TOKEN", "TORCHELASTIC_USE_AGENT_STORE", "SHARDWISE_BACKEND"):
            monkeypatch.delenv(name)
    return rec, state, monkeypatch


def test_init_under_srun_with_one_gpu_per_task(fake_nccl_node):
    import shardwise as sw

    rec, state, monkeypatch = fake_nccl_node
    for name, value in _srun(7, 3, SLURM_STEP_NODELIST="gpu[07-08]", CUDA_VISIBLE_DEVICES="3").items():
        monkeypatch.setenv(name, value)
    assert sw.init(timeout=30) == "comm"
    assert rec.calls == [("set_device", 0), ("store", "gpu07", 10000 + 4242 % 20000, 7),
                         ("join", "nccl", 7, 8, 30, 1800.0)]


def test_init_under_torchrun_on_a_full_node(fake_nccl_node):
    import shardwise as sw

    rec, state, monkeypatch = fake_nccl_node
    state["visible"] = 8
    for name, value in {"RANK": "13", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "MASTER_ADDR": "node01",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    sw.init(nccl_timeout=900)
    assert rec.calls[0] == ("set_device", 5)
    assert rec.calls[-1] == ("join", "nccl", 13, 16, 60.0, 900)


def test_init_rejects_an_nccl_timeout_below_shardwise_s(fake_nccl_node):
    import shardwise as sw

    with pytest.raises(ValueError, match=r"nccl_timeout=10 must be a number of seconds >= timeout=60"):
        sw.init(nccl_timeout=10)
