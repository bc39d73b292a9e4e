"""Two run() calls from two threads at once (a notebook's background thread, a service): the
process-global state they touch (cloudpickle's by-value registry, PYSPARK_PYTHON) is guarded."""

from __future__ import annotations

import importlib
import sys
import threading
import time
from pathlib import Path
from typing import Any

from spark_torch import Distributor


class SlowToPickle:
    """Makes a payload's pickling take long enough for two runs' pickling to overlap."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> Any:
        time.sleep(0.3)
        return (int, (self.value,))


def test_two_threads_ship_the_same_user_module_by_value(tmp_path: Path, no_leftovers: None) -> None:
    """Both runs ship a module only the driver can import. Unguarded, one run unregisters the
    module from cloudpickle's by-value registry while the other is still pickling (its
    unregister then fails, or its function goes by reference and cannot be imported)."""
    (tmp_path / "notebook_helpers.py").write_text("def triple(x):\n    return 3 * int(x)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module("notebook_helpers")
        start = threading.Barrier(2)
        results: dict[int, Any] = {}

        def run(i: int) -> None:
            start.wait()
            try:
                results[i] = [Distributor(num_processes=1).run(module.triple, SlowToPickle(i + j)) for j in range(2)]
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                results[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("notebook_helpers", None)
    assert results == {0: [0, 3], 1: [3, 6]}, results
