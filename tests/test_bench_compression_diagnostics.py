"""bench/compression.py's diagnostics, which docs/compression.md's "Delay" section rests on: the `late1` compressor
applies every rank's whole gradient exactly one step late (zeros first, nothing lost, the fp32 all-reduce's
bytes), and `--ef-beta1` changes Adam's beta1 for the error-feedback rows and `none_ef_beta1` only, never for
`none`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

import shardwise as sw

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_compression", BENCH / "compression.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_late1_averages_each_step_the_previous_steps_gradients_with_fp32_bytes():
    bench = _bench()
    grads = [[torch.randn(37, generator=torch.Generator().manual_seed(10 * r + s)) for s in range(3)]
             for r in range(2)]

    def body(comm):
        late = bench._OneStepLate().fresh()
        out = []
        for step in range(3):
            flat = grads[comm.rank][step].clone()
            before = comm.stats.snapshot()
            late.reduce("b", flat, comm).wait()
            assert comm.stats.since(before).wire_bytes() == late.wire_bytes(37, comm.size)
            out.append(flat)
        return out

    for result in sw.launch(body, 2):
        assert torch.equal(result[0], torch.zeros(37))
        for step in (1, 2):
            torch.testing.assert_close(result[step], (grads[0][step - 1] + grads[1][step - 1]) / 2)


def test_ef_beta1_reaches_the_error_feedback_rows_only():
    bench = _bench()
    cfg = bench.Config("tiny", 2, 1, 1, 1, 0, (), ("none", "topk"), 4, 0, 0.01, 1, 0.1, ef_beta1=0.0)
    params = [torch.nn.Parameter(torch.zeros(2))]
    for row in bench.EF_BETA1_ROWS:  # the error-feedback rows and their same-beta1 uncompressed baseline
        assert bench._optimizer(params, cfg, row).defaults["betas"] == (0.0, 0.999)
    for row in ("none", "fp16", "powersgd", "zero2"):
        assert bench._optimizer(params, cfg, row).defaults["betas"] == (0.9, 0.999)
