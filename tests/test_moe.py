"""The mixture-of-experts GPT in one process (models/moe.py): configuration checks, the dense default untouched, the
MoE layer against a per-token hand computation, the Switch load-balancing loss against its formula, the loss the GPT
returns, experts that get no token, and the capacity limit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.models import GPT, GPTConfig
from shardwise.models.gpt import MLP
from shardwise.models.moe import MoE, capacity

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=4, experts_per_token=2)


def _tokens(b=4, t=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG.vocab_size, (b, t), generator=g)
    return x, torch.roll(x, -1, 1)


def _layer(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = GPTConfig(**{**CFG.__dict__, **overrides})
    return MoE(cfg)


def _by_hand(layer: MoE, x: torch.Tensor, keep=None) -> torch.Tensor:
    """sum over each token's k experts of weight x proj_e(gelu(fc_e(x))), one token at a time."""
    flat = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(flat @ layer.router.weight.t(), dim=-1)
    top, experts = probs.topk(layer.top_k, dim=-1)
    weights = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(layer.top_k):
            if keep is not None and not keep[t * layer.top_k + j]:
                continue
            e = int(experts[t, j])
            h = F.gelu(flat[t] @ layer.w_in[e] + layer.b_in[e]) @ layer.w_out[e] + layer.b_out[e]
            out[t] += weights[t, j] * h
    return out.view(x.shape)


def test_dense_default_is_the_plain_mlp():
    cfg = GPTConfig.preset("tiny")
    assert (cfg.n_experts, cfg.experts_per_token, cfg.moe_aux_loss_coef) == (0, 2, 0.01)
    model = GPT(cfg, seed=0)
    assert all(type(b.mlp) is MLP for b in model.blocks)
    assert not any("router" in n or "w_in" in n for n, _ in model.named_parameters())
    x, y = _tokens(2, 8)
    x, y = x % cfg.vocab_size, y % cfg.vocab_size
    logits = model(x)
    torch.testing.assert_close(model(x, y), F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1)),
                               rtol=0, atol=0)


@pytest.mark.parametrize("overrides, field", [
    (dict(n_experts=-1), "n_experts"), (dict(n_experts=True), "n_experts"), (dict(n_experts=2.0), "n_experts"),
    (dict(n_experts=4, experts_per_token=0), "experts_per_token"),
    (dict(n_experts=4, experts_per_token=5), "experts_per_token"),
    (dict(n_experts=4, experts_per_token=True), "experts_per_token"),
    (dict(n_experts=4, moe_aux_loss_coef=-0.1), "moe_aux_loss_coef"),
    (dict(n_experts=4, moe_aux_loss_coef=float("nan")), "moe_aux_loss_coef"),
    (dict(n_experts=4, moe_aux_loss_coef=True), "moe_aux_loss_coef"),
])
def test_bad_expert_settings_raise_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"GPTConfig.{field}"):
        GPTConfig(**{**CFG.__dict__, **overrides})


def test_moe_gpt_names_shapes_and_seeded_init():
    model = GPT(CFG, seed=0)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith("blocks.0.mlp.")}
    assert shapes == {"blocks.0.mlp.router.weight": (4, 32), "blocks.0.mlp.w_in": (4, 32, 128),
                      "blocks.0.mlp.b_in": (4, 128), "blocks.0.mlp.w_out": (4, 128, 32), "blocks.0.mlp.b_out": (4, 32)}
    again = GPT(CFG, seed=0).state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, again[name]), name
    w_in, w_out = model.blocks[0].mlp.w_in.detach(), model.blocks[0].mlp.w_out.detach()
    assert 0.015 < float(w_in.std()) < 0.025 and float(w_out.std()) < 0.7 * float(w_in.std())  # residual std
    assert not any("proj" in n for n in shapes)


def test_layer_equals_the_per_token_formula():
    layer = _layer()
    x = torch.randn(3, 5, CFG.d_model)
    torch.testing.assert_close(layer(x), _by_hand(layer, x), rtol=1e-5, atol=1e-6)
    assert layer.stats == {"assignments": 30, "dropped": 0, "capacity": None}


def test_aux_loss_is_the_switch_formula():
    layer = _layer(1)
    x = torch.randn(4, 6, CFG.d_model)
    layer(x)
    probs = torch.softmax(x.reshape(-1, CFG.d_model) @ layer.router.weight.t(), dim=-1)
    chosen = probs.topk(2, dim=-1).indices.reshape(-1)
    f = torch.bincount(chosen, minlength=4).float() / (24 * 2)
    want = 4 * (f * probs.mean(0)).sum()
    torch.testing.assert_close(layer.aux_loss, want, rtol=1e-6, atol=0)
    assert layer.aux_loss.requires_grad
    uniform = torch.full((4,), 0.25)
    assert float(4 * (uniform * uniform).sum()) == 1.0  # the normalisation: 1 when perfectly balanced


def test_gpt_loss_adds_the_weighted_aux_losses_and_every_parameter_trains():
    model = GPT(GPTConfig(**{**CFG.__dict__, "moe_aux_loss_coef": 0.5}), seed=0)
    x, y = _tokens()
    loss = model(x, y)
    ce = F.cross_entropy(model(x).reshape(-1, CFG.vocab_size), y.reshape(-1))
    aux = sum(b.mlp.aux_loss for b in model.blocks)
    torch.testing.assert_close(loss, ce + 0.5 * aux, rtol=1e-6, atol=0)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    silent = GPT(GPTConfig(**{**CFG.__dict__, "moe_aux_loss_coef": 0.0}), seed=0)
    torch.testing.assert_close(silent(x, y), ce, rtol=0, atol=0)
    assert all(b.mlp.aux_loss is None for b in silent.blocks)


def test_an_expert_without_tokens_gets_zero_rows_of_the_fused_gradient():
    layer = _layer(2)
    with torch.no_grad():
        layer.router.weight[3] = -1.0  # positive inputs: expert 3 always scores lowest
    x = torch.rand(2, 8, CFG.d_model)
    assert layer.w_in.grad is None
    layer(x).sum().backward()
    assert layer.stats["assignments"] == 32
    for p in (layer.w_in, layer.b_in, layer.w_out, layer.b_out):
        assert torch.count_nonzero(p.grad[3]) == 0 and torch.count_nonzero(p.grad[:3]) > 0


def test_capacity_drops_beyond_the_limit_in_batch_order():
    layer = _layer(3)
    layer.capacity_factor = 0.5
    x = torch.randn(2, 8, CFG.d_model)
    out = layer(x)
    cap = capacity(16, 2, 4, 0.5)
    assert cap == 4
    experts = torch.softmax(x.reshape(-1, CFG.d_model) @ layer.router.weight.t(), -1).topk(2, -1).indices.reshape(-1)
    seen, keep = [0] * 4, []
    for e in experts.tolist():  # assignment order = token order, then choice order
        keep.append(seen[e] < cap)
        seen[e] += 1
    assert layer.stats == {"assignments": 32, "dropped": keep.count(False), "capacity": 4}
    assert keep.count(False) > 0
    torch.testing.assert_close(out, _by_hand(layer, x, keep), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy, world", [("ddp", 2), ("zero3", 2), ("fsdp:hybrid_shard", 4)])
def test_data_parallel_wrappers_balance_over_the_global_batch(strategy, world):
    """The balance loss is a product of batch means: every data-parallel wrapper makes the MoE layers sum their
    statistics over its group (batch_split.py), so 3 AdamW steps with a binding clip equal one process (per-rank
    statistics gave tok_emb gradients off by 1e-5 at the first step)."""
    import shardwise as sw
    from parity import batch

    def build():
        return GPT(CFG, seed=0)

    def global_batch(step):
        x, y = batch(step)
        return x[:, :CFG.seq_len] % CFG.vocab_size, y[:, :CFG.seq_len] % CFG.vocab_size

    report = sw.check(build, global_batch, strategy=strategy, world_size=world, max_norm=0.3,
                      optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, eps=1e-5))
    assert report.ok, report.text(verbose=True)
