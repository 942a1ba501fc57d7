"""Padded rows under context parallel: a HuggingFace decoder given a 2-D ``attention_mask`` (1 a token, 0 padding,
cut by `split_sequence` like the tokens) trains as one process given the whole mask.

The model's forward gathers the mask once and makes each padding token a document of its own (documents.py), so no
token attends to padding, on ring and Ulysses attention, right and left padding, with Gemma 2's soft cap and window;
no label is predicted at a padding position (its output is not defined alike by any two attention implementations:
transformers' eager and SDPA losses differ there). As in transformers, a 2-D mask replaces what packed position ids
would say. Before this, any attention_mask was refused under cp.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_cases import gemma2, tiny_llama
from parity import value_error_text

import shardwise as sw
from shardwise import context_parallel as cp

transformers = pytest.importorskip("transformers")

IDS = torch.randint(1, 64, (3, 17), generator=torch.Generator().manual_seed(1))
X, Y = IDS[:, :-1], IDS[:, 1:]
# Row 0 right-padded (11 tokens, 5 pads), row 1 left-padded (3 pads), row 2 unpadded.
MASK = torch.ones(3, 16, dtype=torch.long)
MASK[0, 11:] = 0
MASK[1, :3] = 0
LABELS = Y.masked_fill(MASK == 0, -100)


def gradients(model, x, labels, mask, scale=1.0):
    """Gradients of the summed cross entropy over the labels that are not -100 (times `scale`)."""
    logits = model(input_ids=x, attention_mask=mask, use_cache=False).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
    (loss * scale).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("model_of", [tiny_llama, gemma2])
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_padded_rows_train_like_one_process(model_of, method):
    want = gradients(model_of(), X, LABELS, MASK)
    unmasked = gradients(model_of(), X, LABELS, None)
    assert max(float((unmasked[n] - w).abs().max()) for n, w in want.items()) > 1e-4  # the padding matters

    def body(comm):
        model = sw.DDP(cp.apply(model_of(), comm, method=method), comm)
        # The gradient is averaged over the cp ranks: each rank's sum counts cp times to make the whole sum's.
        return gradients(model, *cp.split_sequence((X, LABELS, MASK), comm), scale=comm.size)

    for got in sw.launch(body, 2):
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_a_whole_mask_and_a_bool_mask_pass_too():
    want = gradients(tiny_llama(), X, LABELS, MASK)

    def body(comm):
        model = sw.DDP(cp.apply(tiny_llama(), comm), comm)
        x, labels = cp.split_sequence((X, LABELS), comm)
        return gradients(model, x, labels, MASK.bool(), scale=comm.size)  # the whole (B, T) mask on every rank

    for got in sw.launch(body, 2):
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_bad_masks_are_refused_by_name():
    def body(comm):
        model = cp.apply(tiny_llama(), comm)
        x = cp.split_sequence(X, comm)
        return [value_error_text(lambda: model(input_ids=x, attention_mask=m)) for m in (
            torch.ones(3, 5, dtype=torch.long), torch.full((3, 8), 2), torch.ones(3, 1, 8, 8))]

    for shape, values, four_d in sw.launch(body, 2):
        assert "attention_mask must be a padding mask" in shape and "(3, 8)" in shape and "(3, 16)" in shape
        assert "1 (a token) and 0 (padding) only" in values
        assert "attention_mask must be a padding mask" in four_d and "(3, 1, 8, 8)" in four_d


def padded_batch(step):
    """HuggingFace's labels (shifted inside the loss). Row 1 is left-padded: its first token's label would be
    predicted at the last padding position, whose output no two attention implementations agree on (transformers'
    eager and SDPA losses differ), so it is -100 too: then no label reads a padding position."""
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(1, 64, (4, 16), generator=generator)
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[0, 10:], mask[1, :4], mask[3, 13:] = 0, 0, 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 4] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def test_check_trains_padded_rows_like_one_process():
    """sw.check: three AdamW steps (weight decay 0.1) of dp 2 x cp 2 on padded rows, against one process."""
    report = sw.check(tiny_llama, padded_batch, strategy={"cp": 2}, world_size=4, steps=3)
    assert report.ok, report


def opt():
    return transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
        attn_implementation="sdpa"))


def test_a_model_numbering_positions_from_the_mask_is_refused_on_left_padded_rows():
    """OPT numbers a left-padded row from its first token (cumsum of the mask); context parallel gives every token
    its place in the whole sequence: left padding trained on other position embeddings than one process's (loss
    4.540939 against 4.540456), silently. Refused now, naming the module; right padding matches one process."""
    from test_labels_at_padding import left_padded

    with pytest.raises(ValueError, match=r"model.decoder \(OPTDecoder\) computes the position ids from the attention "
                                         r"mask, which numbers a left-padded row from its first token"):
        sw.check(opt, left_padded, strategy={"cp": 2}, world_size=2, steps=1)

    def right_padded(step):
        batch = left_padded(step)
        mask = batch["attention_mask"].flip(1)
        return {**batch, "attention_mask": mask, "labels": batch["input_ids"].masked_fill(mask == 0, -100)}

    report = sw.check(opt, right_padded, strategy={"cp": 2}, world_size=2, steps=2)
    assert report.ok, str(report)
