"""sw.clip_grad_norm_ on a wrapped model runs as torch's own clip does: one foreach norm and one foreach multiply per
(device, dtype) group, and the norm is never read on the host (`aten::_local_scalar_dense`, what `.item()` and
`float()` run, would stall a GPU's queue every step), whether it clips or not; the result is torch's clip of the
same gradients. (Parity of clipping under every strategy: the matrix and hybrid tests.)"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.profiler import profile

import shardwise as sw
from shardwise.check.grads import full_gradients
from shardwise.comm import ThreadWorld
from shardwise.models import GPT, GPTConfig
from shardwise.models.gpt import Block

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)


def _grads_of(model: torch.nn.Module) -> None:
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(0))
    model(x, x).backward()


@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clips", "does-not-clip"])
def test_clip_is_foreach_kernels_without_a_host_read(max_norm):
    plain = GPT(CFG, seed=0)
    _grads_of(plain)
    want_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm)
    model = sw.ZeRO(GPT(CFG, seed=0), ThreadWorld(1).communicators()[0], stage=3, wrap=Block)
    _grads_of(model)
    with profile() as prof:
        norm = sw.clip_grad_norm_(model, max_norm)
    ops = collections.Counter({e.key: e.count for e in prof.key_averages()})
    assert ops["aten::_foreach_norm"] == 1 and ops["aten::_foreach_mul_"] == 1, ops
    assert ops["aten::_local_scalar_dense"] == 0, ops
    torch.testing.assert_close(norm, want_norm, rtol=1e-6, atol=0)
    grads = full_gradients(model)[0]
    assert grads.keys() == dict(plain.named_parameters()).keys()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")
    if max_norm > 1e3:  # not clipping multiplies by exactly 1.0: the gradients are bit for bit as before
        fresh = sw.ZeRO(GPT(CFG, seed=0), ThreadWorld(1).communicators()[0], stage=3, wrap=Block)
        _grads_of(fresh)
        assert all(torch.equal(grads[n], g) for n, g in full_gradients(fresh)[0].items())


def test_tools_given_parameters_instead_of_the_model_name_the_mistake():
    """torch's habit, clip_grad_norm_(model.parameters(), ...), gives a generator: refused with a TypeError that says
    what to pass, not an AttributeError from deep inside (the tools need the model's layout)."""
    model = sw.ZeRO(GPT(CFG, seed=0), ThreadWorld(1).communicators()[0], stage=3)
    opt = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
    _grads_of(model)
    for call in (lambda: sw.clip_grad_norm_(model.parameters(), 1.0), lambda: sw.full_state_dict(model.parameters()),
                 lambda: sw.memory_stats(list(model.parameters()), opt),
                 lambda: sw.full_optimizer_state_dict(model.parameters(), opt)):
        with pytest.raises(TypeError, match=r"expected the model \(a torch.nn.Module.*got (generator|list).*"
                                            r"sw.clip_grad_norm_\(model, max_norm\)"):
            call()
    assert sw.clip_grad_norm_(model, 1.0) > 0  # the model itself is fine
