"""A validation loop on `sw.parallelize`'s model, as a torch script writes it: ``model.eval(); with torch.no_grad():
loss = model(x, y)`` runs `HybridModel.evaluate` (the forward-only schedule computing each microbatch's loss at the
last stage) and trains nothing.

* A MoE GPT (its balance loss per microbatch) on dp2, pp2 x dp2 (ZeRO-3), cp2 x pp2 and tp2 x pp2: the loss equals the
  loss `step` returns on the same batch, no gradient is created, and an evaluation between two accumulated steps
  leaves their gradients what the two steps alone give.
* A HuggingFace Llama on pp2 with padded rows (HuggingFace's loss over the batch's labels): the loss equals
  ``model(**inputs, labels=labels).loss`` of one process under no_grad.
* `sw.pipeline.Pipeline` built by hand: its forward under no_grad is `evaluate` too."""

from __future__ import annotations

import copy

import pytest
import torch

import shardwise as sw
from shardwise import pipeline as pp
from shardwise.models import GPT, GPTConfig
from shardwise.models.gpt import lm_loss

MOE = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=4, experts_per_token=2,
                    moe_aux_loss_coef=0.01), seed=0)


def batch(seed):
    return torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("axes,options", [
    ({"dp": 2}, {}),
    ({"pp": 2, "dp": 2}, {"dp_strategy": "zero3"}),
    ({"cp": 2, "pp": 2}, {}),
    ({"tp": 2, "pp": 2}, {"tp_plan": "gpt"}),
], ids=["dp2", "pp2_dp2_zero3", "cp2_pp2", "tp2_pp2"])
def test_model_under_no_grad_evaluates_the_steps_loss_and_trains_nothing(axes, options):
    def body(comm):
        mesh = sw.Mesh(comm, **axes)
        dp, index = mesh.sizes["dp"], mesh.coords.dp

        def rows(seed):
            return batch(seed)[index * 8 // dp:(index + 1) * 8 // dp]

        plain, interrupted = (sw.parallelize(copy.deepcopy(MOE), mesh, **options).eval() for _ in range(2))
        with torch.no_grad():
            evaluated = interrupted(rows(1), rows(1))
        untouched = all(p.grad is None for p in interrupted.parameters())
        stepped = interrupted.step(rows(1), rows(1), loss_scale=0.5)  # the same batch, trained: the same loss
        plain.step(rows(1), rows(1), loss_scale=0.5)
        with torch.no_grad():
            interrupted(rows(2), rows(2))  # between two accumulated steps
        interrupted.step(rows(3), rows(3), loss_scale=0.5)
        plain.step(rows(3), rows(3), loss_scale=0.5)
        same = all(torch.equal(sw.sharded_tensor.local(a.grad), sw.sharded_tensor.local(b.grad))
                   for a, b in zip(plain.parameters(), interrupted.parameters()) if a.grad is not None)
        return float(evaluated), float(stepped), untouched, same

    for evaluated, stepped, untouched, same in sw.launch(body, 2 * max(len(axes), 1)):
        assert evaluated == stepped and untouched and same


def test_a_huggingface_llama_on_pp2_evaluates_huggingfaces_loss_of_the_batch():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="eager"))
    ids = batch(4)[:4]
    mask = torch.ones_like(ids)
    mask[0, 11:], mask[1, :3] = 0, 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 3] = -100
    with torch.no_grad():
        want = float(model(input_ids=ids, attention_mask=mask, labels=labels).loss)

    def body(comm):
        hybrid = sw.parallelize(copy.deepcopy(model), sw.Mesh(comm, pp=2), n_microbatches=4).eval()
        with torch.no_grad():
            return float(hybrid({"input_ids": ids, "attention_mask": mask}, labels))

    for loss in sw.launch(body, 2):
        assert loss == pytest.approx(want, rel=1e-6)


def test_the_model_called_for_its_logits_under_no_grad_names_predict_on_every_rank():
    def body(comm):
        hybrid = sw.parallelize(copy.deepcopy(MOE), sw.Mesh(comm, pp=2)).eval()
        with torch.no_grad(), pytest.raises(ValueError, match=r"model\.predict\(inputs\)"):
            hybrid(batch(6))
        return float(hybrid.predict(batch(6)).abs().sum()) > 0

    assert all(sw.launch(body, 2))


def test_a_pipeline_built_by_hand_evaluates_under_no_grad():
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2), seed=0)
    x = batch(5)
    with torch.no_grad():
        want = float(lm_loss(model(x), x))

    def body(comm):
        stages = pp.partition(copy.deepcopy(model).pipeline_layers(), comm.size)
        pipe = pp.Pipeline(stages, comm, "1f1b", n_microbatches=2, loss_fn=lm_loss)
        with torch.no_grad():
            loss = pipe(x, x)
        return float(loss), all(p.grad is None for p in pipe.parameters())

    for loss, untouched in sw.launch(body, 2):
        assert loss == pytest.approx(want, rel=1e-6) and untouched
