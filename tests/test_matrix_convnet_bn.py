"""Model matrix row: the `convnet_bn` family (tests/families/convnet_bn.py) under every data-parallel strategy, sw.distribute and,
where the family has a plan, tensor parallel: each cell equals one process or is refused clearly (tests/model_matrix.py)."""

from __future__ import annotations

import pytest
from model_matrix import cells, run_cell


@pytest.mark.parametrize("cell", cells("convnet_bn"), ids=str)
def test_cell(cell):
    run_cell("convnet_bn", cell)
