"""Parameter server (sw.AsyncSGD): s = 0 equals synchronous training, bounded staleness holds, failures, bad input."""

from __future__ import annotations

import io
import math
import time

import pytest
import torch
from parity import CONFIG, assert_state_close, make_optimizer

import shardwise as sw
from shardwise.async_sgd import AsyncSGD, RotatingStraggler, Straggler, assign_shards
from shardwise.data import ByteCorpus
from shardwise.models import GPT

CORPUS = ByteCorpus(max_bytes=300_000)
LOCAL_BATCH = 4


def state_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def worker_batch(step: int, worker: int, n_workers: int):
    return CORPUS.batch(step, LOCAL_BATCH, CONFIG.seq_len, rank=worker, world_size=n_workers)


def reference(steps: int, n_workers: int) -> dict[str, torch.Tensor]:
    """One process on the global batch (every worker's slice), AdamW: synchronous SGD on the same data."""
    model = GPT(CONFIG, seed=0)
    opt = make_optimizer(model.parameters())
    for step in range(steps):
        parts = [worker_batch(step, w, n_workers) for w in range(n_workers)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return state_of(model)


def run_ps(comm, steps, n_servers, staleness, slow=None, factor=1.0, lr_scaling="workers", seen=None):
    """Train the tiny GPT with a parameter server; servers return their report and shard, workers their state."""
    model = AsyncSGD(GPT(CONFIG, seed=0), comm, optimizer=make_optimizer, n_servers=n_servers, staleness=staleness,
                     lr_scaling=lr_scaling)
    if model.is_server:
        report = model.serve()
        return {"report": report, "shard": model.server_state_dict()}
    straggler = Straggler(factor if model.worker_rank == slow else 1.0)
    losses = []
    for step in range(steps):
        x, y = worker_batch(step, model.worker_rank, model.n_workers)
        with straggler:
            loss = model(x, y)
            loss.backward()
        model.step()
        model.zero_grad()
        losses.append(float(loss.detach()))
    model.finish()
    return {"state": state_of(model), "losses": losses}


@pytest.mark.parametrize("world, n_servers", [(3, 1), (4, 2)])
def test_staleness_zero_equals_synchronous_training(world, n_servers):
    steps = 4
    n_workers = world - n_servers
    want = reference(steps, n_workers)
    results = sw.launch(run_ps, world, steps, n_servers, 0, 1, 2.0)  # a straggler changes nothing at s = 0
    for r in results[:n_workers]:
        assert_state_close(r["state"], want)
    shards = {}
    for r in results[n_workers:]:
        report = r["report"]
        assert report.updates == steps and report.lost == [] and sorted(report.finished) == list(range(n_workers))
        assert report.staleness == [0] * (steps * n_workers)
        shards.update(r["shard"]["params"])
    names = [n for n, _ in GPT(CONFIG, seed=0).named_parameters()]  # a tied weight once
    assert sorted(shards) == sorted(names)  # the servers' shards cover the model, each tensor once
    assert_state_close(shards, {n: want[n] for n in names})


def test_bounded_staleness_holds_and_infinity_runs_ahead():
    """3 workers, worker 2 sleeps 4x its compute: with s = 1 nobody is ever more than one step ahead of it; with
    s = inf the fast workers run ahead and their gradients are applied stale."""
    steps = 8
    bounded = sw.launch(run_ps, 4, steps, 1, 1, 2, 4.0)[3]["report"]
    assert max(a.ahead for a in bounded.applied) == 1  # the gate was reached, and held
    assert bounded.updates == 3 * steps
    free = sw.launch(run_ps, 4, steps, 1, math.inf, 2, 4.0)[3]["report"]
    assert max(a.ahead for a in free.applied) > 1
    assert max(free.staleness) > 2
    assert free.updates == 3 * steps


def test_asynchronous_training_lowers_the_loss():
    results = sw.launch(run_ps, 3, 12, 1, 2)
    for r in results[:2]:
        assert sum(r["losses"][-3:]) / 3 < r["losses"][0] - 0.1, r["losses"]


def test_lr_scaling_sees_each_gradients_staleness():
    seen: list[int] = []

    def scale(tau: int) -> float:
        seen.append(tau)
        return 1.0 / (1 + tau)

    report = sw.launch(run_ps, 3, 5, 1, math.inf, None, 1.0, scale)[2]["report"]
    assert seen == report.staleness and len(seen) == 10


def _pushes_recorded(comm, steps):
    """s = inf, default lr scaling: workers return every gradient they pushed; the server its report and shard."""
    model = AsyncSGD(GPT(CONFIG, seed=0), comm, optimizer=make_optimizer, n_servers=1, staleness=math.inf)
    if model.is_server:
        return {"report": model.serve(), "shard": model.server_state_dict()}
    pushed = []
    straggler = Straggler(2.0 if model.worker_rank == 0 else 1.0)  # some reordering of the arrivals
    for step in range(steps):
        x, y = worker_batch(step, model.worker_rank, model.n_workers)
        with straggler:
            model(x, y).backward()
        pushed.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.step()
        model.zero_grad()
    seen = model.pushes_applied
    model.finish()
    return {"pushed": pushed, "seen": seen}


def test_each_asynchronous_push_is_one_nth_of_a_step_for_adam():
    """Replay: the server's parameters equal one process applying the same gradients, in the recorded arrival order,
    each in one AdamW step at lr / n_workers. AdamW ignores a gradient's scale, so this fails if the server divided
    the gradient by N instead of the lr (a full-lr step per push: N x the synchronous step per sample)."""
    steps, n_workers = 3, 3
    results = sw.launch(_pushes_recorded, n_workers + 1, steps)
    report = results[-1]["report"]
    assert [a.worker for a in report.applied].count(0) == steps and report.updates == steps * n_workers
    assert max(r["seen"] for r in results[:-1]) == steps * n_workers  # the last to finish saw every push
    model = GPT(CONFIG, seed=0)
    opt = make_optimizer(model.parameters())
    for group in opt.param_groups:
        group["lr"] = group["lr"] * (1.0 / n_workers)
    names = dict(model.named_parameters())
    for a in report.applied:
        for name, g in results[a.worker]["pushed"][a.clock].items():
            names[name].grad = g
        opt.step()
    assert_state_close(results[-1]["shard"]["params"], {n: p.detach() for n, p in model.named_parameters()})


def test_server_state_round_trips():
    def body(comm):
        model = AsyncSGD(GPT(CONFIG, seed=0), comm, optimizer=make_optimizer, n_servers=1, staleness=0)
        if not model.is_server:
            for step in range(2):
                x, y = worker_batch(step, model.worker_rank, model.n_workers)
                model(x, y).backward()
                model.step()
                model.zero_grad()
            model.finish()
            return None
        model.serve()
        buf = io.BytesIO()
        torch.save(model.server_state_dict(), buf)
        return buf.getvalue()

    saved = sw.launch(body, 2)[1]
    state = torch.load(io.BytesIO(saved), weights_only=True)
    assert state["version"] == 2 and state["optimizer"]["state"]  # AdamW moments are server state

    def restore(comm):
        model = AsyncSGD(GPT(CONFIG, seed=0), comm, optimizer=make_optimizer, n_servers=1)
        if model.is_server:
            model.load_server_state_dict(state)
            again = model.server_state_dict()
            model.serve()
            return again
        model.finish()
        return None

    again = sw.launch(restore, 2)[1]
    assert again["version"] == 2
    assert_state_close(again["params"], state["params"])
    torch.testing.assert_close(again["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])


def _dead_server(comm):
    model = AsyncSGD(GPT(CONFIG, seed=0), comm, optimizer=make_optimizer, n_servers=1)
    if model.is_server:
        return "gone"  # never serves: a server that died after wrapping
    x, y = worker_batch(0, model.worker_rank, model.n_workers)
    model(x, y).backward()
    start = time.monotonic()
    try:
        model.step()
    except sw.CommError as exc:
        return str(exc), exc.peers, time.monotonic() - start
    return None


def test_a_dead_server_is_named_within_the_timeout():
    results = sw.launch(_dead_server, 3, timeout=1.5)
    for message, peers, waited in results[:2]:
        assert "parameter server rank 2 did not answer" in message and peers == (2,)
        assert waited < 5


def test_shards_are_balanced_by_size():
    assert assign_shards([10, 1, 7, 3], 2) == [[0, 1], [2, 3]]  # 10 | 7, +3 -> 10 | 10, +1 on the tie: lowest
    assert assign_shards([5, 5, 5], 3) == [[0], [1], [2]]
    shards = assign_shards([p.numel() for p in GPT(CONFIG, seed=0).parameters()], 3)
    assert sorted(i for s in shards for i in s) == list(range(len(list(GPT(CONFIG, seed=0).parameters()))))


def _bad(comm, kwargs):
    kwargs = dict({"optimizer": make_optimizer}, **kwargs)
    try:
        AsyncSGD(GPT(CONFIG, seed=0), comm, **kwargs)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("kwargs, words", [
    ({"n_servers": 0}, "n_servers=0 must be an int in 1..1"),
    ({"n_servers": 2}, "n_servers=2 must be an int in 1..1"),
    ({"n_servers": True}, "n_servers=True"),
    ({"staleness": -1}, "staleness=-1 must be an int >= 0"),
    ({"staleness": 1.5}, "staleness=1.5 must be an int >= 0"),
    ({"staleness": "inf"}, "or math.inf"),
    ({"lr_scaling": "linear"}, "lr_scaling='linear' must be 'workers' (lr / n_workers, the default)"),
    ({"optimizer": "adam"}, "optimizer='adam' must be a callable"),
])
def test_bad_options_are_named(kwargs, words):
    for message in sw.launch(_bad, 2, kwargs):
        assert message is not None and words in message, message


def test_one_rank_and_wrong_roles_are_refused():
    with pytest.raises(ValueError, match="needs at least 2"):
        AsyncSGD(GPT(CONFIG, seed=0), sw.init(), optimizer=make_optimizer)

    def roles(comm):
        model = AsyncSGD(GPT(CONFIG, seed=0), comm, optimizer=make_optimizer)
        try:
            model.serve() if not model.is_server else model.step()
        except ValueError as exc:
            message = str(exc)
        if model.is_worker:
            model.finish()
        else:
            model.serve()
        return message

    worker_msg, server_msg = sw.launch(roles, 2)
    assert "serve() is for server ranks; rank 0 is a worker" in worker_msg
    assert "step() is for worker ranks; rank 1 is a server" in server_msg


@pytest.mark.parametrize("kind", ["tensor_parallel", "zero3"])
def test_partitioned_models_are_refused(kind):
    def body(comm):
        model = GPT(CONFIG, seed=0)
        model = sw.tensor_parallel.parallelize(model, comm) if kind == "tensor_parallel" else sw.ZeRO(model, comm,
                                                                                                     stage=3)
        try:
            AsyncSGD(model, comm, optimizer=make_optimizer)
        except ValueError as exc:
            return str(exc)

    for message in sw.launch(body, 2):
        assert message and "sharded across ranks" in message and "allowed: a plain module" in message


def test_straggler_sleeps_in_proportion():
    slow = Straggler(3.0)
    with slow:
        time.sleep(0.05)
    assert slow.slept == pytest.approx(2 * slow.computed, rel=0.01)
    with pytest.raises(ValueError, match="factor=0.5 must be a number >= 1"):
        Straggler(0.5)


class _FakeClock:
    """Stands in for the straggler module's `time`: each step's compute takes `step_seconds[k]`, sleeps advance it."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def perf_counter(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.mark.parametrize("every", [1, 2])
def test_rotating_straggler_slows_each_worker_in_turn_by_its_calibrated_step(monkeypatch, every):
    """4 workers, factor 3: after 5 timed full-speed steps (median 0.1 s: one outlier step of 0.5 s does not move
    it), worker w sleeps 0.2 s on exactly the steps where (k - 5) // every cycles to w, and at every such step one
    worker of the four is slowed."""
    import shardwise.async_sgd.straggler as straggler_module

    durations = [0.1, 0.5, 0.1, 0.09, 0.11] + [0.1] * 40  # a slow step in the calibration: the median ignores it
    slowed_at = {}
    for worker in range(4):
        clock = _FakeClock()
        monkeypatch.setattr(straggler_module, "time", clock)
        rotating = RotatingStraggler(3.0, worker=worker, n_workers=4, every=every)
        slowed_at[worker] = []
        for k, seconds in enumerate(durations):
            before = len(clock.sleeps)
            with rotating.step(k):
                clock.now += seconds
            if len(clock.sleeps) > before:
                slowed_at[worker].append(k)
        assert rotating.baseline == pytest.approx(0.1)
        assert clock.sleeps == [pytest.approx(0.2)] * len(slowed_at[worker])
        assert rotating.slept == pytest.approx(0.2 * len(slowed_at[worker]))
        assert slowed_at[worker] == [k for k in range(5, len(durations)) if ((k - 5) // every) % 4 == worker]
    steps = sorted(k for ks in slowed_at.values() for k in ks)
    assert steps == list(range(5, len(durations)))  # one slow worker at every step after the calibration


def test_rotating_straggler_refuses_bad_input():
    for kwargs, message in [({"factor": 0.5}, "RotatingStraggler: factor=0.5 must be a number >= 1"),
                            ({"worker": 4}, r"worker=4 must be an int in \[0, 4\)"),
                            ({"every": 0}, r"RotatingStraggler: every=0 must be a positive int \(1, 2, ...\)"),
                            ({"calibration_steps": 0}, r"calibration_steps=0 must be a positive int \(1, 2, ...\)"),
                            ({"n_workers": 0, "worker": 0}, r"n_workers=0 must be a positive int")]:
        with pytest.raises(ValueError, match=message):
            RotatingStraggler(**({"factor": 3.0, "worker": 0, "n_workers": 4} | kwargs))


# ---- gloo processes under shardwise's supervisor: a worker that dies does not stop the others -------------------

_KILLED_WORKER_SCRIPT = """
import json, os, signal, sys
import torch
import shardwise as sw
from shardwise.async_sgd import AsyncSGD
from shardwise.data import ByteCorpus
from shardwise.models import GPT, GPTConfig

out, steps, victim = sys.argv[1], 10, 1
config = GPTConfig.preset("tiny")
corpus = ByteCorpus(max_bytes=100_000)
comm = sw.init(timeout=60)
model = AsyncSGD(GPT(config, seed=0), comm, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), n_servers=1,
                 staleness=2)
if model.is_server:
    report = model.serve()
    result = {"updates": report.updates, "finished": sorted(report.finished), "lost": report.lost}
else:
    losses = []
    for step in range(steps):
        if model.worker_rank == victim and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)  # dies mid-training, without a word to anyone
        x, y = corpus.batch(step, 4, config.seq_len, rank=model.worker_rank, world_size=model.n_workers)
        loss = model(x, y)
        loss.backward()
        model.step()
        model.zero_grad()
        losses.append(float(loss.detach()))
    model.finish()
    result = {"losses": losses}
with open(os.path.join(out, f"rank{comm.rank}.json"), "w") as f:
    json.dump(result, f)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_gloo_worker_killed_training_continues_on_the_others(tmp_path):
    import json

    from shardwise.launch.supervise import RunConfig, keep_survivors, run

    script = tmp_path / "ps.py"
    script.write_text(_KILLED_WORKER_SCRIPT)
    result = run(RunConfig(str(script), (str(tmp_path),), nproc=4, timeout=60), keep_survivors)
    assert [f.rank for f in result.failures] == [1], result.report()
    server = json.loads((tmp_path / "rank3.json").read_text())
    assert server["lost"] == [1] and server["finished"] == [0, 2]
    # The survivors' 2 x 10 pushes and the victim's 3 were all applied.
    assert server["updates"] == 2 * 10 + 3
    for rank in (0, 2):
        losses = json.loads((tmp_path / f"rank{rank}.json").read_text())["losses"]
        assert len(losses) == 10 and losses[-1] < losses[0]
    assert not (tmp_path / "rank1.json").exists()
