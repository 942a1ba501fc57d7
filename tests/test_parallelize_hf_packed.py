"""Packed rows through `sw.parallelize`: several documents per row, marked by position ids that restart at each
document (what transformers' DataCollatorWithFlattening gives), train as one process trains the same model on the
whole batch with ``model(input_ids, position_ids=..., labels=..., use_cache=False)`` (transformers keeps the
documents apart in its eager mask from the positions alone when no cache is in use).

``step({"input_ids": x, "position_ids": positions}, labels)``: the pipeline carries the positions beside the hidden
states from stage to stage (pp=2, with activation checkpointing), the stages rotate by them (GPT-2 embeds them) and
mask each microbatch block-diagonally by document (Mistral's sliding window as well); under context parallel the ring
and Ulysses attention find the documents from this rank's chunks of the positions (cp=2 with pp=2, dp=2, and experts
over ep=2 with Mixtral's load-balancing loss). GPT-OSS (sinks, a window) on pp=2 and on the ring: its own masks ignore
the positions, so its reference is given the documents' masks. Three AdamW steps (weight decay, eps 1e-5) with a
binding `sw.clip_grad_norm_`, then `predict` on packed rows. A reference trained on the same rows unpacked differs, so
the document mask is what is checked.

Padded rows: ``step({"input_ids": x, "attention_mask": mask}, labels)`` against one process given the mask, on
pp=2, tp=2 x dp=2, cp=2 x pp=2 (ring), GPT-2 on cp=2 x dp=2 (Ulysses) and Mistral's window on pp=2."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_decoders import MAX_NORM, MODELS, STEPS, gpt_oss, one_process, optimizer
from parity import value_error_text

import shardwise as sw

transformers = pytest.importorskip("transformers")

B, T = 4, 16


def packed(step):
    """(input_ids, position_ids, labels) of the global batch: row r holds r + 2 documents of random lengths; each
    document's first label is -100, as DataCollatorWithFlattening sets it (no token predicts the next document)."""
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 64, (B, T), generator=generator)
    positions, labels = torch.empty(B, T, dtype=torch.long), ids.clone()
    for row in range(B):
        cuts = sorted(torch.randperm(T - 1, generator=generator)[:row + 1].add(1).tolist())
        for start, end in zip([0, *cuts], [*cuts, T]):
            positions[row, start:end] = torch.arange(end - start)
            labels[row, start] = -100
    return ids, positions, labels


def gpt_oss_without_router_loss():
    model = gpt_oss()  # a sliding window of 8 on one layer, sinks on both
    model.config.output_router_logits = False  # its loss reads attention_mask as padding: none with explicit masks
    return model


def document_masks(positions, window=8):
    """GPT-OSS's masks do not read position ids (in one process its packed documents see each other): its reference
    gets the additive masks keeping the documents apart explicitly, per layer type (causal; and a window)."""
    documents = (torch.diff(positions, prepend=positions[:, :1] - 1) != 1).cumsum(-1)
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    same = (documents[:, :, None] == documents[:, None, :]) & (k <= q)
    return {kind: torch.where(visible, 0.0, torch.finfo(torch.float32).min).unsqueeze(1)
            for kind, visible in (("full_attention", same), ("sliding_attention", same & (q - k < window)))}


def one_process_inputs(kind, positions, pack=True):
    if not pack:
        return {}
    if kind == "gpt_oss":
        return {"position_ids": positions, "attention_mask": document_masks(positions)}
    return {"position_ids": positions}


def packed_reference(kind, pack=True):
    """One process's batch of each step: HuggingFace keywords (packed positions, or none) and the labels."""
    def batch(step):
        x, positions, labels = packed(step)
        return {"input_ids": x, "use_cache": False, **one_process_inputs(kind, positions, pack)}, labels
    return batch


def packed_inputs(step):
    """The hybrid's batch of each step: the first stage's inputs and the labels."""
    x, positions, labels = packed(step)
    return {"input_ids": x, "position_ids": positions}, labels


def train(comm, model, axes, options, batch):
    """Three steps of the hybrid on this dp rank's rows of `batch(step)`, then `predict` on the next step's."""
    mesh = sw.Mesh(comm, **axes)
    hybrid = sw.parallelize(copy.deepcopy(model), mesh, **options)
    opt = optimizer(hybrid.parameters())
    norms, losses = [], []
    dp, index = mesh.sizes["dp"], mesh.coords.dp
    rows = slice(index * B // dp, (index + 1) * B // dp)
    for step in range(STEPS):
        inputs, labels = batch(step)
        losses.append(float(hybrid.step({k: v[rows] for k, v in inputs.items()}, labels[rows])))
        norms.append(float(sw.clip_grad_norm_(hybrid, MAX_NORM)))
        opt.step()
        opt.zero_grad()
    hybrid.eval()
    logits = hybrid.predict({k: v[rows] for k, v in batch(STEPS)[0].items()})
    return sw.full_state_dict(hybrid), norms, losses, (rows, logits)


def assert_trains_like_one_process(results, axes, want, want_norms, want_losses):
    by_rows = {where[0].start: losses for _, _, losses, where in results}
    assert [sum(step) / axes.get("dp", 1) for step in zip(*by_rows.values())] == pytest.approx(want_losses, rel=1e-5)
    for state, norms, _, _ in results:
        assert norms == pytest.approx(want_norms, rel=1e-5)
        assert set(state) == set(want)
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


CASES = {
    "llama_pp2_checkpointed": ("llama", {"pp": 2}, {"n_microbatches": 2, "activation_checkpointing": True}),
    "llama_tp2": ("llama", {"tp": 2}, {"tp_plan": "llama"}),
    "llama_cp2_pp2_ring": ("llama", {"cp": 2, "pp": 2}, {"n_microbatches": 2}),
    "llama_cp2_dp2_ulysses": ("llama", {"cp": 2, "dp": 2}, {"cp_method": "ulysses"}),
    "gpt2_pp2": ("gpt2", {"pp": 2}, {"n_microbatches": 2}),
    "gpt2_cp2_ring": ("gpt2", {"cp": 2}, {}),
    "mistral_window_pp2": ("mistral_window", {"pp": 2}, {"n_microbatches": 2}),
    "mistral_window_cp2_ulysses": ("mistral_window", {"cp": 2}, {"cp_method": "ulysses"}),
    "mixtral_cp2_ep2": ("mixtral", {"dp": 1, "cp": 2, "ep": 2}, {}),
    "gpt_oss_pp2": ("gpt_oss", {"pp": 2}, {"n_microbatches": 2}),
    "gpt_oss_cp2_ring": ("gpt_oss", {"cp": 2}, {}),
}
DECODERS = {**MODELS, "gpt_oss": gpt_oss_without_router_loss}

_REFERENCES: dict = {}


def reference(kind):
    if kind not in _REFERENCES:
        _REFERENCES[kind] = one_process(DECODERS[kind](), packed_reference(kind))
    return _REFERENCES[kind]


@pytest.mark.parametrize("case", list(CASES))
def test_packed_rows_through_parallelize_train_like_one_process(case):
    kind, axes, options = CASES[case]
    want, want_norms, want_losses = reference(kind)
    unpacked, _, _ = one_process(DECODERS[kind](), packed_reference(kind, pack=False))
    assert max(float((unpacked[k] - w).abs().max()) for k, w in want.items()) > 1e-4  # the documents' mask matters
    world = axes.get("dp", 1) * axes.get("cp", 1) * axes.get("tp", 1) * axes.get("pp", 1)
    results = sw.launch(train, world, DECODERS[kind](), axes, options, packed_inputs)
    assert_trains_like_one_process(results, axes, want, want_norms, want_losses)
    trained = DECODERS[kind]().eval()
    trained.load_state_dict(want)
    x, positions, _ = packed(STEPS)
    with torch.no_grad():
        want_logits = trained(x, use_cache=False, **one_process_inputs(kind, positions)).logits
    for _, _, _, (rows, logits) in results:
        torch.testing.assert_close(logits, want_logits[rows], rtol=1e-5, atol=1e-5)


def test_position_ids_of_another_shape_are_refused_by_name():
    """One row of positions for a batch of four (broadcasting is not a packing): refused, naming the shape."""
    model = DECODERS["llama"]()
    x, positions, labels = packed(0)

    def body(comm):
        hybrid = sw.parallelize(copy.deepcopy(model), sw.Mesh(comm), n_microbatches=1)
        return value_error_text(lambda: hybrid.step({"input_ids": x, "position_ids": positions[:1]}, labels))

    (error,) = sw.launch(body, 1)
    assert "position_ids" in error and f"({B}, {T})" in error and "(1, 16)" in error


class PositionDroppingAttention(transformers.models.llama.modeling_llama.LlamaAttention):
    """An attention that does not hand position_ids to its attention function: it could not keep documents apart."""

    def forward(self, *args, **kwargs):
        kwargs.pop("position_ids", None)
        return super().forward(*args, **kwargs)


def test_an_attention_that_drops_the_positions_is_refused_under_context_parallel():
    model = DECODERS["llama"]()
    for layer in model.model.layers:
        layer.self_attn.__class__ = PositionDroppingAttention
    x, positions, labels = packed(0)

    def body(comm):
        hybrid = sw.parallelize(copy.deepcopy(model), sw.Mesh(comm, cp=2), n_microbatches=1)
        return value_error_text(lambda: hybrid.step({"input_ids": x, "position_ids": positions}, labels))

    for error in sw.launch(body, 2):
        assert "PositionDroppingAttention does not pass position_ids" in error


# ---- padded rows: a 2-D attention_mask (transformers' padding) through every axis ---------------------------------
def padded(step):
    """(input_ids, attention_mask, labels): row 0 right-padded, row 1 left-padded, row 2 padded at both ends, row 3
    whole. -100 on the padding, and on the first token after left padding (its label would be predicted at a padding
    position, whose output transformers' eager and SDPA attention do not agree on)."""
    generator = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(0, 64, (B, T), generator=generator)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 11:], mask[1, :3], mask[2, :2], mask[2, 13:] = 0, 0, 0, 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 3], labels[2, 2] = -100, -100
    return ids, mask, labels


def padded_inputs(step):
    """Both the hybrid's and one process's batch of each step: input ids and the padding mask, and the labels."""
    x, mask, labels = padded(step)
    return {"input_ids": x, "attention_mask": mask}, labels


PADDED = {
    # One row per microbatch: the last (row 3) pads nothing, and still hands the next stage the documents.
    "llama_pp2": ("llama", {"pp": 2}, {"n_microbatches": 4}),
    "llama_tp2_dp2": ("llama", {"tp": 2, "dp": 2}, {"tp_plan": "llama"}),
    "llama_cp2_pp2_ring": ("llama", {"cp": 2, "pp": 2}, {"n_microbatches": 4}),
    "gpt2_cp2_dp2_ulysses": ("gpt2", {"cp": 2, "dp": 2}, {"cp_method": "ulysses"}),
    "mistral_window_pp2": ("mistral_window", {"pp": 2}, {"n_microbatches": 2}),
}


@pytest.mark.parametrize("case", list(PADDED))
def test_padded_rows_through_parallelize_train_like_one_process(case):
    kind, axes, options = PADDED[case]
    want, want_norms, want_losses = one_process(DECODERS[kind](), padded_inputs)
    world = axes.get("dp", 1) * axes.get("cp", 1) * axes.get("tp", 1) * axes.get("pp", 1)
    results = sw.launch(train, world, DECODERS[kind](), axes, options, padded_inputs)
    assert_trains_like_one_process(results, axes, want, want_norms, want_losses)


def test_a_mask_that_is_not_padding_is_refused_by_name():
    model = DECODERS["llama"]()
    x, mask, labels = padded(0)

    def body(comm):
        hybrid = sw.parallelize(copy.deepcopy(model), sw.Mesh(comm), n_microbatches=1)
        return value_error_text(lambda: hybrid.step({"input_ids": x, "attention_mask": mask * 2}, labels))

    (error,) = sw.launch(body, 1)
    assert "attention_mask must be a padding mask" in error and f"({B}, {T})" in error
