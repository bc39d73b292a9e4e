"""The public surface is pinned; the package is lint-clean and type-checks (mypy strict)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import spark_torch

ROOT = Path(__file__).resolve().parents[2]


def test_exported_members() -> None:
    assert sorted(spark_torch.__all__) == sorted(
        [
            "Distributor",
            "SparkTorchError",
            "ConfigurationError",
            "ClusterConfigurationError",
            "InsufficientSlotsError",
            "PicklingError",
            "ArgumentError",
            "LaunchError",
            "DistributedRunError",
            "RunTimeoutError",
            "RankFailure",
            "StoppedRank",
            "__version__",
            "RunResult",
            "Checkpoint",
            "report",
            "get_checkpoint",
            "TorchDistributor",
            "DeepspeedTorchDistributor",
            "RunStalledError",
            "ReplicaGroupError",
            "AttemptRecord",
            "AttemptEnd",
            "AttemptReason",
            "LaunchPlan",
            "AttemptSize",
            "SizeReason",
            "AttemptError",
            "GrowRequest",
            "GpuFallback",
            "list_runs",
            "RunSummary",
            "init_process_group",
            "prepare_model",
            "prepare_data_loader",
            "get_context",
            "get_device",
            "RankContext",
        ]
    )
    for name in spark_torch.__all__:
        assert getattr(spark_torch, name) is not None
    assert sorted(spark_torch._HOMES) == sorted(set(spark_torch.__all__) - {"__version__"})
    import pytest

    with pytest.warns(DeprecationWarning, match="use spark_torch.RunResult.from_path"):
        with pytest.raises(ValueError):
            spark_torch.load_run("/nowhere", "")  # one way to load a past run; the old name warns
    assert not hasattr(spark_torch.RunResult, "collect")  # no internal mutator on the public class
    assert not hasattr(spark_torch.Distributor(), "config")  # the options are read through properties


def test_a_rank_entry_module_loads_no_driver_or_node_module() -> None:
    """spark_torch/__init__.py is lazy: a rank imports only its own layer and the shared modules."""
    for entry in ("spark_torch.rank.function_main", "spark_torch.rank.script_main"):
        code = (
            f"import sys, {entry}; "
            "print(sorted(m for m in sys.modules if m.startswith(('spark_torch.driver', 'spark_torch.node'))))"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
        assert out.strip() == "[]", (entry, out)


def test_import_is_cheap() -> None:
    code = "import sys, spark_torch; print('torch' in sys.modules, 'pyspark' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_errors_pickle_and_subclass_builtins() -> None:
    import pickle

    error = spark_torch.DistributedRunError([spark_torch.RankFailure(rank=1, host="h", exit_code=3)])
    again = pickle.loads(pickle.dumps(error))
    assert str(again) == str(error) and again.rank == 1 and isinstance(again, RuntimeError)
    assert issubclass(spark_torch.RunTimeoutError, TimeoutError)
    stalled = spark_torch.RunStalledError(
        [], headline="no rank made progress", stacks={0: "a"}, stacks_text="rank 0: a"
    )
    again = pickle.loads(pickle.dumps(stalled))
    assert str(again) == str(stalled) and again.stacks == {0: "a"} and isinstance(again, spark_torch.SparkTorchError)
    assert issubclass(spark_torch.ConfigurationError, ValueError)


def test_no_private_function_is_called_from_another_module() -> None:
    """``obj._name(...)`` where ``_name`` is a function or method of spark_torch is called only
    in the module that defines it (the stdlib's and PySpark's private names are theirs)."""
    import ast

    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in sorted((ROOT / "spark_torch").rglob("*.py"))}
    homes: dict[str, set[Path]] = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.name.startswith("_")
                and not node.name.startswith("__")
            ):
                homes.setdefault(node.name, set()).add(path)
    crossing = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            receiver, name = node.func.value, node.func.attr
            if isinstance(receiver, ast.Name) and (
                receiver.id in ("self", "cls") or receiver.id in sys.stdlib_module_names
            ):
                continue  # its own class, or the stdlib's (threading._shutdown)
            if isinstance(receiver, ast.Call) and ast.unparse(receiver.func) == "super":
                continue
            if name in homes and path not in homes[name]:
                crossing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node.func)}")
    assert not crossing, "private functions called from another module:\n" + "\n".join(crossing)


#: the house's bound on a module (docs/architecture.md): past it, split the module by concern
MODULE_LINES = 450


def test_no_module_is_over_the_bound() -> None:
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
        for p in (ROOT / "spark_torch").rglob("*.py")
    }
    over = {path: lines for path, lines in sizes.items() if lines > MODULE_LINES}
    assert not over, f"modules over {MODULE_LINES} lines (split them by concern): {over}"


#: what the house's linter and formatter cover (`make lint` runs the same two commands)
LINTED = ["spark_torch", "tests", "benchmarks", "examples"]


def test_ruff() -> None:
    done = subprocess.run([sys.executable, "-m", "ruff", "check", *LINTED], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format() -> None:
    """Every file is as `ruff format` writes it (fix: `make format`)."""
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *LINTED], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_formatter_exception_says_why() -> None:
    """`# fmt: skip` / `# fmt: off` only where a table reads better, each with its reason on the line."""
    bare = []
    for folder in LINTED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                for marker in ("# fmt: skip", "# fmt: off"):
                    if marker in line and not line.split(marker, 1)[1].strip(" -:"):
                        bare.append(f"{path.relative_to(ROOT)}:{number}")
    assert not bare, "formatter exceptions without a reason:\n" + "\n".join(bare)


@pytest.mark.timeout(900)  # about 110 s without mypy's cache (.mypy_cache) on a quiet 2-core machine, seconds with it
def test_mypy_strict() -> None:
    done = subprocess.run([sys.executable, "-m", "mypy", "spark_torch"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
