"""Context parallelism (shardwise.context_parallel): ring and Ulysses attention against torch's causal attention in
float64 (outputs and gradients, contiguous and zigzag splits, grouped-query heads), the bytes each sends, the GPT
trained 3 steps on chunks equal to one process on the whole sequence, a HuggingFace Llama's gradients with rotary
positions offset per chunk, and the ValueErrors.

Every rank's inputs are cut from one global tensor with `split_sequence` and its results put back with
`gather_sequence`, so a chunk attended against the wrong keys, at the wrong positions or returned in the wrong
order fails the comparison with the one-process computation. Thread ranks run strict (tests/conftest.py): the ring's
point-to-point is unbuffered and in order, as on NCCL.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from hf_cases import tiny_llama

import shardwise as sw
from shardwise import context_parallel as cp
from shardwise.data import ByteCorpus
from shardwise.models import GPT, GPTConfig

B, H, HKV, T, D = 2, 4, 2, 16, 8
_GEN = torch.Generator().manual_seed(0)
Q, K, V, DO = (torch.randn(B, h, T, D, generator=_GEN, dtype=torch.float64) for h in (H, HKV, HKV, H))


def torch_attention(q=Q, k=K, v=V, do=DO):
    """torch's causal attention on the whole sequence: output and gradients of <output, do>."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(do)
    return [out.detach(), q.grad, k.grad, v.grad]


def cp_attention(comm, fn, zigzag, k=K, v=V):
    q_r, k_r, v_r, do_r = (cp.split_sequence(t, comm, zigzag=zigzag, dim=2).requires_grad_() for t in (Q, k, v, DO))
    with comm.stats.measure() as forward:
        out = fn(q_r, k_r, v_r, comm, zigzag=zigzag)
    with comm.stats.measure() as backward:
        out.backward(do_r.detach())
    got = [cp.gather_sequence(t, comm, zigzag=zigzag, dim=2) for t in (out, q_r.grad, k_r.grad, v_r.grad)]
    return got, forward, backward


def assert_all_close(got, want, names=("output", "dq", "dk", "dv")):
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("world,zigzag", [(2, True), (4, True), (4, False)])
def test_ring_attention_equals_torch_causal_attention_float64(world, zigzag):
    want = torch_attention()
    kv_bytes = 2 * K.numel() // world * 8  # this rank's k and v, float64
    for rank, (got, forward, backward) in enumerate(sw.launch(cp_attention, world, cp.ring_attention, zigzag)):
        assert_all_close(got, want)
        if zigzag:  # K/V blocks go round the ring once forward, again backward, with their gradients (+ a last hop)
            assert forward.bytes("send") == (world - 1) * kv_bytes
            assert backward.bytes("send") == (world - 1) * kv_bytes + world * kv_bytes
        else:  # rank r's queries see no later rank's keys: its block goes straight to the later ranks
            later = world - 1 - rank
            assert forward.bytes("send") == later * kv_bytes
            assert backward.bytes("send") == later * kv_bytes + rank * kv_bytes  # and the gradients come back


@pytest.mark.parametrize("world,zigzag", [(2, True), (4, True), (2, False)])
def test_ulysses_attention_equals_torch_causal_attention_float64(world, zigzag):
    """cp=4 with 2 key/value heads repeats k, v to the 4 query heads before the exchange."""
    want = torch_attention()
    for got, forward, backward in sw.launch(cp_attention, world, cp.ulysses_attention, zigzag):
        assert_all_close(got, want)
        assert forward.calls("all_to_all") == backward.calls("all_to_all") == 2


def test_ring_attention_with_equal_head_counts():
    k, v = (t.repeat_interleave(H // HKV, dim=1) for t in (K, V))
    want = torch_attention(k=k, v=v)
    for got, _, _ in sw.launch(cp_attention, 2, cp.ring_attention, True, k, v):
        assert_all_close(got, want)


def test_split_positions_and_gather():
    def body(comm):
        x = torch.arange(16).view(1, 16)
        part = cp.split_sequence(x, comm)
        return part, cp.sequence_positions(4, comm), cp.gather_sequence(part, comm)

    parts = sw.launch(body, 4)
    assert [p[0].tolist() for p in parts] == [[[0, 1, 14, 15]], [[2, 3, 12, 13]], [[4, 5, 10, 11]], [[6, 7, 8, 9]]]
    for part, positions, full in parts:
        assert torch.equal(part[0], positions)
        assert torch.equal(full, torch.arange(16).view(1, 16))
    assert sw.launch(lambda comm: cp.split_sequence(torch.arange(8), comm, zigzag=False, dim=0), 2)[1].tolist() == \
        [4, 5, 6, 7]

    def batch_dict(comm):  # a HuggingFace batch: the keys kept, every tensor cut like the tokens
        x = torch.arange(16).view(1, 16)
        return cp.split_sequence({"input_ids": x, "position_ids": x + 100}, comm), cp.split_sequence(x, comm)

    for got, tokens in sw.launch(batch_dict, 2):
        assert list(got) == ["input_ids", "position_ids"]
        assert torch.equal(got["input_ids"], tokens) and torch.equal(got["position_ids"], tokens + 100)


# ---- the shardwise GPT: three AdamW steps on chunks equal one process on the whole sequence --------------------
CONFIG = GPTConfig(vocab_size=256, seq_len=32, d_model=32, n_heads=4, n_layers=2)
CORPUS = ByteCorpus(max_bytes=100_000)
STEPS, MAX_NORM = 3, 0.05  # the gradient norm is ~2.4: clipping binds at every step


def batch(step):
    return CORPUS.batch(step, 4, CONFIG.seq_len)


def train(model, comm=None, zigzag=True):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5, weight_decay=0.1)
    norms = []
    for step in range(STEPS):
        x, y = batch(step) if comm is None else cp.split_sequence(batch(step), comm, zigzag=zigzag)
        model(x, y).backward()
        norms.append(float(sw.clip_grad_norm_(model, MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return sw.full_state_dict(model), norms


def train_cp(comm, method, zigzag=True):
    return train(sw.DDP(cp.apply(GPT(CONFIG, seed=0), comm, method=method, zigzag=zigzag), comm), comm, zigzag)


@pytest.fixture(scope="module")
def reference():
    return train(GPT(CONFIG, seed=0))


@pytest.mark.parametrize("world,method,zigzag", [(2, "ring", True), (4, "ring", True), (2, "ulysses", True),
                                                 (2, "ring", False)])
def test_gpt_training_matches_one_process(world, method, zigzag, reference):
    want, want_norms = reference
    assert min(want_norms) > MAX_NORM
    for state, norms in sw.launch(train_cp, world, method, zigzag):
        assert norms == pytest.approx(want_norms, rel=1e-5)
        assert list(state) == list(want)
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_composes_with_zero3(reference):
    def body(comm):
        return train(sw.ZeRO(cp.apply(GPT(CONFIG, seed=0), comm), comm, stage=3), comm)[0]

    for state in sw.launch(body, 2):
        for name in reference[0]:
            torch.testing.assert_close(state[name], reference[0][name], rtol=1e-5, atol=1e-6)


def train_dp_cp(comm):
    """4 ranks: 2 data-parallel replicas (2 rows each) x cp 2; DDP averages over all 4 ranks."""
    cp_comm, replica = comm.split(color=comm.rank // 2), comm.rank // 2
    model = sw.DDP(cp.apply(GPT(CONFIG, seed=0), cp_comm, method="ring"), comm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5, weight_decay=0.1)
    for step in range(STEPS):
        x, y = CORPUS.batch(step, 2, CONFIG.seq_len, rank=replica, world_size=2)
        model(*cp.split_sequence((x, y), cp_comm)).backward()
        sw.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
    return sw.full_state_dict(model)


def test_data_parallel_over_dp_x_cp_ranks(reference):
    want = reference[0]
    for state in sw.launch(train_dp_cp, 4):
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_gpt_logits_and_positions():
    """Logits gathered from the chunks are the whole sequence's; the plain GPT on a chunk (positions 0..T/cp-1)
    is not, so the comparison can fail."""
    dense = GPT(CONFIG, seed=0)
    x, y = batch(0)
    want = dense(x).detach()

    def body(comm):
        x_r = cp.split_sequence(x, comm)
        model = cp.apply(GPT(CONFIG, seed=0), comm)
        plain = GPT(CONFIG, seed=0)(x_r).detach()
        logits = model(x_r).detach()
        h = x_r
        for stage in model.pipeline_layers():  # the same computation as stages
            h = stage(h)
        assert torch.equal(h, logits)
        return cp.gather_sequence(logits, comm), cp.gather_sequence(plain, comm)

    for got, plain in sw.launch(body, 2):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (plain - want).abs().max() > 1e-2


# ---- a HuggingFace Llama: rotary positions offset per chunk, grouped-query heads ------------------------------

IDS = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))


def llama_grads(model, x, y):
    logits = model(input_ids=x).logits
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("world,method", [(2, "ring"), (4, "ring"), (2, "ulysses")])
def test_hf_llama_gradients_match_one_process(world, method):
    pytest.importorskip("transformers")
    x, y = IDS[:, :-1], IDS[:, 1:]
    want = llama_grads(tiny_llama(), x, y)

    def body(comm):
        model = sw.DDP(cp.apply(tiny_llama(), comm, method=method), comm)
        return llama_grads(model, *cp.split_sequence((x, y), comm))

    for got in sw.launch(body, world):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


# ---- errors --------------------------------------------------------------------------------------------------
def test_bad_inputs_raise_value_errors():
    def body(comm):
        with pytest.raises(ValueError, match=r"T=30 is not divisible by 2 x cp = 8.*multiples of 8"):
            cp.split_sequence(torch.zeros(1, 30), comm)
        with pytest.raises(ValueError, match=r"T=6 is not divisible by cp = 4"):
            cp.split_sequence(torch.zeros(1, 6), comm, zigzag=False)
        with pytest.raises(ValueError, match=r"sequence lengths \[8, 16\]"):
            cp.split_sequence((torch.zeros(1, 8), torch.zeros(1, 16)), comm)
        q = torch.zeros(1, 4, 3, 8)
        with pytest.raises(ValueError, match=r"T=12 is not divisible by 2 x cp = 8"):
            cp.ring_attention(q, q, q, comm)
        with pytest.raises(ValueError, match=r"query heads 4 must be a multiple of key/value heads 3"):
            cp.ring_attention(torch.zeros(1, 4, 2, 8), *[torch.zeros(1, 3, 2, 8)] * 2, comm)
        with pytest.raises(ValueError, match=r"method='bogus'; allowed \('ring', 'ulysses'\)"):
            cp.apply(GPT(CONFIG, seed=0), comm, method="bogus")
        with pytest.raises(ValueError, match=r"dropout=0.1 .*allowed: 0.0"):
            cp.apply(GPT(GPTConfig.preset("tiny", dropout=0.1), seed=0), comm)
        with pytest.raises(ValueError, match=r"already wrapped \(ddp\)"):
            cp.apply(sw.DDP(GPT(CONFIG, seed=0), comm), comm)
        model = cp.apply(GPT(CONFIG, seed=0), comm)
        with pytest.raises(ValueError, match=r"T=64 \(16 tokens on each of cp=4 ranks\) exceeds config.seq_len=32"):
            model(torch.zeros(1, 16, dtype=torch.long))
        return sw.layout.strategies(model)[-1].options

    assert sw.launch(body, 4)[0] == {"cp": 4, "method": "ring", "zigzag": True}


def test_ulysses_needs_heads_divisible_by_cp():
    def body(comm):
        with pytest.raises(ValueError, match=r"n_heads=4 divisible by cp=3"):
            cp.apply(GPT(CONFIG, seed=0), comm, method="ulysses")
        q = torch.zeros(1, 4, 2, 8)
        with pytest.raises(ValueError, match=r"4 attention heads are not divisible by the context-parallel size cp=3"):
            cp.ulysses_attention(q, q, q, comm)
        cp.apply(GPT(CONFIG, seed=0), comm, method="ring")  # the ring takes any head count

    sw.launch(body, 3)


def test_hf_labels_and_4d_masks_are_refused():
    pytest.importorskip("transformers")

    def body(comm):
        model = cp.apply(tiny_llama(), comm)
        x = cp.split_sequence(IDS[:, :16], comm)
        with pytest.raises(ValueError, match="labels= shifts targets within this rank's chunk"):
            model(input_ids=x, labels=x)
        with pytest.raises(ValueError, match="attention_mask must be a padding mask"):  # 2-D masks pass
            model(input_ids=x, attention_mask=torch.ones(2, 1, 8, 8))

    sw.launch(body, 2)


def _train_cp_ring(comm):  # module level: gloo processes pickle it
    return train_cp(comm, "ring")


@pytest.mark.multiprocess
def test_gloo_processes_ring_cp2_equal_one_process(reference):
    """The ring's K/V blocks between two gloo processes (batch_isend_irecv over TCP), not thread ranks."""
    want, want_norms = reference
    for state, norms in sw.launch(_train_cp_ring, 2, backend="gloo", timeout=120):
        assert norms == pytest.approx(want_norms, rel=1e-5)
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
