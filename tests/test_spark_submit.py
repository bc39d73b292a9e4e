"""spark-submit of a driver script (tests/scripts/submit_driver.py) on ``local-cluster``.

The driver runs in its own spark-submit process (not in pytest's), so it needs no session
fixture; the standalone-master variant lives in tests/test_standalone.py next to its cluster.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import CLUSTER_MASTER, SCRIPTS
from .standalone import check_submit_output, submit

pytestmark = pytest.mark.slow


def test_spark_submit_local_cluster(tmp_path: Path, no_leftovers: None) -> None:
    proc = submit(
        [
            "--master",
            CLUSTER_MASTER,
            "--conf",
            "spark.driver.host=127.0.0.1",
            "--conf",
            "spark.ui.enabled=false",
            str(SCRIPTS / "submit_driver.py"),
        ],
        cwd=tmp_path,
    )
    check_submit_output(proc.returncode, proc.stdout)
