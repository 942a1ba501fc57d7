"""LocalSGD / DiLoCo with `compression=`: outer gradients through a sw.compression method, error feedback per rank."""

from __future__ import annotations

import pytest
import torch
from local_sgd_cases import checkpointed_run, train_inner_steps
from parity import CONFIG, assert_state_close

import shardwise as sw
from shardwise.async_sgd import DiLoCo, LocalSGD
from shardwise.models import GPT


def train(comm, wrap: str, compression, steps: int, sync_every: int, inner: str = "adamw"):
    """Train the tiny GPT (inner AdamW, or SGD) on this rank's slice; return (state, losses, bytes of each sync step)."""
    model = GPT(CONFIG, seed=0)
    if wrap == "diloco":
        model = DiLoCo(model, comm, sync_every=sync_every, compression=compression)
    else:
        model = LocalSGD(model, comm, sync_every=sync_every, compression=compression)
    steps_run = train_inner_steps(model, comm, steps, inner)
    losses = [s.loss for s in steps_run]
    sync_bytes = [s.measured.wire_bytes() for s in steps_run if s.synced]
    memory = {} if model.compressor is None else model.compressor.state_dict()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses,
            "sync_bytes": sync_bytes, "memory": memory}


@pytest.mark.parametrize("wrap", ["diloco", "average"])
def test_lossless_compression_equals_the_plain_all_reduce(wrap):
    """TopK keeping every element sends the exact outer gradient: the same training as without compression (inner
    SGD: Adam's normalisation would blow the all-gather's other summation order up past fp32 parity tolerances)."""
    plain = sw.launch(train, 4, wrap, None, 6, 3, "sgd")
    topk = sw.launch(train, 4, wrap, sw.compression.TopK(ratio=1.0), 6, 3, "sgd")
    for a, b in zip(plain, topk):
        assert_state_close(b["state"], a["state"])


def test_compressed_outer_gradients_send_the_compressors_bytes_and_keep_a_residual():
    method = sw.compression.TopK(ratio=0.01)
    results = sw.launch(train, 4, "diloco", method, 12, 4)
    shapes = [p.shape for p in GPT(CONFIG, seed=0).parameters()]
    want = method.wire_bytes(shapes, 4)  # the model has no floating-point buffer to average besides
    plain = sw.launch(train, 4, "diloco", None, 4, 4)[0]["sync_bytes"][0]
    for r in results:
        assert r["sync_bytes"] == [want] * 3 and want < plain / 10
        assert any(float(v.abs().sum()) > 0 for k, v in r["memory"].items() if k.startswith("memory/"))
        assert sum(r["losses"][-3:]) / 3 < r["losses"][0] - 0.1, r["losses"]


def test_bad_compression_is_named():
    def body(comm):
        out = []
        for kwargs in ({"compression": "topk"}, {"compression": sw.compression.FP16(), "reduce": lambda c, f: None}):
            try:
                LocalSGD(GPT(CONFIG, seed=0), comm, sync_every=2, **kwargs)
            except ValueError as exc:
                out.append(str(exc))
        return out

    bad_type, both = sw.launch(body, 2)[0]
    assert "compression='topk' must be None or a sw.compression method" in bad_type
    assert "give compression= or reduce=, not both" in both


def _checkpointed(comm, path: str, steps: int, save_at: int | None, resume: bool, reset: bool = False):
    """DiLoCo H = 3 with TopK outer gradients, inner SGD without momentum (no inner state: the checkpoint holds all
    of it): save through sw.save_checkpoint at a synchronisation, or resume from it; return the final state and the
    compressor's residuals."""
    model = DiLoCo(GPT(CONFIG, seed=0), comm, sync_every=3, compression=sw.compression.TopK(ratio=0.05))

    def at_a_synchronisation(model, synced):
        assert synced  # saved at a synchronisation: the replicas are equal, the model copy is everyone's

    checkpointed_run(model, comm, path, steps, save_at, resume, reset=reset, before_save=at_a_synchronisation)
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {k: v.clone() for k, v in model.compressor.state_dict().items() if isinstance(v, torch.Tensor)})


def test_compressed_diloco_resumes_from_save_checkpoint_bit_for_bit(tmp_path):
    """Saved mid-run (after 6 of 12 steps) with the outer momentum and each rank's own TopK residual, the resumed
    run equals the uninterrupted one bit for bit; restarting the residuals instead (reset_strategy_state) does not,
    so the per-rank residuals are what the checkpoint must carry."""
    path = str(tmp_path / "ckpt")
    full = sw.launch(_checkpointed, 2, path, 12, 6, False)
    resumed = sw.launch(_checkpointed, 2, path, 12, None, True)
    for (state, memory), (want, want_memory) in zip(resumed, full):
        assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
        assert memory.keys() == want_memory.keys() and all(torch.equal(memory[k], want_memory[k]) for k in memory)
    assert any(float(v.abs().sum()) > 0 for v in full[0][1].values())  # the residual is real state
    assert not torch.equal(full[0][1][next(iter(full[0][1]))], full[1][1][next(iter(full[1][1]))])  # per rank
    reset = sw.launch(_checkpointed, 2, path, 12, None, True, True)
    assert any(not torch.equal(reset[0][0][k], full[0][0][k]) for k in full[0][0])


def _streaming(comm, compression, steps: int, options: dict, inner: str = "adamw"):
    """Streaming DiLoCo (H = 4) with compressed outer gradients: (state, losses, wire bytes of each step)."""
    from shardwise.async_sgd import StreamingDiLoCo

    model = StreamingDiLoCo(GPT(CONFIG, seed=0), comm, sync_every=4, compression=compression, **options)
    steps_run = train_inner_steps(model, comm, steps, inner)
    losses, traffic = [s.loss for s in steps_run], [s.measured.wire_bytes() for s in steps_run]
    params = dict(model.named_parameters())
    shapes = [[params[name].shape for name in f["names"]] for f in model.fragments]
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses,
            "traffic": traffic, "shapes": shapes}


def test_streaming_one_fragment_with_compression_is_compressed_diloco_bit_for_bit():
    method = sw.compression.TopK(ratio=0.05)
    streaming = sw.launch(_streaming, 2, method, 8, {"fragments": 1})
    diloco = sw.launch(train, 2, "diloco", method, 8, 4)
    for s, d in zip(streaming, diloco):
        assert all(torch.equal(s["state"][k], d["state"][k]) for k in d["state"])
        assert s["losses"] == d["losses"]


def test_streaming_fragments_send_the_compressors_bytes_and_train():
    """F = 2, tau = 1: each fragment's synchronisation sends the compressor's bytes for that fragment's shapes."""
    method = sw.compression.TopK(ratio=0.01)
    results = sw.launch(_streaming, 2, method, 16, {"fragments": 2, "overlap_steps": 1})
    r = results[0]
    f0, f1 = (method.wire_bytes(shapes, 2) for shapes in r["shapes"])
    # fragment 0 starts at steps 2, 6, 10, 14 and fragment 1 at 4, 8, 12, 16 (1-based); nothing else is sent
    want = [0, f0, 0, f1] * 4
    assert r["traffic"] == want
    losses = [sum(x["losses"][i] for x in results) / 2 for i in range(16)]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.2, losses


def _streaming_checkpointed(comm, path: str, steps: int, save_at: int | None, resume: bool):
    from shardwise.async_sgd import StreamingDiLoCo

    model = StreamingDiLoCo(GPT(CONFIG, seed=0), comm, sync_every=4, fragments=2, overlap_steps=1,
                            compression=sw.compression.TopK(ratio=0.05))

    def in_flight(model, synced):
        assert model.in_flight  # saved with a compressed synchronisation in flight

    checkpointed_run(model, comm, path, steps, save_at, resume, before_save=in_flight)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_streaming_with_compression_resumes_from_save_checkpoint_bit_for_bit(tmp_path):
    path = str(tmp_path / "ckpt")
    full = sw.launch(_streaming_checkpointed, 2, path, 12, 6, False)
    resumed = sw.launch(_streaming_checkpointed, 2, path, 12, None, True)
    for state, want in zip(resumed, full):
        assert all(torch.equal(state[k], want[k]) for k in want)
