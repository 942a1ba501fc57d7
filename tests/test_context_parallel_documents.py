"""Packed sequences under context parallel: documents packed into one row attend only within themselves.

The kernels (ring and Ulysses, float64) against the eager formula with a document mask, given this rank's ids or
the whole sequence's; HuggingFace decoders given packed ``position_ids`` (restarting at each document) against one
process given the same whole ids (with ``use_cache=False``, where transformers' eager and SDPA masks apply them),
gradients and AdamW steps through ``sw.check``, under activation checkpointing, and the refusals. Before this,
packed position ids were refused under cp (only the chunks' global positions passed).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attention_cases import DO, SINKS, B, K, Q, T, V, cp_attention, eager_attention
from hf_cases import gemma2, gpt_oss, tiny_llama

import shardwise as sw
from shardwise import context_parallel as cp

transformers = pytest.importorskip("transformers")

# Row 0: documents of 3, 6 and 7 tokens; row 1: 8, 1 and 7 (a one-token document, edges on and off chunk edges).
DOCS = torch.tensor([[0] * 3 + [1] * 6 + [2] * 7, [5] * 8 + [6] + [7] * 7])


@pytest.mark.parametrize("fn,world,zigzag", [(cp.ring_attention, 2, True), (cp.ring_attention, 4, True),
                                             (cp.ring_attention, 4, False), (cp.ulysses_attention, 2, True),
                                             (cp.ulysses_attention, 4, False)])
@pytest.mark.parametrize("window,softcap,sinks,whole", [(None, None, None, False), (3, None, None, True),
                                                        (5, 0.7, SINKS, False)])
def test_documents_equal_the_eager_formula_float64(fn, world, zigzag, window, softcap, sinks, whole):
    want = eager_attention(softcap, sinks, window, DOCS)
    documents = DOCS.T.contiguous().T if whole else ("split", DOCS)  # the whole ids in any memory layout
    for got in sw.launch(cp_attention, world, fn, zigzag, softcap, sinks, window, documents):
        for name, g, w in zip(["out", "dq", "dk", "dv", "dsinks"], got, want):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("window,documents,forward_blocks,backward_blocks", [
    (2, None, [1, 2, 2, 1], [2, 4, 4, 2]),                    # a window within one chunk: the neighbours only
    (None, torch.arange(T).div(4, rounding_mode="floor").expand(B, -1), [1] * 4, [2] * 4),  # 4-token documents
])
def test_blocks_go_only_to_the_ranks_that_need_them(window, documents, forward_blocks, backward_blocks):
    """cp 4, zigzag chunks of 2 tokens. The ring would send each rank's block 3 times forward and 7 times backward
    (with the gradients); here a block goes to the ranks whose queries see it, and its gradients come back."""
    docs = documents if documents is not None else torch.zeros(B, T, dtype=torch.long)
    want = eager_attention(None, None, window, docs)
    kv_bytes = 2 * K.numel() // 4 * 4  # this rank's k and v, sent in float32 (the blocks' accumulation dtype)

    def body(comm):
        q_r, k_r, v_r, do_r = (cp.split_sequence(t.float(), comm, dim=2).requires_grad_() for t in (Q, K, V, DO))
        with comm.stats.measure() as forward:
            out = cp.ring_attention(q_r, k_r, v_r, comm, window=window, documents=documents)
        with comm.stats.measure() as backward:
            out.backward(do_r)
        got = [cp.gather_sequence(t, comm, dim=2) for t in (out, q_r.grad, k_r.grad, v_r.grad)]
        return got, forward.bytes("send"), backward.bytes("send")

    for rank, (got, sent_forward, sent_backward) in enumerate(sw.launch(body, 4)):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w.float(), rtol=1e-5, atol=1e-6)
        assert (sent_forward, sent_backward) == (forward_blocks[rank] * kv_bytes, backward_blocks[rank] * kv_bytes)


def test_bad_documents_raise():
    def body(comm):
        q = cp.split_sequence(Q, comm, dim=2)
        with pytest.raises(ValueError, match=r"documents must be an integer tensor \(batch, tokens\) of document ids, "
                                             r"got torch.float32"):
            cp.ring_attention(q, q, q, comm, documents=torch.zeros(2, 8))
        with pytest.raises(ValueError, match=r"documents of shape \(2, 5\) do not fit queries of shape "
                                             r"\(2, 4, 8, 8\); allowed: \(2 or 1, 8\) for this rank's tokens or "
                                             r"\(2 or 1, 16\)"):
            cp.ulysses_attention(q, q, q, comm, documents=torch.zeros(2, 5, dtype=torch.long))

    sw.launch(body, 2)


# ---- HuggingFace decoders ------------------------------------------------------------------------------------------
IDS = torch.randint(1, 64, (2, 17), generator=torch.Generator().manual_seed(1))
X, Y = IDS[:, :-1], IDS[:, 1:]
# DataCollatorWithFlattening's position ids: each document counts from 0 (row 0: 5, 7 and 4 tokens; row 1: 9, 7).
PACKED = torch.tensor([[*range(5), *range(7), *range(4)], [*range(9), *range(7)]])


def gradients(model, x, y, positions, **kwargs):
    logits = model(input_ids=x, position_ids=positions, use_cache=False, **kwargs).logits
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def document_mask(positions, dtype=torch.float32):
    """The additive (B, 1, T, T) mask that keeps packed documents apart, causally: what transformers builds from
    packed position ids for the models whose masks read them, given explicitly to one that does not (GPT-OSS)."""
    documents = (torch.diff(positions, prepend=positions[:, :1] - 1) != 1).cumsum(-1)
    t = torch.arange(positions.shape[1])
    visible = (t[None, :] <= t[:, None]) & (documents[:, :, None] == documents[:, None, :])
    return torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype).unsqueeze(1)


def assert_cp_matches_one_process(model_of, positions, method="ring", reference=None, **one_process):
    """Gradients of `model_of()` under cp 2 (DDP over the group), given this rank's part of `positions`, against
    one process on the whole rows (`reference()` built when given, else `model_of()`)."""
    want = gradients((reference or model_of)(), X, Y, positions, **one_process)

    def body(comm):
        model = sw.DDP(cp.apply(model_of(), comm, method=method), comm, find_unused_parameters=True)
        return gradients(model, *cp.split_sequence((X, Y, positions), comm))

    for got in sw.launch(body, 2):
        for name, w in want.items():
            if w is None:  # an expert no token chose, in one process as under cp
                assert got[name] is None or not got[name].any(), name
                continue
            torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    return want


@pytest.mark.parametrize("model_of", [tiny_llama, gemma2, gpt_oss])
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_packed_hf_gradients_match_one_process(model_of, method):
    # GPT-OSS's eager and SDPA masks do not read position ids (in one process its packed documents see each other,
    # as under flash attention they do not): its reference gets the documents' mask explicitly.
    explicit = {"attention_mask": document_mask(PACKED)} if model_of is gpt_oss else {}
    want = assert_cp_matches_one_process(model_of, PACKED, method, **explicit)
    unpacked = gradients(model_of(), X, Y, None)
    assert max((unpacked[n] - w).abs().max() for n, w in want.items() if w is not None) > 1e-4  # the mask matters


def test_activation_checkpointing_recomputes_with_the_same_documents():
    def checkpointed():
        model = tiny_llama()
        model.activation_checkpointing_enable()
        return model

    assert_cp_matches_one_process(checkpointed, PACKED, reference=tiny_llama)


class PositionCopyingAttention(transformers.models.llama.modeling_llama.LlamaAttention):
    """An attention that hands its attention function a copy of position_ids: a tensor the model's forward did not
    file, whose documents the attention function then finds by gathering it."""

    def forward(self, *args, **kwargs):
        kwargs["position_ids"] = kwargs["position_ids"].clone()
        return super().forward(*args, **kwargs)


def test_position_ids_the_model_makes_itself_are_gathered():
    def copying():
        model = tiny_llama()
        for layer in model.model.layers:
            layer.self_attn.__class__ = PositionCopyingAttention
        return model

    assert_cp_matches_one_process(copying, PACKED)


def test_positions_offset_into_a_long_document_match_one_process():
    """Rows cut from the middle of a long document (positions 40..55): one sequence per row, rotated from 40."""
    assert_cp_matches_one_process(tiny_llama, torch.arange(40, 40 + 16).expand(2, -1), "ulysses")


def packed_batch(step):
    return {"input_ids": IDS[:, :16], "labels": IDS[:, :16], "position_ids": PACKED, "use_cache": False}


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_check_trains_packed_rows_like_one_process(method):
    """sw.check: three AdamW steps (weight decay 0.1) of dp 2 x cp 2 on packed rows, against one process."""
    report = sw.check(tiny_llama, packed_batch, strategy={"cp": 2, "cp_method": method}, world_size=4, steps=3)
    assert report.ok, report


class PositionlessAttention(transformers.models.llama.modeling_llama.LlamaAttention):
    """An attention that does not hand position_ids on to its attention function."""

    def forward(self, *args, **kwargs):
        kwargs.pop("position_ids", None)
        return super().forward(*args, **kwargs)


def test_what_cannot_keep_documents_apart_is_refused():
    def body(comm):
        x, positions = cp.split_sequence((X, PACKED), comm)
        model = cp.apply(tiny_llama(), comm)
        with pytest.raises(ValueError, match=r"position_ids are 0..7 on every rank, positions within each rank's "
                                             r"chunks; they must be the whole sequence's position ids"):
            model(input_ids=x, position_ids=torch.arange(8).expand(2, -1))
        with pytest.raises(ValueError, match=r"position_ids must be an integer tensor \(2 or 1, 8\), this rank's "
                                             r"tokens' positions in the whole sequence, got torch.int64 \(2, 16\)"):
            model(input_ids=x, position_ids=PACKED)
        positionless = tiny_llama()
        for layer in positionless.model.layers:
            layer.self_attn.__class__ = PositionlessAttention
        positionless = cp.apply(positionless, comm)
        with pytest.raises(ValueError, match=r"PositionlessAttention does not pass position_ids to its attention "
                                             r"function, so the packed documents they mark cannot be kept apart"):
            positionless(input_ids=x, position_ids=positions)
        positionless(input_ids=x)  # one sequence per row: nothing to keep apart

    sw.launch(body, 2)
