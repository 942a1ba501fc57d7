"""`sw.parallelize` of a mixture-of-experts GPT: expert parallel with tensor parallel (with and without sequence
parallel), and the Switch load-balancing loss, each equal to one process on the global batch (three AdamW steps with
weight decay and a binding clip); what stays unsupported is refused at wrap time by name.

The MoE layers stay whole under the "gpt" plan (expert-tensor-parallel size 1): each tp rank routes the tokens it
holds and runs its ep share of the experts; ep groups are made of dp ranks of one tp coordinate. The balance loss
(`moe_aux_loss_coef` > 0) is a function of the whole batch, so its statistics are summed over the ranks that split
the batch (dp) and, under sequence parallel, each sequence (tp). A dropped or miscounted balance loss moves the
clipping norms and the weights by far more than the tolerance (checked in `reference`). Under pipeline stages or
several microbatches the balance loss is per microbatch: tests/test_parallelize_moe_microbatches.py."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise import layout
from shardwise import tensor_parallel as tp
from shardwise.data import ByteCorpus
from shardwise.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=256, seq_len=32, d_model=32, n_heads=4, n_layers=2, n_experts=4, experts_per_token=2,
                   moe_aux_loss_coef=0.1)
CORPUS = ByteCorpus(max_bytes=100_000)
STEPS, MAX_NORM, BATCH = 3, 0.05, 4
RTOL, ATOL = 1e-5, 1e-6


def batch(step):
    return CORPUS.batch(step, BATCH, CONFIG.seq_len)


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-5, weight_decay=0.1)


def one_process(config, steps=STEPS):
    """(state, losses, clipping norms) of one process on the global batch."""
    model = GPT(config, seed=0)
    opt = optimizer(model.parameters())
    losses, norms = [], []
    for step in range(steps):
        x, y = batch(step)
        loss = model(x, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms


@pytest.fixture(scope="module")
def reference():
    state, losses, norms = one_process(CONFIG)
    assert min(norms) > MAX_NORM  # the clip binds
    _, _, without = one_process(GPTConfig(**{**CONFIG.__dict__, "moe_aux_loss_coef": 0.0}))
    assert all(abs(a - b) > 1e-3 * b for a, b in zip(norms, without))  # the balance loss weighs in
    return state, losses, norms


def rows(mesh):
    dp = mesh.sizes["dp"]
    return slice(mesh.coords.dp * BATCH // dp, (mesh.coords.dp + 1) * BATCH // dp)


def train(comm, axes, options, steps=STEPS, save=None):
    mesh = sw.Mesh(comm, **axes)
    model = sw.parallelize(GPT(CONFIG, seed=0), mesh, **options)
    opt = optimizer(model.parameters())
    losses, norms = [], []
    for step in range(steps):
        x, y = batch(step)
        losses.append(float(model.step(x[rows(mesh)], y[rows(mesh)])))  # this dp rank's cross entropy + the aux
        norms.append(float(sw.clip_grad_norm_(model, MAX_NORM)))
        opt.step()
        opt.zero_grad()
    sw.check_replicas(model)
    if save is not None:
        sw.save_checkpoint(save, model, opt, step=steps, comm=comm)
    return sw.full_state_dict(model), losses, norms


TP = {"tp_plan": "gpt"}
SP = {"tp_plan": "gpt", "sequence_parallel": True}
CASES = {  # name: (world, mesh axes, parallelize options)
    "dp2_ep2_tp2": (4, {"ep": 2, "tp": 2}, TP),
    "dp2_ep2_tp2_sp": (4, {"ep": 2, "tp": 2}, SP),
    "dp4_ep2_tp2_sp": (8, {"ep": 2, "tp": 2}, SP),
    "dp2_tp2_sp": (4, {"tp": 2}, SP),
    "dp2_ep2": (2, {"ep": 2}, {}),
    "dp2": (2, {}, {}),
    "dp2_zero3": (2, {}, {"dp_strategy": "zero3"}),
    "dp2_ep2_checkpointed": (2, {"ep": 2}, {"activation_checkpointing": True}),
    "cp2_ep2": (2, {"cp": 2, "ep": 2}, {}),  # ep borrows the cp ranks: the balance loss summed over dp x cp
    "dp2_cp2_ep2_zero1": (4, {"cp": 2, "ep": 2}, {"dp_strategy": "zero1"}),
    "dp2_ep2_tp2_zero3": (4, {"ep": 2, "tp": 2}, {**TP, "dp_strategy": "zero3"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_with_balance_loss_trains_like_one_process(case, reference):
    want, want_losses, want_norms = reference
    world, axes, options = CASES[case]
    results = sw.launch(train, world, axes, options)
    # Every rank reports its dp part's cross entropy plus the global batch's balance loss: their mean over the ranks
    # (each dp part counted tp times) is one process's loss.
    mean_losses = [sum(r[1][step] for r in results) / world for step in range(STEPS)]
    assert mean_losses == pytest.approx(want_losses, rel=RTOL)
    for state, _, norms in results:
        assert norms == pytest.approx(want_norms, rel=RTOL)  # the norm counts each expert and tp copy once
        assert set(state) == set(want)
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def _declared(comm):
    mesh = sw.Mesh(comm, ep=2, tp=2)
    model = sw.parallelize(GPT(CONFIG, seed=0), mesh, **SP)
    pls = layout.placements(model)
    expert, router = pls["blocks.0.mlp.w_in"], pls["blocks.0.mlp.router.weight"]
    ranks = lambda groups: sorted(sorted(g.global_ranks) for g in groups if g.size > 1)  # noqa: E731
    return {"expert_box_group": sorted(expert.box_group.global_ranks), "expert_shape": expert.shape,
            "expert_boxes": expert.boxes, "expert_replicated": ranks(expert.replicated_over),
            "router_boxes": router.boxes, "router_replicated": ranks(router.replicated_over),
            "router_partial": sorted(router.partial_grad_over.global_ranks), "tp": sorted(mesh.tp.global_ranks),
            "ep": sorted(mesh.ep.global_ranks)}


def test_layout_declares_experts_split_over_ep_and_replicated_over_tp():
    for rank, got in enumerate(sw.launch(_declared, 4)):  # ranks 0, 1: dp 0 (tp 0, 1); ranks 2, 3: dp 1
        tp_ranks = [rank - rank % 2, rank - rank % 2 + 1]
        assert got["tp"] == tp_ranks and got["ep"] == [rank % 2, rank % 2 + 2]
        assert got["expert_box_group"] == got["ep"] and got["expert_shape"] == (4, 32, 4 * 32)
        assert got["expert_boxes"] == (((rank // 2 * 2, 2), (0, 32), (0, 128)),)  # experts of its ep rank (= dp)
        assert got["expert_replicated"] == [tp_ranks]  # ep == dp: no edp copy; the same experts on both tp ranks
        assert got["router_boxes"] is None and got["router_replicated"] == sorted([got["ep"], tp_ranks])  # dp, tp
        assert got["router_partial"] == tp_ranks  # sequence parallel: each tp rank's router gradient is partial


def _resume_in_one_process(path, steps):
    model = GPT(CONFIG, seed=1)  # another seed: every value must come from the checkpoint
    opt = optimizer(model.parameters())
    start = sw.load_checkpoint(path, model, opt)["step"]
    for step in range(start, start + steps):
        x, y = batch(step)
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_checkpoint_of_ep_by_tp_resumes_in_one_process(tmp_path, reference):
    want = reference[0]
    sw.launch(train, 4, {"ep": 2, "tp": 2}, SP, 1, tmp_path / "ckpt")
    got = _resume_in_one_process(tmp_path / "ckpt", STEPS - 1)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def _tensor_parallel_loss(comm, sp):
    model = tp.parallelize(GPT(CONFIG, seed=0), comm, "gpt", sequence_parallel=sp)
    x, y = batch(0)
    loss = model(x, y)
    loss.backward()
    return float(loss.detach()), float(sw.clip_grad_norm_(model, MAX_NORM))


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_tensor_parallel_gpt_forward_adds_the_balance_loss(sp, reference):
    model = GPT(CONFIG, seed=0)
    x, y = batch(0)
    want = model(x, y)
    want.backward()
    want_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    for loss, norm in sw.launch(_tensor_parallel_loss, 2, sp):
        assert loss == pytest.approx(want.item(), rel=RTOL) and norm == pytest.approx(want_norm, rel=RTOL)


@pytest.mark.parametrize("world, axes, options, match", [
    (2, {"tp": 2}, {"tp_plan": {"blocks.*.attn.qkv": tp.Colwise(fused=3), "blocks.*.attn.proj": "rowwise"},
                    "sequence_parallel": True}, r"'blocks\.0\.mlp' \(MoE\) runs on sequence shards"),
], ids=["sp_plan_without_moe"])
def test_what_stays_unsupported_is_refused_by_name(world, axes, options, match):
    def body(comm):
        with pytest.raises(ValueError, match=match):
            sw.parallelize(GPT(CONFIG, seed=0), sw.Mesh(comm, **axes), **options)
        return True

    assert all(sw.launch(body, world))
