"""Context and expert parallel in the estimates and the planner: `sw.estimate_memory(cp=, ep=)` against hand
formulas, the readable MemoryEstimate, "5d:..." strategy strings, `shardwise plan` with experts, `sw.distribute` over
a five-axis Mesh, and the formulas against the bytes and memory a real cp x ep step measures on thread ranks."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch

import shardwise as sw
from shardwise.data import ByteCorpus
from shardwise.models import GPT, GPTConfig
from shardwise.planner import (Activations, Candidate, Links, Workload, costs, estimate, model_facts, parse_strategy,
                               plan)
from shardwise.sharded_tensor import local
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
    # the "gpt" plan keeps MoE layers whole on every tp rank; MOE has no balance loss (a pipeline may split it)
    assert (facts.n_experts, facts.experts_per_token, facts.moe_layers, facts.tp_plan) == (4, 2, 2, "gpt")
    assert not facts.moe_balance_loss
    assert model_facts(GPT(GPTConfig.preset("tiny", n_experts=4), seed=0)).moe_balance_loss  # default coef 0.01
    assert model_facts(GPT(GPTConfig.preset("tiny"), seed=0)).expert_params == 0
    by_module = sw.estimate_memory(model, "ddp", 4, ep=2, cp=2, seq_len=32, batch_size=8)
    by_count = sw.estimate_memory(facts.num_params, "ddp", 4, ep=2, cp=2, expert_params=facts.expert_params,
                                  n_experts=4, experts_per_token=2, seq_len=32, batch_size=8, hidden_size=64,
                                  num_layers=2, num_heads=4, vocab_size=256)
    assert by_module == by_count


def test_a_huggingface_router_loss_is_a_balance_loss_no_pipeline_is_chosen_for():
    """sw.parallelize computes a HuggingFace MoE's router loss per microbatch under a pipeline (another loss than one
    process's), so sw.distribute must not choose one for it: model_facts says it has a balance loss."""
    transformers = pytest.importorskip("transformers")

    def qwen3_moe(router_logits):
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            output_router_logits=router_logits, router_aux_loss_coef=0.05))

    facts = model_facts(qwen3_moe(True))
    assert facts.pipeline_layers == 4 and facts.moe_balance_loss
    assert not model_facts(qwen3_moe(False)).moe_balance_loss


@pytest.mark.parametrize("kind", ["Mixtral", "Qwen2Moe", "GptOss"])
def test_a_huggingface_moe_gives_its_experts(kind):
    """The experts modules expert parallel splits (Mixtral's fused experts; Qwen2-MoE's shared expert is dense;
    GPT-OSS's biases are the experts'): before, model_facts counted none, so sw.distribute treated them as dense and
    refused an ep mesh ("the model has none")."""
    transformers = pytest.importorskip("transformers")
    extra = {"Mixtral": dict(num_local_experts=4), "Qwen2Moe": dict(num_experts=4, moe_intermediate_size=16,
                                                                     shared_expert_intermediate_size=16),
             "GptOss": dict(num_local_experts=4, head_dim=8)}[kind]
    config = getattr(transformers, kind + "Config")(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                                    num_experts_per_tok=2, **extra)
    model = getattr(transformers, kind + "ForCausalLM")(config)
    facts = model_facts(model)
    in_experts = sum(p.numel() for n, p in model.named_parameters() if re.search(r"\.mlp\.experts\.", n))
    assert facts.expert_params == in_experts > 0
    assert (facts.n_experts, facts.experts_per_token, facts.moe_layers, facts.tp_plan) == (4, 2, 3, "llama")


def test_distribute_splits_a_huggingface_moes_experts_over_an_ep_mesh():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    dense = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
        output_router_logits=True, router_aux_loss_coef=0.05, pad_token_id=None, bos_token_id=0, eos_token_id=1))
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = float(copy.deepcopy(dense)(input_ids=ids, labels=ids).loss)  # with its router loss

    def body(comm):
        model = sw.distribute(copy.deepcopy(dense), sw.Mesh(comm, dp=2, ep=2), memory_gb=10)
        rows = ids[model.plan.data_rank * 2:(model.plan.data_rank + 1) * 2]
        experts = [p for n, p in model.named_parameters() if n.endswith("layers.0.mlp.experts.gate_up_proj")][0]
        return model.plan.strategy, float(model.step(rows, rows)), tuple(experts.shape), local(experts).shape[0]

    results = sw.launch(body, 2, backend="thread", timeout=120)
    assert [r[0] for r in results] == ["5d:dp=2,cp=1,ep=2,tp=1,pp=1"] * 2
    assert [r[2:] for r in results] == [((4, 64, 32), 2)] * 2  # each rank holds 2 of the 4 experts
    assert (results[0][1] + results[1][1]) / 2 == pytest.approx(want, rel=1e-6)  # each rank's loss on its rows


@pytest.mark.parametrize("name,tp_plan", [("Gemma2", "llama"), ("Granite", "llama"), ("Phi3", "llama"),
                                          ("Olmo2", "llama"), ("GraniteMoe", "llama"), ("JetMoe", None)])
def test_huggingface_families_sw_parallelize_splits_are_pipelineable(name, tp_plan):
    """Pipelines for every family sw.parallelize splits (models/hf_parallel.BUILDERS), the "llama" tensor-parallel plan
    where it takes the family's modules; JetMoE (not known to be Llama-shaped) neither."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, name + "Config")(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                    pad_token_id=0)
    facts = model_facts(getattr(transformers, name + "ForCausalLM")(config))
    assert facts.tp_plan == tp_plan
    assert facts.pipeline_layers == (None if name == "JetMoe" else 4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(ep=2), r"ep=2 splits the experts of a mixture of experts; give a module with MoE layers, or expert_params="),
    (dict(ep=2, expert_params=1e8, strategy="fsdp:hybrid_shard"),
     r"ep=2 with strategy='fsdp:hybrid_shard' is not supported \(its shard groups cut across the ranks holding the "
     r"same experts, edp\); allowed \['ddp', 'fsdp', 'fsdp:full_shard'"),
    (dict(ep=3, expert_params=1e8), r"ep=3 must divide dp x cp = 4"),
    (dict(ep=2, expert_params=1e8, n_experts=3, experts_per_token=1), r"ep=2 must divide n_experts=3"),
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


def _paper(psi: float, n: int, strategy: str, width: int = 2, k: int = 12) -> float:
    """The ZeRO paper's model states of psi parameters shared by n ranks (section 5; width-byte parameters and
    gradients, k bytes of optimizer state), written out here rather than read from costs.SHARDED."""
    return {"ddp": (2 * width + k) * psi, "fsdp:no_shard": (2 * width + k) * psi,
            "zero1": 2 * width * psi + k * psi / n, "zero2": width * psi + (width + k) * psi / n,
            "fsdp:shard_grad_op": width * psi + (width + k) * psi / n, "zero3": (2 * width + k) * psi / n,
            "fsdp:full_shard": (2 * width + k) * psi / n}[strategy]


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "fsdp:full_shard", "fsdp:shard_grad_op",
                                      "fsdp:no_shard"])
def test_ep_under_zero_and_fsdp_shards_the_experts_over_edp(strategy):
    """ZeRO / FSDP over an expert-parallel model (sharding/expert_units.py): the dense D by the strategy over dp x cp,
    this rank's X/ep experts by the same strategy over the edp = dp x cp / ep ranks holding the same experts."""
    psi, x, world, cp, ep = 1e9, 6e8, 16, 2, 4  # dp 8 x cp 2: dense over 16 ranks, each expert slice over edp = 4
    est = sw.estimate_memory(psi, strategy, world, cp=cp, ep=ep, expert_params=x)
    want = _paper(psi - x, 16, strategy) + _paper(x / ep, 4, strategy)
    assert est.model_states == pytest.approx(want, rel=1e-12) and est.cpu == 0
    dp_strategy = {"fsdp:no_shard": "ddp"}.get(strategy, strategy)  # sw.parallelize has no no_shard: DDP's figures
    c = parse_strategy(f"5d:dp=8,cp=2,ep=4,dp_strategy={dp_strategy}", world)
    e = estimate(c, Workload(psi, experts=costs.Experts(x)), Links(world, 8, 80 * GB))
    assert e.states.device == pytest.approx(want, rel=1e-12)
    if strategy in ("zero3", "fsdp:full_shard"):  # each rank 1/16 of every tensor, dense or expert: 16 psi / 16
        assert est.model_states == pytest.approx(16 * psi / 16)
        # the gradients: D reduce-scattered and gathered twice over dp x cp, X/ep over edp (bf16)
        assert e.wire == pytest.approx({"dp": 3 * 15 / 16 * 2 * (psi - x), "edp": 3 * 3 / 4 * 2 * x / ep})


def test_ep_with_cpu_offload_moves_each_familys_shards():
    """The sharding engine offloads expert units as dense ones (a 4-rank ZeRO-3 + offload run over ep = 2 equals one
    process): the host holds 16 bytes per parameter of this rank's shards, D/N + (X/ep)/edp."""
    psi, x, ep = 1e9, 6e8, 2
    shards = (psi - x) / 8 + x / ep / 4  # dp x cp = 8, edp = 4
    opt = sw.estimate_memory(psi, "zero3", 8, ep=ep, expert_params=x, cpu_offload="optimizer")
    assert (opt.params, opt.grads, opt.optimizer, opt.cpu) == pytest.approx((2 * shards, 0, 0, 16 * shards))
    full = sw.estimate_memory(psi, "zero3", 8, ep=ep, expert_params=x, cpu_offload="full")
    assert (full.model_states, full.cpu) == pytest.approx((0, 16 * shards))
    zero1 = sw.estimate_memory(psi, "zero1", 8, ep=ep, expert_params=x, cpu_offload="optimizer")
    held = (psi - x) + x / ep  # ZeRO-1 keeps whole bf16 parameters and its gradient buffer on the device
    assert (zero1.model_states, zero1.cpu) == pytest.approx((4 * held, 16 * shards))
    c = parse_strategy("5d:dp=8,ep=2,dp_strategy=zero3", 8)
    e = estimate(dataclasses.replace(c, offload="optimizer"), Workload(psi, experts=costs.Experts(x)),
                 Links(8, 8, 80 * GB))
    assert (e.states.device, e.states.cpu) == pytest.approx((2 * shards, 16 * shards))


def test_tensor_parallel_splits_the_dense_parameters_not_the_experts():
    """The "gpt" plan keeps each MoE layer whole on every tp rank: tp divides D, and X only by ep (and pp)."""
    psi, x = 1e9, 6e8
    d = psi - x
    # ep x tp: 16 ranks = dp 4 x tp 2 x pp 2, ep = 2 of dp 4 (edp 2); ZeRO-1 over dp / edp
    est = sw.estimate_memory(psi, "zero1", 16, tp=2, pp=2, ep=2, expert_params=x)
    assert est.model_states == pytest.approx(_paper(d / 4, 4, "zero1") + _paper(x / 2 / 2, 2, "zero1"), rel=1e-12)
    # tp alone (ep = 1): every tp rank holds all the experts of its stage
    ddp = sw.estimate_memory(psi, "ddp", 4, tp=4, expert_params=x)
    assert ddp.model_states == pytest.approx(16 * (d / 4 + x))
    assert sw.estimate_memory(psi, "ddp", 4, tp=4).model_states == pytest.approx(16 * psi / 4)  # dense: all / tp
    c = parse_strategy("5d:dp=4,ep=2,tp=2,pp=2,dp_strategy=zero1", 16)
    assert (c.ep, c.tp, c.dp_strategy) == (2, 2, "zero1")
    s, b, h, L, E, k = 1024, 2, 1024, 8, 8, 2
    g = Activations(s, b, h, L, 8)
    work = Workload(psi, activations=g, attention="fused", sequence_parallel=True, experts=costs.Experts(x, E, k))
    e = estimate(c, work, Links(16, 8, 80 * GB))
    assert e.states.device == pytest.approx(est.model_states, rel=1e-12)
    # sequence parallel: each tp rank routes its own shard of the tokens (N = b s / tp), and its router and experts'
    # gradients are partial sums, all-reduced over tp on top of Megatron's 4 activation all-reduces per layer
    sbh = s * b * h * 2
    assert e.wire["tp"] == pytest.approx(4 * (1 / 2) * 2 * sbh * L / 2 + 1 / 2 * 2 * (2 * x / 2 / 2))
    assert e.wire["ep"] == pytest.approx(1 / 2 * L / 2 * (8 * E + 4 * (b * s / 2) * k * h * 2))
    # ZeRO-3 gathers a MoE layer: its attention (4h^2, / tp) and this rank's experts of it (X / (L ep)), two at a time
    z3 = estimate(parse_strategy("5d:dp=4,ep=2,tp=2,pp=2,dp_strategy=zero3", 16), work, Links(16, 8, 80 * GB))
    assert z3.working == pytest.approx(2 * 2 * (4 * h * h / 2 + x / (L * 2)))
    # a dense layer's unit, 12h^2, is split by tp only: the pipeline splits the layers among stages, not a layer
    dense = estimate(parse_strategy("5d:dp=4,tp=2,pp=2,dp_strategy=zero3", 16),
                     Workload(psi, activations=g, attention="fused"), Links(16, 8, 80 * GB))
    assert psi / 4 > 2 * 12 * h * h / 2 and dense.working == pytest.approx(2 * 2 * 12 * h * h / 2)
    with pytest.raises(ValueError, match=r"tp=3 must divide model_parallel=4"):
        costs.model_states(psi, "ddp", 4, model_parallel=4, tp=3, expert_params=x)
    with pytest.raises(ValueError, match=r"ep=2 with hybrid_shard is not supported"):
        costs.model_states(psi, "hybrid_shard", 4, ep=2, expert_params=x)


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
    assert parse_strategy("5d:dp=2,cp=2,tp=2", 8) == Candidate("3d", "ddp", 2, 2, 1, cp=2)  # cp over tp's heads
    # ep with ZeRO / FSDP (experts sharded over edp) and with tp (experts kept whole on every tp rank)
    assert parse_strategy("5d:dp=4,ep=2,tp=2,dp_strategy=zero3", 8) == Candidate("3d", "zero3", 4, 2, 1, ep=2)
    assert parse_strategy("5d:dp=8,ep=2,dp_strategy=fsdp:shard_grad_op", 8).dp_strategy == "fsdp:shard_grad_op"


@pytest.mark.parametrize("text, match", [
    ("3d:dp=4,cp=2", r"cp is a key of the 5-D strings; write e.g. '5d:dp=2,cp=2,tp=1,pp=1'"),
    ("5d:dp=8,ep=2,dp_strategy=fsdp:hybrid_shard",
     r"ep=2 with dp_strategy='fsdp:hybrid_shard' is not supported \(its shard groups cut across the ranks holding the "
     r"same experts, edp\); allowed \('ddp', 'zero1', 'zero2', 'zero3', 'fsdp:full_shard', 'fsdp:shard_grad_op'\)"),
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
    # tensor parallel splits the 2B dense parameters, not the 6B in experts (kept whole on every tp rank)
    row = next(line for line in out.splitlines() if line.startswith("  tp "))
    assert float(row.split()[1]) == round(16 * (2e9 / 8 + 6e9) / GB, 1)  # 100.0 GB, not 16 x 8e9 / 8 = 16.0
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
        zero1 = sw.distribute(GPT(MOE, seed=0), mesh, "zero1")  # a sharded strategy over the split experts
        zero1.step(x, y)
        for strategy, options, match in (
                ("tp", {}, r"strategy='tp' splits every layer over all 2 ranks, but the mesh given is "
                           r"Mesh\(dp=1, cp=2, ep=2"),
                ("fsdp:hybrid_shard", {"shard_size": 1}, r"ep=2 with hybrid_shard is not supported")):
            with pytest.raises(ValueError, match=match):
                sw.distribute(GPT(MOE, seed=0), mesh, strategy, **options)
        return model.plan.strategy, model.plan.data_world, float(loss), model.plan.explain(), zero1.plan.strategy

    results = sw.launch(body, 2, backend="thread", timeout=120)
    assert {r[0] for r in results} == {"5d:dp=1,cp=2,ep=2,tp=1,pp=1"} and {r[1] for r in results} == {1}
    assert {r[4] for r in results} == {"5d:dp=1,cp=2,ep=2,tp=1,pp=1,dp_strategy=zero1"}
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


MEASURED = {  # name: (mesh axes, sw.parallelize options, estimate_memory arguments)
    "zero3_dp4_ep2": ({"dp": 4, "ep": 2}, {"dp_strategy": "zero3"}, {"strategy": "zero3"}),
    "zero1_dp4_ep2": ({"dp": 4, "ep": 2}, {"dp_strategy": "zero1"}, {"strategy": "zero1"}),
    "zero3_offload_dp4_ep2": ({"dp": 4, "ep": 2}, {"dp_strategy": "zero3", "cpu_offload": "optimizer"},
                              {"strategy": "zero3", "cpu_offload": "optimizer"}),
    "zero3_dp2_ep2_tp2": ({"dp": 2, "ep": 2, "tp": 2}, {"dp_strategy": "zero3", "tp_plan": "gpt"},
                          {"strategy": "zero3", "tp": 2}),
    "ddp_dp2_ep2_tp2": ({"dp": 2, "ep": 2, "tp": 2}, {"tp_plan": "gpt"}, {"strategy": "ddp", "tp": 2}),
}


@pytest.mark.parametrize("case", list(MEASURED))
def test_measured_states_of_ep_with_zero_and_tp_match_the_estimate(case):
    """What each of 4 thread ranks holds after an fp32 AdamW step (memory_stats) against estimate_memory: ZeRO over
    dp 4 with ep 2 shards the experts over edp = 2; with tp 2 the experts stay whole on each tp rank."""
    axes, options, wanted = MEASURED[case]
    corpus = ByteCorpus(max_bytes=100_000)

    def body(comm):
        mesh = sw.Mesh(comm, **axes)
        model = sw.parallelize(GPT(MOE, seed=0), mesh, n_microbatches=1, **options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        dp = mesh.sizes["dp"]
        x, y = corpus.batch(0, 4, MOE.seq_len, rank=mesh.coords.dp, world_size=dp)
        model.step(x, y)
        opt.step()
        return sw.memory_stats(model, opt).model_states

    est = sw.estimate_memory(GPT(MOE, seed=0), world_size=4, ep=2, mixed_precision=False, **wanted)
    # On the CPU offload has nowhere else to go: the engine keeps the host figure (est.cpu: fp32 master shard, its
    # gradient and Adam's moments) beside the compute shard (est.params), so the rank holds their sum.
    want = est.model_states + est.cpu
    experts = model_facts(GPT(MOE, seed=0)).expert_params
    for got in sw.launch(body, 4, backend="thread", timeout=120):
        if "tp" in axes:  # LayerNorms and the position embedding are replicated over tp: a little over D / tp
            assert want <= got <= 1.02 * want
            # were the experts split by tp too (model_parallel 2 dividing them), it would sit far below
            split = costs.model_states(est.num_params, wanted["strategy"], 2, dtype="fp32", model_parallel=2,
                                       expert_params=experts, ep=2, tp=1).device
            assert got - split > 0.2 * want and split < want
        else:  # AdamW's step counters, a flat buffer's padding to a multiple of the shard group
            assert want <= got <= want + 1024
