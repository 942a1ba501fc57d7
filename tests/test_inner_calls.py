"""A module inside a unit called from outside the unit's forward gathers the unit for that call (sharding/
inner_calls.py): a DiT-shaped model (Peebles & Xie 2023; diffusers' DiTTransformer2DModel computes its output
conditioning with `transformer_blocks[0].norm1.emb(...)` after every block ran) trains as one process under ZeRO-3
and FSDP with a unit per block, where it was refused at its first forward. After the first forward only the modules
called that way keep a hook.

References are computed: the same model trained (AdamW, weight decay) in one process on the global batch."""

from __future__ import annotations

import threading

import pytest
import torch
from parity import assert_state_close, train_mlp
from torch import nn

import shardwise as sw

_BUILD = threading.Lock()  # thread ranks share torch's global RNG: one seeded build at a time


class Conditioning(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mix = Conditioning(), nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.mix(h) * self.emb(x))


class DiTLike(nn.Module):
    """The output layer reads its conditioning from block 0's `emb`, after every block ran."""

    def __init__(self, late: bool = False) -> None:
        super().__init__()
        with _BUILD, torch.random.fork_rng():
            torch.manual_seed(0)
            self.inp = nn.Linear(6, 8)
            self.blocks = nn.ModuleList([Block() for _ in range(3)])
            self.out = nn.Linear(8, 1)
        self.late, self.calls = late, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, x)
        self.calls += 1
        if self.late and self.calls == 1:
            return self.out(h)  # the first forward takes the other path
        return self.out(h * self.blocks[0].emb(x))


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


WRAPS = {
    "zero1-per-block": lambda m, c: sw.ZeRO(m, c, stage=1, wrap=Block),
    "zero2-per-block": lambda m, c: sw.ZeRO(m, c, stage=2, wrap=Block),
    "zero3-per-block": lambda m, c: sw.ZeRO(m, c, stage=3, wrap=Block),
    "zero3-per-block-no-prefetch": lambda m, c: sw.ZeRO(m, c, stage=3, wrap=Block, prefetch=False),
    "zero3-per-block-checkpointed": lambda m, c: sw.ZeRO(m, c, stage=3, wrap=Block, activation_checkpointing=True),
    "fsdp-per-block": lambda m, c: sw.FSDP(m, c, wrap=Block),
    "fsdp-shard-grad-op-per-block": lambda m, c: sw.FSDP(m, c, sharding="shard_grad_op", wrap=Block),
    "fsdp-hybrid-per-block": lambda m, c: sw.FSDP(m, c, sharding="hybrid_shard", shard_size=2, wrap=Block),
}


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_a_blocks_submodule_called_after_the_blocks_trains_as_one_process(wrap: str) -> None:
    want = {k: v.clone() for k, v in train_mlp(DiTLike(), mse).state_dict().items()}
    world = 4 if "hybrid" in wrap else 2

    def body(comm: sw.Communicator) -> dict[str, torch.Tensor]:
        model = train_mlp(WRAPS[wrap](DiTLike(), comm), mse, comm.rank, comm.size)
        with torch.no_grad():  # evaluation takes the same path, with no backward to free the unit
            model(torch.ones(2, 6))
        return {k: v.clone() for k, v in sw.full_state_dict(model).items()}

    for got in sw.launch(body, world):
        assert_state_close(got, want)


def test_only_the_modules_called_from_outside_keep_a_hook() -> None:
    def hooked(model: nn.Module) -> list[str]:
        return sorted(name for name, m in model.named_modules() if m._forward_pre_hooks)

    def body(comm: sw.Communicator) -> tuple[list[str], list[str]]:
        model = sw.ZeRO(DiTLike(), comm, stage=3, wrap=Block)
        before = hooked(model)
        mse(model, torch.ones(2, 6), torch.zeros(2, 1)).backward()
        return before, hooked(model)

    before, after = sw.launch(body, 2)[0]
    assert {"blocks.0.emb", "blocks.0.emb.proj", "blocks.1.mix", "blocks.2.emb.proj"} <= set(before)
    assert after == ["", "blocks.0", "blocks.0.emb", "blocks.1", "blocks.2"]  # the root, the units, the entry


def test_a_call_first_made_after_the_first_forward_is_refused_by_name() -> None:
    def body(comm: sw.Communicator) -> str:
        model = sw.ZeRO(DiTLike(late=True), comm, stage=3, wrap=Block)
        try:
            train_mlp(model, mse, comm.rank, comm.size, steps=2)
        except RuntimeError as e:
            return str(e)
        return "trained"

    for text in sw.launch(body, 2):
        assert "on blocks.0.emb.proj.weight, a ZeRO-3 shard" in text


class Prompted(nn.Module):
    """A forward that takes embeddings: the script builds them with the model's own embedding, a module of the root
    unit called before the model's forward (prompt tuning, image features spliced into a prompt)."""

    def __init__(self) -> None:
        super().__init__()
        with _BUILD, torch.random.fork_rng():
            torch.manual_seed(0)
            self.emb = nn.Embedding(20, 8)
            self.blocks = nn.ModuleList([Block() for _ in range(2)])
            self.head = nn.Linear(8, 1)

    def forward(self, inputs_embeds: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = inputs_embeds
        for block in self.blocks:
            h = block(h, x)
        return self.head(h).mean(1)


def prompted_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    tokens = (x.abs() * 7).long().clamp(max=19)  # (rows, 6) ids from the regression inputs
    embeds = model.emb(tokens)  # the root unit's embedding, outside the forward
    return ((model(embeds, x[:, None, :].expand(-1, 6, -1)) - y) ** 2).mean()


@pytest.mark.parametrize("wrap", ["zero2-per-block", "zero3-per-block", "fsdp-per-block"])
def test_a_root_module_called_before_the_forward_trains_as_one_process(wrap: str) -> None:
    want = {k: v.clone() for k, v in train_mlp(Prompted(), prompted_loss).state_dict().items()}

    def body(comm: sw.Communicator) -> dict[str, torch.Tensor]:
        model = train_mlp(WRAPS[wrap](Prompted(), comm), prompted_loss, comm.rank, comm.size)
        with torch.no_grad():  # evaluation builds its embeddings the same way
            model(model.emb(torch.zeros(2, 3, dtype=torch.long)), torch.ones(2, 3, 6))
        return {k: v.clone() for k, v in sw.full_state_dict(model).items()}

    for got in sw.launch(body, 2):
        assert_state_close(got, want)


def test_a_t5_encoder_called_by_the_script_matches_one_process() -> None:
    """Sentence embeddings from a T5's encoder, called directly (its shared embedding is in the root unit)."""
    pytest.importorskip("transformers")
    from hf_cases import tiny_t5
    from transformers.models.t5.modeling_t5 import T5Block

    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = tiny_t5().encoder(input_ids=ids).last_hidden_state

    def body(comm: sw.Communicator) -> torch.Tensor:
        model = sw.ZeRO(tiny_t5(), comm, stage=3, wrap=T5Block)
        with torch.no_grad():
            return model.encoder(input_ids=ids).last_hidden_state

    for got in sw.launch(body, 2):
        torch.testing.assert_close(got, want)
