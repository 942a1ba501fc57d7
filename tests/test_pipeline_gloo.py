"""Pipeline parity on gloo processes: every schedule at p = 2 (m = 8) and p = 4 (m = 4), 3 steps, in ONE launch of 4
processes.

Process start-up (importing torch, and torch._dynamo on the first optimizer) dominates on a small machine, so the
p = 2 pipelines run on the two halves of the same 4-process world (a split communicator each), then p = 4 on all.
The full p x m matrix (m = 4 and 8 at each p) runs on thread ranks (test_pipeline_executor.py), whose strict mode
already holds point to point to NCCL's rules (unbuffered, in order); here each schedule's sends and receives cross
real process boundaries once per p, with both values of m between them. The same launch then trains the dict-style
decoder of test_pipeline_structured.py (bool and int64 leaves, gradient flags) interleaved over the 4 ranks, with a
predict to every rank first.
"""

from __future__ import annotations

import pytest
import torch
from parity import assert_state_close
from test_pipeline_executor import CONFIG, gathered, reference, train_pipeline
from test_pipeline_structured import _close_dict, batch, decoder, forward_all, train
from test_pipeline_structured import reference as structured_reference

import shardwise as sw
from shardwise import pipeline as pp
from shardwise.models import GPT

MICROBATCHES = {2: 8, 4: 4}  # pipeline size -> microbatches
STEPS = 3


def _every_schedule(comm, model, layers):
    """Module level so spawned ranks can import it. Returns {(p, schedule, m): (parameters, losses)} and what
    `train` of test_pipeline_structured returns for the dict-style decoder (predict before the first step)."""
    results = {}
    half = comm.split(comm.rank // 2)  # ranks {0, 1} and {2, 3}: two independent 2-stage pipelines
    for pipeline_comm in (half, comm):
        m = MICROBATCHES[pipeline_comm.size]
        for name in pp.SCHEDULES:
            state, losses, _, _ = train_pipeline(pipeline_comm, name, m, steps=STEPS, model=model)
            results[(pipeline_comm.size, name, m)] = (state, losses)
    return results, train(comm, layers, "dict", "interleaved_1f1b", 4, 0)


@pytest.fixture(scope="module")
def want():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference(CONFIG, STEPS)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def want_structured():
    return structured_reference("dict")


@pytest.mark.multiprocess
def test_gloo_every_schedule_matches_one_process(want, want_structured):
    want_state, want_losses = want
    launched = sw.launch(_every_schedule, 4, GPT(CONFIG, seed=0), decoder("dict"), backend="gloo", timeout=120)
    results = [r[0] for r in launched]
    assert len(results[0]) == len(MICROBATCHES) * len(pp.SCHEDULES)
    for key in results[0]:
        groups = [results[:2], results[2:]] if key[0] == 2 else [results]
        for ranks in groups:
            per_rank = [r[key] for r in ranks]
            assert_state_close(gathered(per_rank), want_state)
            for _, losses in per_rank:
                assert losses == pytest.approx(want_losses, rel=1e-5), key
    with torch.no_grad():
        want_predicted = forward_all(decoder("dict"), batch(0, "dict")[0])
    assert_state_close(gathered([r[1] for r in launched]), want_structured[0])
    for _, (_, losses, predicted) in launched:
        assert losses == pytest.approx(want_structured[1], rel=1e-5)
        _close_dict(predicted, want_predicted)
