"""Docs that cannot go stale: every ``spark_torch.…`` name in docs/, README and the package's own
docstrings and comments resolves to a module or an attribute that exists, and
docs/architecture.md names every module of the package."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "spark_torch"
#: a dotted name under spark_torch (a trailing dot ends a sentence, not the name)
REFERENCE = re.compile(r"(?<![\w/.-])spark_torch(?:\.[A-Za-z_]\w*)+")
#: file names that look like references but are not Python names
NOT_NAMES = {"spark_torch.zip", "spark_torch.egg", "spark_torch.log"}
#: MLflow parameter and tag names that the tracker logs ("spark_torch.world_size"): string
#: literals of driver/console/tracker.py, not Python names
MLFLOW_NAMES = set(
    re.findall(r'"(spark_torch\.\w+)"', (PACKAGE / "driver" / "console" / "tracker.py").read_text(encoding="utf-8"))
)


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


def _modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).with_suffix("")
        if relative.name == "__init__":
            relative = relative.parent
        names.append(".".join(relative.parts))
    return names


@pytest.mark.parametrize("module", _modules())
def test_architecture_names_every_module(module: str) -> None:
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    short = module.removeprefix("spark_torch.")
    relative = short.replace(".", "/")
    named = (module, f"`{short}`", f"{relative}.py", f"{relative}/")
    assert module == "spark_torch" or any(n in page for n in named), f"docs/architecture.md does not name {module}"


def test_the_test_map_names_every_test_file_and_helper() -> None:
    page = (ROOT / "tests" / "README.md").read_text(encoding="utf-8")
    files = [p for p in (ROOT / "tests").rglob("*.py") if p.name != "__init__.py" and "scripts" not in p.parts]
    missing = sorted(str(p.relative_to(ROOT / "tests")) for p in files if p.name not in page)
    assert not missing, f"tests/README.md does not name: {missing}"


#: a code span in Markdown
CODE_SPAN = re.compile(r"`([^`\n]+)`")
#: a relative path the docs cite: a file with an extension, or a folder ending in "/"
CITED_PATH = re.compile(r"^[\w.-]+(?:/[\w.-]+)*(?:\.(?:py|md|toml|txt|ipynb|json|sh|cfg|yml)|/)$")
#: settings that name a folder of the user's: a path under one is theirs, not the tree's
USER_FOLDERS = {"log_dir", "storage_path"}
#: folders that commands fill, cited as where their output goes
GENERATED = ("benchmarks/results/",)
#: where the tree keeps files a doc may cite by their bare name
_SEARCHED = ("spark_torch", "tests", "benchmarks", "examples", "notebooks", "docs", ".ci")


def _doc_pages() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "tests" / "README.md",
        ROOT / "benchmarks" / "README.md",
    ]


def _path_exists(cited: str) -> bool:
    if (ROOT / cited).exists() or (PACKAGE / cited).exists():
        return True
    # a bare or partial path ("local.py", "template/server.py") names a file somewhere in the tree
    tail = cited.rstrip("/")
    return any(p.as_posix().endswith("/" + tail) for top in _SEARCHED for p in (ROOT / top).rglob(Path(tail).name))


def test_every_cited_file_path_exists() -> None:
    """Every file or folder path a doc cites in a code span (`driver/run/barrier.py`, `tests/`)
    exists: a module renamed or removed cannot stay in the docs."""
    stale = []
    for page in _doc_pages():
        for span in CODE_SPAN.findall(page.read_text(encoding="utf-8")):
            if not CITED_PATH.match(span) or span.startswith("spark_torch.") and not span.endswith(".py"):
                continue
            if any(ch.isupper() for ch in span.replace(".md", "").replace("README", "")):
                continue  # a placeholder such as RUN_ID/attempt-N/
            if span.split("/", 1)[0] in USER_FOLDERS:
                continue  # inside a folder the user names (`log_dir/flight-recorder/...`)
            if span.startswith(GENERATED):
                continue  # written by a command the doc shows (benchmarks/run.py --quick)
            if not _path_exists(span):
                stale.append(f"{page.relative_to(ROOT)}: {span}")
    assert not stale, "paths the docs cite that do not exist:\n" + "\n".join(stale)


#: a module-qualified name in architecture.md: `lines.RankOutput`, `driver.run`, `stall.StallWatch`
QUALIFIED = re.compile(r"^[a-z_]\w*(?:\.[A-Za-z_]\w*)+$")


def test_every_module_qualified_name_in_architecture_resolves() -> None:
    """architecture.md names things by their module (`lines.RankOutput`, `driver.run`): each
    resolves under spark_torch, by its full path or by a module's own name."""
    modules = _modules()
    stale = []
    for span in CODE_SPAN.findall((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")):
        if not QUALIFIED.match(span) or CITED_PATH.match(span):
            continue  # not a qualified name, or a file name (`pyproject.toml`)
        first, _, rest = span.partition(".")
        owners = [m for m in modules if m == f"spark_torch.{first}" or m.endswith(f".{first}")]
        if not any(_resolves(f"{owner}.{rest}") for owner in owners):
            stale.append(span)
    assert not stale, "names in docs/architecture.md that do not resolve: " + ", ".join(stale)
