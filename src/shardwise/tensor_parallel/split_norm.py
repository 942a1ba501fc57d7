"""An RMSNorm over the whole width of a projection that tensor parallel splits (style ``"split_norm"``).

OLMo 2, OLMo 3 and OLMoE normalize the query and key projections over their full output width, before the heads are
separated: ``q = q_norm(q_proj(x))`` with ``q_norm`` an RMSNorm of weight (num_heads x head_dim,) (Groeneveld et al.
2024, "OLMo"; OLMo 2 Team 2024, arXiv 2501.00656). Once ``q_proj`` is column-parallel, rank r holds only its heads'
features, so a norm over what it holds would divide by the wrong root mean square. `SplitRMSNorm` keeps rank r's
slice of the weight (the same features as the projection's slice, so the weight is split like a column-parallel
output: a ShardedParameter answering for the whole width) and takes the mean square over the whole width: each rank
sums its features' squares, the sums are all-reduced over the group, and every rank divides by the full width. The
all-reduce is Megatron's ``g`` then ``f`` (mappings.py): forward the sum of partial sums, backward the sum of the
ranks' gradients of it, since every rank's output depends on every rank's features through it. One (B, T, 1)
all-reduce per norm, instead of gathering the projection's output as vLLM's inference code for OLMo 2 does.

The model's own norm is replaced, so its forward is mirrored rather than run: RMSNorm classes differ in where they
cast back to the input's dtype (Llama's ``weight * h.to(dtype)``, OLMo 2's ``(weight * h).to(dtype)``). `from_dense`
runs the model's norm and each known form on the same input, in the norm's dtype with a random weight, and keeps
the form that gives the same bits; a norm matching none (a different formula, Gemma's ``1 + weight``) is a
ValueError naming its class, never a silently different model. Only the order of the mean's sum differs from one
process (the sum of per-rank sums).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from ..comm.base import Communicator
from ..sharded_tensor import local
from .layer_base import TensorParallelLayer, as_param, check_split
from .mappings import all_gather_along, copy_to_region, reduce_from_region

__all__ = ["SplitRMSNorm"]


def _weight_times_cast(weight: torch.Tensor, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return weight * h.to(dtype)  # LlamaRMSNorm, OlmoeRMSNorm


def _cast_of_weight_times(weight: torch.Tensor, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (weight * h).to(dtype)  # Olmo2RMSNorm, Olmo3RMSNorm (T5's LayerNorm)


_FORMS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]] = {
    "weight * h.to(dtype)": _weight_times_cast, "(weight * h).to(dtype)": _cast_of_weight_times}


def _epsilon(norm: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(norm, attr, None)
        if isinstance(value, float):
            return value
    return None


def _form_of(norm: nn.Module, eps: float, name: str) -> str:
    """The known form whose output is bitwise the norm's own on a probe (module docstring); ValueError otherwise."""
    weight = norm.weight
    probe = copy.deepcopy(norm)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.rand(weight.shape, generator=gen) * 2 - 0.5)
        x = torch.randn(2, 3, weight.numel(), generator=gen).to(device=weight.device, dtype=weight.dtype)
        expected = probe(x)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        for form, apply in _FORMS.items():
            got = apply(probe.weight, h, x.dtype)
            if got.dtype == expected.dtype and torch.equal(got, expected):
                return form
    raise ValueError(f"tensor parallel: {name} ({type(norm).__name__}) normalizes the whole width of a projection "
                     f"tensor parallel splits, but its forward is none of the RMSNorm forms a split norm computes "
                     f"({', '.join(_FORMS)}, over x.float() * rsqrt(mean(x^2) + eps)); pass a plan dict that leaves "
                     f"its projection whole, or use tp=1")


class SplitRMSNorm(TensorParallelLayer):
    """RMSNorm of width `width` over features split across `comm` like a column-parallel output (module docstring).

    Weight (width/tp,): this rank's features. `form` is the key of the RMSNorm form it computes (see `_FORMS`).
    """

    def __init__(self, width: int, comm: Communicator, *, eps: float, form: str,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        check_split("SplitRMSNorm", "width", width, 1, comm.size)
        if form not in _FORMS:
            raise ValueError(f"SplitRMSNorm: form={form!r}; allowed {sorted(_FORMS)}")
        self.width, self.comm, self.eps, self.form = width, comm, float(eps), form
        self.sequence_parallel, self.sequence_dim = False, 1
        self.weight = nn.Parameter(torch.ones(width // comm.size, device=device, dtype=dtype))
        self.slices_answer_for_whole()

    @classmethod
    def from_dense(cls, norm: nn.Module, comm: Communicator, name: str = "the norm") -> SplitRMSNorm:
        """This rank's slice of `norm` (an RMSNorm with a 1-D `weight` and its epsilon), after checking its form."""
        weight = getattr(norm, "weight", None)
        eps = _epsilon(norm)
        own = [n for n, _ in norm.named_parameters()]
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or own != ["weight"] or eps is None:
            raise ValueError(f"tensor parallel: {name} ({type(norm).__name__}) has parameters {own} and epsilon "
                             f"{eps}; a split norm takes an RMSNorm with one 1-D weight and a float epsilon "
                             f"(variance_epsilon or eps)")
        form = _form_of(norm, eps, name)
        layer = cls(weight.numel(), comm, eps=eps, form=form, device="meta", dtype=weight.dtype)
        per, r = weight.numel() // comm.size, comm.rank
        layer.weight = as_param(local(weight).detach()[r * per:(r + 1) * per].clone(), weight)
        layer.slices_answer_for_whole()
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        squares = h.pow(2).sum(-1, keepdim=True)
        if self.comm.size > 1:
            squares = copy_to_region(reduce_from_region(squares, self.comm), self.comm)
        h = h * torch.rsqrt(squares / self.width + self.eps)
        return _FORMS[self.form](local(self.weight), h, x.dtype)

    def full_tensor(self, name: str) -> torch.Tensor:
        return all_gather_along(local(getattr(self, name)).detach(), 0, self.comm)

    def global_shape(self, name: str) -> tuple[int, ...]:
        return (self.width,)

    def boxes(self, name: str, rank: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        per = self.width // self.comm.size
        return (((rank * per, per),),)

    def extra_repr(self) -> str:
        return (f"width={self.width} (local {self.width // self.comm.size}), tp={self.comm.size}, eps={self.eps}, "
                f"form={self.form!r}")
