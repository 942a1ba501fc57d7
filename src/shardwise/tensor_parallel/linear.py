"""Column- and row-parallel Linear layers (Megatron-LM section 3), each one autograd Function that overlaps its
gradient reduction with the weight-gradient matmul. See `layers.py` for the mechanism and sequence parallel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.base import Communicator, ReduceOp
from ..graph_gradients import refuse_second_order
from ..sharded_tensor import local
from .layer_base import TensorParallelLayer, as_param, check_split, dense_linear_init
from .mappings import all_gather_along, gather_from_region, reduce_scatter_along, scatter_to_region
from .sequence_parallel import reduce_sequence_parallel_grads

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "output_blocks"]


class _ColumnParallelLinearFn(torch.autograd.Function):
    """y = x W^T + b for a column shard W, entered through f (or f-bar under sequence parallel).

    Backward starts the reduction of the input gradient (all-reduce, or reduce-scatter along the sequence) before
    computing the weight gradient, and waits for it last, so communication overlaps the weight-gradient matmul.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, comm, sequence_parallel, dim, input_gathered):  # noqa: ANN001, ANN205
        total = all_gather_along(x, dim, comm) if sequence_parallel else x
        ctx.save_for_backward(total, weight)
        ctx.comm, ctx.sequence_parallel, ctx.dim, ctx.has_bias = comm, sequence_parallel, dim, bias is not None
        ctx.input_gathered = input_gathered
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        refuse_second_order("a tensor-parallel linear layer")
        total, weight = ctx.saved_tensors
        comm, dim = ctx.comm, ctx.dim
        grad = grad.contiguous()
        grad_x = work = None
        if ctx.needs_input_grad[0]:
            grad_total = grad.matmul(weight)  # a fresh buffer: reduced in place
            if ctx.sequence_parallel:
                n = comm.size
                chunked = grad_total.unflatten(dim, (n, grad_total.shape[dim] // n)).movedim(dim, 0).contiguous()
                grad_x = torch.empty(chunked.shape[1:], dtype=grad.dtype, device=grad.device)
                work = comm.reduce_scatter(grad_x, chunked, ReduceOp.SUM, async_op=True)
            elif ctx.input_gathered:  # partial: the region that gathered the input reduce-scatters it (hf_sequence.py)
                grad_x = grad_total
            else:
                grad_x = grad_total
                work = comm.all_reduce(grad_x, ReduceOp.SUM, async_op=True)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_w = flat_grad.t().mm(total.reshape(-1, total.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = flat_grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if work is not None:
            work.wait()
        return grad_x, grad_w, grad_b, None, None, None, None


class _RowParallelLinearFn(torch.autograd.Function):
    """y = reduce(x W^T) for a row shard W: g (all-reduce), or g-bar (reduce-scatter) under sequence parallel."""

    @staticmethod
    def forward(ctx, x, weight, comm, sequence_parallel, dim):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.sequence_parallel, ctx.dim = comm, sequence_parallel, dim
        y = F.linear(x, weight)
        if sequence_parallel:
            return reduce_scatter_along(y, dim, comm)
        comm.all_reduce(y, ReduceOp.SUM)  # y is this function's own buffer: no copy needed
        return y

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        refuse_second_order("a tensor-parallel linear layer")
        x, weight = ctx.saved_tensors
        if ctx.sequence_parallel:
            grad = all_gather_along(grad, ctx.dim, ctx.comm)
        grad = grad.contiguous()
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
        return grad_x, grad_w, None, None, None


def output_blocks(fused: object, out_features: int, tp: int) -> tuple[int, ...]:
    """The sizes of a column-parallel layer's output blocks, from `fused` (a count of equal blocks, or the sizes);
    ValueError unless they fill `out_features` and each divides by `tp`."""
    if isinstance(fused, int) and not isinstance(fused, bool) and fused >= 1:
        check_split("ColumnParallelLinear", "out_features", out_features, fused, tp)
        return (out_features // fused,) * fused
    if (not isinstance(fused, tuple) or not fused
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in fused)):
        raise ValueError(f"ColumnParallelLinear: fused={fused!r} must be a positive int (equal blocks) or a tuple of "
                         f"positive block sizes")
    if sum(fused) != out_features:
        raise ValueError(f"ColumnParallelLinear: the output blocks {fused} sum to {sum(fused)}, not out_features="
                         f"{out_features}")
    for k, b in enumerate(fused):
        check_split("ColumnParallelLinear", f"output block {k} of {fused}", b, 1, tp)
    return fused


class ColumnParallelLinear(TensorParallelLayer):
    """Linear layer split by output features. Weight (out/tp, in); bias (out/tp,).

    Args:
        in_features, out_features: the dense layer's sizes; every output block must be divisible by tp.
        comm: the tensor-parallel group.
        bias: whether the layer has a bias (split like the output).
        gather_output: all-gather the output features, so the caller gets the full (B, ..., out) output; otherwise
            each rank returns its (B, ..., out/tp) slice (the input of a row-parallel layer).
        sequence_parallel: the input is a sequence shard; all-gather it along ``sequence_dim`` first.
        input_gathered (attribute, default False): the input was all-gathered by the module around the layer, whose
            reduce-scatter sums the input gradient, so the layer leaves it partial (hf_sequence.py).
        sequence_dim: the sequence dimension of the input (1 for batch-first (B, T, d)).
        fused: the blocks laid side by side in the output, each split on its own: a number of equal blocks (3 for
            the GPT's fused [q | k | v]), or their sizes (Phi-3's [q | k | v] under grouped-query attention:
            (heads x head_dim, kv_heads x head_dim, kv_heads x head_dim)).
        seed: seed of the generator the full dense weight is drawn from (None: torch's global RNG).
    """

    def __init__(self, in_features: int, out_features: int, comm: Communicator, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, sequence_dim: int = 1,
                 fused: int | tuple[int, ...] = 1, seed: int | None = 0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.blocks = output_blocks(fused, out_features, comm.size)
        self.in_features, self.out_features = in_features, out_features
        self.comm, self.gather_output, self.fused = comm, bool(gather_output), fused
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), sequence_dim
        self.input_gathered = False
        local = out_features // comm.size
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(local, device=device, dtype=dtype)) if bias else None
        if self.weight.device.type != "meta":
            w, b = dense_linear_init(out_features, in_features, bias, seed)
            with torch.no_grad():
                self.weight.copy_(self.shard(w))
                if b is not None:
                    self.bias.copy_(self.shard(b))
        self.slices_answer_for_whole()

    @classmethod
    def from_dense(cls, linear: nn.Linear, comm: Communicator, *, gather_output: bool = False,
                   sequence_parallel: bool = False, sequence_dim: int = 1,
                   fused: int | tuple[int, ...] = 1) -> ColumnParallelLinear:
        """This rank's slice of `linear` (same dtype and device; `linear` is left untouched)."""
        layer = cls(linear.in_features, linear.out_features, comm, bias=linear.bias is not None,
                    gather_output=gather_output, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                    fused=fused, device="meta", dtype=linear.weight.dtype)
        layer.weight = as_param(layer.shard(linear.weight), linear.weight)
        if linear.bias is not None:
            layer.bias = as_param(layer.shard(linear.bias), linear.bias)
        layer.slices_answer_for_whole()
        return layer

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full (out, ...) tensor: its slice of each output block."""
        n, r = self.comm.size, self.comm.rank
        pieces = local(full).detach().split(self.blocks, 0)
        return torch.cat([piece[r * (b // n):(r + 1) * (b // n)] for piece, b in zip(pieces, self.blocks)]).clone()

    def _unshard(self, gathered: torch.Tensor, dim: int) -> torch.Tensor:
        """Undo the block interleaving of tensors gathered in rank order along `dim` (the output-feature dim): rank
        r's part holds its slice of every block; the dense layout holds every rank's slice of block 0 first."""
        if len(self.blocks) == 1:
            return gathered
        n = self.comm.size
        per = [b // n for b in self.blocks]
        by_rank = [part.split(per, dim) for part in gathered.split(sum(per), dim)]
        return torch.cat([by_rank[r][k] for k in range(len(per)) for r in range(n)], dim)

    def full_tensor(self, name: str) -> torch.Tensor:
        piece = local(getattr(self, name)).detach()
        return self._unshard(all_gather_along(piece, 0, self.comm), 0)

    def full_weight(self) -> torch.Tensor:
        """The dense (out, in) weight, gathered from every rank. Collective."""
        return self.full_tensor("weight")

    def global_shape(self, name: str) -> tuple[int, ...]:
        return (self.out_features, self.in_features) if name == "weight" else (self.out_features,)

    def boxes(self, name: str, rank: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        rest = ((0, self.in_features),) if name == "weight" else ()
        starts = [sum(self.blocks[:k]) for k in range(len(self.blocks))]
        n = self.comm.size
        return tuple(((start + rank * (b // n), b // n), *rest) for start, b in zip(starts, self.blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = local(self.weight), local(self.bias)  # this rank's slices (layer_base.py)
        if self.comm.size == 1:
            y = F.linear(x, weight, bias)
        else:
            y = _ColumnParallelLinearFn.apply(x, weight, bias, self.comm, self.sequence_parallel,
                                              self.sequence_dim % x.dim(), self.input_gathered)
        if self.gather_output:
            y = self._unshard(gather_from_region(y, self.comm, -1), y.dim() - 1)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (local "
                f"{local(self.weight).shape[0]}), tp={self.comm.size}, bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, blocks={self.blocks}, sequence_parallel={self.sequence_parallel}"
                + (", input_gathered=True" if self.input_gathered else ""))


class RowParallelLinear(TensorParallelLayer):
    """Linear layer split by input features. Weight (out, in/tp); bias (out,) replicated.

    Args:
        in_features, out_features: the dense layer's sizes; in_features must be divisible by tp.
        comm: the tensor-parallel group.
        bias: whether the layer has a bias (added once, after the reduction).
        input_is_parallel: the input already holds this rank's in/tp features (the output of a column-parallel
            layer); otherwise the full input is split along its last dim first.
        sequence_parallel: reduce-scatter the output along ``sequence_dim`` instead of all-reducing it; the bias is
            then added to a sequence shard and its gradient is all-reduced over the group.
        sequence_dim: the sequence dimension of the output (1 for batch-first).
        seed: seed of the generator the full dense weight is drawn from (None: torch's global RNG).
    """

    def __init__(self, in_features: int, out_features: int, comm: Communicator, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, sequence_dim: int = 1,
                 seed: int | None = 0, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        check_split("RowParallelLinear", "in_features", in_features, 1, comm.size)
        self.in_features, self.out_features = in_features, out_features
        self.comm, self.input_is_parallel = comm, bool(input_is_parallel)
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), sequence_dim
        self.weight = nn.Parameter(torch.empty(out_features, in_features // comm.size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        if self.weight.device.type != "meta":
            w, b = dense_linear_init(out_features, in_features, bias, seed)
            with torch.no_grad():
                self.weight.copy_(self.shard(w))
                if b is not None:
                    self.bias.copy_(b)
            self._hook_bias()
        self.slices_answer_for_whole()

    @classmethod
    def from_dense(cls, linear: nn.Linear, comm: Communicator, *, input_is_parallel: bool = True,
                   sequence_parallel: bool = False, sequence_dim: int = 1) -> RowParallelLinear:
        """This rank's slice of `linear` (same dtype and device; `linear` is left untouched)."""
        layer = cls(linear.in_features, linear.out_features, comm, bias=linear.bias is not None,
                    input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel,
                    sequence_dim=sequence_dim, device="meta", dtype=linear.weight.dtype)
        layer.weight = as_param(layer.shard(linear.weight), linear.weight)
        if linear.bias is not None:
            layer.bias = as_param(linear.bias.detach().clone(), linear.bias)
        layer._hook_bias()
        layer.slices_answer_for_whole()
        return layer

    def _hook_bias(self) -> None:
        if self.sequence_parallel and self.bias is not None:
            reduce_sequence_parallel_grads([self.bias], self.comm)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's columns of a full (out, in) weight."""
        n, r = self.comm.size, self.comm.rank
        chunk = self.in_features // n
        return local(full).detach()[:, r * chunk:(r + 1) * chunk].clone()

    def full_tensor(self, name: str) -> torch.Tensor:
        piece = local(getattr(self, name)).detach()
        if name == "bias":
            return piece.clone()
        return all_gather_along(piece, 1, self.comm)

    def full_weight(self) -> torch.Tensor:
        """The dense (out, in) weight, gathered from every rank. Collective."""
        return self.full_tensor("weight")

    def global_shape(self, name: str) -> tuple[int, ...]:
        return (self.out_features, self.in_features) if name == "weight" else (self.out_features,)

    def boxes(self, name: str, rank: int) -> tuple[tuple[tuple[int, int], ...], ...] | None:
        if name == "bias":
            return None  # replicated, added once after the reduction
        chunk = self.in_features // self.comm.size
        return (((0, self.out_features), (rank * chunk, chunk)),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.comm, -1)
        weight = local(self.weight)  # this rank's slice (layer_base.py)
        if self.comm.size == 1:
            y = F.linear(x, weight)
        else:
            y = _RowParallelLinearFn.apply(x, weight, self.comm, self.sequence_parallel,
                                           self.sequence_dim % x.dim())
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {local(self.weight).shape[1]}), "
                f"out_features={self.out_features}, "
                f"tp={self.comm.size}, bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")
