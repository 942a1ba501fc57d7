"""The model matrix on real processes: one cell per family (ZeRO-3; the conv net with SyncBatchNorm) on 2 gloo
ranks, in `make soak` (a few seconds of process start-up each; the thread-rank cells run in make test)."""

from __future__ import annotations

import pytest
from families import FAMILIES
from model_matrix import gloo_cell, run_cell

pytestmark = [pytest.mark.soak, pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_on_gloo_processes(family):
    run_cell(family, gloo_cell(family), backend="gloo")
