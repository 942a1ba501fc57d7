"""sw.check and `shardwise check`: a model under a strategy on thread ranks against one process, phase by phase.

Clean runs (the library GPT under ZeRO-3 and DDP, a HuggingFace Llama under ZeRO-2) report OK; planted bugs are
found where they are planted: a gradient scaled by 1.001 on the ranks (phase "gradient", step 0), an optimizer that
computes per-tensor norms and so sees ZeRO's shards (phase "update", step 0), a zero gradient where one process has
None; BatchNorm's per-rank statistics are diagnosed; bad inputs raise ValueError naming the value.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.check import STRATEGIES, check
from shardwise.check.example import build_gpt, gpt_batch
from shardwise.check.inputs import slice_batch
from shardwise_cli import main
from shardwise_cli.check import CHECK_PP_SCHEDULES, CHECK_STRATEGIES, CHECK_TP_PLANS

GPT_NAMES = [n for n, _ in build_gpt().named_parameters()]


@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_library_gpt_is_clean(strategy):
    report = check(build_gpt, gpt_batch, strategy=strategy, world_size=2, steps=3)
    text = str(report)
    assert report.ok and report.first_mismatch is None, text
    assert text.splitlines()[0].endswith(": OK") and "first mismatch" not in text and "DIFFERS" not in text
    assert f"{strategy} on 2 thread ranks (data parallel 2), 3 steps" in text
    assert [r.name for r in report.rows] == GPT_NAMES and all(r.ok for r in report.rows)
    assert len(report.losses) == len(report.norms) == 3
    assert all(abs(got - want) <= 1e-5 * abs(want) + 1e-6 for got, want in report.norms)
    assert all(name in text for name in GPT_NAMES)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, attention_dropout=0.0, tie_word_embeddings=True,
        pad_token_id=None, bos_token_id=0, eos_token_id=1))


def _token_batch(step):
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def test_huggingface_llama_under_zero2():
    pytest.importorskip("transformers")
    report = check(_tiny_llama, _token_batch, strategy="zero2", world_size=2, steps=2)
    assert report.ok, str(report)
    names = [r.name for r in report.rows]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # the tie, once, canonical name


def _scaled_gradient(model, comm):
    """A planted bug: one parameter's gradient is scaled by 1.001 on every rank before DDP averages it."""
    model.blocks[0].mlp.fc.weight.register_hook(lambda g: g * 1.001)
    return sw.DDP(model, comm)


def test_planted_gradient_bug_is_found_at_step_0():
    report = check(build_gpt, gpt_batch, strategy=_scaled_gradient, world_size=2, steps=2)
    assert not report.ok
    m = report.first_mismatch
    assert (m.step, m.phase, m.name) == (0, "gradient", "blocks.0.mlp.fc.weight")
    assert m.got == pytest.approx(1.001 * m.want, rel=1e-4)
    assert m == tuple(m) and len(m) == 6  # (step, phase, name, index, got, want)
    bad = [r.name for r in report.rows if not r.ok]
    assert bad == ["blocks.0.mlp.fc.weight"]
    text = str(report)
    assert "DIFFERS" in text.splitlines()[0]
    assert "first mismatch: step 0, gradient: blocks.0.mlp.fc.weight[" in text and "in one process" in text


def test_differences_at_the_scale_of_float32_rounding_are_said_to_be_so():
    """With no tolerance a correct strategy differs from one process by float32 rounding (the ranks average split
    batches); the report says every difference is at that scale and how to tell (float64). A planted 1.001 scale of
    one gradient is 1e-3 of its tensor: no such note."""
    rounding = "every difference is below 0.0001 of its tensor's largest element (largest "
    report = check(build_gpt, gpt_batch, strategy="zero3", world_size=2, steps=2, rtol=0, atol=0)
    assert not report.ok
    assert any(n.startswith(rounding) and "in a float32 model" in n and "Check the model in float64" in n
               for n in report.notes), report.notes
    planted = check(build_gpt, gpt_batch, strategy=_scaled_gradient, world_size=2, steps=2)
    assert not planted.ok and not any(n.startswith(rounding) for n in planted.notes), planted.notes


class TrustRatioSGD(torch.optim.Optimizer):
    """LARS-style SGD (You et al. 2017): each tensor's step is scaled by ||w|| / ||grad||, norms per tensor. Under
    ZeRO the optimizer holds each rank's flat shard, so the norms are the shard's: a real bug class (LAMB, LARS,
    Adafactor, Muon), planted without touching the library."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or not p.numel():
                    continue
                w, g = p.norm(), p.grad.norm()
                trust = float(w / g) if w > 0 and g > 0 else 1.0
                p.add_(p.grad, alpha=-group["lr"] * trust)


def test_per_tensor_optimizer_under_sharding_is_refused_at_its_first_norm():
    """Under ZeRO the optimizer steps each rank's piece; a piece answers for the whole tensor's shape, and an
    operation that would see only the piece (the trust ratio's `p.norm()`) raises instead of stepping on the piece's
    norm, naming torch.linalg.vector_norm, which takes the whole tensor's (test_torch_clip_and_scaler.py: LARS)."""
    with pytest.raises(Exception, match=r"norm\(\) on tok_emb.weight, a ZeRO-2 shard .*torch.linalg.vector_norm\(p\)"):
        check(build_gpt, gpt_batch, strategy="zero2", world_size=2, steps=2, optimizer=TrustRatioSGD)
    assert check(build_gpt, gpt_batch, strategy="ddp", world_size=2, steps=2, optimizer=TrustRatioSGD).ok
    assert check(build_gpt, gpt_batch, strategy="fsdp:no_shard", world_size=2, steps=2, optimizer=TrustRatioSGD).ok


class TwoBranch(nn.Module):
    """`b` takes part in the loss at step 0 only (the batch says so)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x, use_b):
        h = self.a(x)
        return (self.b(h) if use_b else h).pow(2).mean()


def _branch_batch(step):
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(step)), step == 0


def test_unused_parameter_under_ddp_find_unused():
    report = check(TwoBranch, _branch_batch, strategy="ddp:find_unused", world_size=2, steps=3)
    assert report.ok, str(report)


def test_unused_parameter_under_zero2():
    report = check(TwoBranch, _branch_batch, strategy="zero2", world_size=2, steps=3)
    assert report.ok, str(report)


def _zero_for_unused(model, comm):
    """A planted bug: after backward, a parameter no rank used gets a zero gradient instead of None."""
    model = sw.DDP(model, comm, find_unused_parameters=True)

    def fill(module, grad_input, grad_output):  # `a` is the first layer: its hook fires last in backward
        for p in model.b.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    model.a.register_full_backward_hook(fill)
    return model


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the input needs no gradient: fine here
def test_zero_gradient_where_one_process_has_none():
    report = check(TwoBranch, _branch_batch, strategy=_zero_for_unused, world_size=2, steps=2)
    m = report.first_mismatch
    assert (m.step, m.phase, m.name, m.index, m.got, m.want) == (1, "gradient", "b.weight", None, 0.0, None)
    assert "b.weight is a tensor (max |value| 0) vs None in one process" in str(report)
    assert any("grad None" in note and "torch optimizers skip it" in note for note in report.notes)


def _drop_on_rank_1(model, comm):
    """A planted bug: at the end of backward, after DDP is done, rank 1 alone drops the gradients of `b` at step 0,
    where every rank used it (the ranks disagree). (Giving it a gradient of its own instead is refused by DDP at the
    optimizer step: tests/test_torch_idioms.py.)"""
    model = sw.DDP(model, comm, find_unused_parameters=True)

    def fill():
        for p in model.b.parameters():
            p.grad = None

    def queue(grad):  # `a` comes last in backward: the callback runs after DDP's own
        torch.autograd.Variable._execution_engine.queue_callback(fill)
        return grad

    if comm.rank == 1:
        model.a.weight.register_hook(queue)
    return model


def test_ranks_that_disagree_on_none_are_reported_not_hung():
    report = check(TwoBranch, _branch_batch, strategy=_drop_on_rank_1, world_size=2, steps=2, timeout=20)
    assert report.first_mismatch[:5] == (0, "gradient", "b.weight", None, None)  # None here, a tensor in one process
    assert "b.weight is None on some ranks and a tensor on others" in str(report)
    assert any("None on some ranks" in note for note in report.notes)


def _bn_model():
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def _regression_batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)


def _mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _local_bn_ddp(model, comm):
    return sw.DDP(model, comm, batch_norm="local")  # torch DDP's per-rank statistics, chosen


def test_batchnorm_using_per_rank_statistics_is_refused_naming_the_choices():
    with pytest.raises(Exception, match=r"BatchNorm1d '1' would normalise by this rank's slice.*batch_norm='sync'"):
        check(_bn_model, _regression_batch, strategy="ddp", world_size=2, steps=1, loss_fn=_mse)


def test_batchnorm_per_rank_statistics_are_diagnosed():
    report = check(_bn_model, _regression_batch, strategy=_local_bn_ddp, world_size=2, steps=1, loss_fn=_mse)
    assert report.first_mismatch[:3] == (0, "forward", "loss")
    assert "loss differs at step 0" in report.notes[0]  # said first
    assert any("SyncBatchNorm.convert" in note and "'1'" in note for note in report.notes)
    assert {"1.running_mean", "1.running_var"} <= {r.name for r in report.rows if r.kind == "buffer"}


def test_a_forward_difference_names_the_first_module_that_computes_differently():
    """BatchNorm under DDP: every rank normalizes by its own rows, so the first output that differs is the
    BatchNorm's ('1'); the Linear before it agrees on each rank's rows of the one-process output."""
    report = check(_bn_model, _regression_batch, strategy=_local_bn_ddp, world_size=2, steps=1, loss_fn=_mse)
    assert any(note.startswith("the first module whose output differs in the first forward is '1' (BatchNorm1d): "
                               "max |diff|") and note.endswith("the 1 module outputs compared before it agree")
               for note in report.notes), report.notes


class _FunctionalDropout(nn.Module):
    """Dropout written as HuggingFace writes it in many families (Seed-OSS's residual dropout): no nn.Dropout."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x):
        return nn.functional.dropout(self.linear(x), p=0.1, training=self.training)


def _drawing_model():
    return nn.Sequential(_FunctionalDropout(), nn.Linear(6, 6), nn.Dropout(0.1), nn.Linear(6, 1))


def test_random_draws_outside_dropout_modules_are_named():
    """A check of a model with dropout differs at the first forward whatever the strategy; an nn.Dropout was named
    before, a functional one (F.dropout(x, p, self.training)) was not: the report now names the module whose own
    code drew random numbers, innermost, and leaves the nn.Dropout to its own note."""
    report = check(_drawing_model, _regression_batch, strategy="ddp", world_size=2, steps=1, loss_fn=_mse)
    assert report.first_mismatch[:3] == (0, "forward", "loss")
    drawn = [n for n in report.notes if n.startswith("the forward draws random numbers outside nn.Dropout modules")]
    assert len(drawn) == 1 and "in '0' (_FunctionalDropout) (functional dropout" in drawn[0], report.notes
    assert "'2'" not in drawn[0] and "'0.linear'" not in drawn[0], drawn
    assert any(n.startswith("Dropout with p > 0 in training mode (modules '2')") for n in report.notes), report.notes
    # a model that differs for another reason (per-rank BatchNorm statistics) and draws nothing gets no such note
    other = check(_bn_model, _regression_batch, strategy=_local_bn_ddp, world_size=2, steps=1, loss_fn=_mse)
    assert other.first_mismatch is not None and not any("random numbers" in n for n in other.notes), other.notes


class _ScalesItsInput(nn.Module):
    """A forward that writes its input in place, as FSMT's does (masked_fill_ on input_ids)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 1)

    def forward(self, x):
        return self.linear(x.mul_(0.5))


def test_a_model_that_writes_its_inputs_gets_a_batch_of_its_own_in_each_run():
    """Each run and each rank gets a copy of its rows: before, the one-process run halved the shared batch in place,
    so the ranks computed on a quarter of it (a step-0 loss difference that was the check's own), and a thread
    rank's in-place write to its rows bumped the version counter every slice of the batch shares, failing another
    rank's backward ("modified by an inplace operation": FSMT under DDP)."""
    report = check(_ScalesItsInput, _regression_batch, strategy="ddp", world_size=2, steps=2, loss_fn=_mse)
    assert report.ok, report
    batch = torch.arange(8.0).reshape(4, 2)
    first, second = slice_batch(batch, 0, 2), slice_batch(batch, 1, 2)
    second.add_(1)
    assert first._version == 0 and torch.equal(batch, torch.arange(8.0).reshape(4, 2))
    whole = slice_batch(batch, 0, 1)
    whole.add_(1)
    assert torch.equal(batch, torch.arange(8.0).reshape(4, 2))


def _tanh_in_block_3(model, comm):
    model[3][1] = nn.Tanh()  # the rank's model computes something else from block 3 on (a planted "wrong layer")
    return sw.ZeRO(model, comm, stage=3)


def test_a_planted_wrong_layer_is_located():
    def blocks():
        return nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.ReLU()) for _ in range(5)))

    report = check(blocks, torch.randn(8, 6, generator=torch.Generator().manual_seed(0)), strategy=_tanh_in_block_3,
                   steps=1, loss_fn=lambda model, x: model(x).pow(2).mean())
    assert report.first_mismatch[:3] == (0, "forward", "loss")
    assert any("first module whose output differs in the first forward is '3.1' (ReLU in one process, Tanh under "
               "the strategy): max |diff|" in n for n in report.notes), report.notes
    # finishing order: each block's Linear and ReLU, then the block: 3 blocks x 3 and block 3's Linear agree first
    assert any(n.endswith("the 10 module outputs compared before it agree") for n in report.notes), report.notes


def _deep_stack():
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(25)))  # 50 tensors


def _scale_one(model, comm):
    model[24].bias.register_hook(lambda g: g * 1.01)
    return sw.DDP(model, comm)


def test_large_models_show_the_rows_that_differ():
    report = check(_deep_stack, torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), strategy=_scale_one,
                   steps=1, max_norm=None, loss_fn=lambda model, x: model(x).pow(2).mean())
    assert report.first_mismatch[:3] == (0, "gradient", "24.bias") and not report.norms
    table = str(report).split("\n\n")[-1].splitlines()
    assert table[1].startswith("24.bias") and "DIFFERS" in table[1]
    assert table[2] == "... and 49 more tensors within rtol 1e-05 / atol 1e-06 (report.text(verbose=True) lists them)"
    assert len(report.text(verbose=True).split("\n\n")[-1].splitlines()) == 51
    assert "no clipping" in str(report)


def test_none_strategy_and_a_mesh():
    assert check(build_gpt, gpt_batch, strategy="none", steps=1).world_size == 1
    report = check(build_gpt, gpt_batch, strategy={"tp": 2, "tp_plan": "gpt", "dp_strategy": "zero2"},
                   world_size=2, steps=2)
    assert report.ok, str(report)


@pytest.mark.parametrize("kwargs, words", [
    (dict(batch=torch.randn(7, 8), strategy="ddp"), ["7 rows", "dp=2"]),
    (dict(strategy="zero4"), ["strategy='zero4'", "'zero3'", "'fsdp:hybrid_shard'"]),
    (dict(strategy="fsdp:hybrid_shard"), ["at least 4", "got 2"]),
    (dict(strategy={"tp": 2, "pp": 2}), ["tp=2 x cp=1 x pp=2", "world_size=2"]),
    (dict(strategy={"tp": 2, "dp_strategy": "zero9"}), ["dp_strategy='zero9'", "'zero3'"]),
    (dict(steps=0), ["steps=0"]),
    (dict(backend="mpi"), ["backend='mpi'", "'gloo'"]),
])
def test_bad_input_raises_naming_the_value(kwargs, words):
    kwargs.setdefault("batch", gpt_batch)
    with pytest.raises(ValueError) as info:
        check(build_gpt, **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_bad_model_and_loss():
    with pytest.raises(ValueError, match="build_model must be a zero-argument callable .* got a GPT module"):
        check(build_gpt(), gpt_batch)
    with pytest.raises(ValueError, match="got 3"):
        check(3, gpt_batch)
    with pytest.raises(ValueError, match="pass loss_fn"):  # the GPT returns logits without targets
        check(build_gpt, lambda step: gpt_batch(step)[0], strategy="none", steps=1)
    with pytest.raises(ValueError, match="backend='gloo'.*build_model must be picklable"):
        check(lambda: build_gpt(), gpt_batch, backend="gloo")


def test_cli_vocabulary_matches_the_library():
    from shardwise.check import TP_PLANS
    from shardwise.pipeline.schedules import SCHEDULES

    assert CHECK_STRATEGIES == STRATEGIES and CHECK_TP_PLANS == TP_PLANS
    assert CHECK_PP_SCHEDULES == SCHEDULES


def test_cli_gpt_example(capsys):
    assert main(["check", "--gpt", "--strategy", "zero3", "-n", "2", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("shardwise check: zero3 on 2 thread ranks") and ": OK" in out.splitlines()[0]


def test_cli_usage_errors(capsys):
    for argv in (["check", "--gpt", "--strategy", "zero4"], ["check", "--gpt", "--strategy", "fsdp:hybrid_shard"],
                 ["check", "mod:build"], ["check", "--gpt", "--tp", "2", "--strategy", "tp"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2, argv
    assert "invalid choice: 'zero4'" in capsys.readouterr().err


def test_cli_file_based_functions(tmp_path, capsys):
    path = tmp_path / "check_cli_user_model.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def build():
            return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

        def batch(step):
            g = torch.Generator().manual_seed(step)
            return torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)

        def loss(model, batch):
            x, y = batch
            return nn.functional.mse_loss(model(x), y)

        def broken(model, batch):
            x, y = batch
            return (model(x) - y).pow(2).sum()  # a sum over examples: ranks' average is half of it
    """))
    argv = ["check", f"{path}:build", "--batch", f"{path}:batch", "--strategy", "ddp", "-n", "2", "--steps", "2"]
    assert main([*argv, "--loss", f"{path}:loss"]) == 0
    assert "0.weight" in capsys.readouterr().out
    assert main([*argv, "--loss", f"{path}:broken"]) == 1
    captured = capsys.readouterr()
    assert "DIFFERS" in captured.out
    assert captured.err.strip().splitlines() == ["shardwise check: DIFFERS: " + captured.err.split("DIFFERS: ")[1]
                                                 .strip()]
    assert "step 0, forward: loss" in captured.err
    assert main([*argv[:1], f"{path}:nothing", *argv[2:]]) == 1
    assert "has no attribute 'nothing'" in capsys.readouterr().err


def test_cli_wrap_finds_a_planted_bug_in_a_users_own_wrapping(tmp_path, capsys):
    """--wrap FILE:fn checks the user's own composition: here ZeRO-3 with one gradient scaled by 1.001 by a hook
    registered before wrapping (which ZeRO-3 used to drop silently, so this very check came back OK)."""
    path = tmp_path / "check_cli_planted.py"
    path.write_text(textwrap.dedent("""
        import shardwise as sw

        def buggy_zero3(model, comm):
            model.blocks[1].mlp.fc.weight.register_hook(lambda g: g * 1.001)
            return sw.ZeRO(model, comm, stage=3)
    """))
    assert main(["check", "--gpt", "--wrap", f"{path}:buggy_zero3", "-n", "2", "--steps", "2"]) == 1
    captured = capsys.readouterr()
    assert "callable buggy_zero3 on 2 thread ranks" in captured.out
    assert "first mismatch: step 0, gradient: blocks.1.mlp.fc.weight[" in captured.out
    with pytest.raises(SystemExit) as info:
        main(["check", "--gpt", "--wrap", f"{path}:buggy_zero3", "--strategy", "ddp"])
    assert info.value.code == 2 and "--wrap is the whole strategy" in capsys.readouterr().err


def test_a_device_other_than_cpu_needs_thread_ranks():
    with pytest.raises(ValueError, match="device='cuda:0' needs backend='thread'"):
        sw.check(lambda: torch.nn.Linear(4, 2), torch.randn(4, 4), backend="gloo", device="cuda:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_thread_ranks_on_cuda_without_cuda_are_refused_by_name():
    with pytest.raises(ValueError, match="device='cuda' but this torch sees no CUDA device"):
        sw.launch(lambda comm: None, 2, device="cuda")
    with pytest.raises(ValueError, match="is for thread ranks"):
        sw.launch(lambda comm: None, 2, backend="gloo", device="cuda")
