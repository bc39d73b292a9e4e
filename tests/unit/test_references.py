"""Docs that cannot go stale: every ``spark_torch.…`` name in docs/, README and the package's own
docstrings and comments resolves to a module or an attribute that exists."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "spark_torch"
#: a dotted name under spark_torch (a trailing dot ends a sentence, not the name)
REFERENCE = re.compile(r"(?<![\w/.-])spark_torch(?:\.[A-Za-z_]\w*)+")
#: file names that look like references but are not Python names
NOT_NAMES = {"spark_torch.zip", "spark_torch.egg", "spark_torch.log"}
#: MLflow parameter and tag names that the tracker logs ("spark_torch.world_size"): string
#: literals of driver/tracker.py, not Python names
MLFLOW_NAMES = set(re.findall(r'"(spark_torch\.\w+)"', (PACKAGE / "driver" / "tracker.py").read_text(encoding="utf-8")))


def _texts() -> list[tuple[str, str]]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(PACKAGE.rglob("*.py"))]
    return [(str(f.relative_to(ROOT)), f.read_text(encoding="utf-8")) for f in files]


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif dataclasses.is_dataclass(obj) and attr in {f.name for f in dataclasses.fields(obj)}:
                return True  # a field with a default factory: not a class attribute
            else:
                return False
        return True
    return False


def test_every_reference_resolves() -> None:
    stale = []
    for where, text in _texts():
        for match in REFERENCE.finditer(text):
            name = match.group(0)
            if name in NOT_NAMES or name in MLFLOW_NAMES or any(name.startswith(n + ".") for n in NOT_NAMES):
                continue
            if where.endswith(".py") and text[match.end() : match.end() + 1] == "-":
                continue  # a thread name such as spark_torch.x-N
            if not _resolves(name):
                stale.append(f"{where}: {name}")
    assert not stale, "references to names that do not exist:\n" + "\n".join(sorted(set(stale)))
