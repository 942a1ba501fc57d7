"""`sw.check` on pipeline stages: a mesh dict with "pp" (or a callable returning `sw.parallelize(...)`) trains through
`model.step(inputs, targets)` and is compared with one process phase by phase, every stage's gradients and parameters
under their one-process names (check/pipelines.py).

Clean: shardwise's GPT in float64 with its embedding tied to the head across the stages (zero3 over dp=2, checked to
1e-10, which a loss carried in float32 would miss), the schedules (interleaved, zero-bubble), tp x pp, cp x pp, and a
HuggingFace Llama on packed rows (position ids, use_cache=False) and on padded rows, Mixtral's router loss per
microbatch on padded rows. Planted bugs are found: the tied embedding's gradient no longer summed over the stages that
hold it; padding counted in the router loss. Refusals name what is allowed."""

from __future__ import annotations

import pytest
import torch
from float64_gpts import tied_gpt, tokens

import shardwise as sw
from shardwise.check.example import build_gpt, gpt_batch
from shardwise.models import hf_router_loss
from shardwise_cli import main


def test_a_float64_gpt_tied_across_stages_matches_one_process_to_1e_10():
    report = sw.check(tied_gpt, tokens, strategy={"pp": 2, "dp_strategy": "zero3"}, world_size=4, rtol=1e-10,
                      atol=1e-10)
    assert report.ok, str(report)
    assert "pp=2 (1f1b) x zero3 over dp=2" in report.strategy and report.dp == 2
    names = {row.name for row in report.rows}
    assert {"tok_emb.weight", "blocks.0.attn.qkv.weight", "blocks.3.mlp.proj.weight", "ln_f.weight"} <= names


@pytest.mark.parametrize("strategy", [
    {"pp": 2, "pp_schedule": "interleaved_1f1b", "virtual_stages": 2, "dp_strategy": "zero1"},
    {"pp": 4, "pp_schedule": "zb_h1"},
    {"pp": 2, "tp": 2, "tp_plan": "gpt"},
    {"pp": 2, "cp": 2, "dp_strategy": "fsdp", "n_microbatches": 2},
], ids=["interleaved_zero1", "zb_h1_pp4", "tp2_pp2", "cp2_pp2_fsdp"])
def test_pipeline_layouts_match_one_process(strategy):
    report = sw.check(build_gpt, gpt_batch, strategy=strategy, world_size=4, steps=2)
    assert report.ok, str(report)


def test_a_tied_gradient_no_longer_summed_over_the_stages_is_found(monkeypatch):
    """The embedding and the head share one weight, held by the first and the last stage; each computes part of its
    gradient. Without their sum (pipeline/tied.py) each copy steps on its own part: the check names the weight."""
    from shardwise.pipeline import tied

    monkeypatch.setattr(tied.TiedParameters, "all_reduce_grads", lambda self: None)
    report = sw.check(tied_gpt, tokens, strategy={"pp": 2}, world_size=2, steps=1)
    assert not report.ok
    assert report.first_mismatch.phase == "gradient" and report.first_mismatch.name == "tok_emb.weight"


transformers = pytest.importorskip("transformers")


def llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, attn_implementation="eager")
    return transformers.LlamaForCausalLM(config).double()


def packed(step):
    """Two documents per row (positions restart at 6), no cache: one process keeps them apart as the stages do."""
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 64, (8, 16), generator=generator)
    labels = ids.clone()
    labels[:, [0, 6]] = -100
    positions = torch.cat([torch.arange(6), torch.arange(10)]).repeat(8, 1)
    return {"input_ids": ids, "position_ids": positions, "labels": labels, "use_cache": False}


def padded(step):
    """Rows 1 and 5 right-padded, the others whole: some microbatches pad nothing."""
    batch = packed(step)
    del batch["position_ids"], batch["use_cache"]
    mask = torch.ones(8, 16, dtype=torch.long)
    mask[1, 12:], mask[5, 9:] = 0, 0
    batch["labels"] = batch["input_ids"].masked_fill(mask == 0, -100)
    batch["attention_mask"] = mask
    return batch


@pytest.mark.parametrize("batch,strategy", [
    (packed, {"pp": 2, "cp": 2}),
    (padded, {"pp": 2, "dp_strategy": "zero3", "n_microbatches": 4}),
], ids=["packed_cp2_pp2", "padded_zero3_pp2"])
def test_a_huggingface_llama_on_pipeline_stages_matches_one_process(batch, strategy):
    report = sw.check(llama, batch, strategy=strategy, world_size=4, steps=2)
    assert report.ok, str(report)


def mixtral():
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        router_jitter_noise=0.0, output_router_logits=True, router_aux_loss_coef=0.05, tie_word_embeddings=False,
        attn_implementation="eager", experts_implementation="eager")
    return transformers.MixtralForCausalLM(config).double()


def test_a_mixtral_router_loss_per_microbatch_matches_one_process_and_padding_counted_is_found(monkeypatch):
    """The stages compute Mixtral's router loss per microbatch (models/hf_router_loss.py): the one process accumulates
    over the same global microbatches, padding left out of the counts. Counting the padding is found."""
    strategy = {"pp": 2, "dp_strategy": "zero3", "n_microbatches": 2}
    report = sw.check(mixtral, padded, strategy=strategy, world_size=4, steps=2)
    assert report.ok, str(report)
    monkeypatch.setattr(hf_router_loss, "_token_weights", lambda *args: None)
    report = sw.check(mixtral, padded, strategy=strategy, world_size=4, steps=2)
    assert not report.ok and report.first_mismatch.phase == "gradient"


def test_packed_rows_with_a_cache_in_use_are_explained():
    """Without use_cache=False transformers lets one process's documents see each other: the report says so."""
    def with_cache(step):
        batch = packed(step)
        del batch["use_cache"]
        return batch

    report = sw.check(llama, with_cache, strategy={"pp": 2}, world_size=2, steps=1)
    assert not report.ok and report.first_mismatch.phase == "forward"
    assert "use_cache=False" in report.notes[0]


def test_a_callable_strategy_returning_parallelize_is_trained_through_step():
    def wrap(model, comm):
        return sw.parallelize(model, sw.Mesh(comm, dp=None, pp=2), dp_strategy="zero2", n_microbatches=2)

    report = sw.check(build_gpt, gpt_batch, strategy=wrap, world_size=4, steps=2)
    assert report.ok, str(report)


@pytest.mark.parametrize("kwargs,message", [
    (dict(strategy={"pp": 2}, loss_fn=lambda model, batch: model(*batch)), "loss_fn cannot be combined with pp > 1"),
    (dict(strategy={"pp": 2}, batch=lambda step: gpt_batch(step)[0]), "under a pipeline the batch must be"),
    (dict(strategy={"pp": 2, "dp_strategy": "fsdp:no_shard"}), "does not apply to pipeline stages"),
    (dict(strategy={"tp": 2, "pp_schedule": "gpipe"}), "only apply to pipelines"),
    (dict(strategy={"pp": 3}), "does not divide world_size=4"),
])
def test_pipeline_refusals_name_what_is_allowed(kwargs, message):
    options = dict(batch=gpt_batch, world_size=4, steps=1) | kwargs
    with pytest.raises(ValueError, match=message):
        sw.check(build_gpt, **options)


def test_a_pipeline_built_by_hand_is_refused():
    def wrap(model, comm):
        stages = sw.pipeline.partition(model.pipeline_layers(), comm.size)
        return sw.pipeline.Pipeline(stages, comm, "1f1b", 2, lambda out, y: out.float().mean())

    with pytest.raises(ValueError, match="pipeline by hand"):
        sw.check(build_gpt, gpt_batch, strategy=wrap, world_size=2, steps=1)


def test_accumulated_steps_match_one_process_and_a_tie_counted_twice_is_found(monkeypatch):
    """accumulate=2: two pipeline steps (each microbatch's loss / 2) per optimizer step, float64 to 1e-10 (a loss
    scale applied in float32 would miss it). Without setting the tie's accumulated gradient aside before a step
    (pipeline/tied.py), its earlier step is summed twice: the check finds it at the first update."""
    strategy = {"pp": 2, "dp_strategy": "zero3"}
    report = sw.check(tied_gpt, tokens, strategy=strategy, world_size=4, steps=2, accumulate=2, rtol=1e-10,
                      atol=1e-10)
    assert report.ok, str(report)
    assert "2 steps of 2 accumulated batches: OK" in str(report)
    from shardwise.pipeline import tied

    monkeypatch.setattr(tied.TiedParameters, "begin_step", lambda self: None)
    report = sw.check(tied_gpt, tokens, strategy=strategy, world_size=4, steps=2, accumulate=2)
    assert not report.ok
    assert (report.first_mismatch.step, report.first_mismatch.phase) == (0, "gradient")
    assert report.first_mismatch.name == "tok_emb.weight"


def test_cli_pipeline_options(capsys):
    assert main(["check", "--gpt", "--pp", "2", "--strategy", "zero1", "-n", "4", "--steps", "1",
                 "--accumulate", "2"]) == 0
    assert "pp=2 (1f1b) x zero1 over dp=2 on 4 thread ranks (data parallel 2), 1 step of 2 accumulated batches: OK" \
        in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["check", "--gpt", "--n-microbatches", "4", "-n", "2"])
    assert exc.value.code == 2 and "need --pp > 1" in capsys.readouterr().err


def test_activation_checkpointing_on_pipeline_stages_is_a_strategy_key(monkeypatch):
    """`{"pp": 2, "activation_checkpointing": True}` checks sw.parallelize's checkpointed layers (the keyword reaches
    it: recorded here) against one process; on pp = 1 the key is refused, naming the pipeline keys."""
    from shardwise import hybrid

    seen = []
    parallelize = hybrid.parallelize

    def recording(*args, **kwargs):
        seen.append(kwargs.get("activation_checkpointing"))
        return parallelize(*args, **kwargs)

    monkeypatch.setattr(hybrid, "parallelize", recording)
    report = sw.check(tied_gpt, tokens, strategy={"pp": 2, "activation_checkpointing": True, "dp_strategy": "zero2"},
                      world_size=4, rtol=1e-10, atol=1e-10)
    assert report.ok, str(report)
    assert "activation checkpointing" in report.strategy and seen == [True] * 4
    with pytest.raises(ValueError, match=r"\['activation_checkpointing'\] only apply to pipelines \(pp > 1\)"):
        sw.check(tied_gpt, tokens, strategy={"activation_checkpointing": True, "dp_strategy": "zero3"})
