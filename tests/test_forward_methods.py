"""Methods called instead of the forward (`forward_methods=`): a CLIP-shaped model trained through its forward and
through `encode_image` / `encode_text` called by the script, and evaluated with them under no_grad, matches one
process under every data-parallel wrapper; without the option ZeRO-3 refuses the call by name; bad names raise.

References are computed: the same model trained (AdamW, weight decay) in one process on the global batch."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from parity import assert_state_close, value_error_text
from torch import nn

import shardwise as sw

_BUILD = threading.Lock()  # thread ranks share torch's global RNG: one seeded build at a time


class TinyClip(nn.Module):
    """Two towers and a learned temperature held by the root (Radford et al. 2021): the root unit's parameters are
    read by `encode_text` and by the forward."""

    def __init__(self) -> None:
        super().__init__()
        with _BUILD, torch.random.fork_rng():
            torch.manual_seed(0)
            self.image = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 8))
            self.token = nn.Embedding(20, 8)
            self.text_proj = nn.Parameter(torch.randn(8, 8) / 3)
            self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.image(pixels), dim=-1)

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.token(tokens).mean(1) @ self.text_proj, dim=-1)

    def forward(self, pixels: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:  # each pair's score
        return self.logit_scale.exp() * (self.encode_image(pixels) * self.encode_text(tokens)).sum(-1)


def batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    pixels, tokens = torch.randn(8, 12, generator=g), torch.randint(0, 20, (8, 5), generator=g)
    targets = torch.randn(8, generator=g)
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    return pixels[rows], tokens[rows], targets[rows]


def train(model: nn.Module, rank: int = 0, world: int = 1) -> tuple[nn.Module, list[float]]:
    """Odd steps go through the forward, even ones through the encoders (the pairs' scores regressed on targets);
    each step ends with an evaluation through the encoders under no_grad."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
    scores = []
    for step in range(4):
        pixels, tokens, targets = batch(step, rank, world)
        if step % 2:
            score = model(pixels, tokens)
        else:
            score = 5.0 * (model.encode_image(pixels) * model.encode_text(tokens)).sum(-1)
        F.mse_loss(score, targets).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            scores.append(float((model.encode_image(pixels) * model.encode_text(tokens)).sum()))
    return model, scores


WRAPS = {
    "ddp": lambda m, c, **kw: sw.DDP(m, c, find_unused_parameters=True, **kw),  # logit_scale: forward steps only
    "zero1": lambda m, c, **kw: sw.ZeRO(m, c, stage=1, **kw),
    "zero2": lambda m, c, **kw: sw.ZeRO(m, c, stage=2, **kw),
    "zero3": lambda m, c, **kw: sw.ZeRO(m, c, stage=3, **kw),
    "zero3-per-layer": lambda m, c, **kw: sw.ZeRO(m, c, stage=3, wrap=(nn.Linear, nn.Embedding), **kw),
    "fsdp": lambda m, c, **kw: sw.FSDP(m, c, **kw),
    "fsdp-shard-grad-op": lambda m, c, **kw: sw.FSDP(m, c, sharding="shard_grad_op", **kw),
    "distribute-zero3": lambda m, c, **kw: sw.distribute(m, c, strategy="zero3", **kw),
}
METHODS = ("encode_image", "encode_text")


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_methods_called_instead_of_the_forward_train_as_one_process(wrap: str) -> None:
    model, want_scores = train(TinyClip())
    want = {k: v.clone() for k, v in model.state_dict().items()}

    def body(comm: sw.Communicator) -> tuple[dict[str, torch.Tensor], list[float]]:
        trained, scores = train(WRAPS[wrap](TinyClip(), comm, forward_methods=METHODS), comm.rank, comm.size)
        totals = torch.tensor(scores)
        comm.all_reduce(totals, sw.ReduceOp.SUM)  # each rank scored its own rows
        scores = totals.tolist()
        return {k: v.clone() for k, v in sw.full_state_dict(trained).items()}, scores

    for got, scores in sw.launch(body, 2):
        assert_state_close(got, want)
        torch.testing.assert_close(torch.tensor(scores), torch.tensor(want_scores), rtol=1e-5, atol=1e-5)


def test_a_method_inside_the_forward_runs_as_it_is() -> None:
    """CLIP's forward calls encode_image itself: the hooks run once per forward, not again for the method."""
    def body(comm: sw.Communicator) -> list[int]:
        model = sw.ZeRO(TinyClip(), comm, stage=3, forward_methods=METHODS)
        calls = []
        model.register_forward_pre_hook(lambda module, args: calls.append(len(args)))
        pixels, tokens, _ = batch(0, comm.rank, comm.size)
        model(pixels, tokens).sum().backward()
        model.encode_text(tokens).sum().backward()
        return calls

    assert sw.launch(body, 2) == [[2, 1], [2, 1]]  # the forward's two arguments, then encode_text's one


@pytest.mark.parametrize("wrap, fragment", [
    (lambda m, c: sw.ZeRO(m, c, stage=3, wrap=(nn.Linear, nn.Embedding)), "matmul() on text_proj"),
    (lambda m, c: sw.DDP(m, c, find_unused_parameters=True), "after no forward of the wrapped model"),
], ids=["zero3", "ddp-find-unused"])
def test_without_the_option_the_method_is_refused_by_name(wrap, fragment: str) -> None:  # noqa: ANN001
    def body(comm: sw.Communicator) -> str:
        model = wrap(TinyClip(), comm)
        try:
            model.encode_text(batch(0, comm.rank, comm.size)[1]).sum().backward()
        except RuntimeError as e:
            return str(e)
        return "ran"

    for text in sw.launch(body, 2):
        assert fragment in text and "forward_methods=" in text


@pytest.mark.parametrize("names, fragment", [
    ("encode_image", "must be a tuple of method names"),
    (("encode_video",), "'encode_video' is not a public method of TinyClip"),
    (("forward",), "other than forward"),
])
def test_bad_method_names_are_refused_at_wrap(names: object, fragment: str) -> None:
    text = sw.launch(lambda comm: value_error_text(
        lambda: sw.ZeRO(TinyClip(), comm, stage=3, forward_methods=names)), 2)[0]
    assert text is not None and fragment in text and "encode_image" in text


class PairedLoss(TinyClip):
    def paired_loss(self, pixels: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A loss method that calls the model twice: nested forwards, served by this call's gathered root."""
        return F.mse_loss(self(pixels, tokens), targets) + F.mse_loss(self(-pixels, tokens), -targets)


@pytest.mark.parametrize("wrap", ["ddp", "zero3", "zero3-per-layer", "fsdp"])
def test_a_method_calling_the_model_inside_trains_as_one_process(wrap: str) -> None:
    def train_paired(model: nn.Module, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
        for step in range(3):
            model.paired_loss(*batch(step, rank, world)).backward()
            opt.step()
            opt.zero_grad()
        return {k: v.clone() for k, v in sw.full_state_dict(model).items()} if world > 1 else model.state_dict()

    want = {k: v.clone() for k, v in train_paired(PairedLoss()).items()}
    for got in sw.launch(lambda comm: train_paired(WRAPS[wrap](PairedLoss(), comm, forward_methods=("paired_loss",)),
                                                   comm.rank, comm.size), 2):
        assert_state_close(got, want)


@pytest.mark.parametrize("named", [True, False], ids=["named", "routed-unasked"])
@pytest.mark.parametrize("sharding", ["zero3-per-block", "fsdp-per-block"])
def test_huggingface_generate_of_an_encoder_decoder_matches_one_process(sharding: str, named: bool) -> None:
    """T5's generate calls its encoder directly, then the model once per token (nested in the routed call); ZeRO /
    FSDP route a HuggingFace model's generate whether named or not."""
    pytest.importorskip("transformers")
    from hf_cases import tiny_t5
    from transformers.models.t5.modeling_t5 import T5Block

    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    want = tiny_t5().generate(ids, max_new_tokens=6, do_sample=False)
    wrap = {"zero3-per-block": lambda m, c, **kw: sw.ZeRO(m, c, stage=3, wrap=T5Block, **kw),
            "fsdp-per-block": lambda m, c, **kw: sw.FSDP(m, c, wrap=T5Block, **kw)}[sharding]

    def body(comm: sw.Communicator) -> tuple[list[torch.Tensor], int]:
        model = wrap(tiny_t5(), comm, **({"forward_methods": ("generate",)} if named else {}))
        reductions = comm.stats.calls("all_reduce")
        tokens = [model.generate(ids, max_new_tokens=6, do_sample=False) for _ in range(2)]
        return tokens, comm.stats.calls("all_reduce") - reductions

    for got, reductions in sw.launch(body, 2):
        for tokens in got:
            assert torch.equal(tokens, want), (tokens, want)
        assert reductions == 0  # the per-token forwards nest in the routed call: no recovery's agreement


def test_a_decoder_only_generation_gathers_its_root_unit_once() -> None:
    """Routed, the root unit (embeddings, output head) is gathered once per generation, not once per token."""
    pytest.importorskip("transformers")
    from hf_cases import tiny_llama
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    want = tiny_llama().eval().generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)

    def body(comm: sw.Communicator) -> tuple[torch.Tensor, int]:
        model = sw.ZeRO(tiny_llama().eval(), comm, stage=3, wrap=LlamaDecoderLayer)
        gathers = comm.stats.calls("all_gather")
        tokens = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        return tokens, comm.stats.calls("all_gather") - gathers

    for tokens, gathers in sw.launch(body, 2):
        assert torch.equal(tokens, want)
        assert gathers == 1 + 2 * 8  # the root once, each of the 2 layers per token (per token: 3 x 8 = 24)
