"""Context and expert parallel in the estimates and the planner: `sw.estimate_memory(cp=, ep=)` against hand
formulas, the readable MemoryEstimate, "5d:..." strategy strings, `shardwise plan` with experts, `sw.distribute` over
a five-axis Mesh, and the formulas against the bytes and memory a real cp x ep step measures on thread ranks."""

from __future__ import annotations

import re

import pytest
import torch

import shardwise as sw
from shardwise.data import ByteCorpus
from shardwise.models import GPT, GPTConfig
from shardwise.planner import (Activations, Candidate, Links, Workload, costs, estimate, model_facts, parse_strategy,
                               plan)
from shardwise_cli import main

GB = 1e9
MOE = GPTConfig.preset("tiny", n_experts=4, experts_per_token=2, moe_aux_loss_coef=0.0)


def _expert_count(model: torch.nn.Module) -> int:
    """Independent of model_facts: the fused expert tensors of every MoE block (routers are dense)."""
    return sum(p.numel() for n, p in model.named_parameters() if re.search(r"mlp\.(w_in|b_in|w_out|b_out)$", n))


# ---- estimate_memory ------------------------------------------------------------------------------------------------
def test_cp_divides_every_activation_and_leaves_the_states():
    s, b, h, a, L, V, psi = 4096, 2, 2048, 16, 24, 32000, 1.5e9
    per_layer = s * b * h * (34 + 5 * a * s / h)  # Korthikanti et al., one layer, whole sequence
    whole = L * per_layer + 4 * s * b * V  # + fp32 logits
    geometry = dict(seq_len=s, batch_size=b, hidden_size=h, num_layers=L, num_heads=a, vocab_size=V)
    for cp in (2, 4):
        est = sw.estimate_memory(psi, "zero3", 16, cp=cp, **geometry)
        assert est.activations == pytest.approx(whole / cp, rel=1e-12)
        assert est.model_states == pytest.approx(16 * psi / 16)  # dense states over dp x cp = 16 ranks, as cp = 1
        assert est.cp == cp and est.all_to_all is None
    fused = sw.estimate_memory(psi, "ddp", 8, cp=2, attention="fused", activation_checkpointing=True, **geometry)
    assert fused.activations == pytest.approx((L * 2 * s * b * h + s * b * h * 34 + 4 * s * b * V) / 2)
    with pytest.raises(ValueError, match=r"cp x tp x pp = 4 x 1 x 1 = 4 does not divide world_size=6"):
        sw.estimate_memory(psi, "ddp", 6, cp=4)


def test_ep_divides_the_experts_states_and_counts_the_all_to_all():
    psi, x, world, ep = 1e9, 6e8, 8, 4
    s, b, h, L, E, k = 2048, 2, 1024, 8, 8, 2
    est = sw.estimate_memory(psi, "ddp", world, ep=ep, cp=2, expert_params=x, n_experts=E, experts_per_token=k,
                             seq_len=s, batch_size=b, hidden_size=h, num_layers=L, num_heads=8)
    held = (psi - x) + x / ep  # every dense parameter and 1/ep of the experts, DDP over dp x cp
    assert (est.params, est.grads, est.optimizer) == pytest.approx((2 * held, 2 * held, 12 * held))
    # per MoE layer: E int64 counts, and four exchanges of N k rows of h bf16 values; (ep-1)/ep leaves the rank
    tokens = b * s / 2  # this rank's half of its replica's sequences
    payload = L * (8 * E + 4 * tokens * k * h * 2)
    assert est.all_to_all == pytest.approx((ep - 1) / ep * payload)
    assert est.activations == pytest.approx(sw.estimate_memory(psi, "ddp", world, seq_len=s, batch_size=b,
                                                               hidden_size=h, num_layers=L,
                                                               num_heads=8).activations / 2)
    # ep = 1: the expert split changes nothing (the experts are parameters like the others)
    assert sw.estimate_memory(psi, "zero3", 8, expert_params=x).total == sw.estimate_memory(psi, "zero3", 8).total
    fp32 = sw.estimate_memory(psi, "ddp", 4, ep=2, expert_params=x, mixed_precision=False)
    assert fp32.total == pytest.approx(16 * ((psi - x) + x / 2)) and fp32.all_to_all is None


def test_a_moe_module_gives_its_experts():
    model = GPT(MOE, seed=0)
    facts = model_facts(model)
    assert facts.expert_params == _expert_count(model) > 0
    assert (facts.n_experts, facts.experts_per_token, facts.moe_layers, facts.tp_plan) == (4, 2, 2, None)
    assert model_facts(GPT(GPTConfig.preset("tiny"), seed=0)).expert_params == 0
    by_module = sw.estimate_memory(model, "ddp", 4, ep=2, cp=2, seq_len=32, batch_size=8)
    by_count = sw.estimate_memory(facts.num_params, "ddp", 4, ep=2, cp=2, expert_params=facts.expert_params,
                                  n_experts=4, experts_per_token=2, seq_len=32, batch_size=8, hidden_size=64,
                                  num_layers=2, num_heads=4, vocab_size=256)
    assert by_module == by_count


@pytest.mark.parametrize("kwargs, match", [
    (dict(ep=2), r"ep=2 splits the experts of a mixture of experts; give a module with MoE layers, or expert_params="),
    (dict(ep=2, expert_params=1e8, strategy="zero1"), r"ep=2 needs strategy='ddp' without cpu_offload"),
    (dict(ep=2, expert_params=1e8, cpu_offload="optimizer"), r"ep=2 needs strategy='ddp'"),
    (dict(ep=3, expert_params=1e8), r"ep=3 must divide dp x cp = 4"),
    (dict(ep=2, expert_params=1e8, n_experts=3, experts_per_token=1), r"ep=2 must divide n_experts=3"),
    (dict(ep=2, expert_params=1e8, tp=2), r"ep=2 with tp=2: tensor parallel does not split experts"),
    (dict(expert_params=2e9), r"expert_params=2,000,000,000 exceeds the 1,000,000,000 parameters"),
    (dict(n_experts=8), r"give expert_params"),
    (dict(expert_params=1e8, n_experts=2, experts_per_token=3), r"experts_per_token=3 must be at most n_experts=2"),
    (dict(cp=0), r"cp=0 must be a positive int"),
])
def test_bad_cp_ep_input_names_the_argument(kwargs, match):
    kwargs = {"strategy": "ddp", **kwargs}
    with pytest.raises(ValueError, match=match):
        sw.estimate_memory(1e9, world_size=4, **kwargs)


def test_a_module_refuses_expert_counts():
    with pytest.raises(ValueError, match="expert_params is read from the module's MoE layers"):
        sw.estimate_memory(GPT(MOE, seed=0), "ddp", 2, expert_params=10)


def test_cp_ep_one_keeps_the_figures_and_the_repr_is_readable():
    est = sw.estimate_memory(7.5e9, "zero3", 64)
    states = costs.model_states(7.5e9, "zero3", 64)
    assert (est.params, est.grads, est.optimizer, est.cp, est.ep, est.all_to_all) == (
        states.params, states.grads, states.optimizer, 1, 1, None)
    text = repr(est)
    assert "params=234 MB" in text and "optimizer=1.41 GB" in text and "total=1.88 GB" in text
    assert "234375000" not in text and "num_params=7,500,000,000" in text and str(est) == text
    moe = sw.estimate_memory(1e6, "ddp", 4, ep=2, expert_params=6e5, n_experts=4, experts_per_token=2, seq_len=64,
                             batch_size=2, hidden_size=64, num_layers=2, num_heads=4)
    assert re.search(r"ep=2, expert_params=600,000, all_to_all=\d+(\.\d+)? kB, params=\d", repr(moe))
    assert sw.estimate.format_bytes(512) == "512 B" and sw.estimate.format_bytes(59_300) == "59.3 kB"


# ---- the planner and its strategy strings ---------------------------------------------------------------------------
def test_five_axis_strategy_strings_round_trip():
    c = parse_strategy("5d:dp=2,cp=2,ep=4", 4)
    assert c == Candidate("3d", "ddp", 2, 1, 1, cp=2, ep=4) and c.data_parallel == 4
    assert c.strategy == "5d:dp=2,cp=2,ep=4,tp=1,pp=1" and parse_strategy(c.strategy, 4) == c
    assert parse_strategy("5d:cp=2,pp=2,dp_strategy=zero1", 8) == Candidate("3d", "zero1", 2, 1, 2, cp=2)
    assert parse_strategy("3d:dp=2,tp=2,pp=2", 8).strategy == "3d:dp=2,tp=2,pp=2"  # 3-D strings unchanged


@pytest.mark.parametrize("text, match", [
    ("3d:dp=4,cp=2", r"cp is a key of the 5-D strings; write e.g. '5d:dp=2,cp=2,tp=1,pp=1'"),
    ("5d:dp=2,cp=2,tp=2", r"cp=2 with tp=2 is not supported by sw.parallelize yet"),
    ("5d:dp=8,ep=2,dp_strategy=zero1", r"ep=2 needs dp_strategy=ddp"),
    ("5d:dp=2,ep=4,tp=4", r"ep=4 must divide dp x cp = 2 x 1 = 2"),
    ("5d:dp=2,cp=3", r"cp x tp x pp = 3 x 1 x 1 = 3 does not divide the world size 8"),
    ("5d:dp=2,cp=2", r"dp x cp x tp x pp = 2 x 2 x 1 x 1 = 4, but the world has 8 ranks"),
    ("5d:dp=2,xp=2", r"unknown key 'xp'; allowed dp, cp, ep, tp, pp, dp_strategy"),
])
def test_bad_five_axis_strings(text, match):
    with pytest.raises(ValueError, match=match):
        parse_strategy(text, 8)


def test_planner_estimates_a_five_axis_layout_by_hand():
    psi, x, E, k = 2e9, 1.5e9, 8, 2
    g = Activations(seq_len=4096, batch_size=1, hidden_size=2048, num_layers=16, num_heads=16)
    work = Workload(psi, activations=g, attention="fused", experts=costs.Experts(x, E, k))
    links = Links(4, 4, 80 * GB)
    e = estimate(parse_strategy("5d:dp=2,cp=2,ep=4", 4), work, links)
    held = psi - x + x / 4
    assert e.states.device == pytest.approx(16 * held)
    s, b, h, L = 4096, 1, 2048, 16
    assert e.activations == pytest.approx(L * s * b * h * 34 / 2)
    dense, local = 2 * (psi - x), 2 * x / 4  # bf16 gradients: dense over dp x cp = 4, experts over edp = 1
    kv = 2 * b * (s / 2) * h * 2  # this rank's K and V blocks, bf16
    assert e.wire == pytest.approx({"dp": 2 * 3 / 4 * dense, "cp": L * (3 * 2 - 2) * kv,
                                    "ep": 3 / 4 * L * (8 * E + 4 * (b * s / 2) * k * h * 2)})
    assert local and "edp" not in e.wire  # ep = dp x cp: every rank holds different experts, nothing to average
    e2 = estimate(parse_strategy("5d:dp=4,cp=2,ep=2", 8), work, Links(8, 8, 80 * GB))
    assert e2.wire["edp"] == pytest.approx(2 * 3 / 4 * 2 * x / 2)  # edp = dp x cp / ep = 4 ranks
    text = plan(work, links, strategy="5d:dp=2,cp=2,ep=4").explain()
    assert "Given: 5d:dp=2,cp=2,ep=4,tp=1,pp=1." in text and "Mixture of experts: 1.50B" in text
    assert "Context parallel: each of the cp ranks holds 1/cp" in text
    assert not any(c.tp > 1 for c in (e.candidate for e in plan(work, links, strategy="5d:dp=2,cp=2,ep=4",
                                                                  tensor_parallel=False).estimates))
    with pytest.raises(ValueError, match=r"ep=4 splits the experts of a mixture of experts, but the model has none"):
        estimate(parse_strategy("5d:dp=2,cp=2,ep=4", 4), Workload(psi), links)
    with pytest.raises(ValueError, match=r"ep=4 must divide the 6 experts of each layer"):
        estimate(parse_strategy("5d:dp=2,cp=2,ep=4", 4), Workload(psi, experts=costs.Experts(x, 6, 2)), links)


def test_shardwise_plan_with_experts(capsys):
    assert main(["plan", "--params", "8e9", "--expert-params", "6e9", "--experts", "8", "--experts-per-token", "2",
                 "--gpus", "8", "--strategy", "5d:dp=4,cp=2,ep=4", "--seq", "8192", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("  5d:dp=4,cp=2,ep=4,tp=1,pp=1"))
    assert float(row.split()[1]) == round(16 * (2e9 + 6e9 / 4) / GB, 1)  # 56.0 GB of states
    assert "Given: 5d:dp=4,cp=2,ep=4,tp=1,pp=1." in out and "Mixture of experts: 6.00B" in out
    assert not re.search(r"^  (tp|3d:dp=\d+,tp=[2-8])", out, re.M)  # tensor parallel does not split experts
    assert main(["plan", "--params", "8e9", "--gpus", "8", "--strategy", "5d:dp=4,cp=2,ep=4"]) == 1
    assert "ep=4 splits the experts of a mixture of experts, but the model has none" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["plan", "--params", "8e9", "--experts", "8"])
    assert info.value.code == 2 and "--experts need --expert-params" in capsys.readouterr().err


# ---- sw.distribute over a five-axis Mesh ----------------------------------------------------------------------------
def test_distribute_models_a_cp_ep_mesh():
    corpus = ByteCorpus(max_bytes=100_000)

    def body(comm):
        mesh = sw.Mesh(comm, dp=1, cp=2, ep=2)
        model = sw.distribute(GPT(MOE, seed=0), mesh, memory_gb=10)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = corpus.batch(0, 4, MOE.seq_len, rank=model.plan.data_rank, world_size=model.plan.data_world)
        loss = model.step(x, y)
        opt.step()
        for strategy, match in (("zero1", r"ep=2 needs DDP \(dp_strategy='ddp', no offload\).*got 'zero1'"),
                                ("tp", r"strategy='tp' splits every layer over all 2 ranks, but the mesh given is "
                                       r"Mesh\(dp=1, cp=2, ep=2")):
            with pytest.raises(ValueError, match=match):
                sw.distribute(GPT(MOE, seed=0), mesh, strategy)
        return model.plan.strategy, model.plan.data_world, float(loss), model.plan.explain()

    results = sw.launch(body, 2, backend="thread", timeout=120)
    assert {r[0] for r in results} == {"5d:dp=1,cp=2,ep=2,tp=1,pp=1"} and {r[1] for r in results} == {1}
    assert results[0][2] == results[1][2] and 0 < results[0][2] < 10  # the cp ranks report the sequence's loss
    assert "Mixture of experts" in results[0][3] and "Chosen: 5d:dp=1,cp=2,ep=2,tp=1,pp=1." in results[0][3]


# ---- the formulas against a measured step ---------------------------------------------------------------------------
def test_measured_cp_ep_step_matches_the_formulas():
    """dp 1 x cp 2 x ep 2 in fp32: the ring's sends per rank, the all-to-all payload of the ep group, and the model
    states per rank, against costs / estimate_memory."""
    batch, corpus = 4, ByteCorpus(max_bytes=100_000)

    def body(comm):
        mesh = sw.Mesh(comm, dp=1, cp=2, ep=2)
        model = sw.parallelize(GPT(MOE, seed=0), mesh, n_microbatches=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = corpus.batch(0, batch, MOE.seq_len)
        with mesh.cp.stats.measure() as cp_stats, mesh.ep.stats.measure() as ep_stats:
            model.step(x, y)
        opt.step()
        return (cp_stats.wire_bytes("send"), ep_stats.bytes("all_to_all"),
                sw.memory_stats(model, opt).model_states)

    results = sw.launch(body, 2, backend="thread", timeout=120)
    g = Activations(MOE.seq_len, batch, MOE.d_model, MOE.n_layers, MOE.n_heads)
    ring = costs.context_parallel_wire_bytes(g, 2, dtype="fp32")
    assert [r[0] for r in results] == [ring, ring]
    experts = costs.Experts(model_facts(GPT(MOE, seed=0)).expert_params, 4, 2)
    payload = costs.expert_all_to_all_bytes(g, experts, cp=2, dtype="fp32")
    assert sum(r[1] for r in results) == 2 * payload  # the group's received rows are its sent rows
    want = sw.estimate_memory(GPT(MOE, seed=0), "ddp", 2, cp=2, ep=2, mixed_precision=False).model_states
    for _, _, got in results:  # AdamW adds a 4-byte step counter per parameter tensor
        assert want <= got <= want + 4 * 64
