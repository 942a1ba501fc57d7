"""sw.elastic.ElasticState on thread ranks: rollback redoes the failed step once; a world that loses a rank (4 -> 3)
and gains one (3 -> 4) ends with the parameters of one process trained on the same global batches (DDP, ZeRO-2,
ZeRO-3 with neighbour redundancy, ZeRO-3 from the last checkpoint); unsupported layouts and bad options named."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.comm import ThreadWorld

pytestmark = pytest.mark.timeout(120)

G, N, STEPS = 24, 96, 7
X = torch.randn(N, 8, generator=torch.Generator().manual_seed(0))
Y = torch.randn(N, 4, generator=torch.Generator().manual_seed(1))
_build = threading.Lock()


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


INIT = _net().state_dict()


def _fresh(comm, strategy: str):
    with _build:  # thread ranks share torch's RNG while building (wrapping is collective: outside the lock)
        net = _net()
    net.load_state_dict(INIT)
    model = {"ddp": lambda: sw.DDP(net, comm), "zero2": lambda: sw.ZeRO(net, comm, stage=2),
             "zero3": lambda: sw.ZeRO(net, comm, stage=3)}[strategy]()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train_step(model, opt, sched, sampler):
    plan = sampler.plan
    share = sampler.rank_indices()
    for k in range(plan.accumulation):
        idx = share[k * plan.micro_batch : (k + 1) * plan.micro_batch]
        loss = nn.functional.mse_loss(model(X[idx]), Y[idx]) / plan.accumulation
        loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def _reference(steps: int) -> dict[str, torch.Tensor]:
    net = _net()
    net.load_state_dict(INIT)
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    sampler = sw.elastic.Sampler(N, global_batch=G, seed=5)
    for _ in range(steps):
        idx = sampler.global_batch_indices()
        nn.functional.mse_loss(net(X[idx]), Y[idx]).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        sampler.advance()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """torch's comparison, its message (how far, where) kept after `what`."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda detail: f"{what}: {detail}")


class _Regroup:
    """The test's stand-in for the membership layer: one new ThreadWorld per epoch, shared by its members."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.worlds: dict[int, ThreadWorld] = {}

    def comm(self, epoch: int, size: int, rank: int):
        with self.lock:
            world = self.worlds.setdefault(epoch, ThreadWorld(size, timeout=20.0))
        return world.communicators()[rank]


def _run_elastic(strategy: str, *, kill_rank: int, kill_step: int, join_step: int, **state_options):
    """4 ranks; `kill_rank` dies at the start of step `kill_step`; the 3 survivors continue; a newcomer joins before
    step `join_step`. Returns every final rank's full state dict and state facts."""
    regroup, results, errors = _Regroup(), {}, []
    first = ThreadWorld(4, timeout=20.0)
    comms = first.communicators()
    survivors = [r for r in range(4) if r != kill_rank]

    def rank_main(rank: int) -> None:
        comm = comms[rank]
        model, opt, sched = _fresh(comm, strategy)
        sampler = sw.elastic.Sampler(N, global_batch=G, seed=5)
        state = sw.elastic.ElasticState(model, opt, lr_scheduler=sched, sampler=sampler, **state_options)
        epoch, facts = 0, []
        while state.step < STEPS:
            if epoch == 1 and state.step == join_step:  # grow back to 4: the newcomer enters the same collective
                epoch = 2
                comm = regroup.comm(2, 4, survivors.index(rank))
                model, opt, sched = _fresh(comm, strategy)
                facts.append(state.resize(comm, model, opt, lr_scheduler=sched))
                continue
            if rank == kill_rank and state.step == kill_step:
                first.abort(f"rank {rank} was killed", rank=rank)  # what gloo peers see of a SIGKILLed process
                return
            try:
                _train_step(model, opt, sched, sampler)
                state.step_done()
            except sw.CommError:
                assert epoch == 0
                epoch = 1
                comm = regroup.comm(1, 3, survivors.index(rank))
                model, opt, sched = _fresh(comm, strategy)
                facts.append(state.resize(comm, model, opt, lr_scheduler=sched))
        results[comm.rank] = (sw.full_state_dict(model), facts, comm.size, sampler.position)

    def newcomer() -> None:
        comm = regroup.comm(2, 4, 3)
        model, opt, sched = _fresh(comm, strategy)
        sampler = sw.elastic.Sampler(N, global_batch=G, seed=5)
        opts = {k: v for k, v in state_options.items() if k != "comm"}
        state = sw.elastic.ElasticState.joining(model, opt, comm, lr_scheduler=sched, sampler=sampler, **opts)
        assert state.step == join_step
        while state.step < STEPS:
            _train_step(model, opt, sched, sampler)
            state.step_done()
        results[comm.rank] = (sw.full_state_dict(model), [], comm.size, sampler.position)

    def guarded(fn, *args):
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            for w in [first, *regroup.worlds.values()]:
                w.abort(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=guarded, args=(rank_main, r)) for r in range(4)]
    threads.append(threading.Thread(target=guarded, args=(newcomer,)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("strategy,options", [
    ("ddp", {}),
    ("zero2", {"redundancy": True}),
    ("zero3", {"redundancy": True}),
])
def test_shrink_then_grow_matches_one_process(strategy, options):
    results = _run_elastic(strategy, kill_rank=1, kill_step=3, join_step=5, **options)
    expected = _reference(STEPS)
    assert sorted(results) == [0, 1, 2, 3]
    for rank, (sd, facts, size, position) in results.items():
        assert size == 4 and position == STEPS
        for name, value in expected.items():
            _assert_close(sd[name], value, f"rank {rank} {name}")
        if rank < 3:  # a survivor: resized twice, each time from the survivors' memory
            assert [f["source"] for f in facts] == ["survivors", "survivors"]
            # back to the commit of step 3, or of step 2 when the kill cut the commit of step 3 short on some
            # survivor (its neighbour exchange is a collective): at most the failed step and one before it redone
            assert facts[0]["step"] in (2, 3) and facts[1]["step"] == 5


@pytest.mark.parametrize("every,kill_step,back_to", [(2, 4, 4), (3, 5, 3)])
def test_zero3_without_redundancy_is_lost_and_comes_back_from_the_checkpoint(tmp_path, every, kill_step, back_to):
    """Without redundancy the killed rank's ZeRO-3 shards are gone: the survivors read the last checkpoint (written
    every K = `every` steps), so at most K steps are lost (here kill_step - back_to: 0, then 2), and those steps are
    redone: the parameters and the sample count still equal one uninterrupted process."""
    results = _run_elastic("zero3", kill_rank=2, kill_step=kill_step, join_step=6, checkpoint_dir=str(tmp_path),
                           checkpoint_every=every)
    expected = _reference(STEPS)
    assert sorted(results) == [0, 1, 2, 3]
    for rank, (sd, facts, size, position) in results.items():
        assert size == 4 and position == STEPS  # every global batch counted once, the redone ones included
        for name, value in expected.items():
            _assert_close(sd[name], value, f"rank {rank} {name}")
        if rank < 3:  # the shards of rank 2 were lost: back to the last checkpoint, then survivors at the join
            assert facts[0] == {"step": back_to, "source": "checkpoint"}
            assert 0 <= kill_step - facts[0]["step"] <= every
            assert facts[1] == {"step": 6, "source": "survivors"}


def test_zero3_without_redundancy_or_checkpoint_names_the_lost_tensors():
    with pytest.raises(sw.elastic.StateLost, match=r"do not cover .* held only by the ranks that left"):
        _run_elastic("zero3", kill_rank=2, kill_step=2, join_step=6)


def test_rollback_redoes_the_failed_step_once():
    net = _net()
    net.load_state_dict(INIT)
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    sampler = sw.elastic.Sampler(N, global_batch=G, seed=5)
    state = sw.elastic.ElasticState(net, opt, sampler=sampler, commit_every=2)
    for _ in range(3):  # commits at 0 and 2; step 3 is in flight when "a peer dies"
        idx = sampler.global_batch_indices()
        nn.functional.mse_loss(net(X[idx]), Y[idx]).backward()
        opt.step()
        opt.zero_grad()
        state.step_done()
    assert state.rollback() == 2 and sampler.position == 2
    for _ in range(STEPS - 2):
        idx = sampler.global_batch_indices()
        nn.functional.mse_loss(net(X[idx]), Y[idx]).backward()
        opt.step()
        opt.zero_grad()
        state.step_done()
    ref = _net()
    ref.load_state_dict(INIT)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    order = sw.elastic.Sampler(N, global_batch=G, seed=5)
    for _ in range(STEPS):
        idx = order.global_batch_indices()
        nn.functional.mse_loss(ref(X[idx]), Y[idx]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        order.advance()
    for (name, a), b in zip(net.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_unsupported_layouts_and_bad_options_are_named():
    def body(comm):
        with _build:
            net = _net()
        net.load_state_dict(INIT)
        model = sw.tensor_parallel.parallelize(net, comm, plan={"0": "colwise", "2": "rowwise"})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ValueError, match=r"supports data parallel strategies only .* not \['tensor_parallel'\]"):
            sw.elastic.ElasticState(model, opt)
        return True

    assert sw.launch(body, 2) == [True, True]
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"commit_every=0 must be a positive int"):
        sw.elastic.ElasticState(net, opt, commit_every=0)
    with pytest.raises(ValueError, match=r"checkpoint_dir=None and checkpoint_every=3 go together"):
        sw.elastic.ElasticState(net, opt, checkpoint_every=3)
    with pytest.raises(ValueError, match=r"redundancy=True needs the model's communicator"):
        sw.elastic.ElasticState(net, opt, redundancy=True)
