"""Streaming DiLoCo: F = 1 and tau = 0 is DiLoCo bit for bit; F fragments synchronise on their staggered schedule
(peak bytes ~1/F); overlap and mixing train; the state resumes exactly; bad options are named."""

from __future__ import annotations

import io

import pytest
import torch
from local_sgd_cases import checkpointed_run, inner_optimizer, outer_state_run, state_of, train_inner_steps
from parity import CONFIG, assert_state_close, batch

import shardwise as sw
from shardwise.async_sgd import DiLoCo, StreamingDiLoCo
from shardwise.async_sgd.fragments import block_of, split_fragments
from shardwise.models import GPT


def wrap(comm, kind: str, h: int, **options):
    model = GPT(CONFIG, seed=0)
    if kind == "diloco":
        return DiLoCo(model, comm, sync_every=h)
    return StreamingDiLoCo(model, comm, sync_every=h, **options)


def train(comm, kind: str, steps: int, h: int, options: dict, inner: str = "adamw"):
    """Train on this rank's slice of each global batch; return (state, losses, all_reduce bytes of each step)."""
    model = wrap(comm, kind, h, **options)
    steps_run = train_inner_steps(model, comm, steps, inner)
    losses, traffic = [s.loss for s in steps_run], [s.measured.bytes("all_reduce") for s in steps_run]
    return state_of(model), losses, traffic


def assert_equal_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_one_fragment_without_overlap_is_diloco_bit_for_bit():
    streaming = sw.launch(train, 2, "streaming", 8, 2, {"fragments": 1, "overlap_steps": 0})
    diloco = sw.launch(train, 2, "diloco", 8, 2, {})
    for (s, ls, ts), (d, ld, td) in zip(streaming, diloco):
        assert_equal_bits(s, d)
        assert ls == ld and ts == td
    # ... and DiLoCo(fragments=1, overlap_steps=0) stays the plain DiLoCo (LocalSGD) wrapper
    assert type(DiLoCo(GPT(CONFIG, seed=0), sw.init(), sync_every=2)).__name__.startswith("LocalSGD")


def test_split_into_blocks():
    names = [n for n, _ in GPT(CONFIG, seed=0).named_parameters()]
    assert block_of("blocks.1.attn.qkv.weight") == "blocks.1" and block_of("tok_emb.weight") == "tok_emb"
    sizes = [p.numel() * 4 for p in GPT(CONFIG, seed=0).parameters()]
    seq = split_fragments(names, sizes, 2)
    assert sorted(i for f in seq for i in f) == list(range(len(names)))
    assert all(f == sorted(f) for f in seq) and seq[0][-1] < seq[1][0]  # consecutive blocks
    assert {block_of(names[i]) for i in seq[1]} == {"blocks.1", "ln_f"}  # cut at the byte midpoint
    strided = split_fragments(names, sizes, 2, "strided")  # blocks: tok_emb, pos_emb, blocks.0, blocks.1, ln_f
    assert {block_of(names[i]) for i in strided[0]} == {"tok_emb", "blocks.0", "ln_f"}
    assert len(split_fragments(names, sizes, 5)) == 5


def test_fragments_synchronise_on_their_staggered_schedule():
    """H = 8, F = 4 (tiny GPT: 5 blocks), tau = 0: fragment f sends its outer gradient at steps 2(f+1) + 8k, so one
    fragment every 2 steps, never the whole model at once; the bytes of one H-round equal DiLoCo's one sync."""
    world, h, f, steps = 2, 8, 4, 16
    results = sw.launch(train, world, "streaming", steps, h, {"fragments": f})
    traffic = results[0][2]
    assert [b > 0 for b in traffic] == [(i + 1) % 2 == 0 for i in range(steps)]
    probe = StreamingDiLoCo(GPT(CONFIG, seed=0), sw.init(), sync_every=h, fragments=f)
    frag_bytes = [x["bytes"] for x in probe.fragments]
    assert [x["offset"] for x in probe.fragments] == [2, 4, 6, 8]
    # ring all-reduce of a fragment's outer gradient: 2 (N-1) / N x its bytes, N = 2
    assert traffic[1:8:2] == frag_bytes
    model_bytes = sum(p.numel() * p.element_size() for p in GPT(CONFIG, seed=0).parameters())
    assert sum(traffic[:h]) == model_bytes == sum(traffic[h:])  # same bytes per H steps as DiLoCo
    assert max(traffic) < 0.45 * model_bytes  # peak ~1/F of DiLoCo's (blocks are not equal: the largest is ~0.38)
    diloco = sw.launch(train, world, "diloco", h, h, {})[0][2]
    assert max(diloco) == model_bytes


def _overlap_run(comm, steps, h, options, eps=1e-8):
    model = StreamingDiLoCo(GPT(CONFIG, seed=0), comm, sync_every=h, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=eps)
    applied, in_flight = [], []
    losses = []
    for step in range(steps):
        x, y = batch(step, comm.rank, comm.size)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        applied.append(model.step())
        in_flight.append(dict(model.in_flight))
        losses.append(float(loss.detach()))
    before = state_of(model)
    model.sync()
    return {"applied": applied, "in_flight": in_flight, "losses": losses, "before": before, "after": state_of(model)}


def test_overlapped_syncs_land_tau_steps_later_and_training_lowers_the_loss():
    h, f, tau, steps = 8, 2, 3, 24
    results = sw.launch(_overlap_run, 2, steps, h, {"fragments": f, "overlap_steps": tau, "alpha": 0.5})
    r = results[0]
    # fragment 0 starts at steps 4, 12, 20 and fragment 1 at 8, 16, 24 (1-based); each lands 3 steps later
    due = [i + 1 for i, a in enumerate(r["applied"]) if a]
    assert due == [7, 11, 15, 19, 23]
    assert r["in_flight"][3] == {0: 7} and r["in_flight"][7] == {1: 11} and r["in_flight"][23] == {1: 27}
    # with mixing (alpha 0.5) the workers' replicas differ even right after an update; sync() makes them equal
    diff = max((results[0]["before"][k] - results[1]["before"][k]).abs().max().item() for k in r["before"])
    assert diff > 1e-5
    assert_equal_bits(results[0]["after"], results[1]["after"])
    losses = [sum(x["losses"][i] for x in results) / 2 for i in range(steps)]
    assert sum(losses[-4:]) / 4 < losses[0] - 0.3, losses


def test_mixing_weights_local_and_global_values():
    """One rank, tau = 1: at the landing step the fragment is alpha * local + (1 - alpha) * new global, where the
    new global is the anchor stepped by the outer SGD on the outer gradient taken one step earlier."""
    comm = sw.init()
    h, alpha = 4, 0.25
    model = StreamingDiLoCo(GPT(CONFIG, seed=0), comm, sync_every=h, fragments=1, overlap_steps=1, alpha=alpha,
                            outer_lr=0.5, outer_momentum=0.0)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(h + 1):
        x, y = batch(step)
        model(x, y).backward()
        with torch.no_grad():  # SGD by hand (lr 0.1): model.step() then counts, after the values are read below
            for p in model.parameters():
                p.sub_(0.1 * p.grad)
                p.grad = None
        if step == h - 1:
            at_start = {n: p.detach().clone() for n, p in model.named_parameters()}
        if step == h:
            local = {n: p.detach().clone() for n, p in model.named_parameters()}
        applied = model.step()
    assert applied
    for n, p in model.named_parameters():
        new_global = start[n] - 0.5 * (start[n] - at_start[n])
        torch.testing.assert_close(p.detach(), alpha * local[n] + (1 - alpha) * new_global, rtol=1e-6, atol=1e-7)


def _resume_run(comm, steps, h, options, inner, resume_from=None, save_at=None):
    model = StreamingDiLoCo(GPT(CONFIG, seed=0), comm, sync_every=h, **options)
    return outer_state_run(model, comm, inner_optimizer(model.parameters(), inner), steps, resume_from, save_at)


def test_outer_state_round_trips_with_syncs_in_flight_and_resumes_bit_for_bit():
    h, options = 8, {"fragments": 2, "overlap_steps": 3}
    # saved after step 6: fragment 0 (started at step 4) is in flight, due at step 7; both momenta are real
    full = sw.launch(_resume_run, 2, 20, h, options, "adamw", None, 6)
    saved = torch.load(io.BytesIO(full[0][1]), weights_only=True)["outer"]
    assert saved["pending"].keys() == {0} and saved["pending"][0]["due"] == 7
    outer = full[0][2]
    assert outer["syncs"] == 4 and len(outer["outer_optimizers"]) == 2
    assert all(o["state"][0]["momentum_buffer"].abs().max() > 0 for o in outer["outer_optimizers"])
    resumed = sw.launch(_resume_run, 2, 14, h, options, "adamw", [r[1] for r in full])
    for (state, _, _), (want, _, _) in zip(resumed, full):
        assert_equal_bits(state, want)


def _checkpoint_run(comm, path, steps, h, options, resume):
    torch.manual_seed(0)
    model = StreamingDiLoCo(GPT(CONFIG, seed=0), comm, sync_every=h, **options)
    checkpointed_run(model, comm, path, steps, None if resume else 6, resume)
    return state_of(model), model.in_flight


def test_save_checkpoint_mid_flight_resumes_bit_for_bit(tmp_path):
    """Through sw.save_checkpoint: the replicated outer state (with the sync in flight) and each worker's own
    values, which differ (mixing), come back; the resumed run lands on the uninterrupted one's bits."""
    path = str(tmp_path / "ckpt")
    h, options = 8, {"fragments": 2, "overlap_steps": 3}
    full = sw.launch(_checkpoint_run, 2, path, 14, h, options, False)
    resumed = sw.launch(_checkpoint_run, 2, path, 14, h, options, True)
    diff = max((full[0][0][k] - full[1][0][k]).abs().max().item() for k in full[0][0])
    assert diff > 1e-5  # the workers differ at the end: the per-rank values matter
    for (state, flight), (want, want_flight) in zip(resumed, full):
        assert_equal_bits(state, want)
        assert flight == want_flight


def test_load_mismatches_are_named():
    comm = sw.init()
    two = StreamingDiLoCo(GPT(CONFIG, seed=0), comm, sync_every=8, fragments=2)
    three = StreamingDiLoCo(GPT(CONFIG, seed=0), comm, sync_every=8, fragments=3)
    with pytest.raises(ValueError, match="saved with fragments=2, this StreamingDiLoCo has fragments=3"):
        three.load_outer_state_dict(two.outer_state_dict())
    saved = two.outer_state_dict()
    saved["pending"] = {0: {"due": 1, "flats": [torch.zeros(3)]}}
    with pytest.raises(ValueError, match="due at step 1, outside"):
        two.load_outer_state_dict(saved)


@pytest.mark.parametrize("kwargs, words", [
    ({"fragments": 6}, r"fragments=6 but the model has 5 layer blocks .*allowed: 1 to 5"),
    ({"fragments": 0}, r"fragments=0 must be a positive int"),
    ({"fragments": 2, "sync_every": 1}, r"fragments=2 must be at most sync_every=1"),
    ({"overlap_steps": 8}, r"overlap_steps=8 must be an int in \[0, sync_every\) = \[0, 8\)"),
    ({"overlap_steps": -1}, r"overlap_steps=-1 must be an int"),
    ({"alpha": 1.0}, r"alpha=1.0 must be a number in \[0, 1\)"),
    ({"pattern": "random"}, r"pattern='random'; allowed: 'sequential', 'strided'"),
])
def test_bad_options_are_named(kwargs, words):
    options = {"sync_every": 8} | kwargs
    with pytest.raises(ValueError, match=words):
        StreamingDiLoCo(GPT(CONFIG, seed=0), sw.init(), **options)


def test_diloco_streaming_options():
    with pytest.raises(ValueError, match="does not take reduce="):
        DiLoCo(GPT(CONFIG, seed=0), sw.init(), sync_every=8, fragments=2, reduce=lambda c, f: None)
    with pytest.raises(ValueError, match="compression='fp16' must be None or a sw.compression method"):
        StreamingDiLoCo(GPT(CONFIG, seed=0), sw.init(), sync_every=8, fragments=2, compression="fp16")
    model = DiLoCo(GPT(CONFIG, seed=0), sw.init(), sync_every=8, fragments=2, overlap_steps=1)
    assert model.overlap_steps == 1 and model.alpha == 0.0 and len(model.outer_optimizers) == 2


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_gloo_processes_equal_thread_ranks():
    """The same overlapped run on 2 gloo processes (async all-reduce on gloo's thread, AVG as SUM / 2) and on 2
    thread ranks: the same replicas, the same landing steps (Adam eps 1e-6: parity.py says why)."""
    args = (12, 4, {"fragments": 2, "overlap_steps": 1}, 1e-6)
    gloo = sw.launch(_overlap_run, 2, *args, backend="gloo", timeout=60)
    threads = sw.launch(_overlap_run, 2, *args)
    for g, t in zip(gloo, threads):
        assert g["applied"] == t["applied"] and g["in_flight"] == t["in_flight"]
        assert_state_close(g["before"], t["before"])
        assert_state_close(g["after"], t["after"])
