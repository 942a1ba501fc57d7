"""Elastic training on gloo processes (issue 17's acceptance): 4 workers train the demo GPT (tiny preset) with DDP
or ZeRO-2 through sw.elastic.run; one is SIGKILLed at a seeded step, the 3 survivors continue in process (a new
membership epoch, a fresh gloo world, the state resharded from their commits), a new worker joins and the 4 finish.
The final parameters equal one process trained on the same global batches in the same sample order; every step is
applied exactly once. Below min_workers the survivors stop with a clear error within the configured wait.

ZeRO-3 with neighbour redundancy (the parameters themselves sharded) does the same with no checkpoint to read.

Each worker is tests/elastic_worker.py; this test hosts the job's store (as `shardwise run` does) and starts the
joiner once the survivors' epoch is published. One trial of ZeRO-2 here (the resharded optimizer state is the
harder path; tests/test_elastic_state.py runs DDP, ZeRO-2 and ZeRO-3 through the same shrink and grow on thread ranks);
under `make soak` the DDP trial, 5 more each (seeded differently), the ZeRO-3 trial and the runs under `shardwise run`
(tests/test_cli_restarts.py runs that supervisor's elastic paths with a tiny script in make test)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import shardwise as sw

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

# The failure detector's settings for these jobs. A live worker on a machine whose two cores also run a CPU burner
# and another test worker can miss its heartbeat for over a second and sit in a collective for several: with a
# silence of 1.5 s and a collective timeout of 4 s, a fresh clone under load saw the 3 survivors re-form their world
# a second time (a live peer taken for dead), so the run went 4 -> 3 -> 3 -> 4. A killed worker is seen at once
# anyway (its sockets close), so generous values cost only the below-min test's wait, which its bound accounts for.
SILENCE, TIMEOUT = 5.0, 12.0
# A trial takes ~30 s on 2 idle cores; a fresh clone beside two CPU burners and the other test worker took 94 s, past
# an earlier limit of 90 s. The limit only bounds a hang, so it is generous.
FINISH_LIMIT = 240.0

HERE = Path(__file__).resolve().parent
WORKER = HERE / "elastic_worker.py"
_spec = importlib.util.spec_from_file_location("elastic_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def _worlds(steps: int, kill_step: int, join_step: int) -> list[int]:
    """Workers per step (1-based): 4 until the kill, 3 from the killed step (redone by the survivors) through the
    join step, 4 again after it (join_step < 0: never)."""
    return [3 if kill_step <= s and (join_step < 0 or s <= join_step) else 4 for s in range(1, steps + 1)]


def _reference(worlds: list[int]) -> dict[str, torch.Tensor]:
    """One process, the same model, optimizer, global batch and sample order, never interrupted, summing as the
    workers do: step s's global batch is split into worlds[s] equal contiguous shares (the sampler's), each share's
    mean-loss gradient is taken on its own, and the shares' gradients are averaged.

    Why not one backward over the whole batch: the mean of the shares' means equals the whole batch's mean only up to
    rounding (an ulp or so of each gradient), and Adam divides by sqrt(v) + eps, which makes that rounding visible
    where a gradient is tiny: with the schedule of seed 11 (4, 4, 3, 3, 3, 4, 4 workers), one element of
    blocks.0.mlp.proj.weight, [22, 9], ends 1.13e-6 apart (relative 3.5e-4) between the two one-process references
    themselves, which is the figure the test used to fail by against the workers on some CPUs. What remains against
    this reference is the order in which the all-reduce adds the shares."""
    torch.manual_seed(0)
    model = worker.build_model()
    params = list(model.parameters())
    opt = worker.make_optimizer(params)
    tokens = worker.data()
    sampler = sw.elastic.Sampler(worker.N, global_batch=worker.G, seed=worker.SEED)
    for world in worlds:
        idx = sampler.global_batch_indices()
        per = len(idx) // world
        total = [torch.zeros_like(p) for p in params]
        for r in range(world):
            share = idx[r * per : (r + 1) * per]
            model(tokens[share, :-1], tokens[share, 1:]).backward()
            for t, p in zip(total, params):
                t += p.grad
            opt.zero_grad()
        for t, p in zip(total, params):
            p.grad = t / world
        opt.step()
        opt.zero_grad()
        sampler.advance()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _Job:
    """The job's store (hosted here, as `shardwise run` hosts it) and its worker processes."""

    def __init__(self, out: Path, min_workers: int, max_workers: int, **env: str) -> None:
        from shardwise.comm import rendezvous

        self.out = out
        self.store = rendezvous.host_store("127.0.0.1", 0, 10.0)
        self.env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port),
                    "SHARDWISE_ELASTIC": f"{min_workers}:{max_workers}", "WORLD_SIZE": str(max_workers),
                    "OMP_NUM_THREADS": "1", "ELASTIC_TIMEOUT": str(TIMEOUT), "ELASTIC_SILENCE": str(SILENCE), **env}
        self.env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), self.env.get("PYTHONPATH", "")])
        self.procs: list[subprocess.Popen] = []

    def start(self, launch_rank: int, *args: object, **env: str) -> None:
        self.procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), str(self.out), *map(str, args)],
            env={**self.env, "RANK": str(launch_rank), **env},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))

    def finish(self, limit: float) -> list[int]:
        deadline = time.monotonic() + limit
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def outputs(self) -> str:
        """Each worker's last output. A worker still running is killed first (reading its pipe would block): a run
        that hangs shows every worker's lines, not only those of the ones that ended."""
        self.close()
        texts = []
        for i, p in enumerate(self.procs):
            texts.append(f"--- worker {i} (exit {p.returncode}) ---\n{p.stdout.read()[-3000:]}")
        return "\n".join(texts)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def _trial(tmp_path: Path, strategy: str, seed: int) -> None:
    rng = random.Random(seed)
    kill_rank, kill_step = rng.randrange(4), rng.randrange(2, 4)
    join_step, steps = kill_step + 2, kill_step + 4
    args = (strategy, steps, kill_rank, kill_step, join_step)
    job = _Job(tmp_path, 3, 4)
    try:
        for r in range(4):
            job.start(r, *args)
        # The newcomer starts now (its imports overlap the others' training) but registers only once the 3
        # survivors reached the join step (the worker's choreography): the run goes 4 -> 3 -> 4.
        job.start(4, *args, ELASTIC_JOINER="1")
        codes = job.finish(FINISH_LIMIT)
        assert codes == [0 if r != kill_rank else -9 for r in range(4)] + [0], job.outputs()
    finally:
        job.close()
    killed = json.loads((tmp_path / "killed.json").read_text())
    runs = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("timeline-*.json"))]
    assert len(runs) == 4 and all(r["world"] == 4 and r["step"] == steps for r in runs)
    assert all(r["samples"] == steps * worker.G for r in runs)  # the sampler's committed position: every sample once
    survivor = next(r["timeline"] for r in runs if r["timeline"][0]["source"] == "new")
    epochs = [e for e in survivor if "epoch" in e]
    assert [(e["world"], e["source"]) for e in epochs[:2]] == [(4, "new"), (3, "survivors")]
    # Growing back to 4: from its own commits ("survivors"), or, when the join caught this survivor one commit ahead
    # of or behind the others (seen under load), from the others by broadcast as the newcomer is ("joined"); either
    # way the final parameters below must equal one process.
    assert epochs[2]["world"] == 4 and epochs[2]["source"] in ("survivors", "joined"), epochs
    assert epochs[1]["step"] == kill_step  # every survivor committed the step before the kill: it is redone once
    on3 = next(e for e in survivor if "loss" in e and e["world"] == 3)
    assert on3["t"] - killed["t"] < 30, f"the survivors' first step on 3 came {on3['t'] - killed['t']:.1f}s after the kill"
    assert [e["step"] for e in survivor if "loss" in e] == list(range(1, steps + 1))  # each step applied once
    assert [e["world"] for e in survivor if "loss" in e].count(3) == join_step - kill_step + 1
    newcomer = next(r["timeline"] for r in runs if r["timeline"][0]["source"] == "joined")
    assert newcomer[0]["step"] == join_step + 1
    sw.elastic.plot_timeline(survivor, tmp_path / "timeline.png", title=f"{strategy}: 4 -> 3 -> 4 workers")
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    got = torch.load(tmp_path / "final.pt", weights_only=True)
    want = _reference(_worlds(steps, kill_step, join_step))
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


# One gloo trial per family in make test: each costs 5 interpreters and ~50-90 s on 2 busy cores. DDP's (replicated
# state, the simpler path through the same membership, epochs and sampler) runs in make soak.
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.soak), "zero2"])
def test_kill_one_then_join_equals_one_process(tmp_path, strategy):
    _trial(tmp_path, strategy, seed=11)


@pytest.mark.soak  # about 30 s more on 2 busy cores; tests/test_elastic_state.py has the thread-rank case in make test
@pytest.mark.timeout(300)
def test_zero3_with_neighbour_redundancy_loses_no_shard(tmp_path):
    """ZeRO-3 shards the parameters themselves: the killed worker's shards come back from its neighbour's in-memory
    copy (redundancy=True), never from disk: the job has no checkpoint to read (a lost shard would raise StateLost
    and fail the run), and every epoch's state is "survivors"."""
    _trial(tmp_path, "zero3", seed=11)
    assert not any(p.is_dir() for p in tmp_path.iterdir())  # no checkpoint folder was ever written


@pytest.mark.soak
@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
@pytest.mark.parametrize("seed", range(5))
def test_kill_one_then_join_soak(tmp_path, strategy, seed):
    _trial(tmp_path, strategy, seed=100 + seed)


def test_below_min_workers_stops_with_a_clear_error(tmp_path):
    """min_workers=4: after a kill the 3 survivors wait `wait_timeout` (3 s) for a joiner, then each raises
    MembershipError naming the counts and exits; nobody is left waiting."""
    job = _Job(tmp_path, 4, 4, ELASTIC_WAIT="3")
    try:
        for r in range(4):
            job.start(r, "ddp", 6, 1, 2, -1)
        codes = job.finish(FINISH_LIMIT)
        killed_at = json.loads((tmp_path / "killed.json").read_text())["t"]
        stopped = time.time() - killed_at
        out = job.outputs()
    finally:
        job.close()
    assert codes == [1, -9, 1, 1], out
    assert out.count("MembershipError: elastic: only 3 worker(s) alive for epoch 1") == 3, out
    assert "fewer than min_workers=4, after waiting 3s" in out
    # wait_timeout (3 s) + the detector's silence + the collective timeout + process exit (Python and torch tearing
    # down, up to 20 s on two loaded cores): a bound that still says nobody is left waiting
    bound = 3 + SILENCE + TIMEOUT + 20
    assert stopped < bound, f"the survivors stopped {stopped:.1f}s after the kill (bound {bound:.0f}s)"


@pytest.mark.soak  # make test runs the same supervisor paths with a tiny script: tests/test_cli_restarts.py
def test_shardwise_run_min_max_keeps_the_survivors(tmp_path):
    """`shardwise run --min 3 --max 4 -n 4`: the supervisor hosts the store and lets the survivors of a SIGKILL run
    to the end on 3 (keep_survivors); the job still exits non-zero, naming the killed worker."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ELASTIC_TIMEOUT": "4", "ELASTIC_SILENCE": "1.5"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), env.get("PYTHONPATH", "")])
    steps = 5
    proc = subprocess.run([sys.executable, "-m", "shardwise", "run", "--min", "3", "--max", "4", "-n", "4",
                           "--timeout", "10", str(WORKER), str(tmp_path), "ddp", str(steps), "1", "2", "-1"],
                          env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "rank 1" in out and "SIGKILL" in out, out
    assert "add workers with SHARDWISE_JOB_TOKEN=" in out, out
    runs = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("timeline-*.json"))]
    assert len(runs) == 3 and all(r["world"] == 3 and r["step"] == steps for r in runs), out
    got = torch.load(tmp_path / "final.pt", weights_only=True)
    want = _reference(_worlds(steps, 2, -1))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.soak  # about a minute on 2 busy cores; tests/test_cli_restarts.py checks the same path in make test
@pytest.mark.timeout(300)
def test_shardwise_run_max_restarts_replaces_the_killed_worker(tmp_path):
    """`shardwise run --min 3 --max 4 -n 4 --max-restarts 1` with ZeRO-2: the SIGKILLed worker is replaced by a
    fresh process that joins the running job (the survivors never stop); the job exits 0 and ends on 4 workers with
    the parameters of one process, every sample counted once."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ELASTIC_TIMEOUT": "4", "ELASTIC_SILENCE": "1.5"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), env.get("PYTHONPATH", "")])
    steps, kill_step, join_step = 7, 2, 4
    proc = subprocess.run([sys.executable, "-m", "shardwise", "run", "--min", "3", "--max", "4", "-n", "4",
                           "--max-restarts", "1", "--timeout", "10", str(WORKER), str(tmp_path), "zero2", str(steps),
                           "1", str(kill_step), str(join_step)], env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "shardwise run: rank 1 killed by SIGKILL; restarting it to join the running job (restart 1 of 1, 0 left)" \
        in out, out
    runs = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("timeline-*.json"))]
    assert len(runs) == 4 and all(r["world"] == 4 and r["step"] == steps for r in runs), out
    assert all(r["samples"] == steps * worker.G for r in runs)
    assert [r["timeline"][0]["source"] for r in runs].count("joined") == 1  # the replacement, given the state
    got = torch.load(tmp_path / "final.pt", weights_only=True)
    want = _reference(_worlds(steps, kill_step, join_step))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
