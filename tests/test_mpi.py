"""The MPI backend under mpirun: the shared comm checks, DDP / ZeRO-3 parity, hangs, failures, gloo bootstrap.

mpirun and a rank's `import torch` cost seconds, so each launch batches many checks: one launch per world size runs
the shared comm checks, MPI-specific dtype checks, recv_any and all_to_all (the bodies of tests/test_comm.py and
tests/test_all_to_all.py), DDP and ZeRO-3 training (and, with 2 ranks, tests/test_collective_check.py's all-reduce of
mismatched sizes, then gloo bootstrapped through MPI), and the tests below assert on its results. Open MPI and mpi4py
are part of the test set-up (`make test` installs them): when they are missing these tests fail, loudly, rather than
skip.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from collective_check_cases import sizes_differ
from comm_checks import check_collectives, check_point_to_point, check_split
from parity import assert_state_close, reference_state
from sharding_cases import train_sharded
from test_all_to_all import _check_exercise, _check_mismatches
from test_all_to_all import mpi_body as all_to_all_body
from test_comm import _parameter_server
from test_ddp import _grad_bytes, train_ddp

import shardwise as sw
from shardwise.comm import CommError, ReduceOp
from shardwise.launch.mpi import mpirun_command

SETUP_HINT = "run `make test` (it installs openmpi-bin, libopenmpi-dev and mpi4py) or install them by hand"
STEPS = 3  # of DDP and ZeRO-3 training, against one process


# ---- rank bodies (module level: the ranks import them by name) ---------------------------------------------------------
def check_mpi_dtypes(comm) -> None:
    """16-bit floats (moved as bits, reduced in float32), integers, bools, non-contiguous tensors, float64."""
    rank, size = comm.rank, comm.size
    for dtype in (torch.bfloat16, torch.float16):
        mine = (torch.arange(5, dtype=torch.float32) / 3 + rank).to(dtype)
        everyone = [(torch.arange(5, dtype=torch.float32) / 3 + r).to(dtype) for r in range(size)]
        out = torch.empty(5 * size, dtype=dtype)
        comm.all_gather(out, mine)
        assert torch.equal(out, torch.cat(everyone)), dtype  # bit-exact
        t = mine.clone()
        comm.all_reduce(t, ReduceOp.AVG)
        assert torch.equal(t, (torch.stack(everyone).float().sum(0) / size).to(dtype)), dtype
        full = torch.cat([mine] * size)
        chunk = torch.empty(5, dtype=dtype)
        comm.reduce_scatter(chunk, full, ReduceOp.SUM, async_op=True).wait()
        assert torch.equal(chunk, torch.stack(everyone).float().sum(0).to(dtype)), dtype
        b = mine.clone()
        comm.broadcast(b, src=size - 1)
        assert torch.equal(b, everyone[-1])
        if size > 1:
            got = torch.empty(5, dtype=dtype)
            send = comm.isend(mine, (rank + 1) % size, tag=7)
            comm.recv(got, (rank - 1) % size, tag=7)
            send.wait()
            assert torch.equal(got, everyone[(rank - 1) % size])
    t = torch.tensor([rank, -rank, 2**40 + rank], dtype=torch.int64)
    comm.all_reduce(t, ReduceOp.MAX)
    assert t.tolist() == [size - 1, 0, 2**40 + size - 1]
    flags = torch.tensor([rank == 0, False, True])
    comm.all_reduce(flags, ReduceOp.MAX)
    assert flags.tolist() == [True, False, True]
    base = torch.arange(12, dtype=torch.float64).view(3, 4) * (rank + 1)
    strided = base.t()  # not contiguous: reduced in a copy and written back
    comm.all_reduce(strided)
    assert torch.equal(base, torch.arange(12, dtype=torch.float64).view(3, 4) * (size * (size + 1) // 2))
    for bad, match in ((lambda: comm.isend(torch.ones(1), 0, tag=-1), "tag=-1"),
                       (lambda: comm.all_reduce(torch.ones(2, device="meta")), "meta")):
        try:
            bad()
        except ValueError as exc:
            assert match in str(exc), exc
        else:
            raise AssertionError(f"expected a ValueError mentioning {match}")


def progress_without_mpi_calls(comm) -> float | None:
    """Rank 0 starts an async all-reduce and sleeps without calling MPI; the others' blocking all-reduce must finish
    anyway, driven by rank 0's progress thread (Open MPI moves messages only inside MPI calls). Their wait time."""
    comm.barrier()
    t = torch.ones(1000)
    if comm.rank == 0:
        work = comm.all_reduce(t, async_op=True)
        time.sleep(1.0)
        work.wait()
        return None
    start = time.monotonic()
    comm.all_reduce(t)
    assert t[0].item() == comm.size
    return time.monotonic() - start


def _everything(comm, with_gloo: bool) -> dict:
    """One launch: the shared comm checks, MPI-only checks, recv_any, all_to_all, DDP and ZeRO-3 training; with 2
    ranks a mismatched all-reduce (caught here: the group stays usable) and gloo bootstrapped from MPI."""
    results = {"backend": comm.backend, "stats": check_collectives(comm)}
    check_point_to_point(comm)
    results["split"] = check_split(comm)
    check_mpi_dtypes(comm)
    results["progress_wait"] = progress_without_mpi_calls(comm)
    comm.barrier()  # the workers' staggered pushes start together
    results["recv_any"] = _parameter_server(comm)
    results["all_to_all"] = all_to_all_body(comm)
    results["ddp"] = train_ddp(comm, STEPS)
    results["zero3"] = train_sharded(comm, "zero3", STEPS)[0]
    if with_gloo:
        try:
            sizes_differ(comm)
            results["sizes_differ"] = None
        except CommError as exc:
            results["sizes_differ"] = str(exc)
        gloo = sw.init(backend="gloo", timeout=60)  # under mpirun: the store's address travels by MPI broadcast
        results["gloo"] = {"backend": gloo.backend, "rank": gloo.rank, "size": gloo.size,
                           "ddp": train_ddp(gloo, STEPS)[0]}
    return results


def _stop_participating(comm):
    if comm.rank == 0:
        time.sleep(120)  # alive, but never joins the all-reduce
        return "woke up"
    comm.all_reduce(torch.ones(1))


# ---- set-up ------------------------------------------------------------------------------------------------------------
def test_mpi_is_installed():
    assert shutil.which("mpirun"), f"mpirun is not on PATH: {SETUP_HINT}"
    assert importlib.util.find_spec("mpi4py"), f"mpi4py is not installed in {sys.prefix}: {SETUP_HINT}"


def test_init_mpi_refuses_a_torchrun_job(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="backend='mpi' needs a job started by mpirun"):
        sw.init(backend="mpi")


def test_init_mpi_without_launcher_is_a_world_of_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    comm = sw.init(backend="mpi")
    assert (comm.rank, comm.size) == (0, 1)


def test_mpi_launch_refuses_an_unpicklable_function():
    with pytest.raises(ValueError, match="module level"):
        sw.launch(lambda comm: None, 2, backend="mpi")


# ---- under mpirun ------------------------------------------------------------------------------------------------------
_LAUNCHES: dict[int, list] = {}


def _launch_everything(world: int) -> list:
    """One mpirun launch per world size, shared by every test that reads its results."""
    if world not in _LAUNCHES:
        start = time.monotonic()
        _LAUNCHES[world] = sw.launch(_everything, world, world == 2, backend="mpi", timeout=60)
        print(f"mpi launch of {world} ranks: {time.monotonic() - start:.1f}s")
    return _LAUNCHES[world]


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def run(request):
    return request.param, _launch_everything(request.param)


@pytest.fixture(scope="module")
def run_two_ranks():
    """The 2-rank launch, which also runs the gloo bootstrap."""
    return _launch_everything(2)


@pytest.fixture(scope="module")
def reference():
    """One process trained on the global batch (sharding_cases.reference() is the same recipe: computed once here)."""
    return reference_state(STEPS)


@pytest.mark.multiprocess
def test_mpi_passes_the_shared_comm_checks(run):
    world, results = run
    assert [r["backend"] for r in results] == ["mpi"] * world
    # The same operations on threads count the same calls and bytes.
    assert results[0]["stats"] == sw.launch(check_collectives, world)[0]
    assert [r["split"] for r in results] == sw.launch(check_split, world)


@pytest.mark.multiprocess
def test_mpi_async_operations_progress_while_the_issuer_computes(run):
    _, results = run
    waits = [r["progress_wait"] for r in results[1:]]
    assert max(waits) < 0.5, waits  # not the 1 s that rank 0 spent away from MPI


@pytest.mark.multiprocess
def test_mpi_recv_any_takes_messages_in_arrival_order(run):
    """The workers push to rank 0 in reverse rank order (tests/test_comm.py's parameter server)."""
    world, results = run
    assert [r["recv_any"] for r in results] == [list(range(world - 1, 0, -1))] + [[10.0 * r] * 2 for r in
                                                                                 range(1, world)]


@pytest.mark.multiprocess
def test_mpi_all_to_all_delivers_every_message_and_names_mismatches(run):
    world, results = run
    _check_exercise([r["all_to_all"] for r in results], world)
    _check_mismatches([r["all_to_all"]["mismatches"] for r in results])


@pytest.mark.multiprocess
def test_mpi_all_reduces_of_other_sizes_are_named(run_two_ranks):
    for text in (r["sizes_differ"] for r in run_two_ranks):
        assert text and "collectives do not match across the group [0, 1]" in text, text
        assert "rank 0 called all_reduce(op=SUM, numel=4) float32" in text, text
        assert "rank 1 called all_reduce(op=SUM, numel=6) float32" in text, text


@pytest.mark.multiprocess
def test_mpi_ddp_and_zero3_match_one_process(run, reference):
    world, results = run
    grad_bytes = _grad_bytes()
    for r in results:
        state, per_step = r["ddp"]
        assert_state_close(state, reference)
        assert all(step["all_reduce"]["wire_bytes"] == 2 * (world - 1) * grad_bytes // world for step in per_step)
        assert_state_close(r["zero3"], reference)


@pytest.mark.multiprocess
def test_gloo_bootstrapped_from_mpi_trains_ddp_to_parity(run_two_ranks, reference):
    results = run_two_ranks
    assert [(r["gloo"]["backend"], r["gloo"]["rank"], r["gloo"]["size"]) for r in results] == [("gloo", 0, 2),
                                                                                               ("gloo", 1, 2)]
    for r in results:
        assert_state_close(r["gloo"]["ddp"], reference)


@pytest.mark.multiprocess
def test_mpi_rank_that_stops_participating_raises_comm_error_and_aborts():
    """Rank 0 sleeps; rank 1's all_reduce raises CommError after 2 s; the failed rank aborts the job, which kills the
    sleeper long before it wakes, and LaunchError names rank 1 with its traceback."""
    start = time.monotonic()
    with pytest.raises(sw.LaunchError) as info:
        sw.launch(_stop_participating, 2, backend="mpi", timeout=2)
    assert time.monotonic() - start < 60  # the sleeper (120 s) was killed by the abort
    message = str(info.value)
    assert info.value.rank == 1 and "CommError" in message
    assert "all_reduce(op=SUM, numel=1) timed out after 2s on rank 1, waiting for rank(s) [0]: rank 0 did not " \
           "answer" in message
    assert "mpirun exited with code" in message and "exited with code 0" not in message
    assert "_stop_participating" in info.value.remote_traceback


@pytest.mark.multiprocess
def test_mpirun_script_with_a_silent_peer_exits_non_zero(tmp_path):
    """A plain script under mpirun: the uncaught CommError aborts the job, so mpirun ends early and non-zero."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import time, torch, shardwise as sw
        comm = sw.init(backend="mpi", timeout=2)
        assert comm.backend == "mpi" and comm.size == 2
        if comm.rank == 1:
            time.sleep(120)
        comm.recv(torch.empty(3), src=1)
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    start = time.monotonic()
    proc = subprocess.run([*mpirun_command(2), sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=150)
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert elapsed < 60, output
    assert "CommError: recv(src=1, tag=0) timed out after 2s on rank 0, waiting for rank(s) [1]" in output, output
    assert "aborting the MPI job" in output, output
