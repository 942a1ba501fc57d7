"""BatchNorm over the data-parallel group: `SyncBatchNorm.convert(model, comm)`.

Batch normalization (Ioffe & Szegedy, 2015, "Batch Normalization: Accelerating Deep Network Training by Reducing
Internal Covariate Shift") normalizes each channel by the mean and variance of the mini-batch. Under data parallelism
every rank sees only its slice of the batch, so plain BatchNorm (and torch DDP) normalizes by per-rank statistics:
with a few images per GPU those are noisy and training differs from one process on the whole batch. Cross-GPU batch
normalization (Peng et al., 2018, "MegDet: A Large Mini-Batch Object Detector", section 3.2) computes the statistics
over every rank's samples; `torch.nn.SyncBatchNorm` does it over a torch.distributed process group. This module does
it over any shardwise Communicator, so the same model trains on thread ranks, gloo, NCCL or MPI.

Mechanism (training mode, group of more than one rank), per BatchNorm layer and channel c:

forward
    Each rank computes its count n_r (samples x spatial positions), its mean m_r and biased variance v_r with
    torch's BatchNorm statistics kernel (`torch.batch_norm_update_stats`: two passes on CPU, Welford on CUDA), and
    contributes [n_r, n_r m_r, n_r (v_r + m_r^2)] in float64.
    ONE all-reduce (SUM) of these 2C+1 values gives the global count n, sum S and sum of squares Q; then
    mean = S / n, var = Q / n - mean^2 (biased, for normalizing) and var * n / (n - 1) (unbiased, for running_var),
    exactly as one process on the concatenated global batch. Why sums and not an all-gather of per-rank (mean, var,
    count) combined with the parallel-variance formula of Chan et al. (what torch.nn.SyncBatchNorm does): the
    all-gather moves world x (2C+1) values, the all-reduce 2C+1 whatever the world size; the price is the
    cancellation in Q/n - mean^2, whose relative error is about 1e-16 (mean/std)^2 in float64: far below float32
    resolution for any activation, and below 1e-12 in a float64 model while |mean| < 100 std. The per-rank
    statistics never cancel, which is what float32 sums of squares would get wrong. The output is normalized with
    the global statistics by inference-mode `F.batch_norm`: one fused pass on every device.
backward
    With xhat = (x - mean) / sqrt(var + eps) and dy the output gradient, the input gradient is
    dx = w / sqrt(var + eps) * (dy - mean(dy) - xhat * mean(dy * xhat)), the means taken over the GLOBAL batch
    (Ioffe & Szegedy, section 3). Each rank's sums [sum dy, sum dy*xhat] come from one fused pass (the weight and
    bias gradients of inference-mode batch_norm, `aten.native_batch_norm_backward`), and ONE all-reduce (SUM,
    float64) of these 2C values makes them global; dx then takes one subtraction and three in-place passes. The
    weight and bias gradients stay the local sums: DDP / ZeRO average them across ranks like every other
    parameter's. As in torch.nn.SyncBatchNorm, dx is the gradient of the SUM of every rank's loss; the data-parallel
    average then makes each parameter's gradient that of the mean of the ranks' losses, i.e. of the global-batch
    loss when each rank's loss is its local mean (equal local batches; see docs/sync_batchnorm.md for uneven ones).
running statistics
    Updated on every rank from the global mean and unbiased variance, as torch's BatchNorm updates them (momentum,
    or a cumulative average when momentum is None, counted by num_batches_tracked): identical on every rank.

Elementwise work runs in the input's dtype (float32 for float16/bfloat16 inputs); per-rank reductions are torch's
BatchNorm kernels' (accumulating in at least float32), and everything combined across ranks is float64. A rank with no
samples contributes zeros and still joins both all-reduces; a global batch of at most one value per channel is refused
on every rank (torch's "Expected more than 1 value per channel when training").

Not communicating: eval mode (running statistics, or with track_running_stats=False each rank's own batch, as
torch.nn.SyncBatchNorm does: evaluation often runs on a subset of ranks, where a collective would hang), and a
group of one (torch's BatchNorm itself, bit for bit). Every rank must run each layer's forward and backward the
same number of times, in the same order relative to its other collectives (the usual data-parallel rule).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from . import layout
from .comm.base import Communicator, ReduceOp, is_communicator
from .graph_gradients import refuse_second_order

__all__ = ["SyncBatchNorm"]

_ACC = torch.float64  # what ranks combine: statistics, gradient sums and counts (exact up to 2**53)


def _per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A (C,) tensor viewed to broadcast against x of shape (N, C, *)."""
    return t.view(1, -1, *([1] * (x.dim() - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalization with statistics over `comm`: one all-reduce in forward, one in backward.

    Returns (y, batch mean, unbiased batch variance); the last two (float64, non-differentiable) feed the running
    statistics."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,  # noqa: ANN001
                comm: Communicator, eps: float):  # noqa: ANN205
        compute = torch.promote_types(x.dtype, torch.float32)
        xc = x.to(compute)  # the same tensor for float32 / float64 inputs
        channels = x.shape[1]
        count = x.numel() // channels
        if count:
            # torch's own BatchNorm statistics kernel (CPU and CUDA): this rank's mean and biased variance.
            mean_r, var_r = (t.to(_ACC) for t in torch.batch_norm_update_stats(xc, None, None, 0.0))
        else:  # an empty local batch: contribute nothing, but still take part in the collective
            mean_r = var_r = torch.zeros(channels, dtype=_ACC, device=x.device)
        stats = torch.cat([torch.full((1,), float(count), dtype=_ACC, device=x.device),
                           count * mean_r, count * (var_r + mean_r * mean_r)])
        comm.all_reduce(stats, ReduceOp.SUM)
        n = stats[0]  # stays on the device: no host synchronization per layer on a GPU
        # The global count is at least the local one, so only a rank with <= 1 value must look; when the global
        # count is <= 1 every rank has <= 1, looks, and raises: no peer is left waiting in the next collective.
        if count <= 1 and float(n) <= 1:
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel when training, got "
                             f"{float(n):.0f} across the {comm.size} ranks (input of shape {tuple(x.shape)} on rank "
                             f"{comm.rank})")
        mean = stats[1:channels + 1] / n
        var = (stats[channels + 1:] / n - mean * mean).clamp_(min=0)  # rounding may leave a tiny negative
        mean_c, var_c = mean.to(compute), var.to(compute)
        # Copies of the affine parameters: a sharded strategy may free the gathered weight after forward.
        w = None if weight is None else weight.detach().to(compute, copy=True)
        b = None if bias is None else bias.detach().to(compute)
        # Normalizing with given statistics is inference-mode batch_norm: one fused pass on every device.
        y = F.batch_norm(xc, mean_c, var_c, w, b, False, 0.0, eps) if count else torch.empty_like(xc)
        ctx.save_for_backward(xc, mean_c, var_c, w)
        ctx.comm, ctx.count, ctx.eps = comm, n, eps
        ctx.dtypes = (x.dtype, None if weight is None else weight.dtype, None if bias is None else bias.dtype)
        unbiased = var * (n / (n - 1))
        ctx.mark_non_differentiable(mean, unbiased)
        return y.to(x.dtype), mean, unbiased

    @staticmethod
    def backward(ctx, dy: torch.Tensor, _dmean: torch.Tensor, _dvar: torch.Tensor):  # noqa: ANN001, ANN205
        refuse_second_order("sw.SyncBatchNorm")
        xc, mean, var, w = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dyc = dy.to(xc.dtype)
        # This rank's sum(dy * xhat) and sum(dy) in one fused pass: the weight and bias gradients of inference-mode
        # batch_norm with these statistics (weight None counts as 1).
        if xc.numel():
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dyc, xc, w, mean, var, None, None, False, ctx.eps, [False, True, True])
        else:  # no samples here (the kernels divide by the count): the sums are zero
            sum_dy_xhat, sum_dy = torch.zeros_like(mean), torch.zeros_like(mean)
        grad_w = sum_dy_xhat.to(w_dtype) if need_w else None
        grad_b = sum_dy.to(b_dtype) if need_b else None
        grad_x = None
        if need_x:  # the same on every rank (same model), so the all-reduce is called by all or by none
            sums = torch.cat([sum_dy, sum_dy_xhat]).to(_ACC)
            ctx.comm.all_reduce(sums, ReduceOp.SUM)
            mean_dy, mean_dy_xhat = (sums / ctx.count).to(xc.dtype).chunk(2)
            invstd = torch.rsqrt(var + ctx.eps)
            alpha = invstd if w is None else invstd * w
            # dx = alpha (dy - mean(dy) - xhat mean(dy xhat)) as (x - mean) beta + dy alpha - alpha mean(dy),
            # in place after one allocation; x - mean is formed first, so large means do not cancel.
            grad_x = torch.sub(xc, _per_channel(mean, xc))
            grad_x.mul_(_per_channel(-alpha * invstd * mean_dy_xhat, xc))
            grad_x.add_(_per_channel(-alpha * mean_dy, xc)).addcmul_(dyc, _per_channel(alpha, xc))
            grad_x = grad_x.to(x_dtype)
        return grad_x, grad_w, grad_b, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training-mode statistics cover every rank of `comm` (see the module docstring).

    Accepts inputs of shape (N, C, *) (what BatchNorm1d, 2d and 3d accept). In training mode on a group of more
    than one rank: one all-reduce of 2C+1 float64 values in forward and of 2C in backward. Otherwise (eval mode, a
    group of one) exactly torch's BatchNorm. Build it with `SyncBatchNorm.convert(model, comm)`.
    """

    def __init__(self, num_features: int, comm: Communicator, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        _check_comm("SyncBatchNorm", comm)
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"SyncBatchNorm: num_features={num_features!r} must be a positive int (channels)")
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.comm = comm

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2 or input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm: expected an input of shape (N, {self.num_features}, *), got "
                             f"{tuple(input.shape)}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self.comm.size == 1:
            return super().forward(input)  # nothing to synchronize: torch's own numbers
        self._check_input_dim(input)
        y, mean, var = _SyncBatchNormFunction.apply(input, self.weight, self.bias, self.comm, self.eps)
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            with torch.no_grad():  # in float64, rounded once into the buffers' dtype, as torch's CPU kernel does
                for buffer, value in ((self.running_mean, mean), (self.running_var, var)):
                    buffer.copy_(buffer.to(_ACC) * (1 - factor) + value * factor)
        return y

    def __deepcopy__(self, memo: dict[int, Any]) -> SyncBatchNorm:
        # A communicator is a handle on the group (threads, sockets), not state: a copy (an EMA model, an
        # evaluation copy) normalizes over the same group. Everything else is copied as Module's default would.
        memo.setdefault(id(self.comm), self.comm)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        return new

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.comm.size}"

    @classmethod
    def convert(cls, module: nn.Module, comm: Communicator) -> nn.Module:
        """Replace every BatchNorm (nn.BatchNorm1d/2d/3d, any `_BatchNorm` subclass, torch.nn.SyncBatchNorm) in
        `module` by a SyncBatchNorm over `comm`, in place; return `module` (or the new layer when `module` is itself
        a BatchNorm).

        The new layers hold the SAME parameter and buffer objects (values, requires_grad and an optimizer's
        references survive), the same eps, momentum, affine, track_running_stats and train/eval mode. A layer
        referenced twice stays one layer. SyncBatchNorm layers already present keep their communicator. Convert
        before applying DDP / ZeRO / FSDP (they record the parameters and modules they manage).
        """
        if not isinstance(module, nn.Module):
            raise ValueError(f"SyncBatchNorm.convert: module={type(module).__name__} object must be a "
                             f"torch.nn.Module")
        _check_comm("SyncBatchNorm.convert", comm)
        for name, sub in module.named_modules():
            if layout.is_wrapped(sub, *layout.DATA_PARALLEL):
                raise ValueError(f"SyncBatchNorm.convert: module {name or '<root>'!r} is already wrapped by "
                                 f"{' + '.join(s.name for s in layout.strategies(sub))}; convert the plain model "
                                 f"first, then wrap it (sw.DDP(SyncBatchNorm.convert(model, comm), comm))")
            if isinstance(sub, _BatchNorm) and isinstance(sub, LazyModuleMixin) and sub.has_uninitialized_params():
                raise ValueError(f"SyncBatchNorm.convert: {name or '<root>'!r} is a lazy BatchNorm not yet "
                                 f"initialized; run one forward first so that its number of features is known")
        memo: dict[int, nn.Module] = {}

        def swap(m: nn.Module) -> nn.Module:
            if id(m) in memo:  # shared (or cyclic) references map to one replacement
                return memo[id(m)]
            new = cls._from_batchnorm(m, comm) if isinstance(m, _BatchNorm) and not isinstance(m, cls) else m
            memo[id(m)] = new
            # All registered names, including a child registered twice under one parent (named_children skips it).
            for name, child in list(m._modules.items()):
                if child is not None:
                    setattr(new, name, swap(child))
            return new

        return swap(module)

    @classmethod
    def _from_batchnorm(cls, bn: _BatchNorm, comm: Communicator) -> SyncBatchNorm:
        # Built on the meta device (no allocation), then given the original tensors themselves.
        new = cls(bn.num_features, comm, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, device="meta")
        new.weight, new.bias = bn.weight, bn.bias
        new.running_mean, new.running_var = bn.running_mean, bn.running_var
        new.num_batches_tracked = bn.num_batches_tracked
        new.training = bn.training  # this layer only; its children keep their own modes
        if hasattr(bn, "qconfig"):
            new.qconfig = bn.qconfig
        return new


def _check_comm(who: str, comm: object) -> None:
    if not is_communicator(comm):
        raise ValueError(f"{who}: comm={type(comm).__name__} object must be a shardwise Communicator (the argument "
                         f"sw.launch passes, sw.init(), or mesh.dp)")
