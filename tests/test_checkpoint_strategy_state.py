"""Strategy state in checkpoints (layout.ExtraState, checkpoint/strategy_state.py): a compressor's per-rank residuals
and PowerSGD's Q are saved with the model, so a run resumed from a checkpoint is bit-identical to the uninterrupted
run (DDP, ZeRO-2, and every pipeline stage of a `sw.parallelize` model); the state reloads only onto the saving layout
(or is reset on request); a damaged copy refuses the whole load."""

from __future__ import annotations

import json

import pytest
import torch
from local_sgd_cases import inner_step, state_of
from parity import CONFIG, batch, frozen_model

import shardwise as sw
from shardwise import layout
from shardwise.checkpoint import CheckpointError, CheckpointMismatch
from shardwise.compression import BF16, PowerSGD, TopK

BEFORE, AFTER = 4, 3  # steps before the save and after the resume


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def ddp(comm, compression, strategy="ddp"):
    if strategy == "zero2":  # the sharding engine's compressor: one residual per unit
        return sw.ZeRO(frozen_model(), comm, stage=2, group_mb=0.05, compression=compression)
    return sw.DDP(frozen_model(), comm, bucket_mb=0.05, first_bucket_mb=0.01, compression=compression)


def steps(model, opt, comm, start, count):
    for step in range(start, start + count):
        x, y = batch(step, comm.rank, comm.size)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()


def snapshot(model):
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {k: v.clone() for k, v in model.compressor.state_dict().items()})


def same(a, b):
    """Bit-identical parameter and compressor states (names, then every tensor exactly)."""
    return all(a[i].keys() == b[i].keys() and all(torch.equal(a[i][k], b[i][k]) for k in a[i]) for i in range(2))


METHODS = [PowerSGD(rank=2, start_iter=1, min_compression_rate=1.0), TopK(0.05)]


@pytest.mark.parametrize("strategy, method", [("ddp", METHODS[0]), ("ddp", METHODS[1]), ("zero2", METHODS[0]),
                                              ("ddp", BF16(error_feedback=True)), ("zero2", BF16(error_feedback=True))],
                         ids=["ddp-powersgd", "ddp-topk", "zero2-powersgd", "ddp-bf16-ef", "zero2-bf16-ef"])
def test_resume_from_checkpoint_is_bit_identical(strategy, method, tmp_path):
    def uninterrupted(comm):
        model = ddp(comm, method, strategy)
        opt = sgd(model.parameters())
        steps(model, opt, comm, 0, BEFORE + AFTER)
        return snapshot(model)

    def interrupted(comm, reset):
        model = ddp(comm, method, strategy)
        opt = sgd(model.parameters())
        steps(model, opt, comm, 0, BEFORE)
        residual = model.compressor.state_dict()
        assert any(k.startswith("memory/") and v.abs().sum() > 0 for k, v in residual.items())  # something to lose
        sw.save_checkpoint(tmp_path / f"run-{reset}", model, opt, step=BEFORE)
        fresh = ddp(comm, method, strategy)
        fresh_opt = sgd(fresh.parameters())
        sw.load_checkpoint(tmp_path / f"run-{reset}", fresh, fresh_opt, reset_strategy_state=reset)
        restored = fresh.compressor.state_dict()
        if not reset:
            assert restored.keys() == residual.keys() and all(torch.equal(restored[k], residual[k]) for k in residual)
        steps(fresh, fresh_opt, comm, BEFORE, AFTER)
        return snapshot(fresh)

    reference = sw.launch(uninterrupted, 2)
    resumed = sw.launch(interrupted, 2, False)
    for rank in range(2):
        assert same(resumed[rank], reference[rank]), f"rank {rank}: the resumed run differs from the uninterrupted one"
    # The residuals are each rank's own: they differ between ranks, so they were saved per rank.
    memory = [r[1] for r in reference]
    assert any(not torch.equal(memory[0][k], memory[1][k]) for k in memory[0] if k.startswith("memory/"))
    # The check can fail: the same resume with the residuals (and Q) thrown away is another run.
    reset = sw.launch(interrupted, 2, True)
    assert not same(reset[0], reference[0])


def test_saved_layout_is_recorded_per_rank(tmp_path):
    def body(comm):
        model = ddp(comm, METHODS[0])
        opt = sgd(model.parameters())
        steps(model, opt, comm, 0, 2)
        sw.save_checkpoint(tmp_path, model, opt, step=2)

    sw.launch(body, 2)
    metadata = json.loads((tmp_path / "step-00000002" / "metadata.json").read_text())
    saved = metadata["strategy_state"]["compressor"]
    assert saved["scope"] == "per_rank" and saved["config"]["compressor"]["method"] == "powersgd"
    assert sorted(saved["copies"]) == ["0", "1"]
    assert {c["file"] for c in saved["copies"].values()} == {"shard-00000-of-00002.safetensors",
                                                             "shard-00001-of-00002.safetensors"}
    assert all(c["group_size"] == 2 for c in saved["copies"].values())


def _saved(tmp_path, world=2, method=None):
    def body(comm):
        model = ddp(comm, method or METHODS[0])
        opt = sgd(model.parameters())
        steps(model, opt, comm, 0, 3)
        sw.save_checkpoint(tmp_path, model, opt, step=3)

    sw.launch(body, world)
    return tmp_path / "step-00000003"


def _load_and_report(path, world, method=None, **options):
    """Each rank: (error text or None, whether its parameters, optimizer and compressor are untouched)."""

    def body(comm):
        model = ddp(comm, method or METHODS[0])
        opt = sgd(model.parameters())
        steps(model, opt, comm, 10, 2)  # some state of its own, which a refused load must leave alone
        before = (snapshot(model), {k: v.clone() for k, v in opt.state_dict()["state"][0].items()})
        try:
            sw.load_checkpoint(path, model, opt, **options)
            error = None
        except (CheckpointError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        after = (snapshot(model), opt.state_dict()["state"][0])
        untouched = same(before[0], after[0]) and all(torch.equal(before[1][k], after[1][k]) for k in before[1])
        return error, untouched

    return sw.launch(body, world)


def test_resize_refuses_per_rank_state_naming_it(tmp_path):
    path = _saved(tmp_path, world=2)
    results = _load_and_report(path, 1)
    error, untouched = results[0]
    assert error is not None and "CheckpointMismatch" in error and "'compressor'" in error
    assert "saved by 2 ranks" in error and "reset_strategy_state=True" in error
    assert untouched


def test_resize_with_reset_loads_the_model_and_starts_fresh(tmp_path):
    path = _saved(tmp_path, world=2)

    def body(comm):
        model = ddp(comm, METHODS[0])
        opt = sgd(model.parameters())
        steps(model, opt, comm, 10, 2)
        sw.load_checkpoint(path, model, opt, reset_strategy_state=True)
        return model.compressor.state_dict(), sw.full_state_dict(model)

    state, params = sw.launch(body, 1)[0]
    assert state == {}
    saved = sw.checkpoint.read_tensors(path)
    assert all(torch.equal(params[k], saved[f"param/{k}"]) for k in params if f"param/{k}" in saved)


def test_other_compressor_configuration_is_refused(tmp_path):
    path = _saved(tmp_path, world=2)
    (error, untouched), _ = _load_and_report(path, 2, method=PowerSGD(rank=3, start_iter=1, min_compression_rate=1.0))
    assert "another configuration" in error and "rank" in error and untouched


def test_state_missing_from_the_checkpoint_and_unexpected_state(tmp_path):
    def plain(comm):
        model = ddp(comm, None)
        opt = sgd(model.parameters())
        steps(model, opt, comm, 0, 1)
        sw.save_checkpoint(tmp_path / "plain", model, opt, step=1)

    sw.launch(plain, 2)
    (error, untouched), _ = _load_and_report(tmp_path / "plain", 2)
    assert "'compressor' (per_rank) is not in the checkpoint" in error and untouched

    path = _saved(tmp_path / "compressed", world=2)

    def into_plain(comm, strict):
        model = ddp(comm, None)
        opt = sgd(model.parameters())
        try:
            return sw.load_checkpoint(path, model, opt, strict=strict).get("skipped")
        except CheckpointMismatch as exc:
            return str(exc)

    assert "strategy/compressor" in sw.launch(into_plain, 2, True)[0]
    assert "strategy/compressor" in sw.launch(into_plain, 2, False)[0]


def _corrupt(path, how):
    metadata_path = path / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    copy = metadata["strategy_state"]["compressor"]["copies"]["1"]
    if how == "missing_tensor":  # the metadata names a tensor the file does not hold
        first = next(iter(copy["tensors"].values()))
        first["key"] = first["key"] + "-gone"
    elif how == "wrong_shape":
        first = next(iter(copy["tensors"].values()))
        first["shape"] = [1]
    elif how == "unknown_entry":  # a state the compressor cannot take (its check refuses it before any commit)
        copy["values"]["bogus/0"] = 1
    elif how == "bytes":  # the shard file holding rank 1's residuals, damaged on disk
        shard = path / copy["file"]
        data = bytearray(shard.read_bytes())
        data[-5] ^= 0xFF
        shard.write_bytes(bytes(data))
    metadata_path.write_text(json.dumps(metadata))


@pytest.mark.parametrize("how", ["missing_tensor", "wrong_shape", "unknown_entry", "bytes"])
def test_a_damaged_copy_refuses_the_whole_load(how, tmp_path):
    path = _saved(tmp_path, world=2)
    _corrupt(path, how)
    results = _load_and_report(path, 2)
    assert all(error is not None for error, _ in results), results
    if how != "bytes":  # (rank 0 reads rank 1's damaged file too: it holds parameter pieces rank 1 wrote)
        assert "rank 1 failed" in results[0][0]  # rank 0 read nothing wrong, and still loaded nothing
    assert all(untouched for _, untouched in results)


def test_extra_state_declaration_is_validated():
    with pytest.raises(ValueError, match="scope='global'"):
        layout.ExtraState("x", "global", dict, lambda s: None)


H = 2  # inner steps per synchronisation


def diloco(comm):
    model = sw.DiLoCo(frozen_model(), comm, sync_every=H)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)  # no inner state: each worker's would be its own


def outer_state(model):
    saved = model.outer_state_dict()
    momentum = saved["outer_optimizer"]["state"]
    return state_of(model), {**saved["anchors"], **{f"m{i}": s["momentum_buffer"] for i, s in momentum.items()}}


def local_steps(model, opt, comm, start, count):
    for step in range(start, start + count):
        inner_step(model, opt, comm, step)


def test_diloco_resumes_bit_identically_from_a_checkpoint(tmp_path):
    def uninterrupted(comm):
        model, opt = diloco(comm)
        local_steps(model, opt, comm, 0, 3 * H)
        return outer_state(model)

    def interrupted(comm):
        model, opt = diloco(comm)
        local_steps(model, opt, comm, 0, 2 * H)  # saved right after a synchronisation: the replicas are equal
        with pytest.raises(ValueError, match="pass comm="):
            sw.save_checkpoint(tmp_path, model, opt, step=2 * H)  # the model alone does not know local SGD's ranks
        sw.save_checkpoint(tmp_path, model, opt, step=2 * H, comm=comm)
        at_save = outer_state(model)
        fresh, fresh_opt = diloco(comm)
        sw.load_checkpoint(tmp_path, fresh, fresh_opt, comm=comm)
        assert fresh.inner_steps == 2 * H and fresh.syncs == 2
        local_steps(fresh, fresh_opt, comm, 2 * H, H)
        return outer_state(fresh), at_save

    reference = sw.launch(uninterrupted, 2)
    resumed = sw.launch(interrupted, 2)
    for rank in range(2):
        assert same(resumed[rank][0], reference[rank]), f"rank {rank}: the resumed DiLoCo run differs"
    metadata = json.loads((tmp_path / f"step-{2 * H:08d}" / "metadata.json").read_text())
    saved = metadata["strategy_state"]["local_sgd"]
    assert saved["scope"] == "replicated" and list(saved["copies"]) == ["0"]  # written once

    def on_one_rank(comm):  # replicated state maps onto any world size
        model, opt = diloco(comm)
        sw.load_checkpoint(tmp_path, model, opt, comm=comm)
        return outer_state(model)

    assert same(sw.launch(on_one_rank, 1)[0], resumed[0][1])  # parameters, anchors and outer momentum as saved


def test_local_sgd_state_into_plain_averaging_is_refused(tmp_path):
    def body(comm):
        model, opt = diloco(comm)
        local_steps(model, opt, comm, 0, H)
        sw.save_checkpoint(tmp_path, model, opt, step=H, comm=comm)
        plain = sw.LocalSGD(frozen_model(), comm, sync_every=H)
        with pytest.raises(CheckpointMismatch, match="'local_sgd' was saved under another configuration"):
            sw.load_checkpoint(tmp_path, plain, sgd(plain.parameters()), comm=comm)

    sw.launch(body, 2)


def test_onebit_adam_resumes_bit_identically_from_a_checkpoint(tmp_path):
    from shardwise.compression import OneBitAdam

    def build(comm):
        model = frozen_model()
        return model, OneBitAdam(model.parameters(), comm, lr=1e-3, eps=1e-6, freeze_step=2)

    def run(comm, save):
        model, opt = build(comm)
        steps(model, opt, comm, 0, 4)  # past the warm-up: frozen variance, residuals in the compressor
        if save:
            sw.save_checkpoint(tmp_path, model, opt, step=4, comm=comm)
            model, opt = build(comm)
            sw.load_checkpoint(tmp_path, model, opt, comm=comm)
            assert opt.steps == 4 and opt.frozen
        steps(model, opt, comm, 4, 2)
        return ({k: v.detach().clone() for k, v in model.state_dict().items()},
                {k: v.clone() for k, v in opt.compressor.state_dict().items()})

    reference, resumed = sw.launch(run, 2, False), sw.launch(run, 2, True)
    for rank in range(2):
        assert same(resumed[rank], reference[rank]), f"rank {rank}: the resumed 1-bit Adam run differs"
    metadata = json.loads((tmp_path / "step-00000004" / "metadata.json").read_text())
    assert {n: s["scope"] for n, s in metadata["strategy_state"].items()} == {
        "onebit_adam": "replicated", "onebit_adam_compressor": "per_rank"}


@pytest.mark.parametrize("field, value, match", [
    ("scope", "global", "scope 'global' is not 'per_rank' or 'replicated'"),
    ("file", "../../etc/passwd", "which 'files' does not list"),
    ("shape", [10**9], "does not fit in shard-00001-of-00002.safetensors"),
])
def test_malformed_strategy_state_metadata_is_refused_naming_it(field, value, match, tmp_path):
    path = _saved(tmp_path, world=2)
    metadata = json.loads((path / "metadata.json").read_text())
    saved = metadata["strategy_state"]["compressor"]
    copy = saved["copies"]["1"]
    if field == "scope":
        saved["scope"] = value
    elif field == "file":
        copy["file"] = value
    else:
        next(iter(copy["tensors"].values()))["shape"] = value
    (path / "metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(CheckpointError, match=match):
        sw.checkpoint.read_metadata(path)


# ---- sw.parallelize: every stage's data-parallel compressor, declared through the pipeline's record -------------
def hybrid(comm, dims, method, schedule, virtual):
    dp, tp_size, pp_size = dims
    mesh = sw.Mesh(comm, dp=dp, tp=tp_size, pp=pp_size)
    model = sw.parallelize(sw.models.GPT(CONFIG, seed=0), mesh, tp_plan="gpt" if tp_size > 1 else None,
                           pp_schedule=schedule, virtual_stages=virtual, n_microbatches=2, compression=method)
    return model, mesh.coords.dp, sgd(model.parameters())


def hybrid_steps(model, opt, dp_rank, dp, start, count):
    for step in range(start, start + count):
        model.step(*batch(step, dp_rank, dp))
        opt.step()
        opt.zero_grad()


def hybrid_snapshot(model):
    """The full parameters (original names) and every declared compressor state, copied."""
    states = {name: {k: v.clone() for k, v in state.state_dict().items()}
              for name, state in layout.extra_states(model).items()}
    return {k: v.clone() for k, v in sw.full_state_dict(model).items()}, states


def hybrid_same(a, b):
    def equal(x, y):
        return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)

    return equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(equal(a[1][n], b[1][n]) for n in a[1])


@pytest.mark.parametrize("dims, method, schedule, virtual", [
    ((2, 1, 2), METHODS[0], "1f1b", 1),
    ((2, 2, 1), METHODS[1], "1f1b", 1),
    ((2, 1, 2), METHODS[1], "interleaved_1f1b", 2),  # two stages per rank: two compressors, two names
], ids=["dp2xpp2-powersgd", "dp2xtp2-topk", "dp2xpp2-interleaved-topk"])
def test_parallelize_resumes_bit_identically_with_its_stages_compressors(dims, method, schedule, virtual, tmp_path):
    world = dims[0] * dims[1] * dims[2]

    def uninterrupted(comm):
        model, dp_rank, opt = hybrid(comm, dims, method, schedule, virtual)
        hybrid_steps(model, opt, dp_rank, dims[0], 0, BEFORE + AFTER)
        for _, params, group in model.pipe.tied.groups:  # the tied embedding / head copies stayed equal
            for p in params:
                mean = p.detach().clone()
                group.all_reduce(mean, sw.ReduceOp.AVG)
                assert torch.equal(mean, p.detach()), "the copies of a tied weight drifted apart"
        return hybrid_snapshot(model)

    def interrupted(comm, reset):
        model, dp_rank, opt = hybrid(comm, dims, method, schedule, virtual)
        hybrid_steps(model, opt, dp_rank, dims[0], 0, BEFORE)
        names = sorted(layout.extra_states(model))
        stages = sorted(int(s) for s in model.pipe.stages)
        assert names == [f"stages.{s}.compressor" for s in stages], names  # one per local stage, named by it
        saved = hybrid_snapshot(model)[1]
        assert all(any(k.startswith("memory/") and v.abs().sum() > 0 for k, v in state.items())
                   for state in saved.values())  # every stage has residuals to lose
        sw.save_checkpoint(tmp_path / f"run-{reset}", model, opt, step=BEFORE)
        fresh, _, fresh_opt = hybrid(comm, dims, method, schedule, virtual)
        sw.load_checkpoint(tmp_path / f"run-{reset}", fresh, fresh_opt, reset_strategy_state=reset)
        if not reset:
            assert hybrid_same(hybrid_snapshot(fresh), hybrid_snapshot(model))
        hybrid_steps(fresh, fresh_opt, dp_rank, dims[0], BEFORE, AFTER)
        return hybrid_snapshot(fresh)

    reference = sw.launch(uninterrupted, world)
    resumed = sw.launch(interrupted, world, False)
    for rank in range(world):
        assert hybrid_same(resumed[rank], reference[rank]), f"rank {rank}: the resumed run differs"
    metadata = json.loads((tmp_path / "run-False" / f"step-{BEFORE:08d}" / "metadata.json").read_text())
    saved = metadata["strategy_state"]
    n_stages = dims[2] * virtual
    assert sorted(saved) == sorted(f"stages.{s}.compressor" for s in range(n_stages))
    assert all(len(state["copies"]) == world // dims[2] and state["scope"] == "per_rank" for state in saved.values())
    reset = sw.launch(interrupted, world, True)  # the check can fail: without the residuals it is another run
    assert not hybrid_same(reset[0], reference[0])
