"""Complex parameters (a Fourier neural operator's spectral weights beside real layers) train under every data-parallel
layout as in one process: units are split by dtype (sharding/policy.py), and AdamW's `view_as_real` of a complex piece
is a piece of the real view (sharded_tensor.py). A module that itself holds parameters of two dtypes is refused by
name.

References are computed: the same model trained (AdamW, weight decay) in one process on the global batch."""

from __future__ import annotations

import threading

import pytest
import torch
from parity import assert_state_close, mlp_batch, train_mlp, value_error_text
from torch import nn

import shardwise as sw
from shardwise.sharding.policy import plan_units

_BUILD = threading.Lock()  # thread ranks share torch's global RNG: one seeded build at a time
GLOBAL = 8


class SpectralConv(nn.Module):
    """The Fourier layer of Li et al. 2021 ("Fourier Neural Operator for Parametric PDEs"): multiply the lowest
    `modes` Fourier coefficients by learned complex weights."""

    def __init__(self, channels: int, modes: int) -> None:
        super().__init__()
        self.modes = modes
        self.weight = nn.Parameter(torch.randn(channels, channels, modes, dtype=torch.cfloat) / channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, channels, points)
        spectrum = torch.fft.rfft(x)
        out = torch.zeros_like(spectrum)
        out[..., :self.modes] = torch.einsum("bim,iom->bom", spectrum[..., :self.modes], self.weight)
        return torch.fft.irfft(out, n=x.shape[-1])


class FNO(nn.Module):
    """Lift (real), two spectral layers (complex) with a pointwise convolution (real), project (real); and a complex
    gain held by the root itself."""

    def __init__(self) -> None:
        super().__init__()
        with _BUILD, torch.random.fork_rng():
            torch.manual_seed(0)
            self.lift = nn.Linear(1, 4)
            self.spectral1, self.pointwise = SpectralConv(4, 3), nn.Conv1d(4, 4, 1)
            self.spectral2 = SpectralConv(4, 3)
            self.project = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, points, 1)
        h = self.lift(x).transpose(1, 2)
        h = torch.nn.functional.gelu(self.spectral1(h) + self.pointwise(h))
        return self.project(self.spectral2(h).transpose(1, 2))


class GainedFNO(FNO):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.tensor([1.0 + 0.5j, 0.8 - 0.2j]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain.abs().mean()


def batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL, 16, 1, generator=g), torch.randn(GLOBAL, 16, 1, generator=g)
    rows = slice(rank * GLOBAL // world, (rank + 1) * GLOBAL // world)
    return x[rows], y[rows]


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def train(model: nn.Module, rank: int = 0, world: int = 1) -> nn.Module:
    return train_mlp(model, mse, rank, world, steps=3, batch_of=batch)


WRAPS = {
    "ddp": lambda m, c: sw.DDP(m, c),
    "zero1": lambda m, c: sw.ZeRO(m, c, stage=1),
    "zero2": lambda m, c: sw.ZeRO(m, c, stage=2),
    "zero3": lambda m, c: sw.ZeRO(m, c, stage=3),
    "zero3-linear-units": lambda m, c: sw.ZeRO(m, c, stage=3, wrap=nn.Linear),
    "fsdp": lambda m, c: sw.FSDP(m, c),
    "fsdp-hybrid": lambda m, c: sw.FSDP(m, c, sharding="hybrid_shard", shard_size=2),
}


def zero3_gloo(comm: sw.Communicator) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in sw.full_state_dict(train(sw.ZeRO(GainedFNO(), comm, stage=3), comm.rank,
                                                                    comm.size)).items()}


@pytest.mark.parametrize("wrap", list(WRAPS))
@pytest.mark.parametrize("build", [FNO, GainedFNO], ids=["fno", "root-holds-complex"])
def test_complex_parameters_train_as_one_process(wrap: str, build: type) -> None:
    want = {k: v.clone() for k, v in train(build()).state_dict().items()}
    assert want["spectral1.weight"].is_complex()
    world = 4 if wrap == "fsdp-hybrid" else 2

    def body(comm: sw.Communicator) -> dict[str, torch.Tensor]:
        model = train(WRAPS[wrap](build(), comm), comm.rank, comm.size)
        return {k: v.clone() for k, v in sw.full_state_dict(model).items()}

    for got in sw.launch(body, world):
        assert_state_close(got, want)


def test_complex_units_over_gloo_processes() -> None:
    want = {k: v.clone() for k, v in train(GainedFNO()).state_dict().items()}
    for got in sw.launch(zero3_gloo, 2, backend="gloo", timeout=120):
        assert_state_close(got, want)


def test_units_are_split_by_dtype() -> None:
    def kinds(model: nn.Module) -> list[tuple[str, list[str]]]:
        return [(u.name, sorted({str(p.dtype).removeprefix("torch.") for p in u.params}))
                for u in plan_units(model, wrap=None)]

    # The root holds no parameter itself: the unit keeps the dtype of most bytes (the spectral weights).
    assert kinds(FNO()) == [("lift", ["float32"]), ("pointwise", ["float32"]), ("project", ["float32"]),
                            ("<root>", ["complex64"])]
    scaled = FNO()
    scaled.scale = nn.Parameter(torch.ones(1))  # the root's own parameter decides: real
    assert kinds(scaled) == [("spectral1", ["complex64"]), ("spectral2", ["complex64"]), ("<root>", ["float32"])]


def test_a_module_holding_two_dtypes_itself_is_refused() -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.real = nn.Parameter(torch.ones(3))
            self.cplx = nn.Parameter(torch.ones(3, dtype=torch.cfloat))

    text = sw.launch(lambda comm: value_error_text(lambda: sw.ZeRO(Mixed(), comm, stage=3)), 2)[0]
    assert text is not None and "mixes parameter dtypes ['torch.complex64', 'torch.float32']" in text
    assert "units of their own" in text


class KeptInFloat32(nn.Module):
    """A float64 MLP whose middle layer is kept in float32 (as HuggingFace's keep_in_fp32 modules are): wrap="auto"
    runs the Sequential's siblings together, and the float32 one must leave that run."""

    def __init__(self) -> None:
        super().__init__()
        with _BUILD, torch.random.fork_rng():
            torch.manual_seed(0)
            self.m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).double()
            self.m[2].float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.m[1](self.m[0](x))
        return self.m[4](self.m[3](self.m[2](h.float()).double()))


def float64_batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = mlp_batch(step, rank, world)
    return x.double(), y.double()


def train_float64(model: nn.Module, rank: int = 0, world: int = 1) -> nn.Module:
    return train_mlp(model, mse, rank, world, steps=3, batch_of=float64_batch)


@pytest.mark.parametrize("wrap", ["zero1", "zero3", "fsdp"])
def test_a_float32_sibling_leaves_a_float64_run(wrap: str) -> None:
    units = [(u.name, sorted({str(p.dtype) for p in u.params})) for u in plan_units(KeptInFloat32())]
    assert units == [("m.2", ["torch.float32"]), ("m.0..4", ["torch.float64"]), ("<root>", [])]
    want = {k: v.clone() for k, v in train_float64(KeptInFloat32()).state_dict().items()}

    def body(comm: sw.Communicator) -> dict[str, torch.Tensor]:
        model = train_float64(WRAPS[wrap](KeptInFloat32(), comm), comm.rank, comm.size)
        return {k: v.clone() for k, v in sw.full_state_dict(model).items()}

    for got in sw.launch(body, 2):
        assert_state_close(got, want)
