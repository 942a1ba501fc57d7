"""Writing into parameters through an index of the whole tensor after wrapping: `w[pad] = 0`, `init.zeros_(w[pad])`.

HuggingFace's `_init_weights` zeroes an embedding's padding row with `init.zeros_(module.weight[padding_idx])`;
scripts set rows with `emb.weight.data[pad] = 0` or re-draw some with `w[i].normal_()`. On a ZeRO-3 / FSDP piece or
a tensor-parallel slice these were refused (an index of the flat piece selects other elements). Each test compares
the wrapped model after the same writes (same generator seed) with one process's, bit for bit, then the generator
state, then three AdamW steps (weight decay) from there, with a gradient row zeroed by index before each.
"""

from __future__ import annotations

import threading

import pytest
import torch
from parity import assert_state_close
from torch import nn

import shardwise as sw
from shardwise import tensor_parallel as tp
from shardwise.models import GPT, GPTConfig

_lock = threading.Lock()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 12, padding_idx=3)
        self.lin = nn.Linear(12, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(self.emb(ids))))


def built() -> Net:
    with _lock, torch.random.fork_rng():  # thread ranks share torch's global generator
        torch.manual_seed(0)
        return Net()


def write(model: nn.Module, g: torch.Generator) -> None:
    """Index writes a script makes: ints, strided slices, Ellipsis, index tensors, a whole-shaped mask; fills,
    copies, random draws and initialisers that read what they wrote (trunc_normal_)."""
    with torch.no_grad():
        nn.init.zeros_(model.emb.weight[model.emb.padding_idx])   # HuggingFace's padding row
        model.emb.weight.data[7] = 0.5
        model.lin.weight[:, 1:9:3] = torch.arange(3.0)             # a column block, broadcast over the rows
        model.lin.weight[2:5].normal_(0.0, 0.1, generator=g)       # re-drawn rows: the selection's count of numbers
        nn.init.trunc_normal_(model.lin.weight[..., -1], std=0.2, generator=g)
        model.head.weight[torch.tensor([0, 2])] = torch.ones(2, 12)  # advanced indexing: the whole-shaped path
        model.lin.bias[torch.arange(12) % 5 == 0] = -1.0           # a whole-shaped boolean mask
        model.lin.weight[torch.tensor([0, 1])].normal_(generator=g)  # a copy in one process: w unchanged, g advanced
        model.head.bias[1:].copy_(torch.tensor([0.25, -0.25]))


def run(model: nn.Module, rank: int, world: int) -> tuple[dict, torch.Tensor, dict]:
    g = torch.Generator().manual_seed(5)
    write(model, g)
    after = {k: v.clone() for k, v in sw.full_state_dict(model).items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
    for step in range(3):
        data = torch.Generator().manual_seed(10 + step)
        ids, y = torch.randint(0, 10, (12,), generator=data), torch.randn(12, 3, generator=data)
        rows = slice(rank * 12 // world, (rank + 1) * 12 // world)
        ((model(ids[rows]) - y[rows]) ** 2).mean().backward()
        model.emb.weight.grad[model.emb.padding_idx + 1] = 0.0  # a row kept frozen through its gradient
        opt.step()
        opt.zero_grad()
    return after, torch.rand(4, generator=g), {k: v.clone() for k, v in sw.full_state_dict(model).items()}


WRAPS = {
    "zero3": lambda m, c: sw.ZeRO(m, c, stage=3),
    "zero3_units": lambda m, c: sw.ZeRO(m, c, stage=3, wrap=(nn.Linear, nn.Embedding)),
    "fsdp_hybrid": lambda m, c: sw.FSDP(m, c, sharding="hybrid_shard", shard_size=2, wrap=(nn.Linear,)),
    "ddp": lambda m, c: sw.DDP(m, c),
}


@pytest.mark.parametrize("name", list(WRAPS))
def test_index_writes_after_wrapping_give_one_process_values(name):
    want_after, want_next, want_trained = run(built(), 0, 1)

    def body(comm):
        return run(WRAPS[name](built(), comm), comm.rank, comm.size)

    for got_after, got_next, got_trained in sw.launch(body, 4 if name == "fsdp_hybrid" else 3):
        for key in want_after:
            assert torch.equal(got_after[key], want_after[key]), key
        assert torch.equal(got_next, want_next)
        assert_state_close(got_trained, want_trained)


def test_index_writes_on_tensor_parallel_slices():
    """Column, row and vocabulary slices of `tp.parallelize` under ZeRO-3: rows and columns written by index."""
    config = GPTConfig.preset("tiny", n_layers=1)

    def edit(model):
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                if p.dim() == 2:
                    p[0] = 0.0
                    p[1:, :3].normal_(generator=g)
                    nn.init.ones_(p[-1])
                else:
                    p[::2] = 2.0
        return {k: v.clone() for k, v in sw.full_state_dict(model).items()}

    want = edit(GPT(config, seed=0))

    def body(comm):
        mesh = sw.Mesh(comm, dp=2, tp=2)
        return edit(sw.ZeRO(tp.parallelize(GPT(config, seed=0), mesh.tp, "gpt"), mesh.dp, stage=3))

    for got in sw.launch(body, 4):
        for key in want:
            assert torch.equal(got[key], want[key]), key


def test_what_needs_the_whole_values_is_refused():
    """Reading a selection of a piece, or writing into it with autograd recording, raises naming the parameter."""

    def body(comm):
        model = sw.ZeRO(built(), comm, stage=3)
        weight = model.lin.weight
        with pytest.raises(RuntimeError, match=r"reads lin.weight\[2\], a selection of a ZeRO-3 piece"):
            weight[2].sum()
        with pytest.raises(RuntimeError, match=r"reads lin.weight\[0\]"):
            with torch.no_grad():
                weight[0].mul_(2.0)  # reads the row before anything was written to it
        with pytest.raises(RuntimeError, match=r"lin.weight\[0\] = \.\.\. on lin.weight writes in place into a "
                                               r"parameter that requires grad while autograd records"):
            weight[0] = 1.0
        with pytest.raises(RuntimeError, match=r"__getitem__\(\) of lin.weight\[0\], a selection of a ZeRO-3 piece, "
                                               r"would be a view of it"):
            with torch.no_grad():
                weight[0].zero_()[3].fill_(1.0)  # a view of the written row: writes to it would stop there
        with pytest.raises(RuntimeError, match=r"would be a view of it"):
            weight[1].data
        with pytest.raises(RuntimeError, match=r"copy_\(\) combines lin.weight\[1\], a selection of a ZeRO-3 piece, "
                                               r"with a ShardedParameter"):
            with torch.no_grad():
                weight[1].copy_(model.lin.bias)
        with torch.no_grad():
            row = weight[0]
            row.fill_(1.0)
            row.mul_(3.0)  # written: the row's values are known now, so in-place operations write through
        return sw.full_state_dict(model)["lin.weight"][0]

    for row in sw.launch(body, 2):
        assert torch.equal(row, torch.full((12,), 3.0))


def test_huggingface_init_weights_after_zero3():
    """`model.apply(model._init_weights)` on a Llama with a padding token after ZeRO-3 (its padding row zeroed by
    `init.zeros_(weight[padding_idx])`): one process's values, bit for bit."""
    transformers = pytest.importorskip("transformers")
    from hf_cases import build

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=5,
                                      tie_word_embeddings=False)

    def initialised(model):
        inner = getattr(model, "module", model)
        with _lock, torch.random.fork_rng():
            torch.manual_seed(7)
            inner.apply(inner._init_weights)
        return {k: v.clone() for k, v in sw.full_state_dict(model).items()}

    want = initialised(build(transformers.LlamaForCausalLM, config))
    assert not want["model.embed_tokens.weight"][5].any()

    def body(comm):
        return initialised(sw.ZeRO(build(transformers.LlamaForCausalLM, config), comm, stage=3))

    for got in sw.launch(body, 3):
        for key in want:
            assert torch.equal(got[key], want[key]), key
