"""Modules nothing calls never bracket a unit. A ModuleList, ModuleDict or ParameterList has no forward of its own: a
unit bracketed by one would never be gathered, and its parameters would reach the forward as this rank's flat piece
(Funnel-Transformer's encoder holds its layers in a ModuleList of ModuleLists: every ZeRO/FSDP layout refused it at
its first forward; an FNO's ParameterList of complex weights failed with a size mismatch). A flat piece read where
its unit is not gathered and broadcast against a tensor of another shape is refused by name: before, a piece whose
length happened to broadcast gave a wrong number on every rank.

References are computed: the same model trained (AdamW, weight decay) in one process on the global batch."""

from __future__ import annotations

import threading

import pytest
import torch
from parity import assert_state_close, train_mlp, value_error_text
from torch import nn

import shardwise as sw
from shardwise.sharding.policy import plan_units

_BUILD = threading.Lock()  # thread ranks share torch's global RNG: one seeded build at a time


def seeded(build):  # noqa: ANN001, ANN201
    with _BUILD, torch.random.fork_rng():
        torch.manual_seed(0)
        return build()


class NestedLists(nn.Module):
    """Blocks in a ModuleList of ModuleLists, as Funnel-Transformer's encoder holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)]) for _ in range(3)])
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            for layer in block:
                h = torch.tanh(layer(h))
        return self.out(h)


class DictInSequential(nn.Module):
    """A ModuleDict among the layers of a Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 8), nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8)}))
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[0](x))
        return self.out(self.layers[1]["b"](torch.tanh(self.layers[1]["a"](h))))


class ComplexGains(nn.Module):
    """Complex weights in a ParameterList, read by the forward of the module holding it (an FNO layer's way)."""

    def __init__(self) -> None:
        super().__init__()
        self.gains = nn.ParameterList([nn.Parameter(torch.randn(8, dtype=torch.cfloat) * 0.5) for _ in range(2)])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = torch.fft.fft(h, dim=-1)
        for gain in self.gains:
            z = z * gain
        return torch.fft.ifft(z, dim=-1).real


class SpectralNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.spectral, self.out = nn.Linear(6, 8), ComplexGains(), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.spectral(self.inp(x))))


MODELS = {"nested-lists": NestedLists, "dict-in-sequential": DictInSequential, "parameter-list": SpectralNet}
WRAPS = {
    "zero1": lambda m, c: sw.ZeRO(m, c, stage=1),
    "zero2": lambda m, c: sw.ZeRO(m, c, stage=2),
    "zero3": lambda m, c: sw.ZeRO(m, c, stage=3),
    "zero3-small-units": lambda m, c: sw.ZeRO(m, c, stage=3, group_mb=0.0005),
    "zero3-size-policy": lambda m, c: sw.ZeRO(m, c, stage=3, wrap="size:0.0005"),
    "fsdp-small-units": lambda m, c: sw.FSDP(m, c, group_mb=0.0005),
}


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


@pytest.mark.parametrize("wrap", list(WRAPS))
@pytest.mark.parametrize("model", list(MODELS))
def test_models_holding_containers_train_as_one_process(model: str, wrap: str) -> None:
    want = {k: v.clone() for k, v in train_mlp(seeded(MODELS[model]), mse).state_dict().items()}

    def body(comm: sw.Communicator) -> dict[str, torch.Tensor]:
        trained = train_mlp(WRAPS[wrap](seeded(MODELS[model]), comm), mse, comm.rank, comm.size)
        return {k: v.clone() for k, v in sw.full_state_dict(trained).items()}

    for got in sw.launch(body, 2):
        assert_state_close(got, want)


@pytest.mark.parametrize("wrap", ["auto", "size:0.0005"])
@pytest.mark.parametrize("model", list(MODELS))
def test_every_unit_is_bracketed_by_modules_with_a_forward(model: str, wrap: str) -> None:
    units = [u for u in plan_units(MODELS[model](), wrap=wrap, group_mb=0.0005) if not u.is_root]
    assert units
    for unit in units:
        for module in unit.modules:
            assert type(module).forward is not nn.Module.forward, (unit.name, type(module).__name__)


def test_the_parameter_list_stays_with_the_module_that_reads_it() -> None:
    units = {u.name: u for u in plan_units(SpectralNet(), wrap=None)}
    assert [type(m).__name__ for m in units["spectral"].modules] == ["ComplexGains"]  # split by dtype: its reader


@pytest.mark.parametrize("cls", [nn.ModuleList, nn.ModuleDict, nn.ParameterList])
def test_a_container_class_as_the_wrap_policy_is_refused(cls: type) -> None:
    text = sw.launch(lambda comm: value_error_text(lambda: sw.ZeRO(NestedLists(), comm, stage=3, wrap=cls)), 2)[0]
    assert text is not None and f"wrap={cls.__name__}" in text and "no forward of its own" in text


class ScaledHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 2)
        self.scale = nn.Parameter(torch.tensor([1.5, 0.5]))  # read by the training script, outside any forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head, self.tail = ScaledHead(), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(torch.tanh(self.head(x)))  # the head's unit is freed when the tail's runs


def scaled_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) * model.head.scale).sum(-1, keepdim=True) - y).pow(2).mean()


def test_a_piece_broadcast_outside_its_units_forward_is_refused_by_name() -> None:
    """Each rank holds one of the two elements of `scale`: `out * scale` would broadcast it and train silently."""
    def body(comm: sw.Communicator) -> str:
        model = sw.ZeRO(seeded(Scaled), comm, stage=3, wrap=(ScaledHead, nn.Linear))
        try:
            train_mlp(model, scaled_loss, comm.rank, comm.size)
        except RuntimeError as e:
            return str(e)
        return "trained"

    for text in sw.launch(body, 2):
        assert "would broadcast head.scale, a ZeRO-3 piece" in text and "replicated_params" in text


def test_the_named_remedy_keeping_the_parameter_whole_trains_as_one_process() -> None:
    want = {k: v.clone() for k, v in train_mlp(seeded(Scaled), scaled_loss).state_dict().items()}

    def body(comm: sw.Communicator) -> dict[str, torch.Tensor]:
        model = seeded(Scaled)
        model = sw.ZeRO(model, comm, stage=3, wrap=(ScaledHead, nn.Linear), replicated_params=(model.head.scale,))
        return {k: v.clone() for k, v in sw.full_state_dict(train_mlp(model, scaled_loss, comm.rank,
                                                                      comm.size)).items()}

    for got in sw.launch(body, 2):
        assert_state_close(got, want)


def test_funnel_transformer_trains_as_one_process_under_zero2() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.FunnelConfig(vocab_size=64, block_sizes=[1, 1], d_model=32, n_head=4, d_head=8,
                                       d_inner=64, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)

    def batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, None]:
        ids = torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(step))
        return ids[rank * 4 // world:(rank + 1) * 4 // world], None

    def loss(model: nn.Module, ids: torch.Tensor, _: None) -> torch.Tensor:
        return model(input_ids=ids).last_hidden_state.pow(2).mean()

    # float64: in float32 the reordered half-batch sums, magnified by AdamW on near-zero gradients, moved one weight
    # 1.6e-5 on one CPU (AVX-512) and under 1e-5 on another
    funnel = lambda: seeded(lambda: transformers.FunnelModel(config)).double()  # noqa: E731
    want = train_mlp(funnel(), loss, steps=2, batch_of=batch).state_dict()

    def body(comm: sw.Communicator) -> dict[str, torch.Tensor]:
        model = sw.ZeRO(funnel(), comm, stage=2)
        trained = train_mlp(model, loss, comm.rank, comm.size, steps=2, batch_of=batch)
        return {k: v.clone() for k, v in sw.full_state_dict(trained).items()}

    for got in sw.launch(body, 2):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")
