"""Model matrix row: the `encoder_mlm` family (tests/families/encoder_mlm.py) under every data-parallel strategy, sw.distribute and,
where the family has a plan, tensor parallel: each cell equals one process or is refused clearly (tests/model_matrix.py)."""

from __future__ import annotations

import pytest
from model_matrix import cells, run_cell


@pytest.mark.parametrize("cell", cells("encoder_mlm"), ids=str)
def test_cell(cell):
    run_cell("encoder_mlm", cell)
