"""Expert parallelism (shardwise.experts) on thread ranks: the step equals one process's on the same global batch.

Each rank of the data-parallel group trains on its own rows of the global batch; the experts are split over ep of
those ranks; dense parameters are averaged by sw.DDP over dp, experts over edp. The reference is one process with the
same seed and the whole batch. Adam divides by sqrt(v), which hides a gradient that is wrong by a constant factor,
so the first step's gradients are also gathered and compared, and the clipping norm (binding) must be one process's.
"""

from __future__ import annotations

import pytest
import torch
from expert_cases import ATOL, CFG, MAX_NORM, RTOL, STEPS, batch, one_process, optimizer, train
from parity import accumulated_backward, value_error_text
from torch import nn

import shardwise as sw
from shardwise import layout
from shardwise.experts import expert_parallel
from shardwise.models import GPT, GPTConfig
from shardwise.models.moe import MoE
from shardwise.sharded_tensor import local
from shardwise.whole.gather import gather_full

@pytest.fixture(scope="module")
def reference():
    state, grads, norms, _ = one_process()
    return state, grads, norms


def run_ep(comm, ep_size, accumulate=1, form="groups"):
    """form: how the groups are given: "groups" (ep, dp, edp), "mesh" (a Mesh), "split" (edp split from dp), "comm"
    (ep alone: ep == dp)."""
    mesh = sw.Mesh(comm, ep=ep_size)
    model = GPT(CFG, seed=0)
    model = {"groups": lambda: expert_parallel(model, mesh.ep, dp=mesh.dp, edp=mesh.edp),
             "mesh": lambda: expert_parallel(model, mesh),
             "split": lambda: expert_parallel(model, mesh.ep, dp=mesh.dp),
             "comm": lambda: expert_parallel(model, comm)}[form]()
    model = sw.DDP(model, mesh.dp)

    def step_batch(step):
        return batch(step, mesh.coords.dp, mesh.dp.size)

    if accumulate > 1:  # micro-batches under no_sync, then one reduction
        grads, norms = _accumulated(model, step_batch, accumulate)
    else:
        grads, norms, _ = train(model, step_batch, sw.clip_grad_norm_)
    sw.check_replicas(model)
    return sw.full_state_dict(model), grads, norms


def _accumulated(model, step_batch, accumulate):
    opt, norms = optimizer(model.parameters()), []
    for step in range(STEPS):
        accumulated_backward(model, *step_batch(step), accumulate)
        norms.append(float(sw.clip_grad_norm_(model, MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return None, norms


def assert_close(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("world, ep, form", [(2, 2, "comm"), (4, 4, "mesh"), (4, 2, "groups"), (2, 1, "groups")],
                         ids=["ep2", "ep4", "ep2-dp4", "ep1-dp2"])
def test_three_adamw_steps_equal_one_process(world, ep, form, reference):
    want_state, want_grads, want_norms = reference
    for state, grads, norms in sw.launch(run_ep, world, ep, 1, form):
        assert_close(grads, want_grads)
        assert norms == pytest.approx(want_norms, rel=1e-5)
        assert_close(state, want_state)


def test_gradient_accumulation_under_no_sync_with_expert_data_parallel():
    """Micro-batches: the aux loss is per micro-batch (a different quantity), so compare with one process doing the
    same micro-batches."""
    model = GPT(CFG, seed=0)
    opt = optimizer(model.parameters())
    for step in range(STEPS):
        x, y = batch(step)
        for micro in range(2):  # the global micro-batch `micro` is every dp rank's micro-batch `micro`
            rows = torch.cat([torch.arange(r * 2 + micro, r * 2 + micro + 1) for r in range(4)])
            (model(x[rows], y[rows]) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for state, _, _ in sw.launch(run_ep, 4, 2, 2, "split"):
        assert_close(state, want)


def test_experts_are_split_and_declared():
    def body(comm):
        model = expert_parallel(GPT(CFG, seed=0), comm)
        w_in = model.blocks[0].mlp.w_in
        pl = layout.placements(model)["blocks.0.mlp.w_in"]
        start = comm.rank * 4
        dense = GPT(CFG, seed=0).blocks[0].mlp
        assert tuple(w_in.shape) == (8, 32, 128) and w_in.dim() == 3 and tuple(local(w_in).shape) == (4, 32, 128)
        assert torch.equal(local(w_in), dense.w_in.detach()[start:start + 4])
        assert pl.box_group is comm and pl.boxes == (((start, 4), (0, 32), (0, 128)),)
        assert pl.replicated_over == ()  # ep == dp: no other rank holds these experts
        assert layout.placements(model)["blocks.0.mlp.router.weight"].box_group is None
        assert sum(p.numel() for p in model.parameters()) == GPT(CFG, seed=0).num_parameters()
        with pytest.raises(RuntimeError, match="expert parallel"):
            w_in.sum()  # a reduction over this rank's experts only: refused, naming the strategy
        return sw.full_state_dict(model)

    want = GPT(CFG, seed=0).state_dict()
    for state in sw.launch(body, 2):
        assert sorted(state) == sorted(want)
        for name in want:
            assert torch.equal(state[name], want[name]), name


def _starved_model():
    """A MoE layer whose router never picks experts 4..7 for positive inputs (they score -sum(x))."""
    layer = MoE(CFG)
    layer.reset_parameters(torch.Generator().manual_seed(0))  # not the global RNG: thread ranks build at once
    with torch.no_grad():
        layer.router.weight[4:] = -1.0
    return nn.Sequential(layer)


def test_experts_without_tokens_get_zero_rows_as_in_one_process():
    x = torch.rand(4, 6, CFG.d_model)
    ref = _starved_model()
    ref(x).sum().backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}

    def body(comm):
        model = expert_parallel(_starved_model(), comm)
        assert all(p.grad is None for p in model.parameters())
        out = model(x[comm.rank * 2:(comm.rank + 1) * 2])
        assert model[0].stats["dropped"] == 0
        (out.sum() * 2).backward()  # each rank's part of the sum; x 2 = the ep ranks' mean of means, as DDP would
        grads = {}
        for name, pl in layout.placements(model).items():
            grads[name] = gather_full(pl, pl.param.grad)
        if comm.rank == 1:  # its experts 4..7 received no row from any rank
            assert torch.count_nonzero(local(model[0].w_in.grad)) == 0
        return grads

    for got in sw.launch(body, 2):
        for name in ("0.w_in", "0.b_in", "0.w_out", "0.b_out"):
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)
            assert torch.count_nonzero(got[name][4:]) == 0


def test_capacity_factor_drops_and_reports_as_one_process_per_rank():
    x = torch.randn(4, 8, CFG.d_model)

    def body(comm):
        model = expert_parallel(_starved_model(), comm, capacity_factor=1.0)
        mine = x[comm.rank * 2:(comm.rank + 1) * 2]
        out = model(mine)
        out.sum().backward()
        ref = _starved_model()
        ref[0].capacity_factor = 1.0
        return out.detach(), dict(model[0].stats), ref(mine).detach(), dict(ref[0].stats)

    for out, stats, want, want_stats in sw.launch(body, 2):
        assert stats == want_stats and stats["capacity"] == 4 and stats["dropped"] > 0
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_bad_configurations_raise_at_wrap_on_every_rank():
    def body(comm):
        mesh = sw.Mesh(comm, ep=2)
        odd = GPTConfig(**{**CFG.__dict__, "n_experts": 6})
        errors = {
            "divisible": value_error_text(lambda: expert_parallel(GPT(odd, seed=0), comm)),
            "no_moe": value_error_text(lambda: expert_parallel(GPT(GPTConfig.preset("tiny"), seed=0), comm)),
            "capacity": value_error_text(lambda: expert_parallel(GPT(CFG, seed=0), comm, capacity_factor=0)),
            "capacity_bool": value_error_text(lambda: expert_parallel(GPT(CFG, seed=0), comm, capacity_factor=True)),
            "not_nested": value_error_text(lambda: expert_parallel(GPT(CFG, seed=0), comm, dp=mesh.ep)),
            "wrapped": value_error_text(lambda: expert_parallel(sw.DDP(GPT(CFG, seed=0), comm), comm)),
            "comm": value_error_text(lambda: expert_parallel(GPT(CFG, seed=0), "world")),
        }
        ep_model = expert_parallel(GPT(CFG, seed=0), mesh.ep, dp=mesh.dp, edp=mesh.edp)
        errors["zero"] = value_error_text(lambda: sw.FSDP(ep_model, comm, sharding="hybrid_shard", shard_size=2))
        errors["again"] = value_error_text(lambda: expert_parallel(ep_model, mesh.ep, dp=mesh.dp, edp=mesh.edp))
        # The aux statistics summed over ep only, but DDP over all 4 ranks: the experts' copies would be missed.
        errors["ddp_group"] = value_error_text(lambda: sw.DDP(expert_parallel(GPT(CFG, seed=0), mesh.ep), comm))
        return errors

    for errors in sw.launch(body, 4):
        assert "n_experts=6" in errors["divisible"] and "ep=4" in errors["divisible"]
        assert "no MoE layer" in errors["no_moe"]
        assert "capacity_factor=0" in errors["capacity"] and "capacity_factor=True" in errors["capacity_bool"]
        assert "must be made of ranks of the dp group" in errors["not_nested"]
        assert "already wrapped" in errors["wrapped"] and "already wrapped" in errors["again"]
        assert "Communicator" in errors["comm"]
        assert "ZeRO/FSDP" in errors["zero"] and "hybrid_shard" in errors["zero"]  # ZeRO: tests/test_experts_zero.py
        assert errors["ddp_group"].startswith("DDP:") and "tile" in errors["ddp_group"]


def test_aux_loss_is_the_global_batch_one_on_every_rank():
    model = GPT(CFG, seed=0)
    x, y = batch(0)
    model(x, y)
    want = [float(b.mlp.aux_loss.detach()) for b in model.blocks]

    def body(comm):
        ep_model = expert_parallel(GPT(CFG, seed=0), comm)
        ep_model(*batch(0, comm.rank, comm.size))
        return [float(b.mlp.aux_loss.detach()) for b in ep_model.blocks]

    for got in sw.launch(body, 4):
        assert got == pytest.approx(want, rel=1e-6)


def test_all_to_all_volume_per_step_is_the_formula():
    """Per MoE layer and step: one all-to-all of counts (E int64 per rank), and four of rows of d floats: a rank
    sends its N x k assignments (dispatch, forward; combine, backward) and the R rows its experts received (combine,
    forward; dispatch, backward). Dropless, the R's of the ep group sum to its N x k's."""
    def body(comm):
        model = expert_parallel(GPT(CFG, seed=0), comm)
        x, y = batch(0, comm.rank, comm.size)
        with comm.stats.measure() as step:
            model(x, y).backward()
        return step.calls("all_to_all"), step.bytes("all_to_all"), step.calls("all_reduce"), x.numel()

    results = sw.launch(body, 2)
    n_tokens = sum(r[3] for r in results)
    per_layer = 2 * CFG.n_experts * 8 + 4 * n_tokens * CFG.experts_per_token * CFG.d_model * 4
    assert sum(r[1] for r in results) == CFG.n_layers * per_layer
    for calls, _, reduces, _ in results:
        assert calls == 5 * CFG.n_layers
        assert reduces == 3 * CFG.n_layers  # counts and probability sums forward, their gradient backward


def test_checkpoint_saved_under_expert_parallel_reloads_in_one_process(tmp_path):
    def body(comm):
        mesh = sw.Mesh(comm, ep=2)
        model = sw.DDP(expert_parallel(GPT(CFG, seed=0), mesh.ep, dp=mesh.dp, edp=mesh.edp), mesh.dp)
        opt = optimizer(model.parameters())
        model(*batch(0, comm.rank, comm.size)).backward()
        opt.step()
        sw.save_checkpoint(tmp_path, model, opt, step=1)
        return sw.full_state_dict(model)

    saved = sw.launch(body, 4)[0]
    plain = GPT(CFG, seed=1)
    sw.load_checkpoint(tmp_path, plain, optimizer(plain.parameters()))
    for name, value in plain.state_dict().items():
        assert torch.equal(value, saved[name]), name


def _gloo_body(comm):
    return run_ep(comm, 2)


@pytest.mark.multiprocess
def test_gloo_processes_equal_one_process(reference):
    want_state, want_grads, want_norms = reference
    for state, grads, norms in sw.launch(_gloo_body, 2, backend="gloo", timeout=120):
        assert_close(grads, want_grads)
        assert norms == pytest.approx(want_norms, rel=1e-5)
        assert_close(state, want_state)


def test_checkpoint_round_trip_ep2_dp4_to_one_process_to_ep4_is_bit_identical(tmp_path):
    """Issue 30: (ep=2 in dp=4) -> one process -> (ep=4): parameters and AdamW state bit-identical at every hop, then
    one more step on ep=4 equals one process's step from the same checkpoint."""

    def trained_on_ep2(comm):
        mesh = sw.Mesh(comm, ep=2)
        model = sw.DDP(expert_parallel(GPT(CFG, seed=0), mesh), mesh.dp_cp)
        opt = optimizer(model.parameters())
        for step in range(2):
            model(*batch(step, comm.rank, comm.size)).backward()
            opt.step()
            opt.zero_grad()
        sw.save_checkpoint(tmp_path / "ep2", model, opt, step=2)
        return sw.full_state_dict(model), sw.full_optimizer_state_dict(model, opt)

    params_ep2, optim_ep2 = sw.launch(trained_on_ep2, 4)[0]
    plain = GPT(CFG, seed=1)
    opt = optimizer(plain.parameters())
    sw.load_checkpoint(tmp_path / "ep2", plain, opt)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, params_ep2[name]), name
    one = opt.state_dict()
    names = [n for n, _ in plain.named_parameters()]
    for i, name in enumerate(names):
        for key, value in one["state"][i].items():
            assert torch.equal(value, optim_ep2["state"][i][key]), (name, key)
    sw.save_checkpoint(tmp_path / "one", plain, opt, step=2)
    x, y = batch(2)
    plain(x, y).backward()
    opt.step()
    want = {k: v.detach().clone() for k, v in plain.state_dict().items()}

    def resumed_on_ep4(comm):
        mesh = sw.Mesh(comm, ep=4)
        model = sw.DDP(expert_parallel(GPT(CFG, seed=2), mesh), mesh.dp_cp)
        opt = optimizer(model.parameters())
        sw.load_checkpoint(tmp_path / "one", model, opt)
        loaded = sw.full_state_dict(model), sw.full_optimizer_state_dict(model, opt)
        model(*batch(2, comm.rank, comm.size)).backward()
        opt.step()
        return loaded, sw.full_state_dict(model)

    for (params, optim), stepped in sw.launch(resumed_on_ep4, 4):
        for name, value in params_ep2.items():
            assert torch.equal(params[name], value), name
        for i in range(len(names)):
            for key, value in optim_ep2["state"][i].items():
                assert torch.equal(optim["state"][i][key], value), (names[i], key)
        for name in want:
            torch.testing.assert_close(stepped[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
