"""Expert parallelism on HuggingFace MoE models (shardwise.experts.hf), on thread ranks: equal to one process.

Two models: Mixtral (fused (E, ...) expert tensors, top-2 routing, its load-balancing loss on) and Switch
Transformers (one module per expert, top-1 routing, router z-loss and auxiliary loss on), whose routing is steered
(tests/families/moe_per_expert.py) so that experts 3..7 of both sparse layers get no token in any step and the two
halves of the batch use different experts: experts with grad None in one process, and experts only some
expert-data-parallel replicas see. Each rank trains on its rows of the global batch, wrapped as
``sw.DDP(expert_parallel(model, mesh), mesh.dp_cp)``; the reference is the same model trained in one process on the
whole batch: 3 AdamW steps with weight decay, a binding `sw.clip_grad_norm_`, the first step's gradients gathered
(None where one process has None), every parameter, the optimizer state and the losses.
"""

from __future__ import annotations

import threading

import pytest
import torch
from families import moe_per_expert as switch
from parity import value_error_text

import shardwise as sw
from shardwise import layout
from shardwise.experts import expert_parallel
from shardwise.sharded_tensor import local
from shardwise.whole.gather import gather_full

STEPS, GLOBAL_BATCH, RTOL, ATOL = 3, 8, 1e-5, 1e-6
MIXTRAL_NORM, SWITCH_NORM = 0.5, 0.5
_BUILD = threading.Lock()  # HuggingFace initialises from torch's global RNG, which thread ranks share


def mixtral(experts=4, jitter=0.0, seed=0):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                           num_local_experts=experts, num_experts_per_tok=2, router_jitter_noise=jitter,
                           output_router_logits=True, router_aux_loss_coef=0.05, attention_dropout=0.0,
                           sliding_window=None, tie_word_embeddings=False, pad_token_id=None, bos_token_id=0,
                           eos_token_id=1, attn_implementation="eager", experts_implementation="eager")
    with _BUILD:
        torch.manual_seed(seed)
        return MixtralForCausalLM(config)


def mixtral_batch(step, rank=0, world=1):
    g = torch.Generator().manual_seed(4000 + step)
    ids = torch.randint(0, 64, (GLOBAL_BATCH, 12), generator=g)[rank * GLOBAL_BATCH // world:
                                                                  (rank + 1) * GLOBAL_BATCH // world]
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def switch_model(seed=0):
    with _BUILD:
        torch.manual_seed(seed)
        model = switch.build()
    model.router_aux_loss_coef, model.router_z_loss_coef = 0.01, 0.001  # both router losses in the loss
    return model


def switch_batch(step, rank=0, world=1):
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return {**{k: v[rows] for k, v in switch.batch(step).items()}, "output_router_logits": True}


MODELS = {"mixtral": (mixtral, mixtral_batch, MIXTRAL_NORM), "switch": (switch_model, switch_batch, SWITCH_NORM)}


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5, weight_decay=0.1)


def gathered_grads(model):
    """Every gradient as one process's tensor (collective), None where the parameter has none."""
    return {name: None if pl.param.grad is None else gather_full(pl, pl.param.grad).clone()
            for name, pl in layout.placements(model).items()}


def train(model, step_batch, clip, max_norm):
    """STEPS steps: (first step's gradients, norms, losses, names with grad None at each step, optimizer)."""
    opt, grads, norms, losses, missing = optimizer(model), None, [], [], []
    for step in range(STEPS):
        out = model(**step_batch(step))
        out.loss.backward()
        missing.append(sorted(n for n, p in model.named_parameters() if p.grad is None))
        if grads is None:
            grads = gathered_grads(model)
        norms.append(float(clip(model, max_norm)))
        losses.append(float(out.loss.detach()))
        opt.step()
        opt.zero_grad()
    return grads, norms, losses, missing, opt


def one_process(kind):
    build, step_batch, max_norm = MODELS[kind]
    model = build()
    grads, norms, losses, missing, opt = train(
        model, step_batch, lambda m, n: torch.nn.utils.clip_grad_norm_(m.parameters(), n), max_norm)
    assert min(norms) > max_norm  # the clipping binds
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, grads, norms, losses, missing, opt.state_dict()


@pytest.fixture(scope="module")
def reference():
    return {kind: one_process(kind) for kind in MODELS}


def run_ep(comm, kind, ep, strategy="ddp"):
    build, step_batch, max_norm = MODELS[kind]
    mesh = sw.Mesh(comm, ep=ep)
    model = expert_parallel(build(), mesh)
    if strategy == "ddp":  # Switch: experts no rank used keep None, which DDP over edp must be told to expect
        model = sw.DDP(model, mesh.dp_cp, find_unused_parameters=kind == "switch")
    else:  # dense parameters sharded over dp, expert weights over edp (sharding/expert_units.py)
        model = sw.ZeRO(model, mesh.dp_cp, stage=3)
    grads, norms, losses, missing, opt = train(
        model, lambda step: step_batch(step, mesh.coords.dp, mesh.dp.size), sw.clip_grad_norm_, max_norm)
    sw.check_replicas(model)
    return (sw.full_state_dict(model), grads, norms, losses, missing, sw.full_optimizer_state_dict(model, opt))


def assert_close(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        if want[name] is None:
            assert got[name] is None, f"{name}: a gradient where one process has None"
            continue
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind, world, ep, strategy", [
    ("mixtral", 2, 2, "ddp"), ("mixtral", 4, 2, "ddp"), ("switch", 2, 2, "ddp"), ("switch", 4, 2, "ddp"),
    ("mixtral", 4, 2, "zero3"), ("switch", 4, 2, "zero3")],
    ids=["mixtral-ep2", "mixtral-ep2-dp4", "switch-ep2", "switch-ep2-dp4", "mixtral-ep2-dp4-zero3",
         "switch-ep2-dp4-zero3"])
def test_three_adamw_steps_equal_one_process(kind, world, ep, strategy, reference):
    want_state, want_grads, want_norms, want_losses, want_missing, want_opt = reference[kind]
    results = sw.launch(run_ep, world, kind, ep, strategy)
    for rank, (state, grads, norms, losses, missing, opt) in enumerate(results):
        assert_close(grads, want_grads)
        assert norms == pytest.approx(want_norms, rel=1e-5)
        assert missing == want_missing, f"rank {rank}: grad None on other parameters than in one process"
        assert_close(state, want_state)
        assert sorted(opt["state"]) == sorted(want_opt["state"])  # no state where one process has none
        for index, entry in want_opt["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(opt["state"][index][key], value, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"optimizer state {index} {key}: {m}")


def test_the_losses_average_to_one_process(reference):
    """The ranks' losses (cross-entropy + router losses of the global batch) average to one process's."""
    for kind in MODELS:
        want = reference[kind][3]
        results = sw.launch(run_ep, 4, kind, 2)
        for step in range(STEPS):
            mean = sum(r[3][step] for r in results) / len(results)
            assert mean == pytest.approx(want[step], rel=1e-5), (kind, step)


def test_switch_routing_leaves_experts_without_tokens(reference):
    """What the Switch cases exercise really happens: experts 3..7 of each sparse layer get no token at any step (one
    process's grad None), and the two halves of the batch (the two ep groups of dp = 4) route to different experts,
    so expert 1 has tokens on one edp replica only and expert 2 on the other."""
    missing = reference["switch"][4]
    for step in range(STEPS):
        for layer in switch.SPARSE_LAYERS:
            for e in range(switch.EXPERTS):
                name = f"{layer}.experts.expert_{e}.wi.weight"
                assert (name in missing[step]) == (e >= 3), (step, name)
    model = switch_model()
    halves = [switch.expert_usage(model, {k: v[rows] for k, v in switch_batch(0).items()
                                          if k != "output_router_logits"})
              for rows in (slice(0, 4), slice(4, 8))]
    for layer in switch.SPARSE_LAYERS:
        assert halves[0][layer] == {0, 1} and halves[1][layer] == {0, 2}


class _Container(torch.nn.Module):
    """A user's module around a HuggingFace model: expert_parallel finds the Mixtral inside."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, **batch):
        return self.inner(**batch)


def test_mixtral_load_balancing_loss_is_the_global_batch_one():
    """HuggingFace computes the loss over the rows it sees; under expert parallel every rank gets the global batch's
    value (also for a Mixtral inside the user's module), which differs from what each rank's rows alone give."""
    plain = mixtral()
    with torch.no_grad():
        want = float(plain(**mixtral_batch(0)).aux_loss)
        alone = [float(plain(**mixtral_batch(0, r, 4)).aux_loss) for r in range(4)]
    assert all(abs(a - want) > 1e-4 for a in alone)

    def body(comm):
        mesh = sw.Mesh(comm, ep=2)
        got = []
        for model in (mixtral(), _Container(mixtral())):
            model = sw.DDP(expert_parallel(model, mesh), mesh.dp_cp)
            with torch.no_grad():
                got.append(float(model(**mixtral_batch(0, comm.rank, comm.size)).aux_loss))
        return got

    for got in sw.launch(body, 4):
        assert got == pytest.approx([want, want], rel=1e-6)


@pytest.mark.parametrize("strategy, world", [("ddp", 2), ("zero3", 2), ("fsdp", 2),
                                             ({"tp": 2, "tp_plan": "llama", "dp_strategy": "zero3"}, 4)],
                         ids=["ddp", "zero3", "fsdp", "tp2-zero3-dp2"])
def test_mixtral_load_balancing_loss_under_plain_data_parallel_is_the_global_batch_one(strategy, world):
    """Without expert parallel, every data-parallel wrapper makes the loss the global batch's too
    (batch_split.share_batch_split): before, each rank computed Mixtral's product of batch means on its own rows and
    the gradients differed from one process (embed_tokens 0.013678 against 0.013862 at step 0)."""
    report = sw.check(lambda: mixtral(), lambda step: mixtral_batch(step), strategy=strategy, world_size=world,
                      steps=2, rtol=1e-4, atol=1e-5,
                      optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-5))
    assert report.ok, str(report)


def padded_mixtral_batch(step, per_call):
    """A global batch with padding (an attention mask, equal per rank: the cross-entropy stays a mean over rows of
    equal weight) and, with `per_call`, the router logits asked for in the call rather than the config."""
    batch = mixtral_batch(step)
    mask = torch.ones_like(batch["input_ids"])
    mask[::2, 8:] = 0
    batch.update(attention_mask=mask, labels=batch["labels"].masked_fill(mask == 0, -100))
    return {**batch, "output_router_logits": True} if per_call else batch


def mixtral_logits_per_call():
    model = mixtral()
    model.config.output_router_logits = False
    return model


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("per_call", [False, True], ids=["mask", "logits-per-call"])
def test_mixtral_load_balancing_loss_reads_the_call_s_own_arguments(strategy, per_call):
    """The global loss reads the attention mask and output_router_logits of the call by the model's own argument
    names, beneath a wrapper whose forward takes *args, **kwargs (DDP's): before, both hid in **kwargs, so the global
    loss ignored the padding, or was not computed when the logits were asked for per call (embed_tokens gradients
    0.001476 against 0.001224 and -0.021670 against -0.021851 in one process under ddp)."""
    report = sw.check(mixtral_logits_per_call if per_call else mixtral,
                      lambda step: padded_mixtral_batch(step, per_call), strategy=strategy, world_size=2, steps=2,
                      rtol=1e-4, atol=1e-5,
                      optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-5))
    assert report.ok, str(report)


def own_loss_granite_moe(config):
    """A causal LM whose forward is its own around Granite-MoE's: its load-balancing loss is computed in code
    experts.hf_kinds cannot read (a subclass's), so it cannot be made the global batch's."""
    from transformers import GraniteMoeForCausalLM

    class OwnLossGraniteMoe(GraniteMoeForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, labels=None, output_router_logits=None, **kwargs):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                                   output_router_logits=output_router_logits, **kwargs)

    return OwnLossGraniteMoe(config)


def _granite_config(logits: bool):
    from transformers import GraniteMoeConfig

    return GraniteMoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                            router_aux_loss_coef=0.01, output_router_logits=logits)


def test_a_load_balancing_loss_that_cannot_be_made_global_is_refused_under_data_parallel():
    """A model that adds its load-balancing loss in a way of its own: with output_router_logits on, each
    data-parallel rank would compute it on its own rows (silently, before); refused by name before the wrapper
    changes the model. With the logits off (its config's default) it wraps and trains, and a call that turns them on
    raises."""

    def own(logits):
        with _BUILD:
            torch.manual_seed(0)
            return own_loss_granite_moe(_granite_config(logits))

    def body(comm):
        model = own(True)
        for wrap in (lambda m: sw.DDP(m, comm), lambda m: sw.ZeRO(m, comm, stage=3), lambda m: sw.FSDP(m, comm)):
            with pytest.raises(ValueError, match=r"over 2 ranks: OwnLossGraniteMoe has router_aux_loss_coef=0.01 "
                                                 r"with output_router_logits on"):
                wrap(model)
            assert type(model).__name__ == "OwnLossGraniteMoe"  # refused before anything changed
        quiet = sw.DDP(own(False), comm)
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(comm.rank))
        quiet(ids, labels=ids).loss.backward()  # logits off: no load-balancing loss, one process's gradients
        with pytest.raises(ValueError, match=r"DDP over 2 ranks: .*OwnLossGraniteMoe has router_aux_loss_coef=0.01 "
                                             r"and this call turns output_router_logits on"):
            quiet(ids, labels=ids, output_router_logits=True)  # turned on per call: refused before computing
        quiet.config.output_router_logits = True
        with pytest.raises(ValueError, match="this call turns output_router_logits on"):
            quiet(ids, labels=ids)  # or in the config after wrapping
        return [s.name for s in sw.layout.strategies(quiet)]

    assert sw.launch(body, 2) == [["ddp"]] * 2


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_granite_moes_load_balancing_loss_is_the_global_batchs_under_data_parallel(strategy):
    """Granite-MoE's forward adds Mixtral's load-balancing loss to a loss of scaled logits (experts.hf_kinds): made the
    global batch's as Mixtral's is (before: refused, as the model above)."""
    from transformers import GraniteMoeForCausalLM

    config = _granite_config(True)
    batch = lambda step: padded_mixtral_batch(step, False)  # noqa: E731
    report = sw.check(lambda: GraniteMoeForCausalLM(config), batch, strategy=strategy, world_size=2, steps=2,
                      rtol=1e-4, atol=1e-5,
                      optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-5))
    assert report.ok, str(report)


def test_ddp_without_find_unused_parameters_names_the_unused_experts():
    """Over edp > 1, experts no rank routed to keep grad None (as in one process), which plain DDP refuses at the
    first backward, naming them and find_unused_parameters, as it does on the model without expert parallel."""
    def body(comm):
        mesh = sw.Mesh(comm, ep=2)
        model = sw.DDP(expert_parallel(switch_model(), mesh), mesh.dp_cp)
        with pytest.raises(RuntimeError, match="expert_3.*find_unused_parameters=True"):
            model(**switch_batch(0, comm.rank, comm.size)).loss.backward()

    sw.launch(body, 4)


@pytest.mark.parametrize("kind", list(MODELS))
def test_experts_are_split_and_state_round_trips(kind, tmp_path):
    """ep = 2: each rank holds its experts only (parameters still answer for the whole shapes); sw.full_state_dict
    equals one process's; a one-process state dict loads through torch's load_state_dict; after a step, a checkpoint
    saved under ep = 2 (with the AdamW state, none for Switch's unused experts) reloads in one process bit for bit."""
    build, step_batch, _ = MODELS[kind]
    want = build(seed=0).state_dict()
    other = {k: v.clone() for k, v in build(seed=1).state_dict().items()}

    def body(comm):
        model = expert_parallel(build(seed=0), comm)
        held = {n: local(p).numel() for n, p in model.named_parameters()}
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        first = sw.full_state_dict(model)
        model.load_state_dict(other)
        second = sw.full_state_dict(model)
        model = sw.DDP(model, comm, find_unused_parameters=kind == "switch")
        opt = optimizer(model)
        model(**step_batch(0, comm.rank, comm.size)).loss.backward()
        opt.step()
        sw.save_checkpoint(tmp_path / kind, model, opt, step=1)
        return held, shapes, first, second, sw.full_state_dict(model), sw.full_optimizer_state_dict(model, opt)

    results = sw.launch(body, 2)
    plain = build(seed=2)
    opt = optimizer(plain)
    sw.load_checkpoint(tmp_path / kind, plain, opt)
    dense = {n: tuple(p.shape) for n, p in build(seed=0).named_parameters()}
    for held, shapes, first, second, stepped, opt_state in results:
        assert shapes == dense
        for name in want:
            assert torch.equal(first[name], want[name]) and torch.equal(second[name], other[name]), name
        for name, value in plain.state_dict().items():
            assert torch.equal(value, stepped[name]), name
        loaded = opt.state_dict()["state"]
        assert sorted(loaded) == sorted(opt_state["state"])
        for index, entry in opt_state["state"].items():
            for key, value in entry.items():
                assert torch.equal(torch.as_tensor(loaded[index][key]), torch.as_tensor(value)), (index, key)
    for name in (n for n in dense if ".experts." in n):  # every expert element is held by exactly one rank of ep
        counts = sorted(r[0][name] for r in results)
        assert sum(counts) == torch.Size(dense[name]).numel(), name
        assert kind == "mixtral" or counts[0] == 0, name  # a Switch expert module lives on one rank only


def test_bad_configurations_raise_at_wrap_on_every_rank():
    def body(comm):
        mesh = sw.Mesh(comm, ep=4)
        return {
            "divisible": value_error_text(lambda: expert_parallel(mixtral(experts=6), mesh)),
            "jitter": value_error_text(lambda: expert_parallel(mixtral(jitter=0.1), mesh)),
            "capacity": value_error_text(lambda: expert_parallel(mixtral(), mesh, capacity_factor=1.25)),
            "wrapped": value_error_text(lambda: expert_parallel(sw.DDP(mixtral(), comm), mesh)),
        }

    for errors in sw.launch(body, 4):
        assert "n_experts=6" in errors["divisible"] and "ep=4" in errors["divisible"]
        assert "jitter" in errors["jitter"] and "0.1" in errors["jitter"]
        assert "capacity_factor=1.25" in errors["capacity"]
        assert "already wrapped" in errors["wrapped"]


def test_an_unsupported_huggingface_experts_module_is_named():
    """Experts whose transformers flags select another formula (a norm after each expert) are refused by name."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                            num_experts_per_tok=2)
    with _BUILD:
        model = Qwen3MoeForCausalLM(config)
    model.model.layers[0].mlp.experts.has_post_expert_norm = True

    def body(comm):
        return value_error_text(lambda: expert_parallel(model, comm))

    for error in sw.launch(body, 2):
        assert "Qwen3MoeExperts" in error and "has_post_expert_norm=True" in error
