"""Parameters that get no gradient in a step: one process leaves their `.grad` None and AdamW skips them (no weight
decay, no momentum step); every data-parallel strategy and composition must do the same, not hand the optimizer a
zero gradient. AdamW with weight decay throughout: under plain SGD a zero gradient and none give the same update.

The sharding engine learns which parameters some rank used from one flag per trainable tensor that rides in each
chunk of the gradient reduce-scatter (sharding/grad_layout.py); under lossy compression the flags travel in a small
all-reduce of their own. The engine also copies each parameter's first gradient of a cycle into its slice of the
flat buffer instead of zeroing the whole buffer first, and zeroes only what nothing wrote (padding, frozen and
unused parameters) before the reduction: a stale slice would show up here as a wrong update too."""

from __future__ import annotations

import pytest
import torch
from parity import assert_state_close
from torch import nn

import shardwise as sw
from shardwise import pipeline as pp
from shardwise import tensor_parallel as tp
from shardwise.compression import BF16, TopK


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.1, weight_decay=0.1)


# ---- the minimal case: b is used in step 0 only -----------------------------------------------------------------
class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.fill_(0.5)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return (self.b(self.a(x)) if step == 0 else self.a(x)).square().mean()


def _two_layers(comm, wrap) -> tuple[dict[str, torch.Tensor], list[bool]]:
    model = wrap(TwoLayers(), comm)
    opt = _adamw(model.parameters())
    grads_none = []
    for step in range(2):
        model(torch.ones(2, 4), step).backward()
        grads_none.append(all(p.grad is None for n, p in model.named_parameters() if n.startswith("b.")))
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in sw.full_state_dict(model).items()}, grads_none


STRATEGIES = {
    "ddp_find_unused": lambda m, c: sw.DDP(m, c, find_unused_parameters=True),
    "zero1": lambda m, c: sw.ZeRO(m, c, stage=1),
    "zero2": lambda m, c: sw.ZeRO(m, c, stage=2),
    "zero3": lambda m, c: sw.ZeRO(m, c, stage=3),
    "zero3_one_unit": lambda m, c: sw.ZeRO(m, c, stage=3, wrap=None),  # a and b share one flat buffer
    "full_shard": lambda m, c: sw.FSDP(m, c, sharding="full_shard"),
    "shard_grad_op": lambda m, c: sw.FSDP(m, c, sharding="shard_grad_op"),
    "no_shard": lambda m, c: sw.FSDP(m, c, sharding="no_shard"),
    "hybrid_shard": lambda m, c: sw.FSDP(m, c, sharding="hybrid_shard", shard_size=2),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_layer_unused_in_step_1_is_left_alone_as_in_one_process(name):
    """The issue's case: one process (and DDP with find_unused_parameters) give b.weight[0, 0] = 0.39950 after two
    AdamW steps; a zero gradient in step 1 would apply decay and momentum (0.33209)."""
    (want, _), = sw.launch(_two_layers, 1, lambda m, c: m)
    world = 4 if name == "hybrid_shard" else 2
    for got, grads_none in sw.launch(_two_layers, world, STRATEGIES[name]):
        assert grads_none == [False, True]
        assert_state_close(got, want)


COMPRESSED = {
    "zero2_topk": lambda m, c: sw.ZeRO(m, c, stage=2, compression=TopK(0.5)),  # flags all-reduced apart
    "zero3_bf16": lambda m, c: sw.ZeRO(m, c, stage=3, compression=BF16()),  # flags in the 16-bit reduce-scatter
    "zero2_bf16_error_feedback": lambda m, c: sw.ZeRO(m, c, stage=2, compression=BF16(error_feedback=True)),
    "hybrid_topk": lambda m, c: sw.FSDP(m, c, sharding="hybrid_shard", shard_size=2, compression=TopK(0.5)),
    "no_shard_topk": lambda m, c: sw.FSDP(m, c, sharding="no_shard", compression=TopK(0.5)),
}


@pytest.mark.parametrize("name", list(COMPRESSED))
def test_compression_leaves_an_unused_layer_alone(name):
    """A compressed average is not one process's, but a layer no rank used still gets no update: its flags reach
    every rank exactly, in the reduce-scatter's band or in an all-reduce of their own."""
    def body(comm):
        model = COMPRESSED[name](TwoLayers(), comm)
        opt = _adamw(model.parameters())
        model(torch.ones(2, 4), 0).backward()
        opt.step()
        opt.zero_grad()
        before = sw.full_state_dict(model)["b.weight"].clone()
        model(torch.ones(2, 4), 1).backward()
        assert all(p.grad is None for n, p in model.named_parameters() if n.startswith("b."))
        opt.step()
        return before, sw.full_state_dict(model)["b.weight"].clone()

    for before, after in sw.launch(body, 4 if name.startswith("hybrid") else 2):
        assert torch.equal(before, after)


# ---- used on one rank only ----------------------------------------------------------------------------------------
class Branchy(nn.Module):
    """A trunk always used, a branch used only on some steps (its gradient is None on others), a frozen layer,
    and an odd parameter count so that the flat buffer has padding."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(7, 7)
        self.branch = nn.Linear(7, 7)
        self.frozen = nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(7, 1)
        # Values from a private generator: thread ranks build their models at the same time, and the global RNG
        # (torch.manual_seed) is shared between threads.
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.frozen(self.trunk(x)))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h).pow(2).mean()


def _data(step: int, rank: int, world: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + micro)
    x = torch.randn(4 * world, 7, generator=g)
    return x[4 * rank : 4 * (rank + 1)]


STEPS, MICRO = 4, 2


def _uses_branch(step: int, micro: int, rank: int) -> bool:
    """Even steps: the second micro-batch uses it on every rank (under no_sync its slice is first written by the
    syncing backward). Step 1: only rank 0's first micro-batch (used on one rank: the others must still get the
    average, not None). Step 3: nowhere."""
    return (step % 2 == 0 and micro == 1) or (step == 1 and micro == 0 and rank == 0)


def _train(model: nn.Module, rank: int, world: int, no_sync) -> dict[str, torch.Tensor]:
    opt = _adamw([p for p in model.parameters() if p.requires_grad])
    for step in range(STEPS):
        for micro in range(MICRO):
            loss = model(_data(step, rank, world, micro), _uses_branch(step, micro, rank)) / MICRO
            if micro < MICRO - 1:
                with no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in sw.full_state_dict(model).items()}


def _train_whole(world: int) -> dict[str, torch.Tensor]:
    """One process on the global batch: each rank's rows through the branch where that rank used it, so the
    branch's gradient is the sum over the ranks that used it, divided by the world (the data-parallel average)."""
    model = Branchy()
    opt = _adamw([p for p in model.parameters() if p.requires_grad])
    for step in range(STEPS):
        for micro in range(MICRO):
            for rank in range(world):
                (model(_data(step, rank, world, micro), _uses_branch(step, micro, rank)) / MICRO / world).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _sharded(comm, name: str) -> dict[str, torch.Tensor]:
    # wrap=None: one flat buffer, so padding, frozen, used and unused slices sit side by side in one reduction.
    model = {"zero1": lambda: sw.ZeRO(Branchy(), comm, stage=1, wrap=None),
             "zero2": lambda: sw.ZeRO(Branchy(), comm, stage=2, wrap=None),
             "zero3": lambda: sw.ZeRO(Branchy(), comm, stage=3, wrap=None),
             "hybrid_shard": lambda: sw.FSDP(Branchy(), comm, sharding="hybrid_shard", shard_size=2, wrap=None),
             "no_shard": lambda: sw.FSDP(Branchy(), comm, sharding="no_shard", wrap=None)}[name]()
    return _train(model, comm.rank, comm.size, model.no_sync)


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "hybrid_shard", "no_shard"])
def test_parameters_used_on_some_ranks_or_steps_match_one_process(name):
    world = 4 if name == "hybrid_shard" else 2
    want = _train_whole(world)
    for got in sw.launch(_sharded, world, name):
        assert_state_close(got, want)


# ---- compositions: the dp axis under tensor parallel, and pipeline stages ---------------------------------------
def _tp_then_zero3(comm) -> tuple[dict[str, torch.Tensor], list[bool]]:
    mesh = sw.Mesh(comm, dp=2, tp=2)
    plan = {"a": tp.Colwise(gather_output=True), "b": tp.Colwise(gather_output=True)}

    def wrap(model, _):
        return sw.ZeRO(tp.parallelize(model, mesh.tp, plan), mesh.dp, stage=3)

    return _two_layers(comm, wrap)


def test_tensor_parallel_with_zero3_on_the_dp_axis_leaves_an_unused_layer_alone():
    (want, _), = sw.launch(_two_layers, 1, lambda m, c: m)
    for got, grads_none in sw.launch(_tp_then_zero3, 4):
        assert grads_none == [False, True]
        assert_state_close(got, want)


class Gated(nn.Module):
    """A pipeline layer whose second Linear runs only while `self.on` (set between steps on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.extra = nn.Linear(4, 4), nn.Linear(4, 4)
        self.on = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return h + self.extra(h) if self.on else h


def _layers() -> list[nn.Module]:
    """Four gated layers, the first's and the last's `extra` weight tied: one copy on each pipeline rank, their
    gradients summed over the pipeline (pipeline/tied.py) and kept whole by ZeRO (a replicated parameter)."""
    torch.manual_seed(0)
    layers = [Gated() for _ in range(4)]
    layers[3].extra.weight = layers[0].extra.weight
    return layers


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean()


def _pipeline_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)


def _pipeline(comm, strategy: str) -> dict[str, torch.Tensor]:
    mesh = sw.Mesh(comm, dp=2, pp=2)
    with _lock:
        layers = _layers()
    pipe = pp.Pipeline(pp.partition(layers, 2), mesh.pp, "1f1b", 2, _mse)
    for stage in pipe.stages.values():
        sw.DDP(stage, mesh.dp, find_unused_parameters=True) if strategy == "ddp" else \
            sw.ZeRO(stage, mesh.dp, stage=int(strategy[-1]))
    opt = _adamw(pipe.parameters())
    for step in range(3):
        for layer in layers:
            layer.on = step != 1  # step 1: every `extra` unused
        x, y = _pipeline_batch(step)
        rows = slice(4 * mesh.coords.dp, 4 * mesh.coords.dp + 4)
        pipe.step(x[rows], y[rows])
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in sw.full_state_dict(pipe).items()}


def _pipeline_reference(prefix: str = "stages") -> dict[str, torch.Tensor]:
    layers = _layers()
    model = nn.Sequential(*layers)
    opt = _adamw(model.parameters())
    for step in range(3):
        for layer in layers:
            layer.on = step != 1
        x, y = _pipeline_batch(step)
        _mse(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    if prefix == "layers":  # sw.parallelize's names: the model's own
        return {f"layers.{i}.{k}": v.detach() for i, layer in enumerate(layers) for k, v in layer.state_dict().items()}
    return {f"stages.{i // 2}.{i % 2}.{k}": v.detach() for i, layer in enumerate(layers)
            for k, v in layer.state_dict().items()}


_lock = __import__("threading").Lock()


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_pipeline_stages_under_data_parallel_leave_unused_layers_alone(strategy):
    want = _pipeline_reference()
    for got in sw.launch(_pipeline, 4, strategy):
        assert_state_close(got, want)


class GatedStack(nn.Module):
    """The gated layers as a model sw.parallelize can split: `pipeline_layers()` and a loss over the last output."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_layers())

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)


def _parallelized(comm, dp_strategy: str, find_unused: bool) -> dict[str, torch.Tensor]:
    with _lock:
        model = GatedStack()
    model = sw.parallelize(model, sw.Mesh(comm, dp=2, pp=2), dp_strategy=dp_strategy, loss_fn=_mse,
                           n_microbatches=2, **({"find_unused_parameters": True} if find_unused else {}))
    opt = _adamw(model.parameters())
    for step in range(3):
        for layer in model.modules():
            if isinstance(layer, Gated):
                layer.on = step != 1
        x, y = _pipeline_batch(step)
        rows = slice(4 * model.mesh.coords.dp, 4 * model.mesh.coords.dp + 4)
        model.step(x[rows], y[rows])
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in sw.full_state_dict(model).items()}


@pytest.mark.parametrize("dp_strategy", ["ddp", "zero2"])
def test_parallelize_dp_axis_leaves_unused_layers_alone(dp_strategy):
    """With pp > 1 the dp reduction runs once per step after the microbatches (sync_gradients): DDP's used to hand a
    zero gradient to a layer no microbatch used."""
    want = _pipeline_reference("layers")
    for got in sw.launch(_parallelized, 4, dp_strategy, dp_strategy == "ddp"):
        assert_state_close(got, want)


def test_parallelize_with_ddp_refuses_an_unused_layer_without_find_unused_parameters():
    with pytest.raises(sw.LaunchError, match=r"got no gradient in this backward pass.*find_unused_parameters=True"):
        sw.launch(_parallelized, 4, "ddp", False)
