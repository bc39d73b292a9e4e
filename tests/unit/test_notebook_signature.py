"""The notebook check does not depend on how a Jupyter kernel names the file of a cell."""

from __future__ import annotations

import pytest

from tests.notebook_runner import _normalise


@pytest.mark.parametrize(
    "cell_file",
    ["/tmp/ipykernel_1157/586557183.py", "<ipython-input-3-5f1c2d>", "<dynamic-code>"],
)
def test_every_kernels_cell_file_reads_the_same(cell_file: str) -> None:
    line = f'[rank 1]   File "{cell_file}", line 7, in train'
    assert _normalise(line) == '[rank #]   File "<cell>", line #, in train'
