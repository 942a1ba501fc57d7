"""A plain torch training loop over a tensor-parallel model gets one process's answers, or an error naming the
shardwise way: the slices answer for the dense parameters (tensor_parallel/layer_base.py).

Every rank of the tensor-parallel group trains on the same global batch, so the reference is one process trained on
that batch. AdamW with weight decay in groups chosen by `p.dim() >= 2` (nanoGPT's rule), eps 1e-5 as in
test_tensor_parallel_gpt.py (whose module docstring says why).
"""

from __future__ import annotations

import io

import pytest
import torch
from parity import CONFIG, batch

import shardwise as sw
from shardwise import tensor_parallel as tp
from shardwise.models import GPT
from shardwise.sharded_tensor import is_sharded, local

STEPS = 3


def nanogpt_optimizer(model):
    """nanoGPT's configure_optimizers: decay every parameter of 2 or more dims, not the others."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, eps=1e-5)
    return opt, len(decay), len(rest)


def census(model):
    """What a script learns from model.parameters(): count, decayed names, shapes by name."""
    return {"numel": sum(p.numel() for p in model.parameters()),
            "decayed": sorted(n for n, p in model.named_parameters() if p.dim() >= 2),
            "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()}}


def train(model, clip):
    opt, _, _ = nanogpt_optimizer(model)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = model(x, y)
        loss.backward()
        clip(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_parameters_answer_for_the_dense_model_and_training_equals_one_process():
    plain = GPT(CONFIG, seed=0)
    want_census = census(plain)
    want_losses = train(plain, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))
    want_state = {k: v.detach().clone() for k, v in plain.state_dict().items()}

    def body(comm):
        model = tp.parallelize(GPT(CONFIG, seed=0), comm, "gpt")
        got_census = census(model)
        sliced = sorted(n for n, p in model.named_parameters() if is_sharded(p))
        losses = train(model, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))  # torch's, as is
        grads_sliced = all(is_sharded(p.grad) for p in model.parameters() if is_sharded(p) and p.grad is not None)
        return got_census, sliced, losses, tp.full_state_dict(model), grads_sliced

    for got_census, sliced, losses, state, grads_sliced in sw.launch(body, 2):
        assert got_census == want_census
        assert sliced and "tok_emb.weight" in sliced and "blocks.0.attn.qkv.weight" in sliced
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
        for name, want in want_state.items():
            torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6, msg=name)
        assert grads_sliced


@pytest.mark.parametrize("dp_strategy", ["ddp", "zero3"])
def test_composed_with_data_parallel_the_parameters_still_answer_for_the_dense_model(dp_strategy):
    want = census(GPT(CONFIG, seed=0))

    def body(comm):
        mesh = sw.Mesh(comm, dp=2, tp=2)
        model = sw.parallelize(GPT(CONFIG, seed=0), mesh, tp_plan="gpt", dp_strategy=dp_strategy)
        return census(model)

    def unnamed(c):  # the composed model names its parameters under its pipeline stages ("pipe.stages.0.0.")
        return c["numel"], len(c["decayed"]), sorted(c["shapes"].values())

    for got in sw.launch(body, 4):
        assert unnamed(got) == unnamed(want)


def _one_step_tp(comm, scaler=None):
    model = tp.parallelize(GPT(CONFIG, seed=0), comm, "gpt")
    x, y = batch(0)
    loss = model(x, y)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    return model


def test_torch_clip_grad_norm_on_slices_is_the_dense_models():
    """torch's clip takes each slice's norm as its whole tensor's: the total is sw.clip_grad_norm_'s."""
    def body(comm):
        model = _one_step_tp(comm)
        return float(sw.clip_grad_norm_(model, 1e9)), float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))

    for ours, torchs in sw.launch(body, 2):
        assert ours == pytest.approx(torchs, rel=1e-6)


def test_torch_grad_scaler_skips_on_every_rank_when_one_slice_overflows():
    """An inf in one rank's vocabulary slice: torch's GradScaler skips the step and backs off on both ranks."""
    def body(comm):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        model = _one_step_tp(comm, scaler)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with torch.no_grad():
            model.tok_emb.weight.grad[-1, 0] = float("inf")  # the last row: rank 1's slice only
        before = {k: v.clone() for k, v in tp.full_state_dict(model).items()}
        scaler.step(opt)
        scaler.update()
        after = tp.full_state_dict(model)
        return scaler.get_scale(), all(torch.equal(before[k], after[k]) for k in before)

    assert sw.launch(body, 2) == [(2.0 ** 9, True)] * 2


def test_saving_the_state_dict_of_slices_raises_and_a_full_one_loads_into_them():
    plain = GPT(CONFIG, seed=3)
    full = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    x, y = batch(0)
    with torch.no_grad():
        want = plain(x, y)

    def body(comm):
        model = tp.parallelize(GPT(CONFIG, seed=0), comm, "gpt")
        with pytest.raises(RuntimeError, match=r"sw\.full_state_dict"):
            torch.save(model.state_dict(), io.BytesIO())
        model.load_state_dict(full)  # torch's own call, a one-process state dict: each rank keeps its slices
        with torch.no_grad():
            got = model(x, y)
        return got, {k: tuple(local(v).shape) for k, v in model.state_dict().items()}

    for got, shapes in sw.launch(body, 2):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert shapes["tok_emb.weight"] == (CONFIG.vocab_size // 2, CONFIG.d_model)
