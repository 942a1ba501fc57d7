"""ZeRO-1/2/3 and FSDP over an expert-parallel MoE GPT (issue 30) on thread ranks: the step equals one process's.

The experts are split over ep ranks borrowed from the data-parallel group (sw.Mesh(comm, dp=4, ep=2): edp = 2 ranks
hold the same experts); the sharding engine shards the dense parameters over dp and the expert slices over edp
(sharding/expert_units.py). Each rank trains on its own rows of the global batch; the reference is one process with
the same seed and the whole batch, AdamW with weight decay, a binding clip, 3 steps, and the load-balancing loss on.
Adam divides by sqrt(v), which hides a gradient wrong by a constant factor, so the first step's gradients are also
gathered and compared, and the clipping norm must be one process's.
"""

from __future__ import annotations

import pytest
import torch

from expert_cases import ATOL, CFG, MAX_NORM, RTOL, STEPS, batch, one_process, optimizer, train
from parity import value_error_text

import shardwise as sw
from shardwise import layout
from shardwise.experts import expert_parallel
from shardwise.models import GPT, GPTConfig
from shardwise.sharded_tensor import local

EXPERTS = ("w_in", "b_in", "w_out", "b_out")


@pytest.fixture(scope="module")
def reference():
    return one_process()


def wrap(model, mesh, strategy):
    if strategy.startswith("zero"):
        return sw.ZeRO(model, mesh.dp, stage=int(strategy[-1]))
    return sw.FSDP(model, mesh.dp, sharding=strategy)


def run(comm, ep, strategy):
    mesh = sw.Mesh(comm, ep=ep)
    model = wrap(expert_parallel(GPT(CFG, seed=0), mesh), mesh, strategy)
    grads, norms, losses = train(model, lambda step: batch(step, mesh.coords.dp, mesh.dp.size), sw.clip_grad_norm_)
    sw.check_replicas(model)
    return sw.full_state_dict(model), grads, norms, losses


def assert_close(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def assert_like_one_process(results, reference):
    want_state, want_grads, want_norms, want_losses = reference
    # Each rank's loss is its rows' cross-entropy plus the global batch's balance loss: their mean is one process's.
    mean_losses = [sum(r[3][step] for r in results) / len(results) for step in range(STEPS)]
    assert mean_losses == pytest.approx(want_losses, rel=1e-5)
    for state, grads, norms, _ in results:
        assert_close(grads, want_grads)
        assert norms == pytest.approx(want_norms, rel=1e-5)
        assert_close(state, want_state)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_zero_over_ep2_dp4_equals_one_process(strategy, reference):
    assert_like_one_process(sw.launch(run, 4, 2, strategy), reference)


@pytest.mark.parametrize("world, ep, strategy", [(4, 2, "full_shard"), (4, 2, "shard_grad_op"), (4, 2, "no_shard"),
                                                  (2, 2, "zero3"), (4, 4, "zero2")],
                         ids=["fsdp-full-ep2-dp4", "fsdp-grad-op-ep2-dp4", "fsdp-no-shard-ep2-dp4", "zero3-ep2-dp2",
                              "zero2-ep4-dp4"])
def test_fsdp_and_ep_equal_to_dp_equal_one_process(world, ep, strategy, reference):
    """ep == dp: no other rank holds a rank's experts, which stay whole in a group of one."""
    assert_like_one_process(sw.launch(run, world, ep, strategy), reference)


def test_expert_slices_are_sharded_over_edp_with_their_optimizer_state():
    def body(comm):
        mesh = sw.Mesh(comm, ep=2)
        model = sw.ZeRO(expert_parallel(GPT(CFG, seed=0), mesh), mesh.dp, stage=3)
        pls = layout.placements(model)
        w_in, router = pls["blocks.0.mlp.w_in"], pls["blocks.0.mlp.router.weight"]
        opt = optimizer(model.parameters())
        model(*batch(0, mesh.coords.dp, mesh.dp.size)).backward()
        opt.step()
        held = {name: local(pl.param).numel() for name, pl in pls.items()}
        state = {name: local(opt.state[pl.param]["exp_avg"]).numel() for name, pl in pls.items()}
        return (w_in.box_group.global_ranks, w_in.flat_group.global_ranks, w_in.replicated_over,
                router.box_group, router.flat_group.global_ranks, router.replicated_over, held, state,
                tuple(mesh.ep.global_ranks), tuple(mesh.edp.global_ranks), len(model.sharding_units()))

    dense = GPT(CFG, seed=0)
    sizes = {name: p.numel() for name, p in dense.named_parameters()}
    results = sw.launch(body, 4)
    for ep_ranks, edp_ranks, replicas, box, dp_ranks, dense_replicas, held, state, mesh_ep, mesh_edp, units \
            in results:
        assert tuple(ep_ranks) == mesh_ep and tuple(edp_ranks) == mesh_edp and replicas == ()
        assert box is None and tuple(dp_ranks) == (0, 1, 2, 3) and dense_replicas == ()
        assert held == state  # the optimizer state follows the shards
        assert units == 3  # the blocks' dense unit, its expert companion, the root
    for name, n in sizes.items():  # every element on exactly one rank
        assert sum(r[6][name] for r in results) == n, name
    # A rank keeps E / ep experts and 1 / edp of their flat buffer: 1 / dp of the experts' elements (none padded here).
    experts = sum(n for name, n in sizes.items() if name.rsplit(".", 1)[-1] in EXPERTS)
    for r in results:
        assert sum(n for name, n in r[6].items() if name.rsplit(".", 1)[-1] in EXPERTS) == experts // 4


def accumulated(comm, strategy):
    """Two micro-batches per step, the first under no_sync(): one reduction per step, of the summed gradients."""
    mesh = sw.Mesh(comm, ep=2)
    model = wrap(expert_parallel(GPT(CFG, seed=0), mesh), mesh, strategy)
    opt = optimizer(model.parameters())
    for step in range(STEPS):
        x, y = batch(step, mesh.coords.dp, mesh.dp.size)
        with model.no_sync():
            (model(x[:1], y[:1]) / 2).backward()
        (model(x[1:], y[1:]) / 2).backward()
        sw.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
    return sw.full_state_dict(model)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_gradient_accumulation_under_no_sync_equals_one_process(strategy):
    """The balance loss is per micro-batch (another quantity than the whole batch's), so the reference is one process
    running the same micro-batches: global micro-batch m is every dp rank's micro-batch m."""
    model = GPT(CFG, seed=0)
    opt = optimizer(model.parameters())
    for step in range(STEPS):
        x, y = batch(step)
        for micro in range(2):
            rows = torch.tensor([r * 2 + micro for r in range(4)])
            (model(x[rows], y[rows]) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for state in sw.launch(accumulated, 4, strategy):
        assert_close(state, want)


def _gloo_body(comm):
    return run(comm, 2, "zero3")


@pytest.mark.multiprocess
def test_gloo_processes_equal_one_process(reference):
    assert_like_one_process(sw.launch(_gloo_body, 4, backend="gloo", timeout=120), reference)


def train_parallelized(comm, strategy):
    config = GPTConfig(**{**CFG.__dict__, "moe_aux_loss_coef": 0.0})  # parallelize's pipeline refuses the aux loss
    mesh = sw.Mesh(comm, dp=4, ep=2)
    model = sw.parallelize(GPT(config, seed=0), mesh, dp_strategy=strategy)
    opt = optimizer(model.parameters())
    for step in range(STEPS):
        model.step(*batch(step, mesh.coords.dp, mesh.dp.size))
        sw.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
    return sw.full_state_dict(model)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "fsdp:full_shard"])
def test_parallelize_with_ep_and_a_sharded_dp_strategy_equals_one_process(strategy):
    config = GPTConfig(**{**CFG.__dict__, "moe_aux_loss_coef": 0.0})
    model = GPT(config, seed=0)
    opt = optimizer(model.parameters())
    for step in range(STEPS):
        model(*batch(step)).backward()
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM) > MAX_NORM
        opt.step()
        opt.zero_grad()
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for state in sw.launch(train_parallelized, 4, strategy):
        assert_close(state, want)


def test_checkpoint_zero3_ep2_to_one_process_to_zero1_ep2_is_bit_identical(tmp_path):
    """(ep=2, dp=4, ZeRO-3) -> one process -> (ep=2, dp=4, ZeRO-1): parameters and AdamW state bit-identical at every
    hop, then one more step there equals one process's step from the same checkpoint."""

    def trained_on_zero3(comm):
        mesh = sw.Mesh(comm, dp=4, ep=2)
        model = sw.ZeRO(expert_parallel(GPT(CFG, seed=0), mesh), mesh.dp, stage=3)
        opt = optimizer(model.parameters())
        for step in range(2):
            model(*batch(step, mesh.coords.dp, mesh.dp.size)).backward()
            sw.clip_grad_norm_(model, MAX_NORM)
            opt.step()
            opt.zero_grad()
        sw.save_checkpoint(tmp_path / "zero3", model, opt, step=2)
        return sw.full_state_dict(model), sw.full_optimizer_state_dict(model, opt)

    params, optim = sw.launch(trained_on_zero3, 4)[0]
    plain = GPT(CFG, seed=1)
    opt = optimizer(plain.parameters())
    sw.load_checkpoint(tmp_path / "zero3", plain, opt)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, params[name]), name
    names = [n for n, _ in plain.named_parameters()]
    one = opt.state_dict()
    for i, name in enumerate(names):
        assert one["state"][i].keys() == optim["state"][i].keys()
        for key, value in one["state"][i].items():
            assert torch.equal(value, optim["state"][i][key]), (name, key)
    sw.save_checkpoint(tmp_path / "one", plain, opt, step=2)
    plain(*batch(2)).backward()
    torch.nn.utils.clip_grad_norm_(plain.parameters(), MAX_NORM)
    opt.step()
    want = {k: v.detach().clone() for k, v in plain.state_dict().items()}

    def resumed_on_zero1(comm):
        mesh = sw.Mesh(comm, dp=4, ep=2)
        model = sw.ZeRO(expert_parallel(GPT(CFG, seed=2), mesh), mesh.dp, stage=1)
        opt = optimizer(model.parameters())
        sw.load_checkpoint(tmp_path / "one", model, opt)
        loaded = sw.full_state_dict(model), sw.full_optimizer_state_dict(model, opt)
        model(*batch(2, mesh.coords.dp, mesh.dp.size)).backward()
        sw.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        return loaded, sw.full_state_dict(model)

    for (got_params, got_optim), stepped in sw.launch(resumed_on_zero1, 4):
        for name, value in params.items():
            assert torch.equal(got_params[name], value), name
        for i, name in enumerate(names):
            for key, value in optim["state"][i].items():
                assert torch.equal(got_optim["state"][i][key], value), (name, key)
        assert_close(stepped, want)


def test_what_cannot_shard_experts_is_refused_at_wrap_by_name():
    def body(comm):
        mesh = sw.Mesh(comm, ep=2)

        def ep_model():
            return expert_parallel(GPT(CFG, seed=0), mesh)

        model = ep_model()
        w_in = model.blocks[0].mlp.w_in
        return {
            "hybrid": value_error_text(lambda: sw.FSDP(ep_model(), mesh.dp, sharding="hybrid_shard", shard_size=2)),
            "compression": value_error_text(lambda: sw.ZeRO(ep_model(), mesh.dp, stage=2,
                                                  compression=sw.compression.BF16())),
            # ep == dp: the slices have no copies (which compression refuses on its own), still their own group
            "compression_ep4": value_error_text(lambda: sw.ZeRO(expert_parallel(GPT(CFG, seed=0), sw.Mesh(comm, ep=4)), comm,
                                                      stage=2, compression=sw.compression.BF16())),
            "replicated": value_error_text(lambda: sw.ZeRO(model, mesh.dp, stage=3, replicated_params=(w_in,))),
            "tiling": value_error_text(lambda: sw.ZeRO(expert_parallel(GPT(CFG, seed=0), mesh.ep), comm, stage=3)),
            "parallelize": value_error_text(lambda: sw.parallelize(
                GPT(GPTConfig(**{**CFG.__dict__, "moe_aux_loss_coef": 0.0}), seed=0), sw.Mesh(comm, dp=4, ep=2),
                dp_strategy="fsdp:hybrid_shard", dp_shard=2)),
        }

    for errors in sw.launch(body, 4):
        assert "hybrid_shard" in errors["hybrid"] and "blocks.0.mlp.w_in" in errors["hybrid"]
        assert "compression=BF16" in errors["compression"] and "blocks.0.mlp.w_in" in errors["compression"]
        assert "compression=BF16" in errors["compression_ep4"] and "expert-parallel" in errors["compression_ep4"]
        assert "replicated_params entries [0]" in errors["replicated"]
        assert errors["tiling"].startswith("ZeRO/FSDP:") and "tile" in errors["tiling"]
        assert "ep=2" in errors["parallelize"] and "fsdp:hybrid_shard" in errors["parallelize"]


@pytest.mark.parametrize("cell", ["ep2_ddp", "ep2_zero3"])
def test_the_gpu_matrix_expert_cells_match_one_process_on_cpu(cell):
    """tests/test_gpu_matrix.py's expert-parallel cells, on CPU: a lent GPU machine then checks only the device."""
    from test_gpu_matrix import check_expert_cell

    report = check_expert_cell(cell, "cpu")
    assert report.ok, report.text(verbose=True)
