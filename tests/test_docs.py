"""The documentation builds (``mkdocs build --strict``) and its code blocks run.

Every fenced code block in docs/ is either executed here or marked illustrative with an
``<!-- illustrative -->`` line right before it. The python blocks of a page run in order as
one script (so a later block may use an earlier one's names), in a fresh interpreter, from the
repository root; they are kept tiny (local mode).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MARKER = "<!-- illustrative -->"
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[\w+-]*)[^\n]*$")


def code_blocks(path: Path) -> list[tuple[int, str, str, bool]]:
    """``(line, language, code, illustrative)`` for every fenced block of a markdown file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, lang = i, match.group("lang")
        previous = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{path.name}:{start + 1}: unclosed code fence"
        blocks.append((start + 1, lang, "\n".join(body) + "\n", previous == MARKER))
        i += 1
    return blocks


PAGES = sorted(DOCS.glob("*.md"))
#: written and verified separately (its commands need a standalone cluster); built, not run here
NOT_RUN = {"clusters.md"}
EXECUTED = [
    p
    for p in PAGES
    if p.name not in NOT_RUN and any(lang == "python" and not ill for _, lang, _, ill in code_blocks(p))
]


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    """The site builds with no warning: nav targets exist, mkdocstrings resolves the API."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    assert "DistributedRunError" in api and "num_processes" in api
    for page in ("concepts", "torchdistributor", "clusters", "troubleshooting", "performance", "examples"):
        assert (tmp_path / "site" / page / "index.html").exists(), page


def test_every_block_is_executed_or_illustrative() -> None:
    assert PAGES, "no docs found"
    for page in PAGES:
        for line, lang, _code, illustrative in code_blocks(page):
            if page.name in NOT_RUN:
                continue
            assert illustrative or lang == "python", (
                f"{page.name}:{line}: a ```{lang or 'plain'} block must be python (executed) or preceded by {MARKER}"
            )


def test_illustrative_python_blocks_compile() -> None:
    """Blocks that are not run (they need a cluster, GPUs...) still compile: no syntax error
    reaches a guide."""
    for page in PAGES:
        for line, lang, code, illustrative in code_blocks(page):
            if lang == "python" and (illustrative or page.name in NOT_RUN):
                compile(code, f"{page.name}:{line}", "exec")


def test_some_blocks_are_executed() -> None:
    assert {p.name for p in EXECUTED} >= {"index.md", "concepts.md", "api.md", "troubleshooting.md"}


@pytest.mark.parametrize("page", EXECUTED, ids=[p.name for p in EXECUTED])
def test_python_blocks_run(page: Path, tmp_path: Path) -> None:
    blocks = [code for _, lang, code, ill in code_blocks(page) if lang == "python" and not ill]
    script = tmp_path / f"{page.stem}_blocks.py"
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1")
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, f"{page.name} blocks failed:\n{done.stdout}\n{done.stderr}"


def test_every_public_name_is_in_the_api_reference() -> None:
    import spark_torch
    import spark_torch.data

    api = (DOCS / "api.md").read_text(encoding="utf-8")
    missing = [n for n in spark_torch.__all__ if n != "__version__" and n not in api]
    missing += [
        f"data.{n}" for n in spark_torch.data.__all__ if not n.isupper() and n not in api and n != "RankDataset"
    ]
    assert not missing, f"public names not in docs/api.md: {missing}"


def test_every_cli_flag_is_in_the_cli_page() -> None:
    import argparse

    from spark_torch.cli.main import build_parser

    page = (DOCS / "cli.md").read_text(encoding="utf-8")
    parser = build_parser()
    flags = set()
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for sub in [parser, *[p for a in subparsers for p in a.choices.values()]]:
        for action in sub._actions:
            flags.update(o for o in action.option_strings if o.startswith("--") and o != "--help")
    missing = sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", page))
    assert not missing, f"CLI flags not in docs/cli.md: {missing}"


def test_every_environment_variable_is_documented() -> None:
    source = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "spark_torch").rglob("*.py"))
    variables = set(re.findall(r"\bSPARK_TORCH_[A-Z0-9_]+\b", source))
    internal = {  # set by spark_torch for its own processes, not knobs for users
        "SPARK_TORCH_PARENT_PID",
        "SPARK_TORCH_REPORT_FDS",
        "SPARK_TORCH_STORAGE",
        "SPARK_TORCH_START_STEP",
        "SPARK_TORCH_DATA_FILE",
        "SPARK_TORCH_DATA_COLUMNS",
        "SPARK_TORCH_DATA_ROWS",
        "SPARK_TORCH_CHECKPOINT",
        "SPARK_TORCH_TEST_SESSION",
        "SPARK_TORCH_MARK_SLOT",
        "SPARK_TORCH_HOST_STORE",
        "SPARK_TORCH_NODE_END",  # the sealed node end's marker in Spark's error text, not a variable
    }
    docs = "\n".join(p.read_text(encoding="utf-8") for p in DOCS.glob("*.md"))
    missing = sorted(v for v in variables - internal if v not in docs)
    assert not missing, f"environment variables read by spark_torch but not documented in docs/: {missing}"
