"""Execute the notebooks in notebooks/ in a real Jupyter kernel; store their outputs.

    .venv/bin/python -m tests.notebook_runner [NAME...]     # re-execute and store the outputs

The stored outputs are what the docs site shows; ``tests/test_notebooks.py`` executes every
notebook again and checks that the stored outputs are current (see :func:`signature`).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CELL_TIMEOUT = 300
#: what a test environment sets and a user's kernel does not have
USER_UNSET = ("SPARK_LOCAL_IP", "PYSPARK_SUBMIT_ARGS")


def kernel_environment(tmp_dir: Path) -> tuple[str, dict[str, str]]:
    """A kernelspec named python3 that runs sys.executable (installed under a temp prefix when
    the venv has none), and the environment that makes jupyter_client find and use it."""
    env = {
        # the kernel must start this venv's interpreter: jupyter_client maps "python" in a
        # kernelspec's argv to sys.executable; PATH first so nothing else can win
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    }
    spec = Path(sys.prefix) / "share" / "jupyter" / "kernels" / "python3" / "kernel.json"
    if not spec.exists():
        from ipykernel.kernelspec import install

        install(prefix=str(tmp_dir), kernel_name="python3")
        env["JUPYTER_PATH"] = os.pathsep.join(
            [str(tmp_dir / "share" / "jupyter"), os.environ.get("JUPYTER_PATH", "")]
        ).rstrip(os.pathsep)
    return "python3", env


def execute(name: str, tmp_dir: Path) -> Any:
    """Run notebooks/NAME.ipynb top to bottom from the notebooks directory; the executed book."""
    import nbformat
    from nbclient import NotebookClient

    kernel, env = kernel_environment(tmp_dir)
    saved = {k: os.environ.get(k) for k in [*env, *USER_UNSET]}
    os.environ.update(env)
    for key in USER_UNSET:  # as a user's kernel starts: the embedded session binds loopback by itself
        os.environ.pop(key, None)
    try:
        book = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
        NotebookClient(
            book, timeout=CELL_TIMEOUT, kernel_name=kernel, resources={"metadata": {"path": str(NOTEBOOKS)}}
        ).execute()
        return book
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


#: how a kernel names the file of a cell's code: ipykernel's temporary files
#: (/tmp/ipykernel_1157/586557183.py), IPython's <ipython-input-3-...> and cloudpickle's
#: <dynamic-code>; each kernel release may pick another, so the check reads them all as <cell>
_CELL_FILE = re.compile(r"/[^\s\"']*/ipykernel_\d+/\d+\.py|<ipython-input-[\w-]+>|<dynamic-code>")

_VOLATILE = [
    (re.compile(r"\x1b\[[0-9;]*[A-Za-z]"), ""),  # terminal colours
    (_CELL_FILE, "<cell>"),
    # where the checkout and its venv live
    (re.compile(r"/[^\s\"']*/(site-packages|spark_torch|tests|examples|notebooks)/"), r"<\1>/"),
    (re.compile(r"/[\w./-]*(spark-torch|tmp|pytest)[\w./-]*"), "<path>"),
    (re.compile(r"\b[0-9a-f]{12}\b"), "<id>"),  # run ids
    # numbers: losses, timings, ports, pids; a sign too (a weight near 0 prints either way)
    (re.compile(r"(?:(?<=[\s\[(,=:])-)?\d+(\.\d+)?(e-?\d+)?"), "#"),
]


def _normalise(line: str) -> str:
    line = _relative(line)  # a fresh run's paths as the stored notebook shows them
    for pattern, replacement in _VOLATILE:
        line = pattern.sub(replacement, line)
    return line.strip()


#: Spark's log lines about the machine that ran the notebook, not about the notebook (another
#: Spark's web UI holds port 4040 on a shared machine): not stored
_MACHINE_STATE = re.compile(r"^\S+ \S+ WARN Utils: Service '[^']+' could not bind on port \d+\. Attempting port \d+\.$")


def _ignored(line: str) -> bool:
    """Lines the check skips: blank, Spark's own log lines, the live status."""
    return (
        not line.strip()
        or " WARN " in line
        or "spark_torch ranks:" in line
        or line.startswith(("Using Spark", "Setting default log", "To adjust logging", "WARNING:"))
    )


def signature(book: Any) -> list[tuple[int, tuple[str, ...], frozenset[str]]]:
    """What must stay the same between the stored and a fresh execution: per code cell, the
    kinds of outputs it has (stream / image / table / error), and its `[rank N]` lines and
    printed lines with numbers, paths and ids blanked out (Spark's own log lines ignored)."""
    result = []
    for index, cell in enumerate(book.cells):
        if cell.cell_type != "code":
            continue
        kinds = set()
        lines: set[str] = set()
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                printed = {_normalise(line) for line in out.text.splitlines() if not _ignored(line)}
                if printed:  # a stream of Spark's own log lines only is not the notebook's output
                    kinds.add(f"stream:{out.name}")
                lines.update(printed)
            elif out.output_type in ("display_data", "execute_result"):
                data = out.get("data", {})
                kinds.add("image" if "image/png" in data else "html" if "text/html" in data else "text")
            else:
                kinds.add(out.output_type)
        result.append((index, tuple(sorted(kinds)), frozenset(lines)))
    return result


ROOT = NOTEBOOKS.parent


def machine_paths() -> list[tuple[str, str]]:
    """Paths of this machine in outputs, and what the stored notebooks show instead: the
    checkout as a relative path, the venv's packages as ``<site-packages>``."""
    import sysconfig

    site = sysconfig.get_paths()["purelib"].rstrip("/") + "/"
    return [(site, "<site-packages>/"), (str(ROOT) + "/", ""), (sys.prefix.rstrip("/") + "/", "<venv>/")]


def machine_names() -> list[tuple[re.Pattern[str], str]]:
    """What else of this machine outputs show, and what the stored notebooks show instead: a
    kernel's file of a cell's code (``<cell>``), a temporary directory (``<tmp>``), the host's
    name (``<host>``)."""
    import socket

    names = {name for name in (socket.gethostname(), socket.getfqdn()) if name and name != "localhost"}
    return [
        (re.compile(r"/[^\s\"']*/ipykernel_\d+/\d+\.py"), "<cell>"),
        (re.compile(re.escape(tempfile.gettempdir().rstrip("/")) + r"/[^\s\"'/]+"), "<tmp>"),
        *(
            (re.compile(rf"(?<![\w.-]){re.escape(name)}(?![\w-])"), "<host>")
            for name in sorted(names, key=len, reverse=True)
        ),
    ]


def _relative(text: str) -> str:
    for path, shown in machine_paths():
        text = text.replace(path, shown)
    for pattern, shown in machine_names():
        text = pattern.sub(shown, text)
    return text


def store(names: list[str]) -> None:
    """Re-execute the notebooks and write them back with their outputs (paths of this machine
    made relative: the docs site shows them)."""
    import nbformat

    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            book = execute(name, Path(tmp))
        for cell in book.cells:  # execution timestamps would make every refresh a diff
            cell.get("metadata", {}).pop("execution", None)
            if "outputs" in cell:
                for out in cell.outputs:
                    if out.output_type == "stream":
                        out["text"] = "".join(
                            line
                            for line in out.text.splitlines(keepends=True)
                            if not _MACHINE_STATE.match(line.rstrip("\n"))
                        )
                cell["outputs"] = [out for out in cell.outputs if out.output_type != "stream" or out.text]
            for out in cell.get("outputs", []):
                if "text" in out:
                    out["text"] = _relative(out["text"])
                if "traceback" in out:
                    out["traceback"] = [_relative(line) for line in out["traceback"]]
                for kind, value in out.get("data", {}).items():
                    if kind.startswith("text/") and isinstance(value, str):
                        out["data"][kind] = _relative(value)
        nbformat.write(book, NOTEBOOKS / f"{name}.ipynb")
        print(f"stored the outputs of notebooks/{name}.ipynb")


if __name__ == "__main__":
    store(sys.argv[1:] or sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")))
