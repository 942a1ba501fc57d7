"""Context parallel composed with tensor parallel in `sw.parallelize` (torchtitan's order: tp, then cp, ...).

Each tensor-parallel rank's attention holds n_heads / tp heads; ring attention or Ulysses runs on those among the cp
ranks of the same tp coordinate (mesh.cp). Three AdamW steps (weight decay, a binding clip) of the GPT on
cp=2 x dp=2 x tp=2 thread ranks, with and without sequence parallel (the sequence split over tp inside each cp
chunk), equal one process on the global batch; so does a HuggingFace Llama composed by hand (llama plan, then cp, then
DDP over dp x cp). A checkpoint saved under cp=2 x tp=2 reloads bit for bit into ZeRO-3 over 4 ranks and into one
process, and the next step matches. Ulysses with n_heads / tp not divisible by cp is refused at wrap time by name."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from checkpoint_cases import state_equal
from hf_cases import tiny_llama

import shardwise as sw
from shardwise import context_parallel as cp
from shardwise import tensor_parallel as tp
from shardwise.checkpoint import read_tensors
from shardwise.data import ByteCorpus
from shardwise.models import GPT, GPTConfig
from shardwise.planner import Activations, Links, Workload, costs, estimate, parse_strategy

CONFIG = GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=8, n_layers=2)
CORPUS = ByteCorpus(max_bytes=100_000)
STEPS, MAX_NORM, BATCH = 3, 0.05, 4


def batch(step):
    return CORPUS.batch(step, BATCH, CONFIG.seq_len)


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-5, weight_decay=0.1)


def rows(mesh_or_none, x):
    """This dp rank's rows of the global batch (every cp and tp rank of it gets the same rows)."""
    if mesh_or_none is None:
        return x
    dp, index = mesh_or_none.sizes["dp"], mesh_or_none.coords.dp
    return x[index * BATCH // dp:(index + 1) * BATCH // dp]


def train(comm, axes, options, steps=STEPS):
    """(full state dict, losses, clip norms) of `steps` steps of the GPT; axes None: one process."""
    mesh = sw.Mesh(comm, **axes) if axes is not None else None
    model = sw.parallelize(GPT(CONFIG, seed=0), mesh, **options) if mesh is not None else GPT(CONFIG, seed=0)
    opt = optimizer(model.parameters())
    losses, norms = [], []
    for step in range(steps):
        x, y = batch(step)
        if mesh is None:
            loss = model(x, y)
            loss.backward()
        else:
            loss = model.step(rows(mesh, x), rows(mesh, y))
        norms.append(float(sw.clip_grad_norm_(model, MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return sw.full_state_dict(model), losses, norms


@pytest.fixture(scope="module")
def reference():
    state, losses, norms = sw.launch(train, 1, None, {})[0]
    assert min(norms) > MAX_NORM  # the clip binds at every step
    return state, losses, norms


CASES = {
    "cp2_dp2_tp2_ring": ({"dp": 2, "cp": 2, "tp": 2}, {"tp_plan": "gpt"}),
    "cp2_dp2_tp2_ring_sp": ({"dp": 2, "cp": 2, "tp": 2}, {"tp_plan": "gpt", "sequence_parallel": True}),
    "cp2_dp2_tp2_ulysses": ({"dp": 2, "cp": 2, "tp": 2}, {"tp_plan": "gpt", "cp_method": "ulysses"}),
    "cp2_dp2_tp2_ulysses_sp_zero3": ({"dp": 2, "cp": 2, "tp": 2}, {"tp_plan": "gpt", "sequence_parallel": True,
                                                                   "cp_method": "ulysses", "dp_strategy": "zero3"}),
    "cp2_tp2_pp2_sp": ({"dp": 1, "cp": 2, "tp": 2, "pp": 2}, {"tp_plan": "gpt", "sequence_parallel": True,
                                                              "n_microbatches": 2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cp_with_tp_trains_like_one_process(case, reference):
    axes, options = CASES[case]
    want, want_losses, want_norms = reference
    world = axes["dp"] * axes["cp"] * axes["tp"] * axes.get("pp", 1)
    for state, losses, norms in sw.launch(train, world, axes, options):
        assert norms == pytest.approx(want_norms, rel=1e-5)
        if axes["dp"] == 1:  # the step's loss is the whole batch's (a dp rank reports its own rows')
            assert losses == pytest.approx(want_losses, rel=1e-5)
        assert set(state) == set(want)
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_ulysses_needs_the_local_heads_divisible_by_cp():
    """n_heads=6 over tp=2 leaves 3 heads per rank: Ulysses over cp=2 cannot split them (6 could be; the ring can)."""
    six = GPTConfig(vocab_size=256, seq_len=32, d_model=48, n_heads=6, n_layers=1)

    def body(comm):
        mesh = sw.Mesh(comm, cp=2, tp=2)
        with pytest.raises(ValueError, match=r"cp_method='ulysses' needs the heads of each tensor-parallel rank, "
                                             r"n_heads=6 / tp=2 = 3, divisible by cp=2"):
            sw.parallelize(GPT(six, seed=0), mesh, tp_plan="gpt", cp_method="ulysses")
        with pytest.raises(ValueError, match=r"cp_method='bogus'; allowed \('ring', 'ulysses'\)"):
            sw.parallelize(GPT(six, seed=0), mesh, tp_plan="gpt", cp_method="bogus")
        model = GPT(six, seed=0)
        with pytest.raises(ValueError, match=r"method='ulysses' needs the heads of each tensor-parallel rank"):
            cp.apply(tp.parallelize(model, mesh.tp, "gpt"), mesh.cp, method="ulysses")
        sw.parallelize(GPT(six, seed=0), mesh, tp_plan="gpt", cp_method="ring")
        return True

    assert all(sw.launch(body, 4))


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_cp_traffic_is_the_local_heads_share(method):
    """Under tp each rank's attention holds n_heads / tp heads, so its ring (or all-to-all) moves 1/tp of the K/V
    bytes of cp alone: what the planner counts for a '5d:...,cp=2,tp=2' layout."""
    def body(comm):
        mesh = sw.Mesh(comm, cp=2, tp=2)
        model = sw.parallelize(GPT(CONFIG, seed=0), mesh, tp_plan="gpt", cp_method=method, n_microbatches=1)
        x, y = batch(0)
        with mesh.cp.stats.measure() as stats:
            model.step(x, y)
        op = "send" if method == "ring" else "all_to_all"
        return stats.wire_bytes(op)

    g = Activations(CONFIG.seq_len, BATCH, CONFIG.d_model, CONFIG.n_layers, CONFIG.n_heads)
    want = costs.context_parallel_wire_bytes(g, 2, dtype="fp32", method=method, tp=2)
    assert sw.launch(body, 4) == [want] * 4
    assert want == costs.context_parallel_wire_bytes(g, 2, dtype="fp32", method=method) / 2
    planned = estimate(parse_strategy("5d:cp=2,tp=2", 4), Workload(1e6, activations=g), Links(4, 4))
    assert planned.wire["cp"] == costs.context_parallel_wire_bytes(g, 2, tp=2)  # bf16 activations by default


# ---- checkpoint round trip: (cp=2, tp=2) -> ZeRO-3 over 4 ranks and one process -----------------------------------
def build(comm, name):
    """The model of layout `name` and its dp coordinate: "cp2_tp2", "zero3" (4 ranks) or "plain"."""
    if name == "plain":
        return GPT(CONFIG, seed=0), None
    if name == "zero3":
        return sw.ZeRO(GPT(CONFIG, seed=0), comm, stage=3), comm
    return sw.parallelize(GPT(CONFIG, seed=0), sw.Mesh(comm, cp=2, tp=2), tp_plan="gpt"), None


def resume(comm, name, steps, load=None, save=None, resave=None):
    model, data = build(comm, name)
    opt = optimizer(model.parameters())
    start = sw.load_checkpoint(load, model, opt, comm=comm)["step"] if load is not None else 0
    if resave is not None:
        sw.save_checkpoint(resave, model, opt, step=start, comm=comm)
    for step in range(start, start + steps):
        x, y = batch(step)
        if isinstance(model, sw.HybridModel):
            model.step(x, y)
        else:
            if data is not None:  # ZeRO-3: this rank's rows of the global batch
                x, y = (t.chunk(data.size)[data.rank] for t in (x, y))
            model(x, y).backward()
        sw.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
    if save is not None:
        sw.save_checkpoint(save, model, opt, step=start + steps, comm=comm)
    return sw.full_state_dict(model)


@pytest.mark.parametrize("dst, world", [("zero3", 4), ("plain", 1)])
def test_checkpoint_from_cp_tp_reloads_on_other_layouts(tmp_path, dst, world):
    saved, again = tmp_path / "cp2_tp2", tmp_path / dst
    sw.launch(resume, 4, "cp2_tp2", 2, None, saved)
    before = read_tensors(saved)
    assert before["param/blocks.0.attn.qkv.weight"].shape == (3 * CONFIG.d_model, CONFIG.d_model)  # whole tensors
    assert any(key.startswith("optim/") for key in before)
    resumed = sw.launch(resume, world, dst, 1, saved, None, again)[0]
    assert state_equal(before, read_tensors(again)) == []  # parameters and AdamW state, bit for bit
    uninterrupted = sw.launch(resume, 4, "cp2_tp2", 3)[0]
    for name, want in uninterrupted.items():
        torch.testing.assert_close(resumed[name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


# ---- a HuggingFace Llama: the llama plan over tp, then cp over the local (grouped-query) heads ---------------------


def llama_train(comm, method):
    """Three AdamW steps with a binding clip; comm None: one process on the whole sequence."""
    model, group = tiny_llama(), None
    if comm is not None:
        mesh = sw.Mesh(comm, cp=2, tp=2)
        model = sw.DDP(cp.apply(tp.parallelize(model, mesh.tp, "llama"), mesh.cp, method=method), mesh.dp_cp)
        group = mesh.cp
    opt = optimizer(model.parameters())
    norms = []
    for step in range(STEPS):
        ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(step))
        x, y = ids[:, :-1], ids[:, 1:]
        if group is not None:
            x, y = cp.split_sequence((x, y), group)
        logits = model(input_ids=x).logits
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        norms.append(float(sw.clip_grad_norm_(model, MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return sw.full_state_dict(model), norms


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_hf_llama_cp2_tp2_trains_like_one_process(method):
    pytest.importorskip("transformers")
    want, want_norms = llama_train(None, method)
    assert min(want_norms) > MAX_NORM
    for state, norms in sw.launch(llama_train, 4, method):
        assert norms == pytest.approx(want_norms, rel=1e-5)
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
