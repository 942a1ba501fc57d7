"""A label predicted at a padding position under `sw.parallelize`'s HuggingFace stages and context parallel.

HuggingFace's causal-LM loss scores the logits at t against label t + 1. After left padding the first token's label
is scored at the last padding position; a batch whose labels are not -100 on the padding scores every padding
position. Those logits are an artefact of the attention (a padding query sees no key after left padding; eager and
SDPA attention disagree there), and the stages and context parallel let a padding token see only itself: the loss
differed from one process's, silently (Llama on pp=2 with left padding: 4.585435 against 4.588498). Such labels are
now refused on every rank at once, naming the row and position; with those labels -100, left-padded rows train as
one process, Mixtral's router loss too. Plain data parallel runs transformers' own forward and is unaffected."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="sdpa")


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))


def mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SMALL, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.05))


def left_padded(step, first_token_scored=False):
    """4 rows of 16 tokens, rows 0 and 2 left-padded by 5 and 11; labels -100 on the padding and, unless
    `first_token_scored`, on each padded row's first token."""
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
    mask = torch.ones_like(ids)
    mask[0, :5], mask[2, :11] = 0, 0
    labels = ids.masked_fill(mask == 0, -100)
    if not first_token_scored:
        labels[0, 5], labels[2, 11] = -100, -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def right_padded_labels_unmasked(step):
    """Rows 0 and 2 right-padded, the labels the tokens themselves (the padding's too)."""
    batch = left_padded(step)
    batch["attention_mask"] = batch["attention_mask"].flip(1)
    batch["labels"] = batch["input_ids"].clone()
    return batch


@pytest.mark.parametrize("strategy", [{"pp": 2}, {"cp": 2}])
@pytest.mark.parametrize("batch", [lambda step: left_padded(step, first_token_scored=True),
                                   right_padded_labels_unmasked], ids=["left_first_token", "right_unmasked"])
def test_a_label_predicted_at_padding_is_refused_naming_where(batch, strategy):
    with pytest.raises(ValueError, match=r"predicted at padding positions \(this rank's row 0: label \d+ at position "
                                         r"\d+ would be predicted by the logits at position \d+, a padding token"):
        sw.check(llama, batch, strategy=strategy, world_size=2, steps=1)


def test_a_stray_label_on_one_data_parallel_rank_stops_every_rank_with_the_error():
    """Only dp rank 0's rows hold it: the count is all-reduced with the labels' count, so every rank raises the
    ValueError (none waits in a collective for a rank that stopped)."""
    batch = left_padded(0)
    batch["labels"][0, 5] = batch["input_ids"][0, 5]

    def body(comm):
        torch.manual_seed(0)
        mesh = sw.Mesh(comm, pp=2, dp=2)
        model = sw.parallelize(llama(), mesh, n_microbatches=2)
        rows = slice(2 * mesh.coords.dp, 2 * mesh.coords.dp + 2)
        try:
            model.step({k: batch[k][rows] for k in ("input_ids", "attention_mask")}, batch["labels"][rows])
        except ValueError as exc:
            return str(exc)
        return "trained"

    errors = sw.launch(body, 4)
    assert all(e.startswith("parallelize: 1 label(s) of the step are predicted at padding positions") for e in errors)
    assert sum("this rank's row 0: label" in e for e in errors) == 2  # dp rank 0's two pipeline ranks
    assert sum("all on other data-parallel ranks' rows" in e for e in errors) == 2


def test_plain_data_parallel_runs_transformers_forward_and_takes_them():
    report = sw.check(llama, lambda step: left_padded(step, first_token_scored=True), strategy="ddp", world_size=2,
                      steps=2)
    assert report.ok, str(report)


@pytest.mark.parametrize("build,strategy", [
    (llama, {"pp": 2, "cp": 2}),
    (mixtral, {"pp": 2, "dp": 2, "dp_strategy": "zero3", "n_microbatches": 2}),  # its router loss over left padding
])
def test_left_padded_rows_with_the_first_token_unscored_match_one_process(build, strategy):
    report = sw.check(build, left_padded, strategy=strategy, world_size=4, steps=2)
    assert report.ok, str(report)
