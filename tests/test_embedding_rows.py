"""nn.Embedding / nn.EmbeddingBag row options under data parallelism (embedding_rows.py): max_norm renormalises the
union of every rank's rows, as one process renormalises the whole batch's (training and evaluation forwards), where
the write reaches the master; layouts that would lose it and sparse gradients are refused by name.

References are computed: the same model trained (AdamW, weight decay) in one process on the global batch."""

from __future__ import annotations

import threading

import pytest
import torch
from parity import assert_state_close, value_error_text
from torch import nn

import shardwise as sw

VOCAB, WIDTH, GLOBAL = 24, 8, 8
_BUILD = threading.Lock()  # thread ranks share torch's global RNG: one seeded build at a time

EXACT = {
    "ddp": lambda m, c: sw.DDP(m, c),
    "zero1": lambda m, c: sw.ZeRO(m, c, stage=1),
    "zero2": lambda m, c: sw.ZeRO(m, c, stage=2, wrap=(nn.Embedding, nn.EmbeddingBag)),
    "fsdp-no_shard": lambda m, c: sw.FSDP(m, c, sharding="no_shard"),
}
REFUSED = {
    "zero3": lambda m, c: sw.ZeRO(m, c, stage=3),
    "fsdp": lambda m, c: sw.FSDP(m, c),
    "fsdp-shard_grad_op": lambda m, c: sw.FSDP(m, c, sharding="shard_grad_op"),
    "zero2-bf16": lambda m, c: sw.ZeRO(m, c, stage=2, mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16)),
    "zero1-offload": lambda m, c: sw.ZeRO(m, c, stage=1, cpu_offload="optimizer"),
}


class Lookup(nn.Module):
    """A max_norm Embedding (token positions) and a max_norm EmbeddingBag (the sequence's bag), summed, then a
    linear head. N(0, 1) rows of width 8 have norms near 2.8, so max_norm=1.5 renormalises most looked-up rows."""

    def __init__(self) -> None:
        super().__init__()
        with _BUILD, torch.random.fork_rng():
            torch.manual_seed(0)
            self.tokens = nn.Embedding(VOCAB, WIDTH, max_norm=1.5)
            self.bag = nn.EmbeddingBag(VOCAB, WIDTH, max_norm=2.0, mode="mean")
            self.head = nn.Linear(WIDTH, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.tokens(ids).mean(1) + self.bag(ids))).squeeze(-1)


def batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    ids, y = torch.randint(0, VOCAB, (GLOBAL, 3), generator=g), torch.randn(GLOBAL, generator=g)
    rows = slice(rank * GLOBAL // world, (rank + 1) * GLOBAL // world)
    return ids[rows], y[rows]


def train(model: nn.Module, rank: int = 0, world: int = 1, steps: int = 3) -> nn.Module:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
    for step in range(steps):
        ids, y = batch(step, rank, world)
        ((model(ids) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():  # an evaluation forward renormalises the rows it looks up too
        model(batch(7, rank, world)[0])
    return model


@pytest.mark.parametrize("wrap", list(EXACT))
def test_max_norm_renormalises_every_ranks_rows_as_one_process(wrap: str) -> None:
    plain = Lookup()
    before = plain.tokens.weight.detach().norm(dim=1)
    want = {k: v.clone() for k, v in train(plain).state_dict().items()}
    after = want["tokens.weight"].norm(dim=1)
    assert int(((before > 1.5) & (after <= 1.5 + 1e-5)).sum()) >= 10  # max_norm did act on many rows

    def body(comm: sw.Communicator) -> dict[str, torch.Tensor]:
        model = train(EXACT[wrap](Lookup(), comm), comm.rank, comm.size)
        return {k: v.clone() for k, v in sw.full_state_dict(model).items()}

    for got in sw.launch(body, 2):
        assert_state_close(got, want)


@pytest.mark.parametrize("wrap", list(REFUSED))
def test_layouts_that_would_lose_the_write_refuse_max_norm(wrap: str) -> None:
    def body(comm: sw.Communicator) -> str | None:
        return value_error_text(lambda: REFUSED[wrap](Lookup(), comm))

    for text in sw.launch(body, 2):
        assert text is not None and "Embedding 'tokens' has max_norm=1.5" in text and "would be lost" in text


def test_sparse_gradients_are_refused_and_a_sharded_group_of_one_takes_them() -> None:
    def model() -> nn.Module:
        return nn.Sequential(nn.Embedding(VOCAB, WIDTH, sparse=True), nn.Linear(WIDTH, 1))

    def body(comm: sw.Communicator) -> tuple[str | None, str | None]:
        return (value_error_text(lambda: sw.DDP(model(), comm)),
                value_error_text(lambda: sw.ZeRO(model(), comm, stage=2)))

    for ddp, zero in sw.launch(body, 2):
        assert ddp is not None and "DDP: Embedding '0' has sparse=True" in ddp and "sparse=False" in ddp
        assert zero is not None and "zero2: Embedding '0' has sparse=True" in zero
    alone = sw.launch(lambda comm: value_error_text(lambda: sw.DDP(model(), comm)), 1)[0]
    assert alone is not None and "sparse=True" in alone  # DDP's buckets take no sparse gradient even alone

    def one(comm: sw.Communicator) -> bool:
        wrapped = sw.ZeRO(model(), comm, stage=3)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        wrapped(torch.tensor([[1, 2]])).sum().backward()
        opt.step()
        return True

    assert sw.launch(one, 1) == [True]
