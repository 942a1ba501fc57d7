"""Initialising parameters after wrapping: random fills of a sharded piece draw what one process draws.

`model.apply(init_fn)`, `layer.reset_parameters()`, `p.data.normal_()` (HuggingFace's `_init_weights`) or noise from
`torch.randn_like(p)` after `sw.ZeRO` / `sw.FSDP` / tensor parallel run on this rank's piece. Run as they were, each
rank drew its piece's count of numbers from the same generator state (the first numbers of the stream, in every
piece), so the model differed from one process's and every later draw too, silently. Each test below compares, bit
for bit, the wrapped model after the same initialiser (same generator seed) with one process's, then the generator
states, then training with AdamW (weight decay) from those values."""

from __future__ import annotations

import threading

import pytest
import torch
from parity import assert_state_close
from torch import nn

import shardwise as sw
from shardwise import tensor_parallel as tp
from shardwise.experts import expert_parallel
from shardwise.models import GPT, GPTConfig
from shardwise.sharded_tensor import ShardSpec, as_sharded, is_sharded

_lock = threading.Lock()
CONFIG = GPTConfig.preset("tiny", n_layers=2)


class Net(nn.Module):
    """A conv, an embedding, linears and a LayerNorm: every kind of initialiser below has a target."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.emb = nn.Embedding(10, 12)
        self.lin = nn.Linear(12, 12)
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 3)

    def forward(self, image: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.conv(image).mean((2, 3)).repeat(1, 3) + self.emb(ids)
        return self.head(self.norm(torch.tanh(self.lin(h))))


def built() -> Net:
    with _lock, torch.random.fork_rng():  # thread ranks share torch's global generator
        torch.manual_seed(0)
        return Net()


def initialise(model: nn.Module, g: torch.Generator) -> None:
    """What scripts do after building (here: after wrapping): torch.nn.init, `.data` fills, reset_parameters, noise."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.xavier_normal_(m.weight, generator=g)
                m.bias.data.normal_(0.0, 0.01, generator=g)
            elif isinstance(m, nn.Embedding):
                m.weight.data.normal_(mean=0.0, std=0.02, generator=g)
            elif isinstance(m, nn.Linear):
                nn.init.kaiming_uniform_(m.weight, a=0.1, generator=g)
                nn.init.uniform_(m.bias, -0.1, 0.1, generator=g)
            elif isinstance(m, nn.LayerNorm):
                nn.init.constant_(m.weight, 1.5)
                m.bias.uniform_(-0.05, 0.05, generator=g)
        for p in model.parameters():
            p.add_(torch.randn_like(p, generator=g) * 1e-3)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(10 + step)
    image, ids = torch.randn(12, 2, 5, 5, generator=g), torch.randint(0, 10, (12,), generator=g)
    y = torch.randn(12, 3, generator=g)
    rows = slice(rank * 12 // world, (rank + 1) * 12 // world)
    return image[rows], ids[rows], y[rows]


def run(model: nn.Module, rank: int, world: int) -> tuple[dict, torch.Tensor, dict]:
    """Initialise with a seeded generator, read the values and the generator's next draw, train 3 AdamW steps."""
    g = torch.Generator().manual_seed(5)
    initialise(model, g)
    after_init = {k: v.clone() for k, v in sw.full_state_dict(model).items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
    for step in range(3):
        image, ids, y = batch(step, rank, world)
        ((model(image, ids) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return after_init, torch.rand(4, generator=g), {k: v.clone() for k, v in sw.full_state_dict(model).items()}


WRAPS = {
    "zero1": lambda m, c: sw.ZeRO(m, c, stage=1),
    "zero3": lambda m, c: sw.ZeRO(m, c, stage=3),
    "zero3_units": lambda m, c: sw.ZeRO(m, c, stage=3, wrap=(nn.Linear, nn.Conv2d, nn.Embedding)),
    "fsdp_hybrid": lambda m, c: sw.FSDP(m, c, sharding="hybrid_shard", shard_size=2, wrap=(nn.Linear,)),
}


@pytest.mark.parametrize("name", list(WRAPS))
def test_initialisers_after_wrapping_give_one_process_values(name):
    """ZeRO-1/3 and FSDP (flat pieces, uneven: 3 ranks): the same values as one process, bit for bit, the same
    generator state after, and the same training. Before: each rank's piece held the stream's first numbers."""
    want_init, want_next, want_trained = run(built(), 0, 1)
    world = 4 if name == "fsdp_hybrid" else 3

    def body(comm):
        return run(WRAPS[name](built(), comm), comm.rank, comm.size)

    for got_init, got_next, got_trained in sw.launch(body, world):
        assert set(got_init) == set(want_init)
        for key in want_init:
            assert torch.equal(got_init[key], want_init[key]), key
        assert torch.equal(got_next, want_next)
        assert_state_close(got_trained, want_trained)


def _gpt_init(model: nn.Module, g: torch.Generator) -> tuple[dict, torch.Tensor]:
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.05, generator=g)
            else:
                p.uniform_(0.5, 1.5, generator=g)
    return {k: v.clone() for k, v in sw.full_state_dict(model).items()}, torch.rand(4, generator=g)


@pytest.mark.parametrize("dp_strategy", [None, "zero3"])
def test_initialisers_on_tensor_parallel_slices_and_their_zero_pieces(dp_strategy):
    """Column, row, fused-QKV (three boxes per rank) and vocabulary slices of `tp.parallelize`, alone and under
    ZeRO-3 over dp (a flat range of each slice): the dense values equal one process's, as do the generators."""
    want, want_next = _gpt_init(GPT(CONFIG, seed=0), torch.Generator().manual_seed(7))

    def body(comm):
        mesh = sw.Mesh(comm, dp=comm.size // 2, tp=2)
        model = tp.parallelize(GPT(CONFIG, seed=0), mesh.tp, "gpt")
        if dp_strategy is not None:
            model = sw.ZeRO(model, mesh.dp, stage=3)
        assert any(is_sharded(p) for p in model.parameters())
        return _gpt_init(model, torch.Generator().manual_seed(7))

    for got, got_next in sw.launch(body, 4 if dp_strategy else 2):
        assert set(got) == set(want)
        for key in want:
            assert torch.equal(got[key], want[key]), key
        assert torch.equal(got_next, want_next)


@pytest.mark.parametrize("dp_strategy", ["ddp", "zero3"])
def test_initialisers_on_expert_parallel_pieces(dp_strategy):
    """A MoE GPT's experts split over ep=2 (under DDP, or ZeRO-3 over dp on top): one process's values."""
    from expert_cases import CFG as MOE

    want, want_next = _gpt_init(GPT(MOE, seed=0), torch.Generator().manual_seed(9))

    def body(comm):
        mesh = sw.Mesh(comm, ep=2)
        model = expert_parallel(GPT(MOE, seed=0), mesh)
        model = sw.DDP(model, mesh.dp) if dp_strategy == "ddp" else sw.ZeRO(model, mesh.dp, stage=3)
        return _gpt_init(model, torch.Generator().manual_seed(9))

    for got, got_next in sw.launch(body, 4):
        assert set(got) == set(want)
        for key in want:
            assert torch.equal(got[key], want[key]), key
        assert torch.equal(got_next, want_next)


def test_data_of_a_piece_answers_for_the_whole_tensor():
    """`p.data` is the same piece answering for the whole parameter (it was the plain flat piece: `.dim()` 1, and
    `p.data.norm()` one rank's norm); writes through it reach the next forward."""

    def body(comm):
        model = sw.ZeRO(built(), comm, stage=3)
        weight = model.lin.weight
        assert weight.data.shape == (12, 12) and weight.data.dim() == 2 and is_sharded(weight.data)
        with pytest.raises(RuntimeError, match="lin.weight"):
            weight.data.norm()
        weight.data.fill_(0.0)
        model.lin.bias.data.fill_(0.0)
        image, ids, _ = batch(0, comm.rank, comm.size)
        out = model(image, ids)
        reference = built()
        with torch.no_grad():
            reference.lin.weight.zero_()
            reference.lin.bias.zero_()
        return out, reference(image, ids)

    for out, want in sw.launch(body, 2):
        torch.testing.assert_close(out, want)


def test_fills_that_need_more_than_the_piece_are_refused():
    """A piece with no declared place, a fill reading another tensor elementwise, initialisers that read the whole
    tensor (trunc_normal_'s rejection sampling, orthogonal_) and reading a row (writes through an index work:
    test_sharded_index.py): a RuntimeError naming the parameter and what works."""
    loose = as_sharded(torch.zeros(2), ShardSpec(torch.Size([4]), "loose.weight", flat=True))
    with pytest.raises(RuntimeError, match="loose.weight.*place in the whole tensor"):
        loose.normal_()

    def body(comm):
        model = sw.ZeRO(built(), comm, stage=3)
        errors = []
        for fill in (lambda w: w.bernoulli_(torch.full((12, 12), 0.5)), lambda w: nn.init.trunc_normal_(w),
                     lambda w: nn.init.orthogonal_(w), lambda w: w.data[0].sum()):  # the last: a row read
            with pytest.raises(RuntimeError) as caught:
                with torch.no_grad():
                    fill(model.lin.weight)
            errors.append(str(caught.value))
        return errors

    for errors in sw.launch(body, 2):
        assert all("lin.weight" in e for e in errors), errors
        assert "tensor argument" in errors[0]
        assert "initialise before wrapping" in errors[1] and "initialise before wrapping" in errors[2]
        assert "writes through the index work" in errors[3]


def test_initialisers_while_transformers_stands_in_for_torch_init():
    """transformers replaces torch.nn.init's functions module-wide while it builds a model (and with thread ranks
    building at once the replacement can outlive the builds): its stand-ins, which call torch's, run on pieces as
    torch's do (they were refused by name)."""
    from transformers import initialization

    with initialization.guard_torch_init_functions():
        assert torch.nn.init.kaiming_uniform_ is initialization.kaiming_uniform_
        test_initialisers_after_wrapping_give_one_process_values("zero3")
