"""The shardwise GPT under tensor (and sequence) parallelism: training parity with one process, communication
volume per block and per step against the formula, activation memory saved by sequence parallelism, errors.

Every tensor-parallel rank trains on the same full global batch; the parameters are gathered back with
`tp.full_state_dict` (original names and shapes) and compared with one process trained on that batch.

Optimizer. parity.py explains why AdamW uses eps=1e-6 for data parallel: Adam divides by sqrt(v), so rounding noise
in a tiny gradient becomes a visible update. Tensor parallelism changes the summation order inside every split
matmul (the reduction dimension itself is split across ranks), not only across the batch, which leaves noise of a
few 1e-9 on gradients of ~1e-2. The worst-case amplification of Adam's first step is lr / eps per unit of gradient,
so bounding lr x noise / eps below the contract's atol (1e-6) needs eps >= ~3e-6: the fp32 test uses eps=1e-5
(measured max |diff| 3e-7 instead of 1.6e-6 on one pos_emb element with a 2.5e-7 gradient under eps=1e-6). The
float64 test keeps eps=1e-6 and shows the two computations agree to ~1e-15: the math is the same.
"""

from __future__ import annotations

import pytest
import torch
from parity import ATOL, CONFIG, RTOL, batch

import shardwise as sw
from shardwise.sharded_tensor import local
from shardwise import tensor_parallel as tp
from shardwise.models import GPT, GPTConfig
from shardwise.models.gpt import Block

STEPS = 5
EPS_FP32 = 1e-5  # see the module docstring


def optimizer(params, eps):
    return torch.optim.AdamW(params, lr=1e-3, eps=eps)


def train(model, steps, eps, dtype=torch.float32, micro=1):
    opt = optimizer(model.parameters(), eps)
    for step in range(steps):
        x, y = batch(step)
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            (model(xm, ym) / micro).backward()
        opt.step()
        opt.zero_grad()
    return model


def reference(steps=STEPS, eps=EPS_FP32, dtype=torch.float32, config=CONFIG):
    model = train(GPT(config, seed=0).to(dtype), steps, eps, dtype)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_tp(comm, sp, steps=STEPS, eps=EPS_FP32, dtype=torch.float32, micro=1, config=CONFIG):
    model = tp.parallelize(GPT(config, seed=0).to(dtype), comm, "gpt", sequence_parallel=sp)
    train(model, steps, eps, dtype, micro)
    return tp.full_state_dict(model)


def assert_close(got, want, rtol=RTOL, atol=ATOL):
    assert list(got) == list(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def ref32():
    return reference()


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("world", [2, 4])
def test_five_adamw_steps_match_one_process(world, sp, ref32):
    for state in sw.launch(train_tp, world, sp):
        assert_close(state, ref32)


def test_float64_training_agrees_to_rounding():
    want = reference(eps=1e-6, dtype=torch.float64)
    for world, sp in ((2, False), (4, True)):
        state = sw.launch(train_tp, world, sp, STEPS, 1e-6, torch.float64)[0]
        assert_close(state, want, rtol=1e-10, atol=1e-12)


def test_untied_head_and_no_biases():
    config = GPTConfig.preset("tiny", bias=False, tie_weights=False)
    want = reference(steps=3, config=config)
    for sp in (False, True):
        assert_close(sw.launch(train_tp, 2, sp, 3, EPS_FP32, torch.float32, 1, config)[1], want)


def test_gradient_accumulation_under_sequence_parallel(ref32):
    """The replicated parameters' hooks reduce each micro-batch's gradient once (not the accumulated .grad)."""
    state = sw.launch(train_tp, 2, True, STEPS, EPS_FP32, torch.float32, 2)[0]
    assert_close(state, ref32)


def train_dp_tp(comm, sp):
    """A 2 x 2 mesh: tensor parallel inside each dp group, DDP across them (each dp group sees half the batch)."""
    mesh = sw.Mesh(comm, dp=2, tp=2)
    model = sw.DDP(tp.parallelize(GPT(CONFIG, seed=0), mesh.tp, "gpt", sequence_parallel=sp), mesh.dp)
    opt = optimizer(model.parameters(), EPS_FP32)
    for step in range(STEPS):
        x, y = batch(step, mesh.coords.dp, mesh.dp.size)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return tp.full_state_dict(model)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_composes_with_ddp_on_a_mesh(sp, ref32):
    for state in sw.launch(train_dp_tp, 4, sp):
        assert_close(state, ref32)


def test_parallelised_model_starts_equal_and_computes_the_same_logits():
    dense = GPT(CONFIG, seed=0)
    x, y = batch(0)
    want_logits, want_loss = dense(x).detach(), dense(x, y).detach()

    def body(comm, sp):
        model = tp.parallelize(GPT(CONFIG, seed=0), comm, "gpt", sequence_parallel=sp)
        assert model.tok_emb.weight is model.head.weight  # one shard for the tied embedding / head
        # The slice answers for the dense table (what one process's model reports); its storage is this rank's rows.
        assert model.tok_emb.weight.shape == (CONFIG.vocab_size, CONFIG.d_model)
        assert local(model.tok_emb.weight).shape == (CONFIG.vocab_size // comm.size, CONFIG.d_model)
        return tp.full_state_dict(model), model(x).detach(), model(x, y).detach()

    for sp in (False, True):
        for state, logits, loss in sw.launch(body, 4, sp):
            assert_close(state, dense.state_dict(), rtol=0, atol=0)
            torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)


# ---- communication volume ----------------------------------------------------------------------------------------
BLOCK_PLAN = {"ln1": "sequence", "attn.qkv": tp.Colwise(fused=3), "attn.proj": "rowwise", "ln2": "sequence",
              "mlp.fc": "colwise", "mlp.proj": "rowwise"}


def block_traffic(comm, sp):
    """One transformer block alone (a dict plan), forward and backward on a (B, T, d) activation."""
    block = Block(CONFIG)
    block.load_state_dict(GPT(CONFIG, seed=0).blocks[0].state_dict())
    block = tp.parallelize(block, comm, BLOCK_PLAN, sequence_parallel=sp)
    x = torch.randn(8, CONFIG.seq_len, CONFIG.d_model, generator=torch.Generator().manual_seed(0))
    if sp:
        x = x.chunk(comm.size, 1)[comm.rank]
    x.requires_grad_()
    with comm.stats.measure() as fwd:
        out = block(x)
    with comm.stats.measure() as bwd:
        out.square().sum().backward()
    return fwd.as_dict(), bwd.as_dict()


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_block_equal_the_formula(world):
    act = 8 * CONFIG.seq_len * CONFIG.d_model * 4  # one (B, T, d) fp32 activation
    ring = 2 * (world - 1) * act // world  # ring all-reduce wire bytes per rank

    # Without sequence parallel: two all-reduces of the activation in forward (g after attn.proj and mlp.proj), two
    # in backward (f before attn.qkv and mlp.fc).
    fwd, bwd = sw.launch(block_traffic, world, False)[0]
    assert fwd == bwd == {"all_reduce": {"calls": 2, "bytes": 2 * act, "wire_bytes": 2 * ring}}

    # With it: each all-reduce becomes a reduce-scatter + all-gather pair of the same total wire bytes; backward
    # also all-reduces the sequence-parallel parameters' gradients (ln1, ln2 weight and bias, two row biases).
    fwd, bwd = sw.launch(block_traffic, world, True)[0]
    half = (world - 1) * act // world
    assert fwd == {"all_gather": {"calls": 2, "bytes": 2 * act, "wire_bytes": 2 * half},
                   "reduce_scatter": {"calls": 2, "bytes": 2 * act, "wire_bytes": 2 * half}}
    params = 6 * CONFIG.d_model * 4
    assert bwd == {"all_gather": {"calls": 2, "bytes": 2 * act, "wire_bytes": 2 * half},
                   "reduce_scatter": {"calls": 2, "bytes": 2 * act, "wire_bytes": 2 * half},
                   "all_reduce": {"calls": 6, "bytes": params, "wire_bytes": 2 * (world - 1) * params // world}}
    assert 2 * half + 2 * half == 2 * ring  # same wire total as the two all-reduces it replaces


def step_traffic(comm, sp):
    model = tp.parallelize(GPT(CONFIG, seed=0), comm, "gpt", sequence_parallel=sp)
    x, y = batch(0)
    with comm.stats.measure() as step:
        model(x, y).backward()
    return step.as_dict()


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_bytes_per_step_equal_the_formula(sp):
    B, T, d, L = 8, CONFIG.seq_len, CONFIG.d_model, CONFIG.n_layers
    act, tokens = B * T * d * 4, B * T
    loss = 3 * tokens * 4  # vocabulary-parallel cross-entropy: max, then (target logit, sum exp), per token
    got = sw.launch(step_traffic, 2, sp)[0]
    if not sp:
        # forward: embedding + 2 per block (+ the loss); backward: 2 per block + the head's input
        assert got == {"all_reduce": {"calls": 1 + 2 * L + 2 + 2 * L + 1, "bytes": (4 * L + 2) * act + loss,
                                      "wire_bytes": (4 * L + 2) * act + loss}}
    else:
        grads = (6 * L + 2) * d * 4 + T * d * 4  # LayerNorms, row biases, ln_f, position embedding
        pairs = (4 * L + 2) * act  # every all-reduce of the TP case, as one all-gather and one reduce-scatter
        assert got == {"all_gather": {"calls": 4 * L + 2, "bytes": pairs, "wire_bytes": pairs // 2},
                       "reduce_scatter": {"calls": 4 * L + 2, "bytes": pairs, "wire_bytes": pairs // 2},
                       "all_reduce": {"calls": 2 + 6 * L + 2 + 1, "bytes": loss + grads, "wire_bytes": loss + grads}}


# ---- activation memory ---------------------------------------------------------------------------------------------
def saved(comm, sp):
    config = GPTConfig.preset("tiny", dropout=0.1)  # dropout keeps masks, which sequence parallel also shards
    model = tp.parallelize(GPT(config, seed=0), comm, "gpt", sequence_parallel=sp)
    x, y = batch(0)
    with tp.saved_activations(model) as s:
        model(x, y)
    return s.total, s.by_module


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_shards_the_activations_of_layernorm_and_dropout(world):
    total, by = sw.launch(saved, world, False)[0]
    total_sp, by_sp = sw.launch(saved, world, True)[0]
    assert by.keys() == by_sp.keys()
    sharded = [m for m in by if m.endswith(("ln1", "ln2", "ln_f", "drop")) or m in ("pos_emb",)]
    assert len(sharded) == 4 * CONFIG.n_layers + 3
    for m in by:
        if m in sharded:  # LayerNorm inputs and statistics, dropout masks, positions: 1/tp of the sequence
            assert by_sp[m] * world == by[m], m
        else:  # the tensor-parallel regions keep what they kept
            assert by_sp[m] == by[m], m
    saved_bytes = sum(by[m] - by_sp[m] for m in sharded)
    assert total - total_sp == saved_bytes > 0


# ---- errors ---------------------------------------------------------------------------------------------------------
def test_sizes_tp_does_not_divide_are_value_errors_naming_the_numbers():
    def body(comm):
        six_heads = GPTConfig(vocab_size=256, seq_len=16, d_model=48, n_heads=6, n_layers=1)
        with pytest.raises(ValueError, match=r"tp size 4 does not divide the number of attention heads n_heads=6"):
            tp.parallelize(GPT(six_heads, seed=0), comm, "gpt")
        odd_ff = GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=1, d_ff=66)
        with pytest.raises(ValueError, match=r"tp size 4 does not divide the MLP hidden size d_ff=66"):
            tp.parallelize(GPT(odd_ff, seed=0), comm, "gpt")
        odd_vocab = GPTConfig(vocab_size=250, seq_len=16, d_model=32, n_heads=4, n_layers=1)
        with pytest.raises(ValueError, match=r"divide the vocabulary size vocab_size=250; pad .*vocab_size=252"):
            tp.parallelize(GPT(odd_vocab, seed=0), comm, "gpt")
        model = tp.parallelize(GPT(CONFIG, seed=0), comm, "gpt", sequence_parallel=True)
        with pytest.raises(ValueError, match=r"already wrapped \(tensor_parallel\)"):
            tp.parallelize(model, comm, "gpt")
        with pytest.raises(ValueError, match=r"sequence length T=30 is not divisible by the tensor-parallel size 4"):
            model(torch.zeros(2, 30, dtype=torch.long))
        with pytest.raises(ValueError, match="plan='gpt' needs a shardwise GPT"):
            tp.parallelize(torch.nn.Linear(4, 4), comm, "gpt")

    sw.launch(body, 4)


# ---- gloo processes -------------------------------------------------------------------------------------------------
def gloo_body(comm):
    """Layer checks and GPT training on real processes (module level: imported by name in each spawned rank)."""
    from test_tensor_parallel_layers import check_all

    check_all(comm, quick=True)
    return {sp: train_tp(comm, sp) for sp in ((False, True) if comm.size == 2 else (True,))}


@pytest.mark.multiprocess
# 4 gloo processes on 2 cores cost 11 s: in `make soak`; thread ranks cover tp=4 in `make test`.
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.soak)])
def test_gloo_layers_and_gpt_parity(world, ref32):
    for states in sw.launch(gloo_body, world, backend="gloo", threads_per_rank=1, timeout=120):
        for state in states.values():
            assert_close(state, ref32)
