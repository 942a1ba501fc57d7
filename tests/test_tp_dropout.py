"""Dropout under tensor parallelism: the replicated regions draw the same masks on every rank of the group, from the
stream the group shares (shardwise/dropout_stream.py), and a recompute under activation checkpointing draws the
masks its forward drew.

Without the stream, thread ranks (one shared torch generator) and process ranks seeded with their rank (nanoGPT's
``torch.manual_seed(1337 + rank)``) drop out different activations in the regions every rank must compute alike:
the copies of the replicated parameters (norms, position embeddings) train on different numbers and drift apart.
The references are computed: one process that draws its masks from the same stream (possible where every dropout
is in a replicated region, HuggingFace GPT-2 with attention dropout 0), and the same model without checkpointing.
Float64, AdamW with weight decay.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers
from parity import CONFIG, batch
from resume_phases import assert_resumed_run_is_exact
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardwise as sw
from shardwise import tensor_parallel as tp
from shardwise.activation_checkpointing import checkpoint_module
from shardwise.dropout_functions import install
from shardwise.dropout_stream import stream_of
from shardwise.models import GPT
from shardwise.sharded_tensor import local

DROPPING = dataclasses.replace(CONFIG, dropout=0.1)
VOCAB, T, BATCH = 256, 16, 4


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.1)


def train_gpt_tp(comm, sp, seed_by_rank):
    if seed_by_rank:
        torch.manual_seed(1337 + comm.rank)  # nanoGPT's per-rank seed (thread ranks: one shared generator)
    model = tp.parallelize(GPT(DROPPING, seed=0).double(), comm, "gpt", sequence_parallel=sp)
    opt = adamw(model)
    for step in range(3):
        x, y = batch(step)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return tp.full_state_dict(model), stream_of(model).seed


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_replicated_parameters_stay_equal_on_every_tp_rank(sp):
    (first, seed0), (second, seed1) = sw.launch(train_gpt_tp, 2, sp, False)
    dense = GPT(DROPPING, seed=0).state_dict()
    for name, value in first.items():
        assert torch.equal(value, second[name]), f"{name} differs between the tp ranks"
    assert not torch.equal(first["blocks.0.ln1.weight"], dense["blocks.0.ln1.weight"].double())  # it trained
    assert (seed0 != seed1) == sp  # under sequence parallel every region is a shard: each rank its own masks


def test_process_ranks_seeded_by_rank_keep_replicas_equal():
    (first, _), (second, _) = sw.launch(train_gpt_tp, 2, False, True, backend="gloo", timeout=120)
    for name, value in first.items():
        assert torch.equal(value, second[name]), f"{name} differs between the tp ranks"


def gpt2_config(**overrides) -> transformers.GPT2Config:
    sizes = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.1, embd_pdrop=0.1,
                 attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Config(**{**sizes, **overrides})


def gpt2(**overrides) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(gpt2_config(**overrides)).double()


def ids(step):
    return torch.randint(0, VOCAB, (BATCH, T), generator=torch.Generator().manual_seed(step))


def train_hf(model, steps=3):
    opt = adamw(model)
    for step in range(steps):
        model(ids(step), labels=ids(step)).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def test_hf_gpt2_residual_and_embedding_dropout_match_one_process_drawing_the_same_masks():
    dense = gpt2()
    copies = [copy.deepcopy(dense) for _ in range(2)]

    def body(comm):
        model = tp.parallelize(copies[comm.rank], comm, "gpt2")
        train_hf(model)
        return tp.full_state_dict(model), stream_of(model).seed

    (state, seed), _ = sw.launch(body, 2)
    reference = copy.deepcopy(dense)
    install(reference, seed)  # one process drawing from the stream the group drew from
    want = train_hf(reference).state_dict()
    without_dropout = train_hf(copy.deepcopy(dense).eval()).state_dict()
    for name, value in want.items():
        torch.testing.assert_close(state[name], value, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")
    assert not torch.allclose(want["transformer.h.0.ln_1.weight"], without_dropout["transformer.h.0.ln_1.weight"])


def checkpoint_layers(model, reentrant):
    """HuggingFace's activation checkpointing of every layer (named gradient checkpointing before transformers 5)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable({"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


def gradients(model, loss):
    loss.backward()
    return {name: local(p.grad).clone() for name, p in model.named_parameters() if p.grad is not None}


def test_checkpointed_blocks_recompute_the_masks_their_forward_drew():
    dense = GPT(DROPPING, seed=0).double()
    copies = [[copy.deepcopy(dense) for _ in range(2)] for _ in range(2)]

    def body(comm):
        plain = tp.parallelize(copies[0][comm.rank], comm, "gpt")
        checkpointed = tp.parallelize(copies[1][comm.rank], comm, "gpt")
        for block in checkpointed.blocks:
            checkpoint_module(block)
        x, y = batch(0)
        return gradients(plain, plain(x, y)), gradients(checkpointed, checkpointed(x, y))

    for want, got in sw.launch(body, 2):
        assert list(got) == list(want)
        for name in want:
            assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_hf_gradient_checkpointing_recomputes_the_masks_its_forward_drew(reentrant):
    dense = gpt2(attn_pdrop=0.1)
    copies = [[copy.deepcopy(dense) for _ in range(2)] for _ in range(2)]

    def body(comm):
        plain = tp.parallelize(copies[0][comm.rank], comm, "gpt2")
        checkpointed = copies[1][comm.rank]
        checkpoint_layers(checkpointed, reentrant)
        checkpointed = tp.parallelize(checkpointed, comm, "gpt2")
        plain.train(), checkpointed.train()
        got = gradients(checkpointed, checkpointed(ids(0), labels=ids(0)).loss)
        return gradients(plain, plain(ids(0), labels=ids(0)).loss), got

    for want, got in sw.launch(body, 2):
        assert list(got) == list(want)
        for name in want:
            assert torch.equal(got[name], want[name]), name


class Dropping(nn.Module):
    """A layer that drops out its input, for the recompute that cannot be replayed."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return F.dropout(self.linear(x), 0.5, self.training)


def test_a_recompute_that_cannot_replay_its_masks_is_an_error():
    dense = nn.Sequential(nn.Linear(8, 8), Dropping())
    copies = [copy.deepcopy(dense) for _ in range(2)]

    def body(comm):
        model = tp.parallelize(copies[comm.rank], comm, {"0": "colwise", "1.linear": "rowwise"})
        outer = model[0](torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
        scale = [1.0]
        out = checkpoint(lambda h: model[1](h * scale[0]), outer, use_reentrant=False)
        scale[0] = 2.0  # the recompute computes something else than the forward did
        with pytest.raises(RuntimeError, match="no forward dropped out"):
            out.sum().backward()
        again = outer * 3
        twice = [checkpoint(model[1], again, use_reentrant=False) for _ in range(2)]  # equal inputs, both in flight
        with pytest.raises(RuntimeError, match="matches 2 forwards"):
            sum(t.sum() for t in twice).backward()
        return True

    assert all(sw.launch(body, 2))


class Functional(nn.Module):
    """Every dropout the stream serves, on one input."""

    def forward(self, x):
        q, on = x.reshape(2, 4, 8, 4), self.training
        kv = q[:, :2]
        return (F.dropout(x, 0.3, on).sum() + torch.dropout(x, 0.3, on).sum()
                + F.dropout1d(x[0], 0.3, on).sum() + F.dropout2d(x.reshape(2, 4, 4, 8), 0.3, on).sum()
                + F.scaled_dot_product_attention(q, kv, kv, dropout_p=0.3 if on else 0.0, is_causal=True,
                                                 enable_gqa=True).sum())


def test_every_dropout_kind_draws_from_the_stream():
    x = torch.randn(2, 4, 32, dtype=torch.float64)
    same = [Functional() for _ in range(2)]
    other = Functional()
    for module, seed in ((same[0], 7), (same[1], 7), (other, 8)):
        install(module, seed)
    torch.manual_seed(0)
    first = same[0](x)
    torch.manual_seed(1)  # torch's generator is not where the masks come from
    assert torch.equal(same[1](x), first)
    assert not torch.equal(other(x), first)
    assert torch.equal(same[0].eval()(x), same[1].eval()(x))  # eval: no dropout, no stream


def test_feature_dropout_keeps_or_drops_whole_channels_scaled_like_torch():
    module = nn.Dropout2d(0.5)
    install(module, 3)
    x = torch.ones(3, 5, 4, 4)
    out = module(x)
    per_channel = out.flatten(2)
    assert torch.all((per_channel == 0).all(-1) | (per_channel == 2.0).all(-1))
    assert 0 < (per_channel == 0).all(-1).sum() < 15


def test_alpha_dropout_in_training_is_refused():
    module = nn.AlphaDropout(0.2)
    install(module, 3)
    with pytest.raises(ValueError, match="alpha_dropout"):
        module(torch.randn(4, 4))
    assert torch.equal(module.eval()(torch.ones(2)), torch.ones(2))


def test_a_resumed_run_draws_the_masks_the_uninterrupted_one_draws(tmp_path):
    assert_resumed_run_is_exact(2, tmp_path, lambda comm: tp.parallelize(GPT(DROPPING, seed=0).double(), comm, "gpt"),
                                lambda step, comm: batch(step))


def train_hybrid(comm, options):
    mesh = sw.Mesh(comm, dp=1, tp=2, pp=2)
    model = sw.parallelize(GPT(DROPPING, seed=0).double(), mesh, tp_plan="gpt", **options)
    opt = adamw(model)
    for step in range(3):
        x, y = batch(step)
        model.step(x, y)
        opt.step()
        opt.zero_grad()
    return sw.full_state_dict(model)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb_h1"])
def test_tp_by_pp_with_checkpointed_stages_trains_as_without_checkpointing(schedule):
    """Microbatches in flight (several forwards before their backwards): each recompute finds its own forward's
    masks among them. zb_h1 recomputes each checkpointed forward twice, in its input pass and again in its weight
    pass: the second takes the masks the first replayed."""
    want = sw.launch(train_hybrid, 4, dict(pp_schedule=schedule))[0]
    got = sw.launch(train_hybrid, 4, dict(pp_schedule=schedule, activation_checkpointing=True))[0]
    for name in want:
        assert torch.equal(got[name], want[name]), name


def mixtral_tp(comm, model, steps=3):
    model = tp.parallelize(model, comm, "llama")
    opt = adamw(model)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return tp.full_state_dict(model)


def test_a_routers_jitter_noise_is_the_same_on_every_tp_rank():
    """Mixtral's router jitter (``hidden *= torch.empty_like(hidden).uniform_(...)``) in the region every rank
    computes alike: the numbers come from the group's stream (random_functions.py)."""
    from hf_decoders import mixtral

    dense = mixtral(router_jitter_noise=0.2, attention_dropout=0.1).double()
    copies = [copy.deepcopy(dense) for _ in range(2)]
    first, second = sw.launch(lambda comm: mixtral_tp(comm, copies[comm.rank]), 2)
    for name, value in first.items():
        assert torch.equal(value, second[name]), f"{name} differs between the tp ranks"
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(first[router], dense.state_dict()[router])  # it trained


def test_a_random_op_other_than_dropout_in_a_recompute_is_refused():
    from hf_decoders import mixtral

    dense = mixtral(router_jitter_noise=0.2).double()
    checkpoint_layers(dense, False)
    copies = [copy.deepcopy(dense) for _ in range(2)]

    def body(comm):
        with pytest.raises(RuntimeError, match="only dropout's masks can be replayed"):
            mixtral_tp(comm, copies[comm.rank], steps=1)
        return True

    assert all(sw.launch(body, 2))


class Noisy(nn.Module):
    """Random ops other than dropout, as models call them."""

    def forward(self, x):
        g = torch.Generator().manual_seed(5)  # a generator of the model's own is left alone
        return (torch.rand(4).sum() + torch.randn_like(x).sum() + x.clone().uniform_(0.9, 1.1).sum()
                + torch.randint(0, 10, (3,)).sum() + torch.randperm(5)[0] + torch.normal(x, 1.0).sum()
                + x.clone().bernoulli_(0.5).sum() + torch.multinomial(x.abs().flatten(), 2).sum()
                + torch.poisson(x.abs(), g).sum())


def test_random_ops_in_a_split_models_forward_draw_from_its_stream():
    x = torch.randn(3, 4)
    same, other = [Noisy(), Noisy()], Noisy()
    for module, seed in ((same[0], 7), (same[1], 7), (other, 8)):
        install(module, seed)
    torch.manual_seed(0)
    first = same[0](x)
    torch.manual_seed(1)
    assert torch.equal(same[1](x), first)
    assert not torch.equal(other(x), first)
    torch.manual_seed(0)
    outside = torch.rand(4)  # outside a stream's forward: torch's generator, as before
    torch.manual_seed(0)
    assert torch.equal(outside, torch.rand(4))
