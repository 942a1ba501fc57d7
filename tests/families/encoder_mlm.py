"""encoder_mlm: HuggingFace ``BertForMaskedLM``, tiny, whose decoder is tied to the embedding twice over.

Model: vocab 64, hidden 32, 2 layers, 4 heads, intermediate 64, 16 positions, 2 token types; dropout 0; fp32;
eager attention. 20,960 parameters in 42 tensors (``named_parameters()``, duplicates removed; 44 names with them,
and 44 state-dict keys).

Ties (transformers 5.23 ``BertForMaskedLM._tied_weights_keys``, applied by ``post_init``):
- ``cls.predictions.decoder.weight`` IS ``bert.embeddings.word_embeddings.weight`` (the same Parameter);
- ``cls.predictions.decoder.bias`` IS ``cls.predictions.bias`` (the same Parameter, zeros at init).
``named_parameters()`` lists each tie under its first name only (``bert.embeddings.word_embeddings.weight`` and
``cls.predictions.bias``); ``state_dict()`` lists both names of each (44 keys). The forward uses the tied bias
through ``decoder`` only: ``BertLMPredictionHead.forward`` never reads ``self.bias`` by that name.

Buffers: ``bert.embeddings.position_ids`` and ``bert.embeddings.token_type_ids`` (int64, non-persistent: not in the
state dict, not shared). The batch passes ``token_type_ids`` so the buffer is not used for it.

Batch: 8 rows of 12 tokens (ids 5..63, no padding, attention mask all ones), segment ids 0 then 1 from a per-row
split point, and exactly 3 masked positions in every row ([MASK]=4 in the input, the original id in ``labels``,
-100 elsewhere): HuggingFace's CrossEntropyLoss(mean) averages 24 tokens, 3 per row, so the mean of equal slices'
losses equals the whole batch's loss.

Tensor parallel (TP_PLAN): q/k/v colwise, attention output rowwise, intermediate colwise, output rowwise, the
word embedding vocabulary-parallel and the decoder column-parallel with gathered logits (HuggingFace's loss views
the logits as (-1, vocab_size), so they must be whole): the decoder weight shares the embedding's row shard, and its
bias is split with it, so ``cls.predictions.bias`` (the same Parameter before the split, and the name
``named_parameters()`` reports) must end up registered as that split bias too, or it becomes a stale dense copy.
BERT's attention reshapes with ``(-1, head_size)``, so no head count needs adjusting. vocab, heads, hidden and
intermediate are divisible by 2 and 4.

Zero-gradient parameters: every attention key bias (``attention.self.key.bias``) has an exactly zero true
gradient (softmax ignores the shift q . b_k), so its computed gradient is rounding noise: see the package
docstring (families/__init__.py) for AdamW's eps.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.tensor_parallel import Colwise

VOCAB, HIDDEN, LAYERS, HEADS, FFN, SEQ, N_MASK, BATCH, MASK_ID, FIRST_ID = 64, 32, 2, 4, 64, 12, 3, 8, 4, 5

NOTES = ("decoder.weight tied to word_embeddings AND decoder.bias tied to cls.predictions.bias (two names, one "
         "Parameter, each listed once by named_parameters); masked LM with 3 labels per row (-100 elsewhere)")
MAX_NORM = 0.5
TP_PLAN = {
    "attention.self.query": "colwise",
    "attention.self.key": "colwise",
    "attention.self.value": "colwise",
    "attention.output.dense": "rowwise",
    "intermediate.dense": "colwise",
    "encoder.layer.*.output.dense": "rowwise",  # also matches attention.output.dense (same style)
    "word_embeddings": "vocab",
    "cls.predictions.decoder": Colwise(gather_output=True),
}


def build() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        intermediate_size=FFN, max_position_embeddings=16, type_vocab_size=2, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, pad_token_id=0, attn_implementation="eager")
    return BertForMaskedLM(config)


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(FIRST_ID, VOCAB, (BATCH, SEQ), generator=g)
    masked = torch.rand(BATCH, SEQ, generator=g).argsort(dim=1)[:, :N_MASK]  # N_MASK distinct positions per row
    labels = torch.full_like(ids, -100)
    labels.scatter_(1, masked, ids.gather(1, masked))
    inputs = ids.scatter(1, masked, MASK_ID)
    split = torch.randint(2, SEQ - 2, (BATCH, 1), generator=g)
    token_type_ids = (torch.arange(SEQ).unsqueeze(0) >= split).long()
    return {"input_ids": inputs, "token_type_ids": token_type_ids,
            "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long), "labels": labels}


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss
