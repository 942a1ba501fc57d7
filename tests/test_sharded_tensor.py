"""Parameters that look like the model's (issue 29): under ZeRO / FSDP each rank trains a flat piece of every
parameter, and the piece answers for the whole tensor (shape, dim, numel), so a training script's own idioms give
one process's answers; an operation that would see only the piece raises, naming the shardwise way."""

from __future__ import annotations

import threading

import pytest
import torch
from parity import assert_state_close
from torch import nn

import shardwise as sw
from shardwise.models import GPT, GPTConfig
from shardwise.sharded_tensor import ShardSpec, as_sharded, is_sharded, local

CONFIG = GPTConfig.preset("tiny", n_layers=2)
_lock = threading.Lock()
WRAPS = {"zero1": lambda m, c: sw.ZeRO(m, c, stage=1), "zero2": lambda m, c: sw.ZeRO(m, c, stage=2),
         "zero3": lambda m, c: sw.ZeRO(m, c, stage=3), "shard_grad_op": lambda m, c: sw.FSDP(m, c, sharding="shard_grad_op"),
         "hybrid_shard": lambda m, c: sw.FSDP(m, c, sharding="hybrid_shard", shard_size=2)}


def _tokens(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, CONFIG.vocab_size, (4 * 2, CONFIG.seq_len + 1), generator=g)
    rows = x[rank * 8 // world : (rank + 1) * 8 // world]
    return rows[:, :-1], rows[:, 1:]


def nanogpt_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """nanoGPT's configure_optimizers: decay every tensor of 2 or more dims, not biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    # eps=1e-6: the attention key bias's gradient is zero up to rounding, which Adam's default 1e-8 would turn into
    # lr-sized steps of a sign that depends on the summation order (tests/parity.py)
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-3, eps=1e-6)


def _idioms(model: nn.Module, rank: int, world: int) -> dict:
    opt = nanogpt_optimizer(model)
    counts = {"params": sum(p.numel() for p in model.parameters()),
              "decayed": len(opt.param_groups[0]["params"]), "not_decayed": len(opt.param_groups[1]["params"]),
              "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()}}
    for step in range(3):
        model(*_tokens(step, rank, world)).backward()
        sw.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad()
    return {**counts, "state": {k: v.clone() for k, v in sw.full_state_dict(model).items()}}


@pytest.mark.parametrize("name", list(WRAPS))
def test_a_training_scripts_own_idioms_give_one_process_answers(name):
    """Weight-decay groups by p.dim() >= 2 and a parameter count (MFU) equal one process's, and AdamW with those
    groups trains like one process (before: 0 decayed tensors, and each rank counted its own pieces)."""
    def body(comm):
        with _lock:
            model = GPT(CONFIG, seed=0)
        return _idioms(WRAPS[name](model, comm), comm.rank, comm.size)

    want = _idioms(GPT(CONFIG, seed=0), 0, 1)
    assert want["decayed"] > 0 and want["not_decayed"] > 0
    for got in sw.launch(body, 4 if name == "hybrid_shard" else 2):
        assert (got["params"], got["decayed"], got["not_decayed"], got["shapes"]) == \
            (want["params"], want["decayed"], want["not_decayed"], want["shapes"])
        assert_state_close(got["state"], want["state"])


OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-2), "AdamW-foreach": lambda p: torch.optim.AdamW(p, foreach=True),
    "AdamW-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "SGD-fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1, fused=True),
    "Adagrad-fused": lambda p: torch.optim.Adagrad(p, lr=0.1, fused=True),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1), "RMSprop": lambda p: torch.optim.RMSprop(p, lr=1e-2),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-2), "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=1e-2), "Adadelta": lambda p: torch.optim.Adadelta(p),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=1e-2), "Rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
}
X = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))


def _mlp() -> nn.Module:
    """Dense inputs and no parameter with a zero gradient: normalizing (Adagrad, RMSprop) and sign-based (Rprop)
    optimizers turn a rounding-level gradient into a full step, which would compare summation orders, not pieces."""
    with _lock:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3))


def _train_with(model: nn.Module, make, rank: int, world: int) -> dict[str, torch.Tensor]:
    opt = make(model.parameters())
    rows = X[rank * 8 // world : (rank + 1) * 8 // world]
    for step in range(3):
        model(rows).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in sw.full_state_dict(model).items()}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_elementwise_torch_optimizer_steps_the_pieces_like_one_process(name):
    def body(comm):
        return _train_with(sw.ZeRO(_mlp(), comm, stage=3, wrap=None), OPTIMIZERS[name], comm.rank, comm.size)

    want = _train_with(_mlp(), OPTIMIZERS[name], 0, 1)
    for got in sw.launch(body, 2):
        assert_state_close(got, want)


def test_optimizers_pick_their_multi_tensor_step_for_pieces_as_for_plain_parameters(monkeypatch):
    """torch's optimizers default to the foreach (multi-tensor) step only for tensor types they list, and only on
    CUDA-like devices: made to treat the CPU as one, they pick it for the pieces exactly as for plain parameters
    (unlisted, an AdamW on GPUs would loop over the tensors one by one)."""
    from torch.optim import optimizer as torch_optimizer

    monkeypatch.setattr(torch_optimizer, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])

    def body(comm):
        model = sw.ZeRO(_mlp(), comm, stage=3, wrap=None)
        model(X).square().mean().backward()
        params = list(model.parameters())
        return (all(is_sharded(p) for p in params), torch_optimizer._default_to_fused_or_foreach(params, False),
                torch_optimizer._default_to_fused_or_foreach([p.grad for p in params], False))

    plain = torch_optimizer._default_to_fused_or_foreach(list(_mlp().parameters()), False)
    assert plain == (False, True)
    for sharded, params_pick, grads_pick in sw.launch(body, 2):
        assert sharded and params_pick == grads_pick == plain


def _after_backward(comm):
    with _lock:
        model = GPT(CONFIG, seed=0)
    model = sw.ZeRO(model, comm, stage=3)
    model(*_tokens(0, comm.rank, comm.size)).backward()
    return model


@pytest.mark.parametrize("call, message", [
    (lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, norm_type=0.0), r"use sw.clip_grad_norm_"),
    (lambda m: torch.linalg.vector_norm(m.tok_emb.weight.grad, dim=1), r"linalg_vector_norm\(\) on tok_emb.weight"),
    (lambda m: m.tok_emb.weight.grad.abs().max(), r"max\(\) on tok_emb.weight, a ZeRO-3 shard"),
    (lambda m: m.tok_emb.weight[0].sum(), r"sum\(\) reads tok_emb.weight\[0\], a selection of a ZeRO-3 piece"),
    (lambda m: m.tok_emb.weight.view(-1), r"view\(\) on tok_emb.weight"),
    (lambda m: float(m.blocks[0].ln1.bias.sum()), r"sum\(\) on blocks.0.ln1.bias"),
    (lambda m: torch.save(m.tok_emb.weight, "/dev/null"), r"pickling tok_emb.weight.*sw.save_checkpoint"),
    (lambda m: torch.optim.Adafactor(m.parameters()).step(), r"cannot step pieces: train it with sw.DDP"),
])
def test_what_would_see_only_the_piece_raises_naming_the_shardwise_way(call, message):
    def body(comm):
        model = _after_backward(comm)
        with pytest.raises(RuntimeError, match=message):
            call(model)

    sw.launch(body, 2)


def test_torch_grad_scaler_skips_on_every_rank_when_one_piece_overflows():
    def body(comm):
        with _lock:
            model = GPT(CONFIG, seed=0)
        model = sw.ZeRO(model, comm, stage=2)
        opt = torch.optim.AdamW(model.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        scaler.scale(model(*_tokens(0, comm.rank, comm.size))).backward()
        with torch.no_grad():
            model.tok_emb.weight.grad[0, 0] = float("inf")  # on rank 0's piece only
        before = {k: v.clone() for k, v in sw.full_state_dict(model).items()}
        scaler.step(opt)
        scaler.update()
        after = sw.full_state_dict(model)
        return scaler.get_scale(), all(torch.equal(v, after[k]) for k, v in before.items())

    assert sw.launch(body, 2) == [(2.0 ** 9, True)] * 2


def test_pieces_and_their_gradients_answer_for_the_whole_tensor_and_run_elementwise_work():
    def body(comm):
        model = _after_backward(comm)
        p = model.blocks[0].mlp.fc.weight
        whole = model.blocks[0].mlp.fc.weight.shape
        assert is_sharded(p) and is_sharded(p.grad) and isinstance(p, nn.Parameter)
        assert p.shape == p.grad.shape == whole == (4 * CONFIG.d_model, CONFIG.d_model) and len(p) == whole[0]
        assert local(p).dim() == 1 and local(p).numel() <= p.numel()
        doubled = p.grad * 2  # elementwise: still a piece of the same tensor
        assert is_sharded(doubled) and doubled.shape == whole
        assert torch.equal(local(doubled), local(p.grad) * 2)
        assert "ShardedParameter(blocks.0.mlp.fc.weight: shape (256, 64), this rank holds" in repr(p)
        return local(p).numel()

    pieces = sw.launch(body, 2)
    assert sum(pieces) == 4 * CONFIG.d_model * CONFIG.d_model  # every element on one rank


def test_no_shard_keeps_plain_parameters_of_the_original_shape():
    """FSDP no_shard (a group of one per rank) holds whole tensors: plain parameters, every operation allowed."""
    def body(comm):
        with _lock:
            model = GPT(CONFIG, seed=0)
        model = sw.FSDP(model, comm, sharding="no_shard")
        model(*_tokens(0, comm.rank, comm.size)).backward()
        p = model.tok_emb.weight
        return is_sharded(p), is_sharded(p.grad), tuple(p.shape), float(p.grad.norm()) > 0

    assert sw.launch(body, 2) == [(False, False, (CONFIG.vocab_size, CONFIG.d_model), True)] * 2


def test_a_transpose_of_a_flat_piece_is_refused_and_of_a_slice_is_not():
    """`grad.T` of a ZeRO piece (flat, answering for a matrix) was the piece itself, a plain tensor, on which
    reductions ran unchecked (torch's Muon took its norm and failed later with "mat1 must be a matrix, got 0-D
    tensor"). Refused, naming the property; a tensor-parallel slice is a matrix and transposes as one."""
    flat = as_sharded(torch.arange(20.0), ShardSpec(torch.Size([8, 6]), "w", "ZeRO-3"), parameter=True)
    for view in ("T", "mT"):
        with pytest.raises(RuntimeError, match=rf"{view}\(\) on w, a ZeRO-3 shard .* Muon"):
            getattr(flat, view)
    rows = as_sharded(torch.ones(4, 6), ShardSpec(torch.Size([8, 6]), "w", "tensor parallel"), parameter=True)
    assert local(rows.T).shape == (6, 4)
