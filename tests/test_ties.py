"""Parameters and buffers shared between modules stay shared through every strategy, or the wrap is refused naming
both names: a silently untied copy trains (or stays) stale while the other trains (issue: BERT's LM head,
``self.bias = self.decoder.bias``, under a column-parallel decoder)."""

from __future__ import annotations

import threading

import pytest
import torch
from parity import assert_state_close
from torch import nn

import shardwise as sw
from shardwise import tensor_parallel as tp
from shardwise.placement import move_keeping_ties

_lock = threading.Lock()  # thread ranks share torch's global RNG


class Head(nn.Module):
    """BERT's LM head in miniature: `bias` is registered on the head and is also the decoder's bias; the
    decoder's weight is tied to the embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.mix = nn.Linear(4, 4)
        self.decoder = nn.Linear(4, 8)
        self.decoder.weight = self.emb.weight
        self.bias = self.decoder.bias

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.decoder(torch.tanh(self.mix(self.emb(tokens))))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, 1).flatten())


def build() -> Head:
    with _lock:
        torch.manual_seed(0)
        return Head()


TOKENS = torch.randint(0, 8, (4, 5), generator=torch.Generator().manual_seed(1))


def _train(model: nn.Module, rows: torch.Tensor, steps: int = 2) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    for _ in range(steps):
        model(rows).backward()
        sw.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad()


def _reference() -> dict[str, torch.Tensor]:
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    for _ in range(2):
        model(TOKENS).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


PLANS = {
    "colwise_gathered": {"emb": "vocab", "decoder": tp.Colwise(gather_output=True)},
    "rowwise_head": {"mix": "colwise", "decoder": "rowwise"},
}


def _tp(comm, plan):
    model = build()
    if plan == "rowwise_head":  # a row split of the decoder's weight cannot share the embedding's row split
        model.decoder.weight = nn.Parameter(model.emb.weight.detach().clone())
    model = tp.parallelize(model, comm, PLANS[plan])
    tied = model.bias is model.decoder.bias
    _train(model, TOKENS)
    full = {k: v.clone() for k, v in sw.full_state_dict(model).items()}
    return tied, model.bias is model.decoder.bias, full, {k: v.clone() for k, v in tp.full_state_dict(model).items()}


def test_a_tied_bias_stays_tied_under_a_column_parallel_decoder_and_trains_as_one_process():
    want = _reference()
    for tied_before, tied_after, full, tp_full in sw.launch(_tp, 2, "colwise_gathered"):
        assert tied_before and tied_after
        assert_state_close(full, want)  # both names of each tie
        assert_state_close(tp_full, want)


def test_a_tied_bias_stays_tied_under_a_row_parallel_decoder():
    for tied_before, tied_after, full, _ in sw.launch(_tp, 2, "rowwise_head"):
        assert tied_before and tied_after
        torch.testing.assert_close(full["bias"], full["decoder.bias"], rtol=0, atol=0)


def test_a_tie_to_a_layer_the_plan_leaves_dense_is_refused_naming_both():
    def body(comm):
        model = build()
        with _lock:  # both ranks' copies must agree (parallelize checks their fingerprints first)
            torch.manual_seed(1)
            other = nn.Linear(4, 8)
        other.bias = model.decoder.bias  # a dense Linear computing with the bias the plan would split
        model.other = other
        with pytest.raises(ValueError, match=r"parameter other.bias is tied to decoder.bias, which the plan splits, "
                                             r"but other is a Linear left dense"):
            tp.parallelize(model, comm, PLANS["colwise_gathered"])

    sw.launch(body, 2)


WRAPS = {
    "ddp": lambda m, c: sw.DDP(m, c),
    "zero1": lambda m, c: sw.ZeRO(m, c, stage=1),
    "zero2": lambda m, c: sw.ZeRO(m, c, stage=2),
    "zero3": lambda m, c: sw.ZeRO(m, c, stage=3),
    "shard_grad_op": lambda m, c: sw.FSDP(m, c, sharding="shard_grad_op"),
    "hybrid_shard": lambda m, c: sw.FSDP(m, c, sharding="hybrid_shard", shard_size=2),
    "tp_zero3": None,
}


def _data_parallel(comm, name):
    if name == "tp_zero3":
        mesh = sw.Mesh(comm, dp=2, tp=2)
        model, dp, rows = tp.parallelize(build(), mesh.tp, PLANS["colwise_gathered"]), mesh.dp, mesh.coords.dp
        model = sw.ZeRO(model, dp, stage=3)
        size = 2
    else:
        model, rows, size = WRAPS[name](build(), comm), comm.rank, comm.size
    per = TOKENS.shape[0] // size
    _train(model, TOKENS[rows * per : (rows + 1) * per])
    ties = (model.bias is model.decoder.bias, model.decoder.weight is model.emb.weight)
    return ties, {k: v.clone() for k, v in sw.full_state_dict(model).items()}


@pytest.mark.parametrize("name", list(WRAPS))
def test_ties_survive_every_data_parallel_strategy(name):
    want = _reference()
    world = 4 if name in ("hybrid_shard", "tp_zero3") else 2
    for ties, full in sw.launch(_data_parallel, world, name):
        assert ties == (True, True)
        assert_state_close(full, want)


class SharedBuffer(nn.Module):
    """Two modules holding one running-statistics buffer (one tensor under two names)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        stats = torch.zeros(3)
        self.a.register_buffer("stats", stats)
        self.b.register_buffer("stats", stats)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.a.stats.add_(x.detach().mean(0))  # one update, seen by both owners
        return (self.b(self.a(x)) + self.b.stats).square().mean()


def test_a_shared_buffer_stays_shared_under_zero_mixed_precision():
    def body(comm):
        model = sw.ZeRO(SharedBuffer(), comm, stage=3,
                        mixed_precision=sw.MixedPrecision(buffer_dtype=torch.float64))
        model(torch.ones(2, 3)).backward()
        return model.a.stats is model.b.stats, model.a.stats.dtype

    for shared, dtype in sw.launch(body, 2):
        assert shared and dtype == torch.float64


def test_moving_a_model_keeps_shared_buffers_shared():
    """to_comm_device moves a CPU model to the communicator's device (a GPU under NCCL); Module.to would untie
    a shared buffer there. The meta device stands in for the GPU on a CPU-only machine."""
    model = SharedBuffer()
    untied = SharedBuffer().to("meta")
    assert untied.a.stats is not untied.b.stats  # torch's own Module.to: the failure this guards against
    move_keeping_ties(model, "meta")
    assert model.a.stats is model.b.stats and model.a.stats.device.type == "meta"
