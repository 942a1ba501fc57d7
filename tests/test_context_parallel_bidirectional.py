"""Bidirectional attention under context parallel (``causal=False``): encoders, vision and diffusion transformers.

The kernels (ring and Ulysses, float64, contiguous and zigzag splits, grouped-query heads) against torch's
``scaled_dot_product_attention(is_causal=False)`` on the whole sequence, and against the eager formula with a soft
cap, sinks and packed documents; the ring sends every block around the ring (every rank's queries see every key);
a small diffusion-style transformer of our own (patch tokens, learned position embeddings, per-token MSE) trained
three AdamW steps on dp x cp equals one process on the whole sequences; and the refusals.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from attention_cases import DO, HKV, SINKS, SOFTCAP, H, K, Q, V, cp_attention, eager_attention
from parity import value_error_text
from torch import nn

import shardwise as sw
from shardwise import context_parallel as cp

DOCS = torch.tensor([[0] * 5 + [1] * 11, [2] * 9 + [3] * 7])  # two packed images' patches per row


def torch_bidirectional():
    q, k, v = (t.clone().requires_grad_() for t in (Q, K, V))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=H != HKV)
    out.backward(DO)
    return [out.detach(), q.grad, k.grad, v.grad]


KERNELS = [(cp.ring_attention, 2, True), (cp.ring_attention, 4, False), (cp.ulysses_attention, 2, True),
           (cp.ulysses_attention, 4, False)]


@pytest.mark.parametrize("fn,world,zigzag", KERNELS)
def test_bidirectional_attention_equals_torch_float64(fn, world, zigzag):
    want = torch_bidirectional()
    for got in sw.launch(cp_attention, world, fn, zigzag, None, None, None, None, False):
        for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("fn,world,zigzag", KERNELS)
def test_bidirectional_with_cap_sinks_and_documents_equals_the_eager_formula(fn, world, zigzag):
    want = eager_attention(SOFTCAP, SINKS, None, DOCS, causal=False)
    causal = eager_attention(SOFTCAP, SINKS, None, DOCS)
    assert (want[0] - causal[0]).abs().max() > 1e-3  # later keys matter
    for got in sw.launch(cp_attention, world, fn, zigzag, SOFTCAP, SINKS, None, ("split", DOCS), False):
        for name, g, w in zip(["out", "dq", "dk", "dv", "dsinks"], got, want):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_the_ring_sends_every_block_to_every_rank():
    """Causal attention over contiguous chunks sends rank r's block only to later ranks (direct.py); bidirectional
    attention needs every block on every rank, so the ring runs: cp - 1 blocks forward, as many back with the
    gradients, plus the last hop."""
    world, kv_bytes = 4, 2 * K.numel() // 4 * 8  # this rank's k and v, float64

    def body(comm):
        q_r, k_r, v_r, do_r = (cp.split_sequence(t, comm, zigzag=False, dim=2).requires_grad_() for t in (Q, K, V, DO))
        with comm.stats.measure() as forward:
            out = cp.ring_attention(q_r, k_r, v_r, comm, zigzag=False, causal=False)
        with comm.stats.measure() as backward:
            out.backward(do_r)
        return forward.bytes("send"), backward.bytes("send")

    for sent_forward, sent_backward in sw.launch(body, world):
        assert sent_forward == (world - 1) * kv_bytes
        assert sent_backward == (world - 1) * kv_bytes + world * kv_bytes


# ---- a diffusion-style transformer of our own: bidirectional attention over patch tokens -------------------------
PATCH, WIDTH, HEADS, ROWS, TOKENS = 6, 16, 4, 4, 16


class Block(nn.Module):
    def __init__(self, attend):
        super().__init__()
        self.attend = attend  # None: one process (torch's attention); else the context-parallel kernel
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, L, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v) if self.attend is None else self.attend(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, WIDTH))
        return x + self.mlp(self.norm2(x))


class Denoiser(nn.Module):
    """Patch tokens in, per-token predictions out; a learned embedding of each token's global position."""

    def __init__(self, attend=None):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.position = nn.Linear(PATCH, WIDTH), nn.Embedding(TOKENS, WIDTH)
        self.blocks = nn.ModuleList([Block(attend) for _ in range(2)])
        self.out = nn.Linear(WIDTH, PATCH)
        self.double()  # the keys' bias has a zero gradient: float32 noise there, amplified by AdamW, would not compare

    def forward(self, patches, positions):
        x = self.embed(patches) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


LOCK = threading.Lock()


def noisy(step):
    generator = torch.Generator().manual_seed(10 + step)
    return tuple(torch.randn(ROWS, TOKENS, PATCH, generator=generator, dtype=torch.float64) for _ in range(2))


def train(model, batches, positions, comm=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5, weight_decay=0.1)
    for x, target in batches:
        F.mse_loss(model(x, positions), target).backward()  # this rank's tokens: the same count on every rank
        opt.step()
        opt.zero_grad()
    return sw.full_state_dict(model) if comm is not None else model.state_dict()


def train_dp_cp(comm, method, zigzag):
    cp_comm = comm.split(color=comm.rank // 2)  # ranks {0, 1} and {2, 3} split each sequence
    replica, kernel = comm.rank // 2, cp.ring_attention if method == "ring" else cp.ulysses_attention

    def attend(q, k, v):
        return kernel(q, k, v, cp_comm, zigzag=zigzag, causal=False)

    with LOCK:  # thread ranks share torch's global RNG: build one model at a time
        plain = Denoiser(attend)
    model = sw.DDP(plain, comm)
    rows = slice(replica * ROWS // 2, (replica + 1) * ROWS // 2)
    batches = [cp.split_sequence(tuple(t[rows] for t in noisy(step)), cp_comm, zigzag=zigzag) for step in range(3)]
    return train(model, batches, cp.sequence_positions(TOKENS // 2, cp_comm, zigzag=zigzag), comm)


@pytest.mark.parametrize("method,zigzag", [("ring", True), ("ulysses", False)])
def test_a_bidirectional_transformer_trains_like_one_process_on_dp_x_cp(method, zigzag):
    with torch.random.fork_rng():
        want = train(Denoiser(), [noisy(step) for step in range(3)], torch.arange(TOKENS))
    for state in sw.launch(train_dp_cp, 4, method, zigzag):
        for name, w in want.items():
            torch.testing.assert_close(state[name], w, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_a_window_with_bidirectional_attention_is_refused():
    def body(comm):
        q, k, v = (cp.split_sequence(t, comm, dim=2) for t in (Q, K, V))
        return [value_error_text(lambda: fn(q, k, v, comm, causal=False, window=4))
                for fn in (cp.ring_attention, cp.ulysses_attention)] + \
            [value_error_text(lambda: cp.ring_attention(q, k, v, comm, causal="no"))]

    for ring, ulysses, bad in sw.launch(body, 2):
        assert "window=4 with causal=False" in ring and "window=4 with causal=False" in ulysses
        assert "causal='no' must be a bool" in bad
