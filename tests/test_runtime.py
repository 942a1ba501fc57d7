"""init() environment detection, launch() on threads and processes, rank-tagged logging."""

from __future__ import annotations

import multiprocessing
import sys

import pytest
import torch

import shardwise as sw
from shardwise.launch.environment import detect_environment, first_slurm_host


def test_torchrun_environment():
    env = detect_environment(
        {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400"}
    )
    assert (env.source, env.rank, env.world_size, env.local_rank) == ("torchrun", 3, 8, 1)
    assert (env.master_addr, env.master_port) == ("10.1.2.3", 29400)


def test_open_mpi_environment_on_one_node_uses_loopback():
    env = detect_environment(
        {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
         "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    )
    assert (env.source, env.rank, env.world_size, env.local_rank) == ("openmpi", 1, 4, 1)
    assert (env.master_addr, env.master_port) == ("127.0.0.1", 29500)


def test_open_mpi_across_nodes_needs_master_addr():
    env = detect_environment(
        {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    )
    assert env.master_addr is None
    env = detect_environment(
        {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
         "MASTER_ADDR": "node1", "MASTER_PORT": "1234"}
    )
    assert (env.master_addr, env.master_port) == ("node1", 1234)


def test_pmi_environment():
    env = detect_environment({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3"})
    assert (env.source, env.rank, env.world_size, env.local_rank, env.master_addr) == ("pmi", 2, 3, 2, "127.0.0.1")
    # Without MPI_LOCALNRANKS the job may span nodes: no loopback address (tests/test_cluster_env.py has more).
    assert detect_environment({"PMI_RANK": "2", "PMI_SIZE": "3"}).master_addr is None


def test_slurm_environment():
    env = detect_environment(
        {"SLURM_PROCID": "6", "SLURM_NTASKS": "16", "SLURM_LOCALID": "2", "SLURM_STEP_NODELIST": "gpu[003-006,9]",
         "SLURM_JOB_ID": "123456"}
    )
    assert (env.source, env.rank, env.world_size, env.local_rank) == ("slurm", 6, 16, 2)
    assert env.master_addr == "gpu003"
    assert env.master_port == 10000 + 123456 % 20000


def test_torchrun_variables_win_over_slurm():
    env = detect_environment({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "5", "SLURM_NTASKS": "8"})
    assert env.source == "torchrun"


def test_no_launcher_is_a_world_of_one():
    env = detect_environment({})
    assert (env.source, env.rank, env.world_size) == ("none", 0, 1)


@pytest.mark.parametrize("nodelist, host", [("node7", "node7"), ("a[10-12],b1", "a10"), ("x[5]", "x5")])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


@pytest.mark.parametrize(
    "environ, match",
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, "rank 4 in a world of 4"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x' is not an integer"),
        ({"PMI_RANK": "0"}, "PMI_SIZE is not set"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "not a TCP port"),
    ],
)
def test_bad_environment_is_a_clear_error(environ, match):
    with pytest.raises(ValueError, match=match):
        detect_environment(environ)


def test_init_without_launcher_gives_world_of_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    comm = sw.init()
    assert (comm.rank, comm.size) == (0, 1)
    t = torch.ones(3)
    comm.all_reduce(t, sw.ReduceOp.AVG)
    assert t.tolist() == [1.0, 1.0, 1.0]


def test_init_rejects_unknown_backend():
    with pytest.raises(ValueError, match="backend='carrier-pigeon' is not supported"):
        sw.init(backend="carrier-pigeon")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"world_size": 0}, "world_size=0"),
        ({"world_size": 2, "backend": "mpi-ish"}, "backend='mpi-ish'"),
        ({"world_size": 2, "timeout": 0}, "timeout=0"),
    ],
)
def test_launch_validates_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sw.launch(lambda comm: None, **kwargs)


def test_launch_passes_args_and_returns_results_in_rank_order():
    assert sw.launch(lambda comm, a, b: (comm.rank, a + b), 3, 1, 2) == [(0, 3), (1, 3), (2, 3)]


def test_gloo_launch_refuses_an_unpicklable_function():
    with pytest.raises(ValueError, match="module level"):
        sw.launch(lambda comm: None, 2, backend="gloo")


def test_log_lines_carry_the_rank(capsys):
    def body(comm):
        sw.get_logger("shardwise.test").warning("hello from %d", comm.rank)

    sw.launch(body, 2)
    err = capsys.readouterr().err
    assert "[rank 0] WARNING shardwise.test: hello from 0" in err
    assert "[rank 1] WARNING shardwise.test: hello from 1" in err


def _fail_on_rank_one(comm):
    if comm.rank == 1:
        raise KeyError("rank one fails on purpose")
    comm.barrier()
    return comm.rank


def _return_tensors(comm):
    t = torch.full((3,), float(comm.rank))
    comm.all_reduce(t)
    return {"rank": comm.rank, "sum": t, "backend": comm.backend}


@pytest.mark.multiprocess
def test_gloo_launch_returns_copies_and_reports_failures():
    results = sw.launch(_return_tensors, 2, backend="gloo", timeout=30)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(torch.equal(r["sum"], torch.ones(3)) and r["backend"] == "gloo" for r in results)
    with pytest.raises(sw.LaunchError) as info:
        sw.launch(_fail_on_rank_one, 2, backend="gloo", timeout=30)
    assert info.value.rank == 1
    assert "rank one fails on purpose" in str(info.value) and "_fail_on_rank_one" in info.value.remote_traceback


def _what_was_imported(comm):
    return {name: name in sys.modules for name in ("shardwise", "torch._dynamo")}


@pytest.mark.multiprocess
@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="ranks are spawned here")
def test_gloo_ranks_start_with_what_every_rank_imports_already_imported():
    """Ranks are forks of a fork server that imported shardwise and torch._dynamo (which any torch optimizer's
    construction imports) once: a rank starts in a fraction of a second instead of importing them again (seconds)."""
    assert sw.launch(_what_was_imported, 2, backend="gloo", timeout=30) == [
        {"shardwise": True, "torch._dynamo": True}] * 2


def test_a_rank_that_cannot_start_raises_its_own_error(monkeypatch):
    """When starting a rank's process fails (e.g. a script without a `__main__` guard under spawn), launch raises
    that error, not multiprocessing's assertion about reaping a child that never started."""
    import multiprocessing.context

    def refuse(self):
        raise RuntimeError("cannot start: no __main__ guard")

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", refuse)
    if hasattr(multiprocessing.context, "ForkServerProcess"):  # launch forks its ranks from the fork server there
        monkeypatch.setattr(multiprocessing.context.ForkServerProcess, "start", refuse)
    with pytest.raises(RuntimeError, match="no __main__ guard"):
        sw.launch(_return_tensors, 2, backend="gloo", timeout=30)
