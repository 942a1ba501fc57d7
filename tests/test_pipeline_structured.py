"""Structured pipeline stages (tuples and dicts of tensors) and forward-only inference (`Pipeline.predict`).

The model is a toy HF-style decoder: an embedding taking (input_ids, attention_mask, position_ids, scale), six
layers taking and returning (hidden, attention_mask, position_ids, bias, past) as a tuple or a dict, and a head.
The mask is bool, the position ids int64 (sent, no gradient), `bias` a second floating leaf carrying a gradient
(unused by the head, so zeros flow back), `past` None (rebuilt by the receiver), `scale` a float given to every
microbatch. References are one process running the same layers on the whole batch.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from parity import CORPUS, assert_state_close, make_optimizer
from test_pipeline_executor import gathered
from test_pipeline_executor import one_intra_op_thread  # noqa: F401  (the autouse fixture, for this module too)
from torch import nn

import shardwise as sw
from shardwise import pipeline as pp
from shardwise.comm import ThreadWorld
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.pipeline.structure import call

VOCAB, D, T, B, N_LAYERS = 32, 16, 8, 8, 6
STEPS = 3
VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1}


def _pack(style, hidden, mask, pos, bias):
    if style == "dict":
        return {"hidden": hidden, "attention_mask": mask, "position_ids": pos, "bias": bias, "past": None}
    return hidden, mask, pos, bias, None


class Embed(nn.Module):
    def __init__(self, style):
        super().__init__()
        self.style = style
        self.tok, self.pos, self.gate = nn.Embedding(VOCAB, D), nn.Embedding(T, D), nn.Linear(D, D)

    def forward(self, input_ids, attention_mask, position_ids, scale):
        hidden = (self.tok(input_ids) + self.pos(position_ids)) * scale
        return _pack(self.style, hidden, attention_mask, position_ids, torch.tanh(self.gate(hidden)))


class Layer(nn.Module):
    """Masked causal attention plus an MLP; uses the bool mask, the int position ids and the float bias."""

    def __init__(self, style):
        super().__init__()
        self.style = style
        self.qkv, self.proj = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.freq, self.mix = nn.Parameter(torch.randn(D) * 0.1), nn.Parameter(torch.randn(D))

    def forward(self, hidden, attention_mask, position_ids, bias, past):
        assert past is None
        q, k, v = self.qkv(hidden).chunk(3, dim=-1)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        keep = attention_mask[:, None, :] & causal
        scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~keep, -1e9)
        hidden = hidden + self.proj(scores.softmax(-1) @ v) + torch.sin(position_ids[..., None] * self.freq) + bias
        hidden = hidden + self.mlp(hidden)
        return _pack(self.style, hidden, attention_mask, position_ids, torch.tanh(bias * self.mix))


class Head(nn.Module):
    """Ignores `bias`, so the previous stage gets a zero gradient for it. The dict style returns a dict."""

    def __init__(self, style):
        super().__init__()
        self.style = style
        self.ln, self.out = nn.LayerNorm(D), nn.Linear(D, VOCAB)

    def forward(self, hidden, attention_mask, position_ids, bias, past):
        logits = self.out(self.ln(hidden))
        if self.style == "dict":
            return {"logits": logits, "attention_mask": attention_mask, "past": past}
        return logits


def decoder(style: str) -> list[nn.Module]:
    torch.manual_seed(0)
    return [Embed(style), *(Layer(style) for _ in range(N_LAYERS)), Head(style)]


def loss_fn(out, targets):
    logits = out["logits"] if isinstance(out, dict) else out
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(step: int, style: str):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] >= (T - lengths)[:, None]  # left padding, as HF batches for generation
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    targets = torch.randint(0, VOCAB, (B, T), generator=g)
    if style == "dict":
        return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "scale": 0.5}, targets
    return (ids, mask, pos, 0.5), targets


def optimizer(style, params):
    return make_optimizer(params) if style == "dict" else torch.optim.SGD(params, lr=0.1)


def forward_all(layers, inputs):
    value = inputs
    for layer in layers:
        value = call(layer, value)
    return value


def named(layers) -> dict[int, str]:
    return {id(p): n for n, p in nn.ModuleList(layers).named_parameters()}


def reference(style: str, steps: int = STEPS):
    layers = decoder(style)
    opt = optimizer(style, nn.ModuleList(layers).parameters())
    losses = []
    for step in range(steps):
        loss = loss_fn(forward_all(layers, batch(step, style)[0]), batch(step, style)[1])
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in nn.ModuleList(layers).named_parameters()}, losses


@pytest.fixture(scope="module")
def references():
    return {style: reference(style) for style in ("dict", "tuple")}


def train(comm, layers, style, schedule, m=4, predict_at=None):
    """Train STEPS steps on this rank's stages (a predict before step `predict_at`); return (parameters held here
    by name, losses, what predict returned)."""
    layers = copy.deepcopy(layers)
    pipe = pp.Pipeline(pp.partition(layers, comm.size, virtual_stages=VIRTUAL[schedule]), comm, schedule, m, loss_fn)
    opt = optimizer(style, pipe.parameters())
    losses, predicted = [], None
    for step in range(STEPS):
        if step == predict_at:
            predicted = pipe.eval().predict(batch(step, style)[0])
            assert all(p.grad is None for p in pipe.parameters())  # predict touched no gradient
            pipe.train()
        losses.append(pipe.step(*batch(step, style)).item())
        opt.step()
        opt.zero_grad()
    names = named(layers)
    return {names[id(p)]: p.detach().clone() for p in pipe.parameters()}, losses, predicted


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved_1f1b", "zb_h1"])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("style", ["dict", "tuple"])
def test_structured_decoder_trains_like_one_process(style, p, schedule, references):
    want_state, want_losses = references[style]
    results = sw.launch(train, p, decoder(style), style, schedule, backend="thread")
    assert_state_close(gathered(results), want_state)
    for _, losses, _ in results:
        assert losses == pytest.approx(want_losses, rel=1e-5)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zb_h1"])
def test_one_rank_hands_structures_over_locally(schedule, references):
    state, losses, predicted = train(sw.init(), decoder("dict"), "dict", schedule, predict_at=1)
    assert_state_close(state, references["dict"][0])
    assert losses == pytest.approx(references["dict"][1], rel=1e-5)
    assert set(predicted) == {"logits", "attention_mask", "past"}


def test_training_after_predict_still_matches_and_predict_keeps_no_graph(references):
    want_state, want_losses = references["dict"]
    results = sw.launch(train, 2, decoder("dict"), "dict", "1f1b", 4, 1, backend="thread")
    assert_state_close(gathered(results), want_state)
    for _, losses, predicted in results:
        assert losses == pytest.approx(want_losses, rel=1e-5)
        assert not predicted["logits"].requires_grad and predicted["logits"].grad_fn is None


def _predict_every_way(comm, layers, schedule, inputs, m):
    """predict to all, to 0 and to the last stage's rank; also report the modules' mode after eval()."""
    layers = copy.deepcopy(layers)
    stages = pp.partition(layers, comm.size, virtual_stages=VIRTUAL[schedule])
    pipe = pp.Pipeline(stages, comm, schedule, m, loss_fn if isinstance(layers[0], Embed) else lm_loss)
    assert pipe.eval() is pipe and not any(module.training for module in pipe.modules())
    last = pipe.schedule.rank_of(len(stages) - 1)
    return [pipe.predict(inputs, to=to) for to in ("all", 0, last)], last


def _check_predictions(results, want, compare):
    last = results[0][1]
    for rank, (outs, _) in enumerate(results):
        to_all, to_0, to_last = outs
        compare(to_all, want)
        if rank == 0:
            compare(to_0, want)
        else:
            assert to_0 is None
        if rank == last:
            compare(to_last, want)
        else:
            assert to_last is None


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not got.requires_grad


@pytest.mark.parametrize("p, schedule", [(2, "1f1b"), (2, "interleaved_1f1b"), (4, "gpipe")])
def test_predict_gpt_equals_one_process_forward(p, schedule):
    model = GPT(GPTConfig.preset("tiny"), seed=0)
    x, _ = CORPUS.batch(0, 8, model.config.seq_len)
    with torch.no_grad():
        want = model.eval()(x)
    results = sw.launch(_predict_every_way, p, GPT(GPTConfig.preset("tiny"), seed=0).pipeline_layers(), schedule, x,
                        4, backend="thread")
    _check_predictions(results, want, _close)


def _close_dict(got, want):
    assert set(got) == {"logits", "attention_mask", "past"} and got["past"] is None
    _close(got["logits"], want["logits"])
    assert torch.equal(got["attention_mask"], want["attention_mask"])


@pytest.mark.parametrize("p, schedule, m", [(2, "1f1b", 4), (4, "interleaved_1f1b", 4), (4, "gpipe", 2)])
def test_predict_dict_decoder_equals_one_process_forward(p, schedule, m):
    inputs, _ = batch(0, "dict")
    layers = decoder("dict")
    with torch.no_grad():
        want = forward_all(layers, inputs)
    _check_predictions(sw.launch(_predict_every_way, p, layers, schedule, inputs, m, backend="thread"), want,
                       _close_dict)


def test_predict_takes_its_own_microbatch_count_and_any_structure_of_inputs():
    layers = decoder("tuple")
    inputs, _ = batch(0, "tuple")
    with torch.no_grad():
        want = forward_all(layers, inputs)

    def body(comm):
        pipe = pp.Pipeline(pp.partition(copy.deepcopy(layers), 2), comm, "1f1b", 4, loss_fn)
        return pipe.predict(list(inputs), n_microbatches=8), pipe.predict(inputs, n_microbatches=1)

    for eight, one in sw.launch(body, 2, backend="thread"):
        _close(eight, want)
        _close(one, want)


# ---- schedules ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p, m, v", [(2, 4, 1), (4, 3, 1), (2, 4, 2), (3, 5, 3), (1, 2, 2)])
def test_forward_only_schedule_is_data_the_simulator_runs(p, m, v):
    sched = pp.build_schedule("forward_only", p, m, virtual_stages=v)
    assert sched.forward_only and "forward_only" not in pp.SCHEDULES and "forward_only" in pp.FORWARD_SCHEDULES
    assert {a.op for acts in sched.actions for a in acts} <= {pp.Op.FORWARD, pp.Op.SEND_F, pp.Op.RECV_F}
    pp.check_schedule(sched)
    result = pp.simulate(sched)
    assert result.peak_inflight == 1  # no graph is kept
    if v == 1:
        assert result.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert not pp.build_schedule("1f1b", 2, 2).forward_only


def test_a_forward_only_schedule_sending_gradients_is_rejected():
    bad = pp.Schedule.from_text(["0F0 0SEND_F0 0RECV_B0", "1RECV_F0 1F0 1SEND_B0"], n_microbatches=1)
    with pytest.raises(pp.ScheduleError, match=r"a forward-only schedule \(no backward pass\) sends no gradients"):
        pp.check_schedule(bad)


# ---- errors ------------------------------------------------------------------------------------------------------
class _Tagged(nn.Module):
    """Returns a string leaf: fine within a rank, a ValueError when it must be sent."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, tag=None):
        return self.lin(x), "layer-output"


def _tagged_stages(first=_Tagged):
    torch.manual_seed(0)
    return [first(), _Tagged()]


def _rank0(build):
    """Rank 0's Pipeline of a 2-rank thread world. Construction agrees on the schedule with the other rank (a
    collective), so both ranks build; the tests then drive rank 0 alone into errors raised before any message."""
    return sw.launch(build, 2, timeout=5)[0]


def test_a_leaf_that_cannot_be_sent_is_a_value_error_naming_the_stage_and_key():
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    pipe = _rank0(lambda comm: pp.Pipeline(_tagged_stages(), comm, "gpipe", 2, lambda out, t: F.mse_loss(out[0], t)))
    with pytest.raises(ValueError, match=r"stage 0 output\[1\] is a str, which cannot be sent to another rank"):
        pipe.step(x, None)
    with pytest.raises(ValueError, match=r"stage 0 output\[1\] is a str"):
        pipe.predict(x)
    # Within one rank the string is passed along as is.
    one = pp.Pipeline(_tagged_stages(), sw.init(), "interleaved_1f1b", 2, lambda out, t: F.mse_loss(out[0], t))
    assert one.step(x, y).item() > 0
    assert one.predict(x)[1] == "layer-output"


def test_an_output_predict_cannot_send_fails_on_every_rank_that_waits_for_it():
    def body(comm):
        pipe = pp.Pipeline(_tagged_stages(lambda: nn.Linear(4, 4)), comm, "gpipe", 2, loss_fn)
        x, raised = torch.randn(4, 4), []
        kept = pipe.predict(x, to=1)  # stays on the last stage's rank: nothing to send
        for to in ("all", 0):
            try:
                pipe.predict(x, to=to)
                raised.append(None)
            except ValueError as error:
                raised.append(str(error))
        return None if kept is None else kept[1], raised

    (kept0, raised0), (kept1, raised1) = sw.launch(body, 2, backend="thread")
    assert kept0 is None and kept1 == "layer-output"
    assert all("the last stage output[1] is a str, which cannot be sent" in e for e in raised1)
    assert all("the last stage's output cannot be sent from rank 1" in e for e in raised0)


def test_predict_and_construction_errors_name_what_is_allowed():
    comm = ThreadWorld(2, timeout=5).communicators()[0]
    pipe = _rank0(lambda comm: pp.Pipeline(_tagged_stages(), comm, "gpipe", 2, loss_fn))
    for to in (99, -1, "last", True):
        with pytest.raises(ValueError, match=r"must be 'all' or a rank of the pipeline communicator, one of 0\.\.1"):
            pipe.predict(torch.randn(4, 4), to=to)
    with pytest.raises(ValueError, match=r"schedule='forward_only' is not a training schedule \(pipe.predict"):
        pp.Pipeline(_tagged_stages(), comm, "forward_only", 2, loss_fn)
    with pytest.raises(ValueError, match=r"has no backward pass, so it cannot train"):
        pp.Pipeline(_tagged_stages(), comm, pp.build_schedule("forward_only", 2, 2), 2, loss_fn)
    inputs, _ = batch(0, "dict")
    with pytest.raises(ValueError, match=r"inputs\['attention_mask'\] has a batch of 6 rows \(dim 0\), which does not "
                                         r"split into n_microbatches=4"):
        pipe.predict({**inputs, "attention_mask": inputs["attention_mask"][:6]}, n_microbatches=4)
