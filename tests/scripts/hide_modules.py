"""Written as ``sitecustomize.py`` beside an executor Python wrapper: the top-level modules
named in ``SPARK_TORCH_TEST_HIDE`` (comma-separated) cannot be imported or found, as on an
executor without them; spark_torch from a zip (what the driver ships) still can."""

import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType

_HIDDEN = set(filter(None, os.environ.get("SPARK_TORCH_TEST_HIDE", "").split(",")))


class _Hide:
    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name.split(".")[0] not in _HIDDEN:
            return None
        spec = PathFinder.find_spec(name, path, target)
        if spec is not None and ".zip" in str(spec.origin):
            return spec
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, _Hide())
