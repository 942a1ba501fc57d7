"""Plans: the built-in Llama plan on a small model with HuggingFace's module names, dict plans, and plan errors.

The Llama here mirrors HuggingFace's LlamaForCausalLM structure and names (model.embed_tokens, model.layers.N.
self_attn.{q,k,v,o}_proj with grouped-query attention, mlp.{gate,up,down}_proj, RMSNorms, model.norm, lm_head,
optional tie_word_embeddings). Its attention reshapes with its num_heads / num_key_value_heads / hidden_size
attributes, as HuggingFace did before 4.48, so the plan's adjustment of those attributes is exercised too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity import ATOL, RTOL
from torch import nn

import shardwise as sw
from shardwise import tensor_parallel as tp
from shardwise.models import GPT, GPTConfig
from shardwise.sharded_tensor import local

VOCAB, D, HEADS, KV_HEADS, FF, LAYERS, T = 64, 32, 4, 2, 48, 2, 16


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class LlamaAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim, self.hidden_size = HEADS, KV_HEADS, D // HEADS, D
        self.q_proj = nn.Linear(D, HEADS * self.head_dim, bias=False)
        self.k_proj = nn.Linear(D, KV_HEADS * self.head_dim, bias=False)
        self.v_proj = nn.Linear(D, KV_HEADS * self.head_dim, bias=False)
        self.o_proj = nn.Linear(HEADS * self.head_dim, D, bias=False)

    def forward(self, x):
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        groups = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, L, self.hidden_size))


class LlamaMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(D, FF, bias=False)
        self.up_proj = nn.Linear(D, FF, bias=False)
        self.down_proj = nn.Linear(FF, D, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(D), LlamaAttention()
        self.post_attention_layernorm, self.mlp = RMSNorm(D), LlamaMLP()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D, padding_idx=0)
        self.layers = nn.ModuleList(LlamaDecoderLayer() for _ in range(LAYERS))
        self.norm = RMSNorm(D)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, tie_word_embeddings=False):
        super().__init__()
        self.model = LlamaModel()
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        if tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if not name.endswith("norm.weight") and not name.endswith("layernorm.weight"):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)

    def forward(self, ids, labels=None):
        logits = self.lm_head(self.model(ids))
        if labels is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def data(step):
    ids = torch.randint(0, VOCAB, (4, T + 1), generator=torch.Generator().manual_seed(step))
    return ids[:, :-1], ids[:, 1:]


def train(model, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)  # eps: see test_tensor_parallel_gpt.py
    for step in range(steps):
        model(*data(step)).backward()
        opt.step()
        opt.zero_grad()
    return model


def train_llama_tp(comm, tie):
    model = tp.parallelize(LlamaForCausalLM(tie), comm, "llama")
    attn = model.model.layers[0].self_attn
    shapes = {"num_heads": attn.num_heads, "num_key_value_heads": attn.num_key_value_heads,
              "q_proj": tuple(local(attn.q_proj.weight).shape), "k_proj": tuple(local(attn.k_proj.weight).shape),
              "tied": model.lm_head.weight is model.model.embed_tokens.weight}
    train(model)
    return tp.full_state_dict(model), shapes


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_llama_plan_trains_like_one_process(tie):
    want = train(LlamaForCausalLM(tie)).state_dict()
    for state, shapes in sw.launch(train_llama_tp, 2, tie):
        assert list(state) == list(want)
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
        hd = D // HEADS
        assert shapes == {"num_heads": HEADS // 2, "num_key_value_heads": KV_HEADS // 2, "q_proj": (HEADS * hd // 2, D),
                          "k_proj": (KV_HEADS * hd // 2, D), "tied": tie}


def test_llama_plan_errors():
    def body(comm):
        with pytest.raises(ValueError, match=r"tp size 4 does not divide the number of key/value heads .*=2"):
            tp.parallelize(LlamaForCausalLM(), comm, "llama")

    sw.launch(body, 4)


def test_llama_plan_without_a_head_and_with_heads_from_config():
    """A bare LlamaModel has no lm_head (the plan omits it); head counts may come from a config object."""

    def body(comm):
        model = LlamaModel()
        for layer in model.layers:  # newer HuggingFace: the counts live in the config only
            del layer.self_attn.head_dim, layer.self_attn.num_heads, layer.self_attn.num_key_value_heads
            layer.self_attn.config = type("Config", (), {"num_attention_heads": 6, "num_key_value_heads": 6})()
        with pytest.raises(ValueError, match=r"divide the number of attention heads .*num_attention_heads\)=6"):
            tp.parallelize(model, comm, "llama")

    sw.launch(body, 4)
    model = tp.parallelize(LlamaModel(), sw.init(), "llama")
    assert isinstance(model.embed_tokens, tp.VocabParallelEmbedding)


# ---- modules with a forward of their own ----------------------------------------------------------------------------
class ScaledEmbedding(nn.Embedding):
    """As transformers' GemmaTextScaledWordEmbedding: an nn.Embedding whose forward scales its output."""

    def forward(self, ids):
        return super().forward(ids) * D**0.5


class ScaledLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 0.5


def _gemma_like(tie):
    model = LlamaForCausalLM(tie)
    scaled = ScaledEmbedding(VOCAB, D, padding_idx=0)
    scaled.weight = model.model.embed_tokens.weight  # the same values (and the tie, if any)
    model.model.embed_tokens = scaled
    return model


def train_gemma_like_tp(comm, tie):
    model = tp.parallelize(_gemma_like(tie), comm, "llama")
    kinds = (type(model.model.embed_tokens).__name__, type(model.lm_head).__name__)
    train(model)
    return tp.full_state_dict(model), kinds


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_llama_plan_keeps_an_embedding_with_its_own_forward_whole(tie):
    """Gemma's embedding scales its output: a vocabulary-parallel embedding would not, a different model without an
    error (the plan split it until this test). The plan keeps it whole, and a head tied to it; the rest is split."""
    want = train(_gemma_like(tie)).state_dict()
    for state, kinds in sw.launch(train_gemma_like_tp, 2, tie):
        assert kinds == ("ScaledEmbedding", "Linear" if tie else "ColumnParallelLinear")
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_a_plan_that_splits_a_module_with_its_own_forward_is_refused():
    def body(comm):
        with pytest.raises(ValueError, match=r"'model.embed_tokens' is a ScaledEmbedding, an nn.Embedding with a "
                                             r"forward of its own.*leave 'model.embed_tokens' out of the plan"):
            tp.parallelize(_gemma_like(False), comm, {"embed_tokens": "vocab"})
        model = LlamaForCausalLM()
        dense, model.lm_head = model.lm_head, ScaledLinear(D, VOCAB, bias=False)
        model.lm_head.weight = dense.weight  # the same values on every rank
        with pytest.raises(ValueError, match=r"'lm_head' is a ScaledLinear, an nn.Linear with a forward of its own"):
            tp.parallelize(model, comm, {"lm_head": "colwise"})

    sw.launch(body, 2)


@pytest.mark.parametrize("kind", ["Gemma", "Qwen3", "Glm4", "Apertus", "Starcoder2"])
def test_huggingface_decoders_that_once_trained_wrong_under_the_llama_plan_train_like_one_process(kind):
    """Gemma: its embedding scales its output (kept whole, see above). Qwen3: it normalizes each head of q and k
    (q_norm / k_norm, a weight of head_dim), so a rank holding half the heads computes their part of those norms'
    gradients; the plan makes them "heads" regions, summed over the group (before, each rank trained on its part).
    GLM-4: its MLP is one fused gate_up_proj Linear ([gate | up]), split as two column blocks (before, down_proj was
    split and gate_up_proj not: a shape error at the first forward). Apertus: its MLP activation (xIELU) has two
    learned scalars applied to every hidden feature, of which a rank holds half: their gradients were each rank's
    part (alpha_p's -0.0006 against -0.0020 in one process); now a "heads" region, summed over the group.
    StarCoder2: its MLP is c_fc -> activation -> c_proj with biases (before: refused, no gate/up/down_proj)."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=D // HEADS, intermediate_size=FF, max_position_embeddings=T,
        **({"pad_token_id": 0} if kind == "Glm4" else {}))  # its default pad id lies beyond this vocabulary

    def batch(step):
        ids = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(step))
        return {"input_ids": ids, "labels": ids}

    # Adam's eps 1e-5 (the check's default is 1e-6): on a gradient element near zero its update magnifies the
    # rounding of the split matmuls, which differs between CPUs (embed_tokens 1.2e-6 off on one, against atol 1e-6).
    report = sw.check(lambda: getattr(transformers, f"{kind}ForCausalLM")(config), batch, strategy="tp:llama",
                      world_size=2, steps=2, rtol=RTOL, atol=ATOL,
                      optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-5))
    assert report.ok, str(report)


@pytest.mark.parametrize("norm", ["one_per_head", "own_parameter"])
def test_an_attention_module_the_plan_cannot_split_by_heads_is_refused(norm):
    """Inside an attention, a list of one norm per head (StableLM's: a rank would apply the first heads' norms to its
    own heads) or a parameter of the attention itself that is not one row per head (one per head_dim feature here)
    cannot run on a rank's heads: refused by name. One row per head is split with the heads (GPT-OSS's sinks: the
    test below); a norm over the projection's whole width is split with it (OLMo 2's: the tests after)."""
    model = LlamaForCausalLM()
    attn = model.model.layers[0].self_attn
    if norm == "one_per_head":
        attn.q_layernorm = nn.ModuleList(nn.LayerNorm(D // HEADS) for _ in range(HEADS))
        match = r"self_attn.q_layernorm \(ModuleList\) has parameters and runs on the heads of .*neither a per-head"
    else:
        attn.scales = nn.Parameter(torch.zeros(D // HEADS))
        match = (rf"self_attn.scales \({D // HEADS},\) is a parameter of the attention model.layers.0.self_attn "
                 rf"\(LlamaAttention\).*not one row per query head \({HEADS}\)")
    with pytest.raises(ValueError, match=r"tensor parallel plan 'llama': model.layers.0." + match):
        tp.parallelize(model, sw.init(), "llama")


class _ScaledActivation(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.scale = nn.Parameter(torch.full(shape, 1.5))

    def forward(self, x):
        return F.silu(x) * self.scale


@pytest.mark.parametrize("where", ["activation_per_feature", "another_child", "own_parameter"])
def test_a_parameter_in_a_split_mlp_the_plan_cannot_place_is_refused(where):
    """Inside an MLP whose projections the plan splits, only the activation's scalars have a known relation to the
    split features (summed over the group, as Apertus's xIELU); a per-feature activation weight, another child with
    parameters (it may run on the split features or on the whole input) or a parameter of the MLP itself: refused by
    name, where before they trained on each rank's part, silently."""
    model = LlamaForCausalLM()
    mlp = model.model.layers[0].mlp
    if where == "activation_per_feature":
        mlp.act_fn = _ScaledActivation((FF,))
        match = r"mlp.act_fn in the MLP .* \(_ScaledActivation\) has parameters that are not the activation's scalars"
    elif where == "another_child":
        mlp.norm = RMSNorm(FF)
        match = r"mlp.norm in the MLP .* \(RMSNorm\) has parameters that are not the activation's scalars"
    else:
        mlp.bias = nn.Parameter(torch.zeros(FF))
        match = rf"mlp.bias in the MLP .* is a parameter of the MLP itself \({FF},\)"
    with pytest.raises(ValueError, match=r"tensor parallel plan 'llama': model.layers.0." + match):
        tp.parallelize(model, sw.init(), "llama")


def test_an_activation_with_scalar_parameters_trains_like_one_process():
    """A learned scalar in the activation between the split projections (as Apertus's xIELU): its gradient is
    summed over tp, so two AdamW steps with weight decay equal one process's."""
    def build():
        model = LlamaForCausalLM()
        for layer in model.model.layers:
            layer.mlp.act_fn = _ScaledActivation(())
        return model

    report = sw.check(build, data, strategy="tp:llama", world_size=2, steps=2, rtol=RTOL, atol=ATOL,
                      optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-5))
    assert report.ok, str(report)


@pytest.mark.parametrize("strategy, world", [("tp:llama", 2), ({"tp": 2, "tp_plan": "llama", "ep": 2}, 4)],
                         ids=["tp2", "tp2-ep2"])
def test_gpt_oss_sinks_are_split_with_the_heads(strategy, world):
    """GPT-OSS's attention sinks (one logit per head) are "head_rows": each rank keeps its heads' rows, which the
    attention's own forward reads as a plain tensor (it reshapes them); before, the plan refused GPT-OSS. With its
    experts over ep too; full state dicts and a one-process state dict round trip through the split."""
    pytest.importorskip("transformers")
    from hf_cases import gpt_oss

    def batch(step):
        ids = torch.randint(1, 64, (4, 16), generator=torch.Generator().manual_seed(step))
        return {"input_ids": ids, "labels": ids}

    report = sw.check(gpt_oss, batch, strategy=strategy, world_size=world, steps=2,
                      optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, eps=1e-5))
    assert report.ok, str(report)
    dense = gpt_oss().state_dict()
    shifted = {k: v + 0.01 for k, v in dense.items()}

    def body(comm):
        model = tp.parallelize(gpt_oss(), comm, "llama")
        held = tuple(local(model.model.layers[0].self_attn.sinks).shape)
        first = tp.full_state_dict(model)
        model.load_state_dict(shifted)
        return held, first, sw.full_state_dict(model)

    for held, first, second in sw.launch(body, 2):
        assert held == (2,)  # 4 heads over 2 ranks
        assert all(torch.equal(first[k], dense[k]) and torch.equal(second[k], shifted[k]) for k in dense)


# ---- dict plans ---------------------------------------------------------------------------------------------------
CONFIG = GPTConfig.preset("tiny")


def test_dict_plan_replaces_matched_modules_and_hooks_sequence_parameters():
    def body(comm):
        plan = {"blocks.*.attn.qkv": tp.Colwise(fused=3), "blocks.*.attn.proj": "rowwise", "ln1": "sequence"}
        model = tp.parallelize(GPT(CONFIG, seed=0), comm, plan, sequence_parallel=True)
        kinds = {name: type(m).__name__ for name, m in model.named_modules() if name.startswith("blocks.1.")}
        hooked = {name for name, p in model.named_parameters() if tp.is_sequence_parallel_param(p)}
        return kinds, hooked, type(model).__name__

    kinds, hooked, cls = sw.launch(body, 2)[0]
    assert kinds["blocks.1.attn.qkv"] == "ColumnParallelLinear" and kinds["blocks.1.attn.proj"] == "RowParallelLinear"
    assert kinds["blocks.1.mlp.fc"] == "Linear"
    assert cls == "GPT"  # only plan="gpt" installs the GPT's parallel forward
    # LayerNorm parameters and the row-parallel biases run on sequence shards: their gradients are all-reduced
    assert hooked == {f"blocks.{i}.{p}" for i in range(CONFIG.n_layers)
                      for p in ("ln1.weight", "ln1.bias", "attn.proj.bias")}


def test_without_sequence_parallel_nothing_is_hooked():
    model = tp.parallelize(GPT(CONFIG, seed=0), sw.init(), "gpt")
    assert not any(tp.is_sequence_parallel_param(p) for p in model.parameters())
    # a group of one: hooks would be no-ops anyway; with 2 ranks and no SP, gradients of replicated params are
    # complete on every rank (checked by the GPT parity tests)


def test_plan_errors_are_value_errors_naming_the_problem():
    def body(comm):
        gpt = lambda: GPT(CONFIG, seed=0)  # noqa: E731
        with pytest.raises(ValueError, match=r"plan pattern 'blocks.\*.attn.qkvv' matches no module"):
            tp.parallelize(gpt(), comm, {"blocks.*.attn.qkvv": "colwise"})
        with pytest.raises(ValueError, match=r"module 'blocks.0.ln1' is a torch.nn.modules.normalization.LayerNorm, "
                                             r"not a torch.nn.Linear .* which style Colwise"):
            tp.parallelize(gpt(), comm, {"blocks.0.ln1": "colwise"})
        lora_like = gpt()
        lora_like.blocks[0].mlp.fc = type("Linear", (nn.Module,), {"__module__": "peft.tuners.lora.layer"})()
        with pytest.raises(ValueError, match=r"is a peft.tuners.lora.layer.Linear, not a torch.nn.Linear .* an "
                                             r"adapter layer \(PEFT's LoRA\) is not split"):
            tp.parallelize(lora_like, comm, {"blocks.0.mlp.fc": "colwise"})  # named alike, said apart
        with pytest.raises(ValueError, match=r"'blocks.0.mlp.fc' is matched by 'fc' .* and 'blocks.0.mlp.fc'"):
            tp.parallelize(gpt(), comm, {"fc": "colwise", "blocks.0.mlp.fc": "rowwise"})
        with pytest.raises(ValueError, match=r"plan\['fc'\]='columnwise' is not a style; allowed"):
            tp.parallelize(gpt(), comm, {"fc": "columnwise"})
        with pytest.raises(ValueError, match=r"parameter head.weight is tied to tok_emb.weight, which the plan splits"):
            tp.parallelize(gpt(), comm, {"tok_emb": "vocab"})
        with pytest.raises(ValueError, match=r"head.weight is tied to tok_emb.weight, but the plan splits them "
                                             r"differently \(columns vs rows\)"):
            tp.parallelize(gpt(), comm, {"tok_emb": "vocab", "head": "rowwise"})
        with pytest.raises(ValueError, match="plan='mixtral' is not a built-in plan; allowed \\['gpt', 'gpt2', 'hf', 'llama'\\]"):
            tp.parallelize(gpt(), comm, "mixtral")

    sw.launch(body, 2)


def test_full_state_dict_of_a_dense_model_is_a_copy():
    model = nn.Linear(3, 2)
    state = tp.full_state_dict(model)
    assert state.keys() == model.state_dict().keys()
    assert state["weight"].data_ptr() != model.weight.data_ptr()
    torch.testing.assert_close(state["weight"], model.weight.detach(), rtol=0, atol=0)


def test_sequence_parallel_with_a_dict_plan_on_a_huggingface_model_is_refused_at_wrap_time():
    """The built-in "llama" / "gpt2" plans refused it; a dict plan got through and failed at the first forward
    ("mat1 and mat2 shapes cannot be multiplied")."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def body(comm):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2))
        with pytest.raises(ValueError, match=r"sequence_parallel=True with a HuggingFace LlamaForCausalLM"):
            tp.parallelize(model, comm, {"q_proj": "colwise", "o_proj": "rowwise"}, sequence_parallel=True)

    sw.launch(body, 2)
