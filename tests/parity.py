"""Shared helpers of the parity tests: a reference single-process run and a tolerant-but-tight comparison.

The reference is always computed: the same model, seed and global batch trained in one process. A data-parallel
rank trains on its slice of the same global batch (ByteCorpus.batch gives rank r rows r*b..(r+1)*b).

Optimizer choice: AdamW with lr=1e-3, eps=1e-6. Adam divides each update by sqrt(v), so a gradient that is
mathematically zero but carries float rounding noise (the attention key bias: softmax ignores a constant added
to every score) gets a full lr-sized step whose sign is the noise's. Splitting a batch across ranks changes the
summation order and so the noise; eps=1e-6 bounds that amplification so the contract's fp32 tolerance
(rtol 1e-5, atol 1e-6) is meaningful, while real gradients (>> eps) are stepped exactly as usual. Tensor parallel
splits the inner dimension of every matmul, which adds a little more noise: its tests use eps=1e-5 for the same
reason (a float64 variant of the same test agrees to ~1e-15 with eps=1e-6, so the mathematics is exact).
"""

from __future__ import annotations

import torch

from shardwise.data import ByteCorpus
from shardwise.models import GPT, GPTConfig

CONFIG = GPTConfig.preset("tiny")
GLOBAL_BATCH = 8
CORPUS = ByteCorpus(max_bytes=300_000)
RTOL, ATOL = 1e-5, 1e-6


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def batch(step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return CORPUS.batch(step, GLOBAL_BATCH // world_size, CONFIG.seq_len, rank=rank, world_size=world_size)


def frozen_model(freeze: tuple[str, ...] = (), config: GPTConfig = CONFIG) -> GPT:
    """The seeded GPT with every parameter whose name starts with one of `freeze` set to requires_grad=False."""
    model = GPT(config, seed=0)
    for name, p in model.named_parameters():
        if name.startswith(freeze):
            p.requires_grad_(False)
    return model


def grouped_optimizer(named_params) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (no decay on biases and norms): parameter groups by name."""
    def decays(name: str) -> bool:
        return name.endswith("weight") and ".ln" not in name and not name.startswith("ln")

    trainable = [(n, p) for n, p in named_params if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for n, p in trainable if decays(n)], "weight_decay": 0.1},
                              {"params": [p for n, p in trainable if not decays(n)], "weight_decay": 0.0}],
                             lr=1e-3, eps=1e-6)


def accumulated_backward(model, x: torch.Tensor, y: torch.Tensor, accumulate: int) -> None:
    """Backward over `accumulate` micro-batches of (x, y): all but the last under model.no_sync()."""
    for micro, (xm, ym) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
        if micro < accumulate - 1:
            with model.no_sync():
                (model(xm, ym) / accumulate).backward()
        else:
            (model(xm, ym) / accumulate).backward()


def reference_state(steps: int, config: GPTConfig = CONFIG, freeze: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Parameters after `steps` AdamW steps of one process on the whole global batch."""
    model = frozen_model(freeze, config)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    for step in range(steps):
        x, y = batch(step)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_state_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def value_error_text(fn) -> str | None:
    """The message of the ValueError `fn()` raises, or None when it raises none (tests of refusals by name)."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def small_mlp() -> torch.nn.Module:
    """A 6 -> 8 -> 8 -> 1 tanh MLP with values from a private generator (thread ranks build their copies at the same
    time, and the global RNG is shared between threads)."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def mlp_batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`small_mlp`'s regression batch of step `step`: 8 rows, this rank's share of them."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    return x[rows], y[rows]


def train_mlp(model: torch.nn.Module, loss_of, rank: int = 0, world: int = 1, steps: int = 4,
              batch_of=mlp_batch) -> torch.nn.Module:
    """`steps` AdamW steps (lr 1e-2, weight decay 0.1, eps 1e-5) of a `small_mlp`-shaped model on this rank's share
    of `mlp_batch` (or of `batch_of(step, rank, world)`), the loss `loss_of(model, x, y)`."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
    for step in range(steps):
        x, y = batch_of(step, rank, world)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return model
