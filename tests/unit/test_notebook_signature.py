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


def test_machine_names_read_the_same() -> None:
    """A temporary directory and this host's name are stored (and compared) as placeholders."""
    import socket
    import tempfile

    tmp = tempfile.gettempdir()
    assert (
        _normalise(f"[rank 0] saved checkpoint to {tmp}/tmpub8dc2hm/digits.pt")
        == "[rank #] saved checkpoint to <tmp>/digits.pt"
    )
    assert _normalise(f"rank 1 on {socket.gethostname()} failed: ValueError") == "rank # on <host> failed: ValueError"


def test_a_numbers_sign_reads_the_same() -> None:
    """A weight near zero prints either sign from run to run (notebook 06 once failed on it); a
    hyphen inside a word or a range is not a sign."""
    assert _normalise("group 0's final weights: [0.12, -0.03, -5e-05]") == _normalise(
        "group 0's final weights: [0.12, 0.03, 5e-05]"
    )
    assert _normalise("rank-1 steps 3-4, loss=-0.5") == "rank-# steps #-#, loss=#"
