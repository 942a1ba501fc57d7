"""Model matrix row: the `frozen` family (tests/families/frozen.py) under every data-parallel strategy, sw.distribute and,
where the family has a plan, tensor parallel: each cell equals one process or is refused clearly (tests/model_matrix.py)."""

from __future__ import annotations

import pytest
from model_matrix import cells, run_cell


@pytest.mark.parametrize("cell", cells("frozen"), ids=str)
def test_cell(cell):
    run_cell("frozen", cell)
