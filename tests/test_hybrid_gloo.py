"""The 3-D composition on real processes: one launch of 4 gloo processes trains the GPT as dp2 x pp2 with ZeRO-3
(and, in the same launch, dp2 x tp2 with ZeRO-3 and sequence parallel), each matching one process."""

from __future__ import annotations

import pytest
import torch
from compose_cases import dense_clipped, optimizer
from parity import CONFIG, RTOL, batch

import shardwise as sw
from shardwise.models import GPT

STEPS, MAX_NORM = 3, 0.3


def reference():
    return {k: v.detach().clone() for k, v in dense_clipped(STEPS, MAX_NORM).state_dict().items()}


def _train(comm, tp, pp, sp):
    mesh = sw.Mesh(comm, dp=2, tp=tp, pp=pp)
    model = sw.parallelize(GPT(CONFIG, seed=0), mesh, tp_plan="gpt" if tp > 1 else None, sequence_parallel=sp,
                           dp_strategy="zero3")
    opt = optimizer(model.parameters())
    for step in range(STEPS):
        x, y = batch(step, mesh.coords.dp, 2)
        model.step(x, y)
        sw.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
    return sw.full_state_dict(model)


def _both(comm):
    return {"dp2-pp2": _train(comm, 1, 2, False), "dp2-tp2-sp": _train(comm, 2, 1, True)}


@pytest.mark.multiprocess
def test_gloo_dp_pp_and_dp_tp_with_zero3_match_one_process():
    want = reference()
    for per_rank in sw.launch(_both, 4, backend="gloo", timeout=120):
        for case, state in per_rank.items():
            assert state.keys() == want.keys(), case
            for name in want:
                torch.testing.assert_close(state[name], want[name], rtol=RTOL, atol=1e-5,
                                           msg=lambda m: f"{case} {name}: {m}")
