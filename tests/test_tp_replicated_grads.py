"""A plan that leaves a module with parameters whole inside a split region is refused at the first optimizer step
(tensor_parallel/replica_grads.py), where before it trained, silently, a different copy on every rank.

Measured before the check: HuggingFace Phi with ``qk_layernorm=True`` under tensor parallel with the plan HuggingFace
ships for it (``PhiConfig.base_model_tp_plan``: the projections only), and Gemma 3 with Llama's (the same projections),
differed from one process in the gradient of every ``q_layernorm`` / ``q_norm`` at the first step (7.2e-4 against
6.5e-5), and the copies of those norms drifted apart from there on. Each case below is checked against one process
through `sw.check` once the norm is declared "heads", and refused, naming the norm, while it is not: tensor parallel
alone, with ZeRO-3 over dp, and on pipeline stages (`sw.parallelize`).
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from parity import ATOL, RTOL
from torch import nn

import shardwise as sw
from shardwise import tensor_parallel as tp
from shardwise.tensor_parallel.replica_grads import MAX_STEPS

transformers = pytest.importorskip("transformers")

VOCAB, D, HEADS, T = 64, 32, 4, 16


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-5)


class HeadNormAttention(nn.Module):
    """q / k / v projections, a LayerNorm over each head of q and k (Phi's qk_layernorm), causal attention, o."""

    def __init__(self):
        super().__init__()
        self.head_dim = D // HEADS
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, D) for _ in range(3))
        self.q_norm, self.k_norm = nn.LayerNorm(self.head_dim), nn.LayerNorm(self.head_dim)
        self.o_proj = nn.Linear(D, D)

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = (proj(x).view(B, L, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        y = nn.functional.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, L, -1))


class TinyDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.norm, self.attn, self.out_norm = nn.LayerNorm(D), HeadNormAttention(), nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids, labels):
        h = self.embed(ids)
        h = h + self.attn(self.norm(h))
        return nn.functional.cross_entropy(self.head(self.out_norm(h)).flatten(0, 1), labels.flatten())


def _tiny_batch(step):
    ids = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(step))
    return ids, ids.roll(-1, 1)


PROJECTIONS = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}


def _tiny() -> TinyDecoder:
    torch.manual_seed(0)
    return TinyDecoder()  # built once: thread ranks share torch's generator, so each rank deep-copies it


def test_a_per_head_norm_left_whole_by_a_dict_plan_is_refused_at_the_first_step_naming_it():
    base = _tiny()

    def body(comm):
        model = tp.parallelize(copy.deepcopy(base), comm, PROJECTIONS)
        optimizer = _adamw(model.parameters())
        model(*_tiny_batch(0)).backward()
        with pytest.raises(ValueError, match="different gradients") as raised:
            optimizer.step()
        # the same model, untouched by the refused step
        return str(raised.value), float(model.attn.q_norm.weight.detach().sum())

    for message, total in sw.launch(body, 2):
        assert "attn.q_norm.weight" in message and "attn.k_norm.weight" in message and "'heads'" in message
        assert "attn.norm" not in message and "out_norm" not in message  # replicated activations: equal gradients
        assert total == D // HEADS


def test_declared_heads_the_same_model_trains_like_one_process():
    report = sw.check(TinyDecoder, _tiny_batch, strategy={"tp": 2, "tp_plan": {
        **PROJECTIONS, "q_norm": "heads", "k_norm": "heads"}}, world_size=2, steps=3, optimizer=_adamw,
        rtol=RTOL, atol=ATOL)
    assert report.ok, str(report)


def _hf(name, model_class, **extra):
    config = getattr(transformers, f"{name}Config")(
        vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=64, attn_implementation="eager", **extra)
    return lambda: getattr(transformers, model_class)(config)


def _hf_batch(step):
    ids = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


FAMILIES = {  # the per-head norms of each, and the HuggingFace plan of the projections only: Phi's own, Llama's
    "phi": (_hf("Phi", "PhiForCausalLM", partial_rotary_factor=0.5, qk_layernorm=True), ("q_layernorm", "k_layernorm"),
            "Phi"),
    "gemma3": (_hf("Gemma3Text", "Gemma3ForCausalLM", head_dim=8), ("q_norm", "k_norm"), "Llama"),
}
MESHES = {"tp2": ({"tp": 2}, 2), "tp2-zero3": ({"tp": 2, "dp": 2, "dp_strategy": "zero3"}, 4),
          "tp2-pp2": ({"tp": 2, "pp": 2}, 4)}  # Phi is not among the decoders sw.parallelize splits into stages


def _hf_plan(family):
    plan = getattr(transformers, f"{FAMILIES[family][2]}Config").base_model_tp_plan
    return {f"model.{pattern}": style for pattern, style in plan.items()}


@pytest.mark.parametrize("family, mesh", [(f, m) for f in FAMILIES for m in MESHES if (f, m) != ("phi", "tp2-pp2")])
def test_huggingfaces_own_plan_is_refused_naming_the_norms_and_with_them_declared_heads_matches_one_process(
        family, mesh):
    build, norms, _ = FAMILIES[family]
    strategy, world = MESHES[mesh]
    with pytest.raises(ValueError, match="different gradients") as raised:
        sw.check(build, _hf_batch, strategy={**strategy, "tp_plan": _hf_plan(family)}, world_size=world, steps=1,
                 optimizer=_adamw)
    assert f"self_attn.{norms[0]}.weight" in str(raised.value)
    declared = {**_hf_plan(family), **{norm: "heads" for norm in norms}}
    report = sw.check(build, _hf_batch, strategy={**strategy, "tp_plan": declared}, world_size=world, steps=2,
                      optimizer=_adamw)
    assert report.ok, str(report)


def test_a_gradient_on_some_ranks_only_is_refused_and_an_overflow_step_is_compared_at_the_next():
    """An overflowing step (a GradScaler's first, inf everywhere) is not a verdict: the next finite one is."""

    base = _tiny()

    def body(comm, case):
        model = tp.parallelize(copy.deepcopy(base), comm, {**PROJECTIONS, "q_norm": "heads", "k_norm": "heads"})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        model(*_tiny_batch(0)).backward()
        if case == "some ranks":
            model.out_norm.bias.grad = None if comm.rank == 0 else model.out_norm.bias.grad
        else:
            model.out_norm.bias.grad.fill_(float("inf"))
            optimizer.step()  # nothing to compare yet
            model.out_norm.bias.grad.fill_(float(comm.rank))  # finite, and different
        with pytest.raises(ValueError) as raised:
            optimizer.step()
        return str(raised.value)

    assert all("out_norm.bias has a gradient on some ranks only" in m for m in sw.launch(body, 2, "some ranks"))
    assert all("out_norm.bias (32,)" in m for m in sw.launch(body, 2, "overflow"))


def test_equal_gradients_pass_quietly_and_the_check_ends_after_the_first_compared_step():
    base = _tiny()

    def body(comm):
        model = tp.parallelize(copy.deepcopy(base), comm, {**PROJECTIONS, "q_norm": "heads", "k_norm": "heads"})
        optimizer = _adamw(model.parameters())
        for step in range(MAX_STEPS + 1):
            optimizer.zero_grad()
            model(*_tiny_batch(step)).backward()
            if step == 1:  # compared at step 0 already: a later difference is check_replicas' to catch
                model.out_norm.bias.grad.add_(comm.rank)
            optimizer.step()
        return True

    assert all(sw.launch(body, 2))


def test_a_norm_left_out_of_the_sequence_regions_under_sequence_parallel_is_refused_naming_it():
    torch.manual_seed(0)
    base = nn.Sequential(collections.OrderedDict(norm1=nn.LayerNorm(D), fc1=nn.Linear(D, 2 * D), act=nn.GELU(),
                                                 fc2=nn.Linear(2 * D, D), norm2=nn.LayerNorm(D)))
    x = torch.randn(2, T, D, generator=torch.Generator().manual_seed(0))

    def body(comm, plan):
        model = tp.parallelize(copy.deepcopy(base), comm, plan, sequence_parallel=True)
        optimizer = _adamw(model.parameters())
        model(x.chunk(comm.size, 1)[comm.rank]).square().mean().backward()  # each rank its sequence shard
        try:
            optimizer.step()
        except ValueError as error:
            return str(error)
        return "stepped"

    mlp = {"fc1": "colwise", "fc2": "rowwise"}
    for message in sw.launch(body, 2, mlp):
        assert "norm1.weight" in message and "norm2.bias" in message and "'sequence'" in message
    assert sw.launch(body, 2, {**mlp, "norm1": "sequence", "norm2": "sequence"}) == ["stepped", "stepped"]


def test_a_replicated_module_declared_heads_is_refused_at_the_first_backward():
    """The other direction: "heads" on a LayerNorm that runs on the whole, replicated activations would sum tp equal
    gradients (twice the gradient at tp=2, equal on every rank: the check above cannot see it); refused by name at
    the first backward, before anything is accumulated."""
    base = _tiny()

    def body(comm):
        model = tp.parallelize(copy.deepcopy(base), comm, {**PROJECTIONS, "q_norm": "heads", "k_norm": "heads",
                                                           "out_norm": "heads"})
        with pytest.raises(ValueError, match="every rank computed the same gradient") as raised:
            model(*_tiny_batch(0)).backward()
        return str(raised.value)

    assert all(message.startswith("tensor parallel: out_norm is declared") for message in sw.launch(body, 2))
