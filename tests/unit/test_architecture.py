"""The layers are enforced: the import contracts in pyproject.toml hold, and they break on an
upward import (checked on a copy of the package with one injected)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = [
    sys.executable,
    "-c",
    "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
]


def _lint(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run(
        [*LINT, "--no-cache", "--config", str(cwd / "pyproject.toml")],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_contracts_hold() -> None:
    done = _lint(ROOT, ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(
    ("module", "upward", "contract"),
    [
        (
            "node/lifecycle.py",
            "import spark_torch.driver.run.barrier",
            "spark_torch.node.lifecycle -> spark_torch.driver.run.barrier",
        ),
        (
            "channel/node_end.py",
            "import spark_torch.reporting.pipes",
            "spark_torch.channel.node_end -> spark_torch.reporting.pipes",
        ),
        ("rank/function_main.py", "import pyspark", "spark_torch.rank.function_main -> pyspark"),
        ("errors.py", "import spark_torch.shared.spec", "spark_torch.errors -> spark_torch.shared.spec"),
        # the driver's sub-layers: Spark access and the console never reach up into the run loop
        (
            "driver/spark/session.py",
            "import spark_torch.driver.run.controller",
            "spark_torch.driver.spark.session -> spark_torch.driver.run.controller",
        ),
        (
            "driver/console/logs.py",
            "import spark_torch.driver.spark.cluster",
            "spark_torch.driver.console.logs -> spark_torch.driver.spark.cluster",
        ),
        (
            "driver/run/plan.py",
            "import spark_torch.driver.api.distributor",
            "spark_torch.driver.run.plan -> spark_torch.driver.api.distributor",
        ),
    ],
)
def test_an_upward_import_breaks_the_contracts(tmp_path: Path, module: str, upward: str, contract: str) -> None:
    shutil.copytree(ROOT / "spark_torch", tmp_path / "spark_torch", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "spark_torch" / module
    target.write_text(target.read_text() + f"\n{upward}  # an upward import\n")
    done = _lint(tmp_path, tmp_path)
    assert done.returncode != 0, done.stdout
    assert contract in done.stdout and "BROKEN" in done.stdout, done.stdout


def test_every_package_says_what_it_may_import() -> None:
    """docs/architecture.md: each sub-package's ``__init__.py`` says what the package may import
    (the contracts in pyproject.toml enforce it)."""
    import ast

    silent = []
    for init in sorted((ROOT / "spark_torch").rglob("__init__.py")):
        if init.parent == ROOT / "spark_torch":
            continue  # the package itself: the public API, lazily
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if not any(line.startswith("May import:") for line in doc.splitlines()):
            silent.append(str(init.relative_to(ROOT)))
    assert silent == [], f"no 'May import:' line in {silent}"


def test_the_top_level_holds_at_most_twelve_modules() -> None:
    """The top level keeps the public modules; the rest is grouped in packages (spark_torch.base,
    spark_torch.shared, the layers)."""
    top = sorted(p.name for p in (ROOT / "spark_torch").glob("*.py"))
    assert len(top) <= 12, top


# -- the import graph itself (tests/unit/import_graph.py): cycles and the rules the docs state ------

from tests.unit.import_graph import cycles, import_graph, path_in  # noqa: E402

#: what the docs call the shared (top-level) modules: below every layer
SHARED = ("spark_torch.shared", "spark_torch.base", "spark_torch.errors", "spark_torch.settings", "spark_torch.version")
#: the one import of the rank layer by the node layer, stated in docs/architecture.md and node/__init__.py:
#: the warm-start template's server imports the ranks' entry modules once, so that every fork starts with them
NODE_IMPORTS_RANK = {
    "spark_torch.node.template.server": {"spark_torch.rank.function_main", "spark_torch.rank.script_main"}
}


def _under(module: str, prefixes: object) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)  # type: ignore[attr-defined]


def test_no_module_imports_one_that_imports_it_back() -> None:
    """docs/architecture.md: imports only go down. Not even through a function-level import: the
    package's import graph has no cycle."""
    graph = import_graph(ROOT)
    assert len(graph) > 100, sorted(graph)
    found = [path_in(graph, component) for component in cycles(graph)]
    assert found == [], "import cycles (break each: move what both need below them):\n" + "\n".join(found)


def test_a_function_level_import_back_is_a_cycle(tmp_path: Path) -> None:
    """The cycle test fails on a cycle made by an import inside a function (the shape of the
    driver/result.py <-> driver/group_runs.py cycle it found), and not on one under TYPE_CHECKING."""
    back = {
        "typed": "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from spark_torch.driver.result import RunResult\n",
        "lazy": "\n\ndef _back() -> object:\n    from spark_torch.driver.result import RunResult\n\n    return RunResult\n",
    }
    for name, added in back.items():
        shutil.copytree(
            ROOT / "spark_torch", tmp_path / name / "spark_torch", ignore=shutil.ignore_patterns("__pycache__")
        )
        target = tmp_path / name / "spark_torch" / "driver" / "group_runs.py"
        target.write_text(target.read_text() + added)
    assert cycles(import_graph(tmp_path / "typed")) == []
    graph = import_graph(tmp_path / "lazy")
    assert cycles(graph) == [["spark_torch.driver.group_runs", "spark_torch.driver.result"]]
    assert (
        path_in(graph, cycles(graph)[0])
        == "spark_torch.driver.group_runs -> spark_torch.driver.result -> spark_torch.driver.group_runs"
    )


def test_every_driver_module_is_in_the_driver_contract() -> None:
    """A driver module left out of ``driver-sublayers`` is bound by nothing (how the result <->
    group_runs cycle passed): each module and package of spark_torch.driver is in one layer."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["id"] == "driver-sublayers"]
    named = {name.strip() for layer in contract["layers"] for name in layer.split("|")}
    driver = ROOT / "spark_torch" / "driver"
    present = {p.stem for p in driver.glob("*.py") if p.name != "__init__.py"} | {
        p.name for p in driver.iterdir() if (p / "__init__.py").exists()
    }
    assert present - named == set(), f"driver modules in no layer of driver-sublayers: {sorted(present - named)}"
    assert named - present == set(), f"driver-sublayers names modules that do not exist: {sorted(named - present)}"


_NAME = re.compile(r"spark_torch(?:\.\w+)+")


def _clause_names(text: str) -> set[str]:
    """The packages a 'may import' clause names: dotted names, and the shared modules."""
    names = set(_NAME.findall(text))
    if re.search(r"shared (top-level )?modules", text):
        names.update(SHARED)
    return names


def _may_import(init: Path) -> tuple[set[str], set[str], str]:
    """An ``__init__.py``'s 'May import:' line: what it allows, what it forbids, the line."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    line = " ".join(doc[doc.index("May import:") :].split())
    line = re.sub(
        r"what (spark_torch(?:\.\w+)+) may import",
        lambda m: _may_import(ROOT / Path(*m[1].split(".")) / "__init__.py")[2],
        line,
    )
    allowed, _, forbidden = line.partition("never")
    banned = _clause_names(forbidden) | set(re.findall(r"\b(pyspark|torch)\b", forbidden))
    return _clause_names(allowed), banned, line


@pytest.mark.parametrize(
    "init",
    sorted(
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "spark_torch").rglob("__init__.py")
        if p.parent != ROOT / "spark_torch"
    ),
)
def test_each_packages_may_import_line_is_true(init: str) -> None:
    """The 'May import:' line of each package's ``__init__.py`` holds for every module under it:
    what it imports of spark_torch, outside the package, is a package the line names (or a
    shared module, when it names those), and it imports nothing the line's 'never' part names."""
    package = init.removesuffix("/__init__.py").replace("/", ".")
    allowed, banned, line = _may_import(ROOT / init)
    wrong = []
    for module, targets in import_graph(ROOT).items():
        if not _under(module, [package]):
            continue
        for target in sorted(targets):
            if _under(target, [package]):
                continue
            ours = target.startswith("spark_torch")
            if (ours and not _under(target, allowed)) or _under(target, banned):
                wrong.append(f"{module} -> {target}")
    assert wrong == [], f"{init} says {line!r}, but:\n" + "\n".join(wrong)


def _layer_order() -> list[set[str]]:
    """The ``layers`` contract of pyproject.toml, top first, each layer's packages."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["id"] == "layers"]
    return [{name.strip() for name in layer.split("|")} for layer in contract["layers"]]


def _table_words(cell: str, row: set[str]) -> set[str]:
    """A cell of architecture.md's layer table as packages: layer names, ``shared`` (the shared
    modules), ``pyspark``, ``each other`` (the row's other packages), ``anything above``/``anything
    below`` (by the ``layers`` contract), ``any layer``; a note in brackets says why, not what."""
    order = _layer_order()
    depth = {name: i for i, layer in enumerate(order) for name in layer}
    row_depth = min(depth[name] for name in row)
    found: set[str] = set()
    for word in (w.strip() for w in re.sub(r"\([^)]*\)", "", re.sub(r"`[^`]*`", "", cell)).split(",")):
        if not word:
            continue
        if word in ("shared", "shared modules"):
            found.update(SHARED)
        elif word == "pyspark":
            found.add("pyspark")
        elif word == "each other":
            found.update(row)
        elif word == "anything above":
            found.update(n for n, d in depth.items() if d < row_depth)
        elif word == "anything below":
            found.update(n for n, d in depth.items() if d > row_depth)
        elif word == "any layer":
            found.update(f"spark_torch.{n}" for n in ("cli", "driver", "node", "rank", "ft", "channel", "reporting"))
        else:
            assert re.fullmatch(r"\w+", word), f"architecture.md's layer table: {word!r} is not a layer this test knows"
            found.add(f"spark_torch.{word}")
    return found


def test_the_layer_table_of_architecture_md_holds() -> None:
    """docs/architecture.md's table of layers (may import, never imports) is what the code does:
    e.g. the node never imports the rank layer but in the one place the row names (the template's
    server, the ranks' entry modules), the driver never imports rank, nobody below imports pyspark."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    lines = page[page.index("| layer | may import | never imports |") :].splitlines()[2:]
    table = lines[: next(i for i, line in enumerate(lines) if not line.startswith("|"))]
    graph = import_graph(ROOT)
    wrong, checked = [], 0
    for line in table:
        first, allowed_cell, never_cell = (cell.strip() for cell in line.strip("|").split("|"))
        if ">" in first:
            continue  # the driver's sub-layers: the driver-sublayers contract
        row = (
            SHARED
            if first == "shared modules"
            else {f"spark_torch.{n}" for n in re.findall(r"`(\w+)`", first) if n != "__init__"}
        )
        allowed = _table_words(allowed_cell, set(row)) | set(row)
        never = _table_words(never_cell, set(row)) - (set() if "each other" in never_cell else set())
        if first == "shared modules":
            never -= set(SHARED)  # 'each other' in the may-import column: the shared modules import each other
        for module, targets in graph.items():
            home = [r for r in row if _under(module, [r])]
            if not home:
                continue
            checked += 1
            for target in targets:
                if _under(target, home) or target in NODE_IMPORTS_RANK.get(module, ()):
                    continue
                if _under(target, never - set(home)) or (
                    target.startswith("spark_torch") and not _under(target, allowed)
                ):
                    wrong.append(f"{first}: {module} -> {target}")
    assert checked > 100
    assert "node/template/server.py" in next(line for line in table if line.startswith("| `node`")), (
        "the node row names its one exception"
    )
    assert wrong == [], "docs/architecture.md's layer table is not what the code does:\n" + "\n".join(sorted(wrong))


def _calls(name: str) -> list[tuple[str, ast.Call]]:
    """Every call of ``name`` in the package: (file, call)."""
    found = []
    for path in sorted((ROOT / "spark_torch").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) == name
            ):
                found.append((path.relative_to(ROOT).as_posix(), node))
    return found


@pytest.mark.parametrize(("opener", "position"), [("RunStorage", 2), ("run_ids", 1), ("stored_group_ids", 2)])
def test_no_side_opens_a_storage_without_its_options(opener: str, position: int) -> None:
    """docs/architecture.md: a storage is opened one way on every side, with the options as a
    required argument, so no side opens one without its credentials: every call passes the
    run's options (a name or an attribute, never a literal such as ``{}`` or None)."""
    import inspect

    from spark_torch.driver import group_runs
    from spark_torch.reporting import storage

    function = getattr(storage, opener, None) or getattr(group_runs, opener)
    parameters = list(inspect.signature(function).parameters.values())
    assert parameters[position].name == "options" and parameters[position].default is inspect.Parameter.empty
    literal = []
    for where, call in _calls(opener):
        given = (
            call.args[position]
            if len(call.args) > position
            else next((k.value for k in call.keywords if k.arg == "options"), None)
        )
        if given is None or isinstance(given, (ast.Constant, ast.Dict)):
            literal.append(f"{where}:{call.lineno}: {ast.unparse(call)}")
    assert _calls(opener), opener
    assert literal == [], f"{opener} opened without the run's options:\n" + "\n".join(literal)


def test_an_attempts_exceptions_are_made_in_failures_py() -> None:
    """docs/architecture.md: the exception an attempt's end becomes (a rank failure, the timeout,
    a stall) is made in driver/run/failures.py alone; a replica group past its budget names the
    group in driver/api/replica_groups.py."""
    makers = {
        "DistributedRunError": {"spark_torch/driver/run/failures.py"},
        "RunTimeoutError": {"spark_torch/driver/run/failures.py"},
        "RunStalledError": {"spark_torch/driver/run/failures.py"},
        "ReplicaGroupError": {"spark_torch/driver/api/replica_groups.py"},
    }
    made = {name: {where for where, _ in _calls(name)} for name in makers}
    for name, where in made.items():
        assert where <= makers[name], (
            f"{name} is made in {sorted(where - makers[name])}, not only in {sorted(makers[name])}"
        )
    assert made["DistributedRunError"] and made["ReplicaGroupError"]
    # failures.py picks RunStalledError or DistributedRunError for a stop's cause (``kind(...)``)
    assert "kind = RunStalledError if" in (ROOT / "spark_torch" / "driver" / "run" / "failures.py").read_text()


def test_a_run_result_is_made_in_one_place_per_reason() -> None:
    """spark_torch.driver.result.RunResult's docstring names the four places a RunResult is made,
    one per reason (a call's end, a call that failed before it ran, a past run, a replica-group
    run's merge); no other code builds one."""
    makers = set()
    for path in sorted((ROOT / "spark_torch").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for call in (n for n in ast.walk(function) if isinstance(n, ast.Call)):
                name = getattr(call.func, "id", None)
                in_result = path.name == "result.py" and name == "cls" and function.name == "from_path"
                if name == "RunResult" or in_result:
                    makers.add(f"{path.relative_to(ROOT / 'spark_torch').as_posix()}:{function.name}")
    assert makers == {
        "driver/run_record.py:finish",
        "driver/run_record.py:final",
        "driver/result.py:from_path",
        "driver/result.py:merge_groups",
    }
