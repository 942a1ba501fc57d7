"""A HuggingFace language model's loss over -100 labels is the global batch's token mean under data parallelism.

Each rank averaged over its own labels and the wrappers averaged the ranks' losses: with padded rows of unequal
lengths a Llama trained 0.053 off one process after three AdamW steps at lr 1e-2 (loss 4.1478 against 4.1426 at step 0), under
DDP, ZeRO-3 and FSDP alike. token_mean.py scales each rank's cross-entropy by its share of the global label count.
References are one process on the global batch; the ranks' mean loss must equal its loss at every step."""

from __future__ import annotations

import threading

import pytest
import torch

import shardwise as sw

transformers = pytest.importorskip("transformers")
_BUILD = threading.Lock()  # HuggingFace initialises from torch's global RNG, which thread ranks share
VOCAB, ROWS, LENGTH = 64, 4, 12


def _seeded(make):
    with _BUILD, torch.random.fork_rng():
        torch.manual_seed(0)
        return make()


def llama_config():
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)


def llama():
    return _seeded(lambda: transformers.LlamaForCausalLM(llama_config()))


def t5():
    return _seeded(lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0)))


def bert():
    return _seeded(lambda: transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)))


def qwen3_moe():
    return _seeded(lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.02, decoder_sparse_step=1, mlp_only_layers=[])))


def bart_decoder():
    """BartForCausalLM, the decoder alone: its loss pairs logits and labels at the same position (its labels come
    shifted), not shifted as a Llama's; Marian, Pegasus, Blenderbot ... are built the same way. Refused before."""
    return _seeded(lambda: transformers.BartForCausalLM(transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64,
        encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0)))


def bert_generation():
    """BertGenerationDecoder: a causal LM of transformers' causal-LM mapping named otherwise (its padded rows were
    each rank's own mean: a step-0 loss 0.4% off one process, silently)."""
    return _seeded(lambda: transformers.BertGenerationDecoder(transformers.BertGenerationConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, is_decoder=True)))


MODELS = {"llama": llama, "t5": t5, "bert-mlm": bert, "qwen3-moe-router-loss": qwen3_moe,
          "bart-causal-lm": bart_decoder, "bert-generation": bert_generation}


def batch(step: int, kind: str, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
    """Rows padded to unequal lengths (-100 labels), or BERT's random masking: the ranks hold different counts."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
    if kind == "bert-mlm":
        labels = torch.where(torch.rand(ROWS, LENGTH, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    else:
        labels = ids.clone()
        for row, length in enumerate((12, 5, 9, 3)):
            labels[row, length:] = -100
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    return {"input_ids": ids[rows], "labels": labels[rows]}


def train(model, kind: str, rank: int = 0, world: int = 1):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-5)
    losses = []
    for step in range(3):
        loss = model(**batch(step, kind, rank, world)).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses


WRAPS = {"ddp": lambda m, c: sw.DDP(m, c), "zero3": lambda m, c: sw.ZeRO(m, c, stage=3),
         "fsdp": lambda m, c: sw.FSDP(m, c),
         # BART's decoder layers hold a cross-attention that a decoder alone never calls: DDP is told
         "ddp:find_unused": lambda m, c: sw.DDP(m, c, find_unused_parameters=True)}


def _wraps_for(kind: str) -> list[str]:
    if kind == "bart-causal-lm":
        return ["ddp:find_unused", "zero3"]
    return ["ddp", "zero3"] + (["fsdp"] if kind == "llama" else [])


CASES = [(kind, name) for kind in MODELS for name in _wraps_for(kind)]


@pytest.mark.parametrize(("kind", "name"), CASES)
def test_the_loss_over_padded_labels_is_the_global_token_mean(kind, name):
    model = MODELS[kind]()
    want_losses = train(model, kind)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def body(comm):
        wrapped = WRAPS[name](MODELS[kind](), comm)
        losses = train(wrapped, kind, comm.rank, comm.size)
        return {k: v.clone() for k, v in sw.full_state_dict(wrapped).items()}, losses

    results = sw.launch(body, 2)
    ranks_mean = [sum(step) / len(step) for step in zip(*(losses for _, losses in results))]
    assert ranks_mean == pytest.approx(want_losses, rel=1e-5)
    # HuggingFace's causal-LM loss runs in float32 (logits.float()), where a rank's scaled mean and one process's
    # mean round differently (1e-7); Adam magnifies that on rows that get almost no gradient, as in
    # tests/test_experts_hf.py. A float64 T5 or BERT agrees to 1e-14.
    for got, _ in results:
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")


def test_a_loss_that_is_not_the_mean_cross_entropy_is_refused_naming_the_model():
    class Smoothed(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, **kwargs)
            logits = out.logits[:, :-1].reshape(-1, VOCAB)
            out.loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), label_smoothing=0.1)
            return out

    def body(comm):
        model = _seeded(lambda: Smoothed(llama_config()))
        sw.DDP(model, comm)(**batch(0, "llama", comm.rank, comm.size))

    with pytest.raises(sw.LaunchError, match="Smoothed's loss is not HuggingFace's mean cross-entropy over the "
                                             "labels that are not -100"):
        sw.launch(body, 2)


def wav2vec2_ctc():
    return _seeded(lambda: transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, apply_spec_augment=False, pad_token_id=0)))


def audio_batch(step: int, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    audio, labels = torch.randn(ROWS, 800, generator=g), torch.randint(1, 12, (ROWS, 6), generator=g)
    labels[1, 3:], labels[3, 2:] = -100, -100
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    return {"input_values": audio[rows], "labels": labels[rows]}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_a_ctc_loss_summed_over_the_batch_is_the_global_sum(name, optimizer):
    """wav2vec2's CTC loss with ctc_loss_reduction="sum" (HuggingFace's default): the ranks' average of their sums
    was half the global sum, and SGD stepped 0.10 off one process after three steps (AdamW nearly hides a scale)."""
    def train_ctc(model, rank=0, world=1):
        params = model.parameters()
        opt = torch.optim.SGD(params, lr=1e-3) if optimizer == "sgd" else \
            torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-5)
        losses = []
        for step in range(3):
            loss = model(**audio_batch(step, rank, world)).loss
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
        return losses

    model = wav2vec2_ctc()
    want_losses = train_ctc(model)
    want = model.state_dict()

    def body(comm):
        model = wav2vec2_ctc()  # its masked_spec_embed takes no part without SpecAugment: DDP is told
        wrapped = sw.DDP(model, comm, find_unused_parameters=True) if name == "ddp" else WRAPS[name](model, comm)
        losses = train_ctc(wrapped, comm.rank, comm.size)
        return {k: v.clone() for k, v in sw.full_state_dict(wrapped).items()}, losses

    results = sw.launch(body, 2)
    assert [sum(s) / 2 for s in zip(*(losses for _, losses in results))] == pytest.approx(want_losses, rel=1e-5)
    for got, _ in results:
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")


def llava():
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, image_size=16, patch_size=8, projection_dim=32)
    text = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2)
    return _seeded(lambda: transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=VOCAB - 1, vision_feature_layer=-1,
        vision_feature_select_strategy="full", projector_hidden_act="gelu")))


def image_text_batch(step: int, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
    """Supervised fine-tuning of a vision-language model: 5 image tokens (4 patches and CLIP's class token) and the
    prompt scored -100, answers padded to unequal lengths."""
    g = torch.Generator().manual_seed(step)
    pixels, text = torch.randn(ROWS, 3, 16, 16, generator=g), torch.randint(0, VOCAB - 4, (ROWS, 8), generator=g)
    ids = torch.cat([torch.full((ROWS, 5), VOCAB - 1), text], dim=1)
    labels = ids.clone()
    labels[:, :7] = -100  # the image and a two-token prompt
    for row, length in enumerate((8, 3, 6, 2)):
        labels[row, 5 + length:] = -100
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    return {"input_ids": ids[rows], "pixel_values": pixels[rows], "labels": labels[rows]}


@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_a_vision_language_models_masked_and_padded_labels_are_the_global_token_mean(name):
    def train_vlm(model, rank=0, world=1):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-5)
        for step in range(3):
            model(**image_text_batch(step, rank, world)).loss.backward()
            opt.step()
            opt.zero_grad()
        return model

    want = train_vlm(llava()).state_dict()

    def body(comm):
        model = llava()
        wrapped = sw.DDP(model, comm, find_unused_parameters=True) if name == "ddp" else WRAPS[name](model, comm)
        return {k: v.clone() for k, v in sw.full_state_dict(train_vlm(wrapped, comm.rank, comm.size)).items()}

    for got in sw.launch(body, 2):
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_generate_of_a_wrapped_language_model_gives_the_plain_models_tokens(name):
    """The loss mixin keeps the model's forward signature (_mixin.py): under a bare `*args, **kwargs` HuggingFace's
    generate passed other arguments, and a ZeRO-3 Llama generated other tokens than the plain model."""
    prompts = [torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(rank)) for rank in range(2)]
    options = {"max_new_tokens": 6, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    plain = llama()
    with torch.no_grad():
        want = [plain.generate(prompt, **options).tolist() for prompt in prompts]

    def body(comm):
        wrapped = WRAPS[name](llama(), comm)
        with torch.no_grad():  # every rank runs as many forwards (no end-of-sequence token): no sync needed
            return wrapped.generate(prompts[comm.rank], **options).tolist()

    assert sw.launch(body, 2) == want


def test_a_tuple_output_with_labels_is_refused_naming_return_dict():
    def body(comm):
        sw.DDP(llama(), comm)(**batch(0, "llama", comm.rank, comm.size), return_dict=False)

    with pytest.raises(sw.LaunchError, match=r"returned tuple for a call with labels \(return_dict=False\).*"
                                             r"return_dict=True"):
        sw.launch(body, 2)
