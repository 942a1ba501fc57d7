"""Pipeline executor on thread ranks: parity with one process for every schedule, tied weights, losses, traffic,
timelines, and the errors of the API.

The model is the tiny GPT with 6 blocks, so `pipeline_layers()` has 8 layers: enough for p = 4 with v = 2.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from parity import CORPUS, GLOBAL_BATCH, assert_state_close, make_optimizer

import shardwise as sw
from shardwise import pipeline as pp
from shardwise.comm import ThreadWorld
from shardwise.models import GPT, GPTConfig, lm_loss

CONFIG = GPTConfig.preset("tiny", n_layers=6)
STEPS = 5
VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return CORPUS.batch(step, GLOBAL_BATCH, CONFIG.seq_len)


def reference(config: GPTConfig, steps: int = STEPS) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Parameters (original names, tied ones under both names) and losses of one process on the global batch."""
    model = GPT(config, seed=0)
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}, losses


def train_pipeline(comm, schedule: str, n_microbatches: int, config: GPTConfig = CONFIG, steps: int = STEPS,
                   record: bool = False, model: GPT | None = None):
    """Train on this rank's stages; return (this rank's parameters by original name, losses, per-step traffic,
    recorded events). `model`: a GPT(config, seed=0) built beforehand, copied here (spawned ranks get one from the
    parent, which spares each process the seconds that building a GPT's first meta-device module costs)."""
    model = GPT(config, seed=0) if model is None else copy.deepcopy(model)
    stages = pp.partition(model.pipeline_layers(), comm.size, virtual_stages=VIRTUAL[schedule])
    pipe = pp.Pipeline(stages, comm, schedule=schedule, n_microbatches=n_microbatches, loss_fn=lm_loss,
                       record_timeline=record)
    del stages
    opt = make_optimizer(pipe.parameters())
    losses, traffic = [], []
    for step in range(steps):
        x, y = batch(step)
        with comm.stats.measure() as measured:
            losses.append(pipe.step(x, y).item())
        opt.step()
        opt.zero_grad()
        traffic.append(measured.as_dict())
    held = {id(p) for p in pipe.parameters()}
    state = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False) if id(p) in held}
    timeline = pipe.timeline.events if record else None
    return state, losses, traffic, timeline


def gathered(results) -> dict[str, torch.Tensor]:
    """The full model from the ranks' pieces; a tensor held by two ranks (a tied weight) must agree exactly."""
    full: dict[str, torch.Tensor] = {}
    for state, *_ in results:
        for name, tensor in state.items():
            if name in full:
                assert torch.equal(full[name], tensor), f"{name} differs between the ranks holding it"
            full[name] = tensor
    return full


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """The tiny model gains nothing from intra-op threads, and on a loaded machine they spin: use one, then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tied_reference():
    return reference(CONFIG)


@pytest.mark.parametrize("m", [4, 8])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("schedule", pp.SCHEDULES)
def test_every_schedule_matches_one_process(schedule, p, m, tied_reference):
    want_state, want_losses = tied_reference
    results = sw.launch(train_pipeline, p, schedule, m)
    assert_state_close(gathered(results), want_state)
    for _, losses, _, _ in results:  # the mean loss comes back on every rank
        assert losses == pytest.approx(want_losses, rel=1e-5)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_untied_model_matches_and_needs_no_all_reduce(schedule):
    config = dataclasses.replace(CONFIG, tie_weights=False)
    want_state, _ = reference(config, steps=3)
    results = sw.launch(train_pipeline, 2, schedule, 4, config, 3)
    assert_state_close(gathered(results), want_state)
    assert all("all_reduce" not in step for _, _, traffic, _ in results for step in traffic)


def test_tied_embedding_gradient_is_summed_between_first_and_last_stage():
    """p = 4: only ranks 0 and 3 hold the tied embedding; they all-reduce its gradient on their own sub-group."""

    def body(comm):
        model = GPT(CONFIG, seed=0)
        pipe = pp.Pipeline(pp.partition(model.pipeline_layers(), 4), comm, "1f1b", 4, lm_loss)
        pipe.step(*batch(0))
        grad = model.tok_emb.weight.grad
        groups = [(ranks, sub.stats.bytes("all_reduce")) for ranks, _, sub in pipe.tied.groups]
        return groups, None if grad is None else grad.clone(), pipe.tied.names

    results = sw.launch(body, 4)
    emb_bytes = CONFIG.vocab_size * CONFIG.d_model * 4 + 4  # + its used flag (unused.py): an int32 all-reduced first
    assert [r[0] for r in results] == [[((0, 3), emb_bytes)], [], [], [((0, 3), emb_bytes)]]
    assert results[0][2] == ["stage 0 <-> stage 3: 16384 elements"]
    model = GPT(CONFIG, seed=0)
    model(*batch(0)).backward()
    for rank in (0, 3):  # both copies got the sum of the lookup's and the head's gradient
        torch.testing.assert_close(results[rank][1], model.tok_emb.weight.grad, rtol=1e-5, atol=1e-7)


def test_point_to_point_traffic_is_one_activation_and_one_gradient_per_microbatch_and_boundary():
    m, p = 4, 2
    results = sw.launch(train_pipeline, p, "1f1b", m, CONFIG, 2)
    act_bytes = GLOBAL_BATCH // m * CONFIG.seq_len * CONFIG.d_model * 4
    meta_bytes = 10 * 8  # one small shape message per stage boundary and step
    sent0, sent1 = (r[2][-1]["send"] for r in results)
    assert sent0 == {"calls": m + 1, "bytes": m * act_bytes + meta_bytes, "wire_bytes": m * act_bytes + meta_bytes}
    assert sent1 == {"calls": m, "bytes": m * act_bytes, "wire_bytes": m * act_bytes}


def test_recorded_timeline_has_the_schedules_compute_actions_in_order():
    results = sw.launch(train_pipeline, 2, "zb_h1", 4, CONFIG, 1, True)
    schedule = pp.build_schedule("zb_h1", 2, 4)
    timeline = pp.Timeline.merge([pp.Timeline(r[3]) for r in results])
    for rank in range(2):
        events = timeline.of_rank(rank)
        assert [e.action for e in events] == [str(a) for a in schedule.actions[rank] if a.is_compute]
        assert all(a.end <= b.start for a, b in zip(events, events[1:]))
    assert 0.0 <= timeline.bubble < 1.0


def test_a_hand_written_schedule_runs():
    lines = ["0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B1 0RECV_B0 0B1 0B0",  # backwards in reverse order, on purpose
             "1RECV_F0 1RECV_F1 1F0 1F1 1B1 1SEND_B1 1B0 1SEND_B0"]
    schedule = pp.Schedule.from_text(lines, n_microbatches=2)
    config = dataclasses.replace(CONFIG, n_layers=2)
    want_state, _ = reference(config, steps=2)

    def body(comm):
        model = GPT(config, seed=0)
        pipe = pp.Pipeline(pp.partition(model.pipeline_layers(), 2), comm, schedule, 2, lm_loss)
        opt = make_optimizer(pipe.parameters())
        for step in range(2):
            pipe.step(*batch(step))
            opt.step()
            opt.zero_grad()
        held = {id(p) for p in pipe.parameters()}
        return ({n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False) if id(p) in held},)

    assert_state_close(gathered(sw.launch(body, 2)), want_state)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zb_h1"])
def test_one_rank_pipeline_hands_stages_over_locally(schedule, tied_reference):
    state, losses, traffic, _ = train_pipeline(sw.init(), schedule, 4)
    assert_state_close(state, tied_reference[0])
    assert all("send" not in step for step in traffic)


def _two_comms():
    return ThreadWorld(2, timeout=5).communicators()


def _stages(n=2, v=1):
    return pp.partition(GPT(CONFIG, seed=0).pipeline_layers(), n, virtual_stages=v)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(schedule="1f1b", n_microbatches=1), r"schedule='1f1b' needs n_microbatches >= the number of pipeline"),
        (dict(schedule="zb_h1", n_microbatches=1), r"needs n_microbatches >= the number of pipeline ranks \(2\)"),
        (dict(schedule="interleaved_1f1b", n_microbatches=4), r"needs virtual_stages >= 2 \(got 1\)"),
        (dict(schedule="fifo", n_microbatches=4), r"schedule='fifo' is not a schedule"),
        (dict(schedule="1f1b", n_microbatches=4, loss_fn=None), r"loss_fn=None must be a callable"),
    ],
)
def test_bad_configurations_are_value_errors_at_construction(kwargs, match):
    kwargs = {"loss_fn": lm_loss, **kwargs}
    with pytest.raises(ValueError, match=match):
        pp.Pipeline(_stages(), _two_comms()[0], **kwargs)


def test_stage_count_must_fit_the_ranks():
    with pytest.raises(ValueError, match=r"3 stages cannot be spread over 2 pipeline ranks"):
        pp.Pipeline(_stages(3), _two_comms()[0], "gpipe", 4, lm_loss)
    with pytest.raises(ValueError, match=r"runs one stage per rank but virtual_stages=2"):
        pp.Pipeline(_stages(2, 2), _two_comms()[0], "1f1b", 4, lm_loss)
    with pytest.raises(ValueError, match=r"9 x 1 = 9 stages but the model has only 8 layers"):
        _stages(9)


def test_microbatches_must_divide_the_batch_and_inputs_are_required():
    pipe = pp.Pipeline(_stages(1), sw.init(), "gpipe", 3, lm_loss)
    x, y = batch(0)
    with pytest.raises(ValueError, match=r"inputs has a batch of 8 rows \(dim 0\), which does not split into "
                                         r"n_microbatches=3 equal microbatches"):
        pipe.step(x, y)
    pipe = pp.Pipeline(_stages(1), sw.init(), "gpipe", 4, lm_loss)
    with pytest.raises(ValueError, match=r"rank 0 holds the last stage \(0\) and needs targets, got None"):
        pipe.step(x, None)


def test_pipeline_keeps_only_its_own_stages():
    def body(comm):
        stages = _stages(2, 2)
        pipe = pp.Pipeline(stages, comm, "interleaved_1f1b", 2, lm_loss)
        mine = {id(p) for p in pipe.parameters()}
        expected = {id(p) for s in pipe.local_stages for p in stages[s].parameters()}
        return pipe.local_stages, mine == expected

    assert sw.launch(body, 2) == [([0, 2], True), ([1, 3], True)]


def test_a_silent_peer_is_a_comm_error_naming_the_receive_not_a_hang():
    untied = dataclasses.replace(CONFIG, tie_weights=False)

    def body(comm):
        if comm.rank == 1:
            return None  # never takes part
        stages = pp.partition(GPT(untied, seed=0).pipeline_layers(), 2)
        pp.Pipeline(stages, comm, "1f1b", 2, lm_loss).step(*batch(0))

    # Pipeline construction agrees on the schedule with its peers first: the silent peer is caught there.
    with pytest.raises(sw.LaunchError, match=r"rank 0 failed: CommError: all_gather.* timed out after 1s.*\[1\]"):
        sw.launch(body, 2, timeout=1)


# ---- placement: every buffer the pipeline allocates for communication is on comm.device ------------------------------
class _Recorder:
    """A pipeline communicator of one rank of a world of two that declares the meta device and records the devices
    of every tensor handed to it (nothing is delivered: placement only)."""

    def __init__(self, rank: int = 0, size: int = 2) -> None:
        self.rank, self.size, self.device = rank, size, torch.device("meta")
        self.seen: list[tuple[str, torch.device]] = []

    def batch_isend_irecv(self, ops):
        from shardwise.comm.base import CompletedWork, P2PKind

        self.seen += [("send" if o.kind is P2PKind.SEND else "recv", o.tensor.device) for o in ops]
        return [CompletedWork() for _ in ops]

    def broadcast(self, tensor, src=0, *, async_op=False):
        self.seen.append(("broadcast", tensor.device))


def test_metadata_flags_and_receive_buffers_are_allocated_on_comm_device():
    from shardwise.pipeline.messages import Messenger, spec_of

    comm = _Recorder()
    sender = Messenger(comm, lambda s: s % 2, 2)
    out = (torch.randn(2, 3, device="meta", requires_grad=True), torch.ones(2, dtype=torch.int64, device="meta"))
    sender.send_activation(out, 0, 0)  # header + body (metadata), then the leaves
    sender.post()
    receiver = Messenger(comm, lambda s: s % 2, 2)
    receiver.in_spec[1] = spec_of(out)
    receiver.expect_activation(1, 1)  # shapes known: receive buffers allocated here
    receiver.send_gradients([None], 1, 0)  # a structured input: flags, then zeros for the unused leaf
    receiver.expect_gradients(0, 0, spec_of(out))  # flags buffer + gradient buffers
    receiver.post()
    kinds = [k for k, _ in comm.seen]
    assert kinds.count("send") >= 5 and kinds.count("recv") >= 3
    assert {d for _, d in comm.seen} == {torch.device("meta")}, comm.seen


def test_the_broadcast_loss_is_allocated_on_comm_device():
    comm = _Recorder(rank=0, size=1)
    pipe = pp.Pipeline([torch.nn.Linear(3, 3)], comm, schedule="gpipe", n_microbatches=1,
                       loss_fn=lambda out, y: ((out - y) ** 2).mean())
    pipe.step(torch.randn(2, 3), torch.randn(2, 3))
    assert comm.seen == [("broadcast", torch.device("meta"))]
