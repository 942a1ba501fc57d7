"""Model matrix row: the `decoder_tied` family (tests/families/decoder_tied.py) under every data-parallel strategy, sw.distribute and,
where the family has a plan, tensor parallel: each cell equals one process or is refused clearly (tests/model_matrix.py)."""

from __future__ import annotations

import pytest
from model_matrix import cells, run_cell


@pytest.mark.parametrize("cell", cells("decoder_tied"), ids=str)
def test_cell(cell):
    run_cell("decoder_tied", cell)
