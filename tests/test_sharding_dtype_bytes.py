"""Mixed precision without waste: each collective moves exactly the bytes of its dtype policy.

Parameters are gathered in `param_dtype` (bf16: half the all-gather bytes of fp32) and gradients reduce-scattered in
`reduce_dtype`; the expected bytes are the unit layout's padded sizes times each dtype's element size.
"""

from __future__ import annotations


import pytest
import torch
from sharding_cases import padded_units, train_sharded

import shardwise as sw

POLICIES = {
    "fp32": (None, None),
    "bf16": (torch.bfloat16, None),  # reduce_dtype None with a param_dtype: fp32 reductions
    "bf16-reduce-bf16": (torch.bfloat16, torch.bfloat16),
    "fp16-reduce-fp32": (torch.float16, torch.float32),
}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_bytes_per_step_follow_the_dtype_policy(name, policy):
    param_dtype, reduce_dtype = POLICIES[policy]
    gather_size = (param_dtype or torch.float32).itemsize
    reduce_size = (reduce_dtype or torch.float32).itemsize
    mp = sw.MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    world = 2
    padded, root, last, reduced = padded_units(name, world)
    psi = sum(padded)
    per_step = sw.launch(lambda comm: train_sharded(comm, name, 3, mixed_precision=mp), world)[0][1]
    for step in per_step[1:]:  # from the 2nd step on, stage 2's post-step all-gather is in every step
        assert step["reduce_scatter"]["bytes"] == reduce_size * sum(reduced)  # the gradients and their used flags
        # ZeRO-3 gathers every unit in forward and all but the root and the last forward unit again in backward.
        gathered = psi if name == "zero2" else 2 * psi - root - last
        assert step["all_gather"]["bytes"] == gather_size * gathered
