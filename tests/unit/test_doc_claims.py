"""Claims the README and docs/ make about the code, checked against the code: the
``Distributor`` signature, the keyword lists, the requirements, the examples table, the names
``report()`` reserves and the MLflow parameters."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import tomllib

from spark_torch import Distributor
from spark_torch.settings import SETTINGS

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
SETTING_NAMES = [s.name for s in SETTINGS]


def _readme_signature() -> list[str]:
    """The parameters of the ``Distributor(...)`` signature README shows, in order."""
    match = re.search(r"`Distributor\((num_processes=.*?)\)`", README, re.S)
    assert match, "README shows Distributor's signature as `Distributor(num_processes=...)`"
    return [p.strip() for p in " ".join(match.group(1).split()).split(",")]


def test_readme_signature_is_the_code() -> None:
    """README writes every keyword but the settings (``**settings``, one table in
    docs/configuration.md) with its default, in the code's order."""
    shown = _readme_signature()
    code = []
    for name, parameter in inspect.signature(Distributor).parameters.items():
        if name in SETTING_NAMES or parameter.kind is inspect.Parameter.VAR_KEYWORD:
            continue
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and "*" not in code:
            code.append("*")
        code.append(f"{name}={parameter.default!r}".replace("'", '"'))
    assert shown == [*code, "**settings"]
    last = list(inspect.signature(Distributor).parameters.values())[-1]
    assert last.name == "settings" and last.kind is inspect.Parameter.VAR_KEYWORD  # the table's, by keyword


def test_configuration_page_lists_every_other_keyword() -> None:
    page = " ".join((ROOT / "docs" / "configuration.md").read_text(encoding="utf-8").split())
    sentence = page[page.index("The `Distributor` arguments themselves") :].split(") are documented")[0]
    listed = re.findall(r"`(\w+)`", sentence)
    others = [
        n
        for n, p in inspect.signature(Distributor).parameters.items()
        if n not in SETTING_NAMES and p.kind is not p.VAR_KEYWORD
    ]
    assert listed == ["Distributor", *others]


def _requirements(text: str) -> tuple[str, str]:
    match = re.search(r"Python (\d+\.\d+)\+ and Java (\d+)\+", text)
    assert match, "states the requirements as 'Python X.Y+ and Java N+'"
    return match.group(1), match.group(2)


def test_one_set_of_requirements() -> None:
    """README and docs/index.md state the same Python and Java: pyproject's requires-python and
    the Java the Makefile checks for."""
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    assert _requirements(README) == _requirements(index)
    python, java = _requirements(README)
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["requires-python"]
    assert requires == f">={python}"
    makefile = re.search(r"^JAVA_MIN \?= (\d+)$", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M)
    assert makefile and makefile.group(1) == java


def test_lifecycle_numbers_are_the_code() -> None:
    """docs/lifecycle.md's line limit and node queue bounds are the constants the code uses."""
    from spark_torch.channel.log_stream import QUEUE_BYTES, QUEUE_LINES
    from spark_torch.channel.wire import MAX_FRAME
    from spark_torch.shared.lines import MAX_LINE_BYTES

    page = " ".join((ROOT / "docs" / "lifecycle.md").read_text(encoding="utf-8").split())
    assert f"the queue ({QUEUE_LINES:,} lines or {QUEUE_BYTES // 2**20} MiB)" in page
    assert f"lines longer than {MAX_LINE_BYTES // 1024} KiB" in page
    assert f"every frame (at most {MAX_FRAME // 2**20} MiB) is AES-256-GCM encrypted" in page
    assert "SPARK_LOCAL_IP" not in page  # the channel never reads it


def test_reserved_metric_names_are_documented() -> None:
    """Every name report() reserves is named where users read about report()."""
    from spark_torch.reporting.api import RECORDED_KEYS, report

    page = " ".join((ROOT / "docs" / "checkpoints.md").read_text(encoding="utf-8").split())
    reserved = ", ".join(f"`{k}`" for k in RECORDED_KEYS[:-1]) + f" and `{RECORDED_KEYS[-1]}` are added by spark_torch"
    assert reserved in page
    assert f"a dict with {', '.join(f'`{k}`' for k in RECORDED_KEYS)} |" in page
    assert ", ".join(RECORDED_KEYS) in " ".join((report.__doc__ or "").split())


def test_torchdistributor_page_hung_runs_row_is_the_code() -> None:
    """docs/torchdistributor.md's "hung runs" row names stall detection with its real default,
    what each stall_action does, and the errors, as the code has them."""
    from spark_torch import errors

    page = (ROOT / "docs" / "torchdistributor.md").read_text(encoding="utf-8")
    (row,) = [line for line in page.splitlines() if line.startswith("| hung runs |")]
    default = {s.name: s.default for s in SETTINGS}["stall_timeout"]
    assert f"no rank made progress for `stall_timeout` ({default:g} s by default)" in row
    assert '`stall_action="fail"` stops the attempt with `RunStalledError`' in row and "`RunTimeoutError`" in row
    assert issubclass(errors.RunStalledError, errors.DistributedRunError) and issubclass(
        errors.RunTimeoutError, TimeoutError
    )


def test_checkpoints_page_says_when_report_on_some_ranks_fails() -> None:
    """docs/checkpoints.md gives the wait after which report() under ``if rank == 0:`` fails
    (tested end to end in tests/test_report.py), as the code has it."""
    from spark_torch.driver.run.stall import REPORT_DEADLOCK_SECONDS

    page = " ".join((ROOT / "docs" / "checkpoints.md").read_text(encoding="utf-8").split())
    assert f"once both have waited {REPORT_DEADLOCK_SECONDS:g} s the run fails with `DistributedRunError`" in page


def _argparse_options(path: Path) -> list[str]:
    """The long options an example's ``add_argument`` calls define, in order."""
    import ast

    options = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            options += [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
    return options


def _examples_tables() -> list[dict[str, list[str]]]:
    """docs/examples.md's tables: example file -> the options its ``arguments`` column names."""
    tables: list[dict[str, list[str]]] = []
    for block in (ROOT / "docs" / "examples.md").read_text(encoding="utf-8").split("\n\n"):
        rows = [r for r in block.splitlines() if r.startswith("|")]
        if not rows or rows[0].split("|")[1:3] != [" example ", " arguments "]:
            continue
        tables.append(
            {
                re.fullmatch(r" `(\w+\.py)` ", cells[1]).group(1): re.findall(r"`(--[\w-]+)`", cells[2])  # type: ignore[union-attr]
                for cells in (r.split("|") for r in rows[2:])
            }
        )
    return tables


def test_examples_tables_are_the_examples_arguments() -> None:
    """Every example is in docs/examples.md once, with exactly its argparse options; the first
    table's examples take ``--num-processes`` and ``--local-mode`` as the page says."""
    tables = _examples_tables()
    assert len(tables) == 2, "docs/examples.md has two tables (function and script examples) with an arguments column"
    functions, scripts = tables
    listed = [*functions, *scripts]
    assert sorted(listed) == sorted(p.name for p in (ROOT / "examples").glob("*.py"))
    for name in listed:
        documented = {**functions, **scripts}[name]
        assert sorted(documented) == sorted(_argparse_options(ROOT / "examples" / name)), name
    for name, options in functions.items():
        assert {"--num-processes", "--local-mode"} <= set(options), name


#: each line of troubleshooting.md's progress list -> the tests that check it (end to end in
#: tests/test_stall.py, unit in tests/unit/test_stacks.py)
PROGRESS_LIST_TESTS = {
    "Collectives": [
        "test_ranks_whose_collectives_complete_are_never_stalled",
        "test_a_rank_that_only_polls_is_stalled",
    ],
    "Computing": [
        "test_ranks_that_compute_silently_are_not_stalled",
        "test_a_native_call_that_computes_is_not_a_stall",
        "test_computing_is_judged_over_the_time_since_the_last_progress",
    ],
    "I/O": ["test_progress_is_computing_or_io_not_waiting"],
    "New code": ["test_a_new_position_an_upload_and_another_threads_bytes_are_progress"],
    "report()": [
        "test_a_new_position_an_upload_and_another_threads_bytes_are_progress",
        "test_work_outside_the_main_thread_is_progress",
    ],
    "Other threads it waits on": [
        "test_a_new_position_an_upload_and_another_threads_bytes_are_progress",
        "test_progress_is_computing_or_io_not_waiting",
        "test_work_outside_the_main_thread_is_progress",
    ],
    "Its processes": ["test_work_outside_the_main_thread_is_progress", "test_a_rank_that_only_polls_is_stalled"],
    "A native call holding the GIL": ["test_a_native_call_that_computes_is_not_a_stall"],
    "Finishing": ["test_work_outside_the_main_thread_is_progress"],
}
#: each line of its "what the doctor does to a rank" list -> the tests that check it
DOCTOR_LIST_TESTS = {
    "Reads": ["test_the_sampler_keeps_no_local_alive"],
    "From outside": ["test_a_stopped_rank_is_named_stopped", "test_work_outside_the_main_thread_is_progress"],
    "Signals": [
        "test_looking_at_a_rank_holding_the_gil_never_interrupts_it",
        "test_a_rank_holding_the_gil_shows_its_true_stack_when_stopped",
    ],
    "Flight Recorder": ["test_warn_shows_both_stacks_while_stuck_and_the_run_succeeds"],
}


def _bold_items(page: str, marker: str) -> list[str]:
    """The bold heads of the bullet list after ``<!-- marker -->``."""
    block = page.split(f"<!-- {marker} -->", 1)[1].strip().split("\n\n", 1)[0]
    return [line[4 : line.index("**", 4)] for line in block.splitlines() if line.startswith("- **")]


def test_stall_lists_each_line_has_its_tests() -> None:
    """docs/troubleshooting.md's lists of what counts as progress and what the doctor does to a
    rank: every line is checked by a test that exists, and no line is left without one."""
    import ast

    page = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    defined = set()
    for path in (ROOT / "tests" / "test_stall.py", ROOT / "tests" / "unit" / "test_stacks.py"):
        defined |= {
            n.name for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(n, ast.FunctionDef)
        }
    for marker, table in (("progress-list", PROGRESS_LIST_TESTS), ("doctor-list", DOCTOR_LIST_TESTS)):
        assert _bold_items(page, marker) == list(table), marker
        missing = {item: [t for t in tests if t not in defined] for item, tests in table.items()}
        assert not any(missing.values()), missing


def test_dataframe_numbers_are_the_measured_ones() -> None:
    """docs/dataframe.md's measured table, its loader costs and every "x the rows/s" claim about
    the DataFrame path (README too) are the numbers in benchmarks/results/ (dataframe.json and
    dataframe_4m.json from bench_dataframe.py, loader.json from bench_loader.py)."""
    import json

    results = json.loads((ROOT / "benchmarks" / "results" / "dataframe.json").read_text(encoding="utf-8"))
    loader = json.loads((ROOT / "benchmarks" / "results" / "loader.json").read_text(encoding="utf-8"))
    page = (ROOT / "docs" / "dataframe.md").read_text(encoding="utf-8")
    for table in ("array", "scalar"):
        (row,) = [line for line in page.splitlines() if line.startswith(f"| {table} |")]
        ratios = results[table]["ratios"]
        assert f"{ratios['loop_rows_per_s']:.2f}x" in row and f"{ratios['total_speedup']:.2f}x" in row, row
        assert f"{ratios['peak_rss']:.2f}x" in row, row
        ours, theirs = results[table]["spark_torch"], results[table]["pyspark"]
        assert f"{ours['loop_rows_per_s']:,} vs {theirs['loop_rows_per_s']:,}" in row, row
        for peer, name in (("petastorm", "Petastorm"), ("streaming", "Mosaic")):
            (row,) = [line for line in page.splitlines() if line.startswith(f"| {table}, {name}")]
            cells = [c.strip() for c in row.split("|")[2:-1]]
            measured = results[table][peer]
            assert cells[:4] == [f"{measured[k]:.1f}" for k in ("prep_s", "train_s", "total_s")] + [
                f"{measured['loop_rows_per_s']:,}"
            ], row
    # the 4M-row run (bench_dataframe.py --rows 4000000 --tables array --out results/dataframe_4m.json)
    four = json.loads((ROOT / "benchmarks" / "results" / "dataframe_4m.json").read_text(encoding="utf-8"))["array"]
    text = " ".join(page.split())
    for claim in (
        f"reads {four['ratios']['loop_rows_per_s']:.2f}x PySpark's rows/s",
        f"{four['ratios']['total_speedup']:.2f}x faster than PySpark's",
        f"{four['ratios']['total_speedup_vs_petastorm']:.2f}x faster than Petastorm's",
        f"{four['ratios']['peak_rss']:.2f}x PySpark's "
        f"({four['spark_torch']['peak_rss_mb_per_rank']} vs {four['pyspark']['peak_rss_mb_per_rank']} MB)",
    ):
        assert claim in text, claim
    for text in (page, README):
        for claim in re.findall(r"(\d+(?:\.\d+)?)x the (?:loop )?rows/s", " ".join(text.split())):
            assert claim == f"{results['array']['ratios']['loop_rows_per_s']:.2f}", claim
    (row,) = [line for line in page.splitlines() if line.startswith("| ms per batch, shuffled |")]
    sizes = loader["sizes"]
    assert row.split("|")[2:5] == [
        f" {sizes[n]['ms_per_batch']['shuffled/all']:.1f} " for n in ("62500", "500000", "4000000")
    ], row
    (row,) = [line for line in page.splitlines() if line.startswith("| replaced loader, array column |")]
    cells = [
        f" {sizes[n]['ms_per_batch']['shuffled/features/arrow_table_take']:.1f} "
        for n in ("62500", "500000", "4000000")
    ]
    assert row.split("|")[2:5] == cells, row


def test_security_page_storage_claims_are_the_code() -> None:
    """docs/security.md's storage paragraphs: the default storage, the private and the team
    folder's modes, the set-group-ID command and the refusal's error type are the code's, and
    the tests they cite exist."""
    from spark_torch.errors import ConfigurationError
    from spark_torch.reporting.local_files import Owners, refusal
    from spark_torch.reporting.storage import DEFAULT_STORAGE

    page = " ".join((ROOT / "docs" / "security.md").read_text(encoding="utf-8").split())
    private, team = Owners(uid=1000, group=None), Owners(uid=1000, group=1000)
    assert f"(`storage_path`, default `{DEFAULT_STORAGE}`)" in page
    assert f"every folder in it, is `{private.folder_mode:04o}`" in page
    assert f"whatever their modes where the rank wrote them) is `{private.file_mode:04o}`" in page
    assert f"(the default, and any missing folder above a `storage_path`) is `{private.folder_mode:04o}`" in page
    command = f"chgrp TEAM DIR; chmod {team.folder_mode:o} DIR"
    assert f"(`{command}`, the usual mark of a group's folder)" in page
    assert f"are then `{team.folder_mode:o}` and their files `{team.file_mode:04o}`" in page
    error = refusal("/runs/RUN", "is a symbolic link")
    assert isinstance(error, ConfigurationError) and command in str(error)
    assert "is refused with a `ConfigurationError` naming the path and what to do" in page
    for cited in (
        "tests/unit/test_local_files.py",
        "tests/test_host_exposure.py",
        "spark_torch/reporting/local_files.py",
    ):
        assert f"`{cited}`" in page and (ROOT / cited).is_file()


def _met(ratio: dict[str, Any], goal: float) -> str:
    """ "yes" when the whole interval is within the goal, "no" when the ratio is not, else "ratio only"."""
    return "yes" if ratio["high"] <= goal else "no" if ratio["ratio"] > goal else "ratio only"


def _ft_cnn_rows(results: dict[str, Any]) -> list[str]:
    """docs/fault-tolerance.md's per-step table, as benchmarks/results/ft_cnn.json has it."""
    import statistics

    kinds, goals = ("ddp", "ft", "localsgd", "diloco"), {"ft": 1.25, "localsgd": 1.0, "diloco": 1.0}
    ms = [
        f"{statistics.median(results['ms'][k]):.1f} ({min(results['ms'][k]):.1f}-{max(results['ms'][k]):.1f})"
        for k in kinds
    ]
    ratios = [results["ratios"][k] for k in kinds[1:]]
    every = results["every"]
    return [
        f"| per step | plain DDP | torchft DDP | LocalSGD, sync every {every} | DiLoCo, sync every {every} |",
        "| ms, median of the runs (range) | " + " | ".join(ms) + " |",
        f"| x plain DDP (95% interval, {ratios[0]['pairs']} rounds) | 1 | "
        + " | ".join(f"{r['ratio']:.2f} ({r['low']:.2f}-{r['high']:.2f})" for r in ratios)
        + " |",
        "| goal, met | | "
        + " | ".join(f"<= {goals[k]}, {_met(r, goals[k])}" for k, r in zip(kinds[1:], ratios))
        + " |",
        f"| load average (1 min), start -> end | {results['load_start'][0]:.1f} -> {results['load_end'][0]:.1f} on {results['cpus']} CPUs | | | |",
    ] + _ft_torchft_row(results)


def _ft_torchft_row(results: dict[str, Any]) -> list[str]:
    """The table's row for torchft's own per-step path (``--kinds ...,ft_torchft``), when measured."""
    import statistics

    if "ft_torchft" not in results["ms"]:
        return []
    ms, ratio = results["ms"]["ft_torchft"], results["ratios"]["ft_torchft"]
    return [
        f"| torchft's own per-step path: ms; x plain DDP | | {statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f}); "
        f"{ratio['ratio']:.2f} ({ratio['low']:.2f}-{ratio['high']:.2f}) | | |"
    ]


def test_ft_cnn_numbers_are_the_measured_ones() -> None:
    """The LocalSGD / DiLoCo cost table in docs/fault-tolerance.md and benchmarks/README.md is
    benchmarks/results/ft_cnn.json (bench_ft.py --cnn)."""
    import json

    results = json.loads((ROOT / "benchmarks" / "results" / "ft_cnn.json").read_text(encoding="utf-8"))
    for page in (ROOT / "docs" / "fault-tolerance.md", ROOT / "benchmarks" / "README.md"):
        lines = page.read_text(encoding="utf-8").splitlines()
        for row in _ft_cnn_rows(results):
            assert row in lines, (page.name, row)
