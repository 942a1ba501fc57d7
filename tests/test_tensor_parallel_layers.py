"""Tensor-parallel layers and the vocabulary-parallel loss against their dense counterparts.

Every rank builds the dense layer from the same seed, slices it with `from_dense`, and runs the same global input
(or its sequence shard under sequence parallel). The reference is the dense layer run on the whole input in one
process; the loss is sum(output * G) for a fixed G, so each rank's part of the output gets its part of G. Outputs,
input gradients and weight gradients (this rank's slice of the dense gradient) must match. float64 keeps the
comparison about the math (the order of floating-point sums differs between 1 and N ranks).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import tensor_parallel as tp
from shardwise.sharded_tensor import local as piece

B, T, D_IN, D_OUT, VOCAB = 2, 8, 12, 24, 32
TOL = dict(rtol=1e-10, atol=1e-12)


def rand(seed: int, *shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def dense_linear(bias=True) -> nn.Linear:
    lin = nn.Linear(D_IN, D_OUT, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(rand(1, D_OUT, D_IN))
        if bias:
            lin.bias.copy_(rand(2, D_OUT))
    return lin


def shard(t: torch.Tensor, dim: int, comm) -> torch.Tensor:
    return t.chunk(comm.size, dim)[comm.rank]


def reference(module: nn.Module, x: torch.Tensor, g: torch.Tensor):
    x = x.clone().requires_grad_(x.is_floating_point())
    y = module(x)
    (y * g).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


UNEVEN = (12, 4, 8)  # [q | k | v] under grouped-query attention (Phi-3's qkv_proj): blocks of different sizes


def check_column(comm, sp: bool, gather_output: bool, fused: int | tuple[int, ...]):
    dense = dense_linear()
    x, g = rand(3, B, T, D_IN), rand(4, B, T, D_OUT)
    want_y, want_dx, want_dp = reference(dense, x, g)
    layer = tp.ColumnParallelLinear.from_dense(dense, comm, gather_output=gather_output, sequence_parallel=sp,
                                               fused=fused)

    def local_features(t):  # this rank's output features: its slice of each of the `fused` blocks
        blocks = t.split(fused, -1) if isinstance(fused, tuple) else t.chunk(fused, -1)
        return torch.cat([shard(block, -1, comm) for block in blocks], -1)

    xin = (shard(x, 1, comm) if sp else x).clone().requires_grad_()
    y = layer(xin)
    gy = g if gather_output else local_features(g)
    (y * gy).sum().backward()
    torch.testing.assert_close(y, want_y if gather_output else local_features(want_y), **TOL)
    torch.testing.assert_close(xin.grad, shard(want_dx, 1, comm) if sp else want_dx, **TOL)
    torch.testing.assert_close(piece(layer.weight.grad), local_features(want_dp["weight"].T).T, **TOL)
    torch.testing.assert_close(piece(layer.bias.grad), local_features(want_dp["bias"]), **TOL)
    torch.testing.assert_close(layer.full_weight(), dense.weight, rtol=0, atol=0)
    torch.testing.assert_close(layer.full_state()["bias"], dense.bias, rtol=0, atol=0)


def check_row(comm, sp: bool, input_is_parallel: bool, bias: bool):
    dense = dense_linear(bias)
    x, g = rand(3, B, T, D_IN), rand(4, B, T, D_OUT)
    want_y, want_dx, want_dp = reference(dense, x, g)
    layer = tp.RowParallelLinear.from_dense(dense, comm, input_is_parallel=input_is_parallel, sequence_parallel=sp)
    xin = (shard(x, -1, comm) if input_is_parallel else x).clone().requires_grad_()
    y = layer(xin)
    (y * (shard(g, 1, comm) if sp else g)).sum().backward()
    torch.testing.assert_close(y, shard(want_y, 1, comm) if sp else want_y, **TOL)
    torch.testing.assert_close(xin.grad, shard(want_dx, -1, comm) if input_is_parallel else want_dx, **TOL)
    torch.testing.assert_close(piece(layer.weight.grad), shard(want_dp["weight"], -1, comm), **TOL)
    if bias:  # replicated; under sequence parallel its partial gradient is all-reduced by a hook
        torch.testing.assert_close(piece(layer.bias.grad), want_dp["bias"], **TOL)
    torch.testing.assert_close(layer.full_weight(), dense.weight, rtol=0, atol=0)


def check_embedding(comm, sp: bool, padding_idx):
    dense = nn.Embedding(VOCAB, D_IN, padding_idx=padding_idx, dtype=torch.float64)
    with torch.no_grad():
        dense.weight.copy_(rand(5, VOCAB, D_IN))
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(6))
    ids[0, :3] = torch.tensor([0, VOCAB - 1, 7])  # both ends of the vocabulary and the padding id
    g = rand(7, B, T, D_IN)
    want_y, _, want_dp = reference(dense, ids, g)
    layer = tp.VocabParallelEmbedding.from_dense(dense, comm, sequence_parallel=sp)
    y = layer(ids)
    (y * (shard(g, 1, comm) if sp else g)).sum().backward()
    torch.testing.assert_close(y, shard(want_y, 1, comm) if sp else want_y, **TOL)
    torch.testing.assert_close(piece(layer.weight.grad), shard(want_dp["weight"], 0, comm), **TOL)
    torch.testing.assert_close(layer.full_weight(), dense.weight, rtol=0, atol=0)


def check_cross_entropy(comm, reduction: str):
    logits = rand(8, B, T, VOCAB) * 3
    target = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(9))
    target[0, 0], target[1, 1] = 0, VOCAB - 1
    target[1, 2] = -100  # ignored
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full.reshape(-1, VOCAB), target.reshape(-1), reduction=reduction)
    want = want.view(B, T) if reduction == "none" else want
    g = rand(10, *want.shape)
    (want * g).sum().backward()
    local = shard(logits, -1, comm).clone().requires_grad_()
    with comm.stats.measure() as stats:
        got = tp.vocab_parallel_cross_entropy(local, target, comm, reduction=reduction)
    (got * g).sum().backward()
    torch.testing.assert_close(got, want.detach(), **TOL)
    torch.testing.assert_close(local.grad, shard(full.grad, -1, comm), **TOL)
    # one MAX all-reduce of a float per token, one SUM all-reduce of two: never the (tokens x V) logits
    assert stats.as_dict() == {"all_reduce": {"calls": 2, "bytes": 3 * B * T * 8, "wire_bytes": 2 * (comm.size - 1)
                                              * 3 * B * T * 8 // comm.size}}


def check_all(comm, quick: bool = False):
    """Every layer configuration on this rank; `quick` (the gloo test, see test_tensor_parallel_gpt.py) keeps one
    configuration per layer and mode."""
    for sp in (False, True):
        for gather_output, fused in ((True, 3),) if quick else ((False, 1), (True, 1), (False, 3), (True, 3),
                                                                 (False, UNEVEN), (True, UNEVEN)):
            check_column(comm, sp, gather_output, fused)
        for input_is_parallel, bias in ((True, True),) if quick else ((True, True), (True, False), (False, True)):
            check_row(comm, sp, input_is_parallel, bias)
        for padding_idx in (7,) if quick else (None, 7):
            check_embedding(comm, sp, padding_idx)
    for reduction in ("mean",) if quick else ("mean", "sum", "none"):
        check_cross_entropy(comm, reduction)
    return comm.rank


@pytest.mark.parametrize("world", [2, 4])
def test_every_layer_matches_its_dense_counterpart(world):
    assert sw.launch(check_all, world) == list(range(world))


def test_one_rank_layers_are_the_dense_layers():
    comm = sw.init()
    for sp in (False, True):
        check_column(comm, sp, True, 3)
        check_row(comm, sp, True, True)
        check_embedding(comm, sp, 7)
    logits, target = rand(8, 6, VOCAB), torch.arange(6)
    got = tp.vocab_parallel_cross_entropy(logits, target, comm)
    torch.testing.assert_close(got, F.cross_entropy(logits, target), rtol=0, atol=0)
    assert comm.stats.calls() == 0


def test_layers_built_directly_equal_the_dense_init_sliced():
    """Built without a dense layer, the full weight is drawn once from the seed and sliced: equal for any tp."""

    def body(comm):
        col = tp.ColumnParallelLinear(D_IN, D_OUT, comm, seed=3, fused=3)
        row = tp.RowParallelLinear(D_IN, D_OUT, comm, seed=3)
        emb = tp.VocabParallelEmbedding(VOCAB, D_IN, comm, seed=3)
        return col.full_weight(), col.full_state()["bias"], row.full_weight(), emb.full_weight()

    one = body(sw.init())
    for got in sw.launch(body, 4):
        for a, b in zip(got, one):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    bound = 1 / D_IN**0.5
    assert one[0].abs().max() <= bound and one[0].std() > bound / 3  # nn.Linear's kaiming-uniform range


def test_sizes_not_divisible_by_tp_are_value_errors():
    def body(comm):
        with pytest.raises(ValueError, match=r"out_features=10 cannot be split across tensor-parallel size 4"):
            tp.ColumnParallelLinear(4, 10, comm)
        with pytest.raises(ValueError, match=r"out_features=16 in 3 fused blocks .* divisible by 12"):
            tp.ColumnParallelLinear(4, 16, comm, fused=3, device="meta")  # 16 splits in 4, not as 3 blocks
        with pytest.raises(ValueError, match=r"output block 1 of \(8, 6, 2\)=6 cannot be split .* size 4"):
            tp.ColumnParallelLinear(4, 16, comm, fused=(8, 6, 2), device="meta")
        with pytest.raises(ValueError, match=r"the output blocks \(8, 4\) sum to 12, not out_features=16"):
            tp.ColumnParallelLinear(4, 16, comm, fused=(8, 4), device="meta")
        with pytest.raises(ValueError, match=r"fused=\[8, 8\] must be a positive int \(equal blocks\) or a tuple"):
            tp.ColumnParallelLinear(4, 16, comm, fused=[8, 8], device="meta")
        with pytest.raises(ValueError, match=r"in_features=6 cannot be split across tensor-parallel size 4"):
            tp.RowParallelLinear(6, 4, comm)
        with pytest.raises(ValueError, match=r"vocabulary size\)=250 cannot be split across tensor-parallel size 4"):
            tp.VocabParallelEmbedding(250, 4, comm)
        with pytest.raises(ValueError, match="max_norm"):
            tp.VocabParallelEmbedding.from_dense(nn.Embedding(8, 2, max_norm=1.0), comm)
        logits = torch.zeros(3, 2)
        with pytest.raises(ValueError, match=r"target shape \(4,\) must equal the logits shape \(3, 2\)"):
            tp.vocab_parallel_cross_entropy(logits, torch.zeros(4, dtype=torch.long), comm)
        with pytest.raises(ValueError, match="reduction='avg'"):
            tp.vocab_parallel_cross_entropy(logits, torch.zeros(3, dtype=torch.long), comm, reduction="avg")

    sw.launch(body, 4)


def test_half_precision_logits_are_computed_in_float32():
    def body(comm):
        logits = rand(8, 16, VOCAB).to(torch.bfloat16)
        target = torch.arange(16) * 2
        local = shard(logits, -1, comm).clone().requires_grad_()
        loss = tp.vocab_parallel_cross_entropy(local, target, comm)
        loss.backward()
        return loss.detach().float(), local.grad.dtype

    want = F.cross_entropy(rand(8, 16, VOCAB).to(torch.bfloat16).float(), torch.arange(16) * 2)
    for loss, dtype in sw.launch(body, 2):
        assert dtype == torch.bfloat16
        torch.testing.assert_close(loss, want, rtol=1e-2, atol=0)  # the loss is rounded to bf16 once
