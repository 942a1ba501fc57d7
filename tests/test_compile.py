"""torch.compile of wrapped models on CPU (the GPU run with inductor is tests/test_gpu.py and `make gpu-check`).

ZeRO / FSDP's forward hooks gather, free and swap parameters and issue collectives; they run eagerly under
torch.compile (torch.compiler.disable: a graph break at each unit's edges, the layers between them compiled). The
`aot_eager` backend traces and partitions forward and backward as inductor would, without a C++ compiler, so a
compiled run must equal the eager one bit for bit here; the number of graphs dynamo captured is bounded by the units.
"""

from __future__ import annotations

import pytest
import torch
from parity import CONFIG, batch

import shardwise as sw
from shardwise.comm.thread_backend import ThreadWorld
from shardwise.models import GPT
from shardwise.models.gpt import Block


def _train(model, forward, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-5)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = forward(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), {k: v.detach().clone() for k, v in sw.full_state_dict(model).items()}


def _wrap(kind):
    comm = ThreadWorld(1).communicators()[0]
    model = GPT(CONFIG, seed=0)
    if kind == "ddp":
        return sw.DDP(model, comm)
    return sw.ZeRO(model, comm, stage=int(kind[-1]), wrap=Block)


@pytest.mark.parametrize("kind", ["zero3", "zero2", "ddp"])
def test_a_compiled_wrapped_model_trains_exactly_as_eager(kind):
    from torch._dynamo.utils import counters

    eager = _wrap(kind)
    want_losses, want = _train(eager, eager)
    torch._dynamo.reset()
    counters.clear()
    model = _wrap(kind)
    compiled = torch.compile(model, backend="aot_eager")
    got_losses, got = _train(model, compiled)
    torch.testing.assert_close(got_losses, want_losses, rtol=0, atol=0)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    # the model's 2 Blocks + the root's pieces between them, compiled twice at most (ZeRO's first forward carries
    # the discovery hooks of sharding/inner_calls.py, removed after it): a handful of graphs, not one per layer
    assert 1 <= counters["stats"]["unique_graphs"] <= 8, dict(counters["stats"])
    graphs = counters["stats"]["unique_graphs"]
    _train(model, compiled, steps=2)
    assert counters["stats"]["unique_graphs"] == graphs, "later steps compiled again"


@pytest.mark.parametrize("kind", ["ddp", "zero3", "tp", "local_sgd"])
def test_wrapping_a_compiled_module_is_refused_naming_the_order_that_works(kind):
    from shardwise.async_sgd import LocalSGD

    comm = ThreadWorld(1).communicators()[0]
    compiled = torch.compile(GPT(CONFIG, seed=0), backend="eager")
    wrap = {"ddp": lambda m: sw.DDP(m, comm), "zero3": lambda m: sw.ZeRO(m, comm, stage=3),
            "tp": lambda m: sw.tensor_parallel.parallelize(m, comm, "gpt"),
            "local_sgd": lambda m: LocalSGD(m, comm, sync_every=2)}[kind]
    with pytest.raises(ValueError, match=r"torch.compile\(\)d GPT .*compile what the wrapper returns"):
        wrap(compiled)
    wrap(compiled._orig_mod)  # the plain module inside is fine


def test_shardwise_tools_see_through_a_compiled_wrapped_model():
    """sw.clip_grad_norm_ / sw.full_state_dict / sw.ShardedGradScaler given torch.compile(wrapped) act on the wrapped
    model's layout (found by tests/test_nanogpt_example.py's compiled run: the clip fell back to torch's)."""
    def body(comm):
        model = sw.ZeRO(GPT(CONFIG, seed=0), comm, stage=3, wrap=Block)
        compiled = torch.compile(model, backend="aot_eager")
        compiled(*batch(0, comm.rank, comm.size)).backward()
        norm = sw.clip_grad_norm_(compiled, 1e9)
        return float(norm), sorted(sw.full_state_dict(compiled)) == sorted(GPT(CONFIG, seed=0).state_dict())

    ref = GPT(CONFIG, seed=0)
    ref(*batch(0)).backward()
    want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
    for norm, same_keys in sw.launch(body, 2):
        assert same_keys
        assert abs(norm - want) <= 1e-5 * want


def _tp_losses(comm, compiled):
    import dataclasses

    model = sw.tensor_parallel.parallelize(GPT(dataclasses.replace(CONFIG, dropout=0.1), seed=0).double(), comm,
                                           "gpt")
    forward = torch.compile(model, backend="aot_eager") if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for step in range(2):
        loss = forward(*batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, sw.full_state_dict(model)


def test_a_compiled_tensor_parallel_model_trains_as_the_eager_one():
    """The tensor-parallel layers run eagerly inside a compiled model (a graph break each: dynamo's guards do not
    follow a slice whose shape says the dense tensor; compiling failed with "Guard failed on the same frame it was
    created"), everything between them compiles; dropout draws from the group's stream in both."""
    (want_losses, want), _ = sw.launch(_tp_losses, 2, False)
    (got_losses, got), _ = sw.launch(_tp_losses, 2, True)
    assert got_losses == want_losses
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _assert_alike(compiled, eager, rtol, atol):
    """Each rank's losses and full state dict, compiled against eager. A random draw other than eager's moves the
    loss by ~1e-2 at the first step; rtol 1e-5 is far below that. A compiled run on thread ranks may differ from eager
    by ~1e-7 from the second step (in about one run in three on the jittered MLP): torch's optimizers take other code
    paths while `torch.compiler.is_compiling()` is true, a process-wide flag, so a rank stepping while another thread
    rank compiles steps slightly differently (a colwise bias off by 6.6e-8 after the first AdamW step, its gradient
    equal). Processes are not affected. AdamW's eps is 1e-5 (parity.py)."""
    for (got_losses, got), (want_losses, want) in zip(compiled, eager):
        torch.testing.assert_close(torch.tensor(got_losses, dtype=torch.float64),
                                   torch.tensor(want_losses, dtype=torch.float64), rtol=rtol, atol=0)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


class _JitteredMLP(torch.nn.Module):
    """Random draws in every region of a tensor-parallel MLP: a MoE router's jitter noise (``Tensor.uniform_``) and
    dropout where the ranks hold the same activations, dropout after the row-parallel output."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x):
        h = self.norm(x)
        h = self.drop(h * torch.empty_like(h).uniform_(0.9, 1.1))
        return self.drop(self.down(torch.tanh(self.up(h)))).pow(2).mean()  # smooth: no ReLU kink to round across


def _jittered_run(comm, base, backend):
    import copy

    model = sw.tensor_parallel.parallelize(copy.deepcopy(base), comm, {"up": "colwise", "down": "rowwise"})
    forward = torch.compile(model, backend=backend) if backend else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
    losses = []
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
        loss = forward(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, sw.full_state_dict(model)


def _compiled_and_eager(backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = _JitteredMLP().double()
    return sw.launch(_jittered_run, 2, base, backend), sw.launch(_jittered_run, 2, base, None)


def test_random_draws_of_a_compiled_tensor_parallel_model_are_the_eager_ones():
    """Dynamo keeps ``Tensor.uniform_`` / ``F.dropout`` (shardwise's, found under torch's names) whole in its graph and
    traces them later: the jitter noise was drawn from a generator object frozen into the graph (other losses than
    eager's from the first step, silently), and inductor failed on it ("While executing %_opaque_obj0"). Each draw
    from the group's stream is now a graph break that runs eagerly (compiled.graph_tracing)."""
    _assert_alike(*_compiled_and_eager("aot_eager"), rtol=1e-5, atol=1e-6)


@pytest.mark.soak  # inductor's C++ compile of every graph: ~20 s on 2 cores; tests/test_gpu.py runs it on CUDA
def test_inductor_compiles_a_tensor_parallel_model_and_draws_the_eager_numbers():
    _assert_alike(*_compiled_and_eager("inductor"), rtol=1e-5, atol=1e-6)


def _blocks_compiled_in_place(comm, base, compiled, mesh, options):
    """Two AdamW steps of a copy of `base` (shardwise's GPT, or a HuggingFace decoder on tokens of its 64-word
    vocabulary) under sw.parallelize, each block compiled in place first when `compiled` (torchtitan's way: the model
    around the blocks stays eager); this rank's losses and the full state dict."""
    import copy

    model = copy.deepcopy(base)
    gpt = isinstance(model, GPT)
    if compiled:
        for block in model.blocks if gpt else model.model.layers:
            block.compile(backend="aot_eager")
    mesh = sw.Mesh(comm, **mesh)
    hybrid = sw.parallelize(model, mesh, **options)
    opt = torch.optim.AdamW(hybrid.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-5)
    d, dp = mesh.coords.dp, mesh.dp.size
    losses = []
    for step in range(2):
        if gpt:
            inputs, targets = batch(step, d, dp)
        else:
            ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
            inputs, targets = {"input_ids": ids[d * 4 // dp:(d + 1) * 4 // dp]}, ids[d * 4 // dp:(d + 1) * 4 // dp]
        losses.append(float(hybrid(inputs, targets)))  # forward and backward of the step
        opt.step()
        opt.zero_grad()
    return losses, sw.full_state_dict(hybrid)


@pytest.mark.parametrize("mesh,options", [
    pytest.param(dict(tp=2), {}, id="tp2"),
    # 4 thread ranks compiling: ~25 s each on 2 cores, in `make soak`
    pytest.param(dict(dp=2, tp=2), dict(dp_strategy="zero3"), marks=pytest.mark.soak, id="dp2-tp2-zero3"),
    pytest.param(dict(pp=2, tp=2), dict(n_microbatches=2), marks=pytest.mark.soak, id="pp2-tp2"),
])
def test_blocks_compiled_in_place_under_parallelize_draw_the_eager_dropout_masks(mesh, options):
    """Under sw.parallelize the stages call the blocks, never the model the stream was attached to: a block compiled
    in place took none of its traced hooks as the outermost call and drew its masks from a thread rank's own stream
    (a process: torch's generator), not the group's: another loss than eager's from the first step, silently."""
    import dataclasses

    torch._dynamo.reset()
    base = GPT(dataclasses.replace(CONFIG, dropout=0.1, n_layers=2 * mesh.get("pp", 1)), seed=0).double()
    world = 2 * mesh.get("dp", 1) * mesh.get("pp", 1)
    options = {"tp_plan": "gpt", **options}
    eager = sw.launch(_blocks_compiled_in_place, world, base, False, mesh, options)
    compiled = sw.launch(_blocks_compiled_in_place, world, base, True, mesh, options)
    _assert_alike(compiled, eager, rtol=1e-9, atol=1e-11)


def test_blocks_compiled_in_place_with_expert_parallel_train_as_the_eager_ones():
    """An expert-parallel layer runs eagerly between the compiled pieces: dynamo guarded on its slices' shapes,
    which say the whole (E, ...), and failed ("Guard failed on the same frame it was created")."""
    import dataclasses

    torch._dynamo.reset()
    base = GPT(dataclasses.replace(CONFIG, n_experts=4, experts_per_token=2, moe_aux_loss_coef=0.01), seed=0)
    eager = sw.launch(_blocks_compiled_in_place, 2, base, False, dict(dp=2, ep=2), {})
    compiled = sw.launch(_blocks_compiled_in_place, 2, base, True, dict(dp=2, ep=2), {})
    _assert_alike(compiled, eager, rtol=1e-5, atol=1e-6)  # float32


@pytest.mark.parametrize("family,mesh,options", [
    ("mixtral", dict(dp=2, ep=2), {}),  # HuggingFace's fused experts, expert parallel (experts/hf_experts.py)
    # sequence parallel's gathers (tensor_parallel/hf_sequence.py): ~15 s on 2 cores, in `make soak`
    pytest.param("llama", dict(tp=2), dict(tp_plan="llama", sequence_parallel=True), marks=pytest.mark.soak),
], ids=["mixtral-ep2", "llama-tp2-sp"])
def test_huggingface_layers_compiled_in_place_train_as_the_eager_ones(family, mesh, options):
    import hf_decoders

    torch._dynamo.reset()
    base = getattr(hf_decoders, family)()
    world = mesh.get("dp", 1) * mesh.get("tp", 1)  # ep borrows its ranks from dp
    eager = sw.launch(_blocks_compiled_in_place, world, base, False, mesh, options)
    compiled = sw.launch(_blocks_compiled_in_place, world, base, True, mesh, options)
    _assert_alike(compiled, eager, rtol=1e-5, atol=1e-6)  # float32
