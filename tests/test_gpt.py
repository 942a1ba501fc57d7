"""Tests for shardwise.models.gpt: shapes, loss, deterministic init, tying, stages, validation."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from shardwise.models import GPT, GPTConfig
from shardwise.models.gpt import PRESETS, Block, CausalSelfAttention, lm_loss

TINY = GPTConfig.preset("tiny")


def _batch(cfg: GPTConfig, b: int = 3, t: int | None = None, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (b, t or cfg.seq_len), generator=g)


def test_logits_shape_and_short_sequences():
    model = GPT(TINY, seed=0)
    assert model(_batch(TINY)).shape == (3, TINY.seq_len, TINY.vocab_size)
    assert model(_batch(TINY, b=2, t=5)).shape == (2, 5, TINY.vocab_size)


def test_loss_is_cross_entropy_of_logits():
    model = GPT(TINY, seed=0)
    x, y = _batch(TINY, seed=1), _batch(TINY, seed=2)
    loss = model(x, y)
    assert loss.dim() == 0
    expected = F.cross_entropy(model(x).reshape(-1, TINY.vocab_size), y.reshape(-1))
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    torch.testing.assert_close(lm_loss(model(x), y), expected, rtol=0, atol=0)


def test_same_seed_same_params_different_seed_different():
    a, b, c = GPT(TINY, seed=5), GPT(TINY, seed=5), GPT(TINY, seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].std() > 0)


def test_seeded_init_leaves_global_rng_alone_and_is_thread_safe():
    state = torch.get_rng_state()
    ref = GPT(TINY, seed=3).state_dict()
    assert torch.equal(state, torch.get_rng_state())
    out: list = [None] * 4

    def build(i: int) -> None:
        out[i] = GPT(TINY, seed=3).state_dict()

    threads = [threading.Thread(target=build, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for sd in out:
        assert all(torch.equal(ref[k], sd[k]) for k in ref)


def test_unseeded_init_uses_global_rng():
    torch.manual_seed(11)
    a = GPT(TINY)
    torch.manual_seed(11)
    b = GPT(TINY)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_init_statistics():
    cfg = GPTConfig.preset("small")
    model = GPT(cfg, seed=0)
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    resid = model.blocks[0].attn.proj.weight.std().item()
    assert resid == pytest.approx(0.02 / (2 * cfg.n_layers) ** 0.5, rel=0.05)
    assert torch.all(model.blocks[0].attn.qkv.bias == 0)
    assert torch.all(model.ln_f.weight == 1) and torch.all(model.ln_f.bias == 0)


def test_tie_weights():
    tied = GPT(TINY, seed=0)
    assert tied.head.weight is tied.tok_emb.weight
    untied = GPT(GPTConfig.preset("tiny", tie_weights=False), seed=0)
    assert untied.head.weight is not untied.tok_emb.weight
    assert not torch.equal(untied.head.weight, untied.tok_emb.weight)
    extra = TINY.vocab_size * TINY.d_model
    assert untied.num_parameters() == tied.num_parameters() + extra
    assert tied.head.bias is None


def test_no_buffers():
    for cfg in (TINY, GPTConfig.preset("tiny", bias=False, dropout=0.1)):
        model = GPT(cfg, seed=0)
        assert list(model.buffers()) == []
        assert set(model.state_dict()) == {n for n, _ in model.named_parameters(remove_duplicate=False)}


def test_contract_attribute_names():
    model = GPT(TINY, seed=0)
    block = model.blocks[0]
    assert isinstance(block, Block) and isinstance(block.attn, CausalSelfAttention)
    d = TINY.d_model
    assert block.attn.qkv.weight.shape == (3 * d, d)
    assert block.attn.proj.weight.shape == (d, d)
    assert block.mlp.fc.weight.shape == (4 * d, d)
    assert block.mlp.proj.weight.shape == (d, 4 * d)
    assert block.attn.n_heads == TINY.n_heads
    for name in ("tok_emb", "pos_emb", "drop", "ln_f", "head"):
        assert hasattr(model, name)
    assert isinstance(model.ln_f, torch.nn.LayerNorm)


def test_attention_runs_on_head_slice():
    """Keeping heads [h0, h1) of q, k and v (as a column-parallel split does) computes exactly those heads."""
    torch.manual_seed(0)
    cfg = TINY
    attn = CausalSelfAttention(cfg).eval()
    x = torch.randn(2, 7, cfg.d_model)
    d, hd = cfg.d_model, cfg.head_dim
    half = slice(0, 2 * hd)  # first two of four heads
    rows = torch.cat([torch.arange(d)[half] + i * d for i in range(3)])
    local = CausalSelfAttention(cfg).eval()
    with torch.no_grad():
        local.qkv = torch.nn.Linear(d, rows.numel())
        local.qkv.weight.copy_(attn.qkv.weight[rows])
        local.qkv.bias.copy_(attn.qkv.bias[rows])
        local.proj = torch.nn.Linear(2 * hd, d, bias=False)
        local.proj.weight.copy_(attn.proj.weight[:, half])
        other = CausalSelfAttention(cfg).eval()
        rest = torch.cat([torch.arange(d)[2 * hd :] + i * d for i in range(3)])
        other.qkv = torch.nn.Linear(d, rest.numel())
        other.qkv.weight.copy_(attn.qkv.weight[rest])
        other.qkv.bias.copy_(attn.qkv.bias[rest])
        other.proj = torch.nn.Linear(2 * hd, d, bias=False)
        other.proj.weight.copy_(attn.proj.weight[:, 2 * hd :])
        torch.testing.assert_close(local(x) + other(x) + attn.proj.bias, attn(x))


def test_pipeline_layers_equal_forward_exactly():
    model = GPT(TINY, seed=0)
    layers = model.pipeline_layers()
    assert len(layers) == TINY.n_layers + 2
    x = _batch(TINY)
    h = x
    for layer in layers:
        h = layer(h)
    assert torch.equal(h, model(x))
    model_params = {id(p) for p in model.parameters()}
    stage_params = [p for layer in layers for p in layer.parameters()]
    assert {id(p) for p in stage_params} == model_params
    assert layers[0].tok_emb.weight is layers[-1].head.weight
    untied = GPT(GPTConfig.preset("tiny", tie_weights=False), seed=0).pipeline_layers()
    assert untied[0].tok_emb.weight is not untied[-1].head.weight


def test_backward_reaches_every_parameter():
    for cfg in (TINY, GPTConfig.preset("tiny", tie_weights=False, dropout=0.1)):
        model = GPT(cfg, seed=0)
        model(_batch(cfg), _batch(cfg, seed=1)).backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_dropout_only_in_training():
    model = GPT(GPTConfig.preset("tiny", dropout=0.5), seed=0)
    x = _batch(TINY)
    model.eval()
    assert torch.equal(model(x), model(x))
    model.train()
    assert not torch.equal(model(x), model(x))


def test_forward_errors():
    model = GPT(TINY, seed=0)
    with pytest.raises(ValueError, match=rf"T={TINY.seq_len + 1}.*seq_len={TINY.seq_len}"):
        model(_batch(TINY, t=TINY.seq_len + 1))
    with pytest.raises(ValueError, match="integer tensor"):
        model(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="targets shape"):
        model(_batch(TINY, b=2), _batch(TINY, b=3))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(d_model=100, n_heads=3), r"d_model=100.*n_heads=3"),
        (dict(n_layers=0), "n_layers"),
        (dict(vocab_size=-1), "vocab_size"),
        (dict(seq_len=2.5), "seq_len"),
        (dict(n_heads=True), "n_heads"),
        (dict(d_ff=0), "d_ff"),
        (dict(dropout=1.0), "dropout"),
        (dict(dropout=-0.1), "dropout"),
        (dict(tie_weights=1), "tie_weights"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_config_defaults_and_frozen():
    cfg = GPTConfig()
    assert (cfg.vocab_size, cfg.seq_len, cfg.d_model, cfg.n_heads, cfg.n_layers) == (256, 128, 256, 4, 4)
    assert cfg.d_ff is None and cfg.ff_dim == 1024 and cfg.head_dim == 64
    assert GPTConfig(d_ff=300).ff_dim == 300
    with pytest.raises(Exception):
        cfg.d_model = 8  # type: ignore[misc]


def test_presets():
    with pytest.raises(ValueError, match=r"'huge'.*bench.*gpt2.*small.*tiny"):
        GPTConfig.preset("huge")
    assert GPTConfig.preset("small") == GPTConfig()
    assert GPTConfig.preset("tiny", n_layers=3).n_layers == 3
    # Counted on meta: no memory, no init, same shapes.
    with torch.device("meta"):
        counts = {name: GPT(GPTConfig.preset(name)).num_parameters() for name in PRESETS}
    assert counts["tiny"] < 200_000
    assert 3_000_000 <= counts["small"] <= 4_000_000
    assert 6_000_000 <= counts["bench"] <= 10_000_000
    assert 120_000_000 <= counts["gpt2"] <= 130_000_000  # GPT-2 small: 124 M with tied embeddings
    assert set(PRESETS) == {"tiny", "small", "bench", "gpt2"}
