"""The planner: the ZeRO formulas against the paper's Figure 1 (computed from the definitions), activations against
Korthikanti et al.'s formula, ring wire bytes, the choice and its explanation, and bad input."""

from __future__ import annotations

import pytest

import shardwise as sw
from shardwise.planner import Activations, Candidate, Links, Workload, candidates, costs, parse_strategy, plan

GB = 1e9


def _paper_states(psi: float, n: int) -> dict[str, float]:
    """Figure 1's definitions (section 5): 2Ψ fp16 parameters, 2Ψ fp16 gradients, KΨ optimizer states, K = 12."""
    k = 12
    return {"ddp": (2 + 2 + k) * psi, "zero1": 2 * psi + 2 * psi + k * psi / n,
            "zero2": 2 * psi + (2 + k) * psi / n, "zero3": (2 + 2 + k) * psi / n}


def test_model_states_reproduce_zero_figure_1():
    psi, n = 7.5e9, 64
    want = _paper_states(psi, n)
    for strategy, bytes_ in want.items():
        got = costs.model_states(psi, strategy, n)
        assert got.device == pytest.approx(bytes_, rel=1e-12), strategy
    # the figure's printed numbers, as the paper rounds them
    assert [round(want[s] / GB, 1) for s in ("ddp", "zero1", "zero2", "zero3")] == [120.0, 31.4, 16.6, 1.9]


def test_estimate_memory_takes_a_float_count_and_the_fsdp_names():
    assert sw.estimate_memory(7.5e9, "zero3", 64).total == pytest.approx(_paper_states(7.5e9, 64)["zero3"])
    assert sw.estimate_memory(7.5e9, "fsdp:shard_grad_op", 64).total == sw.estimate_memory(7.5e9, "zero2", 64).total
    with pytest.raises(ValueError, match="7.5 is not a whole number"):
        sw.estimate_memory(7.5, "zero3", 2)
    with pytest.raises(ValueError, match="neither a module nor a positive parameter count"):
        sw.estimate_memory(float("nan"), "zero3", 2)


def test_variants_fp32_offload_tensor_and_pipeline_parallel():
    psi = 1e9
    fp32 = costs.model_states(psi, "ddp", 1, dtype="fp32")  # 4 + 4 + 8 (Adam: momentum, variance)
    assert fp32.device == 16 * psi and fp32.optimizer == 8 * psi
    off = costs.model_states(psi, "zero3", 4, offload="optimizer")  # bf16 compute shard; master, grad, Adam on host
    assert (off.device, off.cpu) == (2 * psi / 4, 16 * psi / 4)
    off1 = costs.model_states(psi, "zero1", 4, offload="optimizer")  # whole params and gradient buffer stay
    assert (off1.device, off1.cpu) == (4 * psi, 16 * psi / 4)
    full = costs.model_states(psi, "zero3", 4, offload="full")
    assert (full.device, full.cpu) == (0.0, 16 * psi / 4)
    mp = costs.model_states(psi, "zero1", 2, model_parallel=4)  # tp x pp = 4 first divides Ψ
    assert mp.device == pytest.approx(4 * psi / 4 + 12 * psi / 4 / 2)
    hybrid = costs.model_states(psi, "hybrid_shard", 16, shard=4)  # full_shard inside groups of 4
    assert hybrid.device == 16 * psi / 4
    assert costs.model_states(psi, "ddp", 1, optimizer="none").device == 4 * psi  # the 4 bytes/parameter tables


def test_activations_follow_korthikanti():
    g = Activations(seq_len=2048, batch_size=4, hidden_size=1024, num_layers=24, num_heads=16)
    s, b, h, a, L = 2048, 4, 1024, 16, 24
    per_layer = s * b * h * (34 + 5 * a * s / h)
    assert costs.activation_bytes(g) == pytest.approx(L * per_layer)
    assert costs.activation_bytes(g, attention="fused") == pytest.approx(L * s * b * h * 34)
    t = 4  # tensor parallel without / with sequence parallel (eq. 2 and 4 of the paper)
    assert costs.activation_bytes(g, tp=t) == pytest.approx(L * s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert costs.activation_bytes(g, tp=t, sequence_parallel=True) == pytest.approx(L * per_layer / t)
    # full recomputation: each layer's input (2sbh) plus one layer rebuilt at a time
    assert costs.activation_bytes(g, checkpointing=True) == pytest.approx(L * 2 * s * b * h + per_layer)
    assert costs.activation_bytes(g, dtype="fp32") == pytest.approx(2 * L * per_layer)
    # estimate_memory states the same figure when given the geometry
    est = sw.estimate_memory(1e9, "zero3", 8, seq_len=s, batch_size=b, hidden_size=h, num_layers=L, num_heads=a)
    assert est.activations == pytest.approx(L * per_layer)
    assert est.total == pytest.approx(est.model_states + L * per_layer)
    with pytest.raises(ValueError, match="both seq_len and batch_size"):
        sw.estimate_memory(1e9, "zero3", 8, seq_len=s)


def test_default_shape_recovers_the_7b_family():
    hidden, layers, heads = costs.default_shape(7e9)
    assert 12 * layers * hidden ** 2 == pytest.approx(7e9, rel=0.1)
    assert hidden % 128 == 0 and heads == hidden // 128 and 30 <= layers <= 36


@pytest.mark.parametrize("n", [2, 8, 64])
def test_ring_wire_bytes(n):
    psi = 1e8
    grad = 2 * psi
    assert costs.data_parallel_wire_bytes(psi, "ddp", n)["dp"] == pytest.approx(2 * (n - 1) / n * grad)
    assert costs.data_parallel_wire_bytes(psi, "zero2", n)["dp"] == pytest.approx(2 * (n - 1) / n * grad)
    assert costs.data_parallel_wire_bytes(psi, "zero3", n)["dp"] == pytest.approx(3 * (n - 1) / n * grad)
    if n >= 8:
        h = costs.data_parallel_wire_bytes(psi, "hybrid_shard", n, shard=4)
        r = n // 4
        assert h == pytest.approx({"shard": 3 * 3 / 4 * grad, "replicate": 2 * (r - 1) / r * grad / 4})


def test_plan_reproduces_figure_1_rows_and_chooses_what_fits():
    p = plan(Workload(7.5e9), Links(64, 8, 80 * GB))
    rows = {e.candidate.label: e for e in p.estimates}
    for strategy, bytes_ in _paper_states(7.5e9, 64).items():
        assert rows[strategy].states.device == pytest.approx(bytes_)
    assert not rows["ddp"].fits and rows["zero1"].fits
    assert p.chosen.fits and p.chosen.tier == 0
    # fastest data-parallel layout by the link model: hybrid_shard keeps 3x traffic inside the node
    fitting = [e for e in p.estimates if e.fits and e.tier == 0]
    assert p.chosen.seconds == min(e.seconds for e in fitting)


def test_plan_7b_on_four_24gb_gpus_needs_offload_and_explains_it():
    p = plan(Workload(7e9), Links(4, 4, 24 * GB))
    assert p.candidate.offload is not None
    assert p.chosen.device <= 0.9 * 24 * GB
    assert all(not e.fits for e in p.estimates if not e.candidate.offload)
    text = p.explain()
    assert "Chosen: " + p.candidate.label in text and "do not fit" in text and "ddp needs 112.0 GB" in text
    assert "16 bytes per parameter" in text and "Activations: not counted" in text


def test_nothing_fits_names_the_smallest_world_size():
    work = Workload(7e9)
    with pytest.raises(ValueError, match="smallest world size that would fit is") as info:
        plan(work, Links(4, 4, 24 * GB), offload=False)
    n = int(str(info.value).split("fit is ")[1].split()[0])
    # computed from the formulas: the smallest whole number of 4-rank nodes with a layout within 90% of 24 GB
    assert n % 4 == 0 and plan(work, Links(n, 4, 24 * GB), offload=False).chosen.fits
    with pytest.raises(ValueError):
        plan(work, Links(n - 4, 4, 24 * GB), offload=False)


def test_candidates_apply_to_the_world():
    labels = [c.label for c in candidates(8, 4)]
    assert "fsdp:hybrid_shard (shard 4)" in labels and "tp" not in labels  # tp stays within a node of 4
    assert "3d:dp=2,tp=4,pp=1,dp_strategy=zero1" in labels
    assert [c.label for c in candidates(4, 4, tensor_parallel=False, pipeline=False, offload=False)] == [
        "ddp", "zero1", "zero2", "fsdp:shard_grad_op", "zero3"]
    assert all(c.tp in (1, 2) for c in candidates(8, 8, tp_divides=(6,)))


def test_strategy_strings():
    assert parse_strategy("fsdp", 4) == Candidate("dp", "fsdp:full_shard", 4)
    assert parse_strategy("deepspeed_stage_3", 4).dp_strategy == "zero3"
    assert parse_strategy("fsdp:hybrid_shard", 8, devices_per_node=4).shard == 4
    assert parse_strategy("3d:dp=2,tp=2,pp=2", 8) == Candidate("3d", "ddp", 2, 2, 2)
    c = parse_strategy("3d:tp=2,pp=2,dp_strategy=zero1", 8)
    assert (c.dp, c.dp_strategy, c.strategy) == (2, "zero1", "3d:dp=2,tp=2,pp=2,dp_strategy=zero1")


@pytest.mark.parametrize("text, match", [
    ("zero4", r"strategy='zero4' is not known; allowed .*'ddp'.*'3d:dp=A"),
    ("3d:dp=2,tp=3", r"tp x pp = 3 x 1 = 3 does not divide the world size 8"),
    ("3d:dp=3,tp=2,pp=2", r"dp x tp x pp = 3 x 2 x 2 = 12, but the world has 8 ranks"),
    ("3d:dp=2,tp=two", r"tp='two' must be a positive int"),
    ("3d:dp=2,zz=2", r"unknown key 'zz'"),
    ("3d:dp=8,dp_strategy=zero9", r"dp_strategy='zero9' is not allowed"),
    ("fsdp:hybrid_shard", r"needs shard_size, a positive int dividing the world size 8"),
])
def test_bad_strategy_strings_name_what_is_allowed(text, match):
    with pytest.raises(ValueError, match=match):
        parse_strategy(text, 8)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_params=0), "num_params=0 must be a positive number"),
    (dict(num_params=1e9, dtype="fp8"), r"dtype='fp8' is not known; allowed \['bf16', 'fp16', 'fp32'\]"),
    (dict(num_params=1e9, optimizer="lion"), "optimizer='lion' is not known"),
])
def test_bad_workloads(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Workload(**kwargs)
