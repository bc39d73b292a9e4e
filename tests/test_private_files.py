"""What spark_torch leaves on a host stays this user's: every file of a node's scratch folder is
created 0600 whatever the umask (a real run, looked at while its rank runs)."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spark_torch import Distributor

from .conftest import run_temp_dirs

#: the scratch files a rank with stack sampling and a forked child has while it runs
EXPECTED = ("payload.pkl", "stack-0.json", "stack-0.json.native", "rank-0.torchelastic-error.json")


def _wait(what: str, done: Callable[[], bool], seconds: float, fix: str) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {seconds:g}s for {what}; {fix}")
        time.sleep(0.05)


def waits_with_a_child(release: str) -> str:
    """A rank (and a forked child of it, which samples its own stack) waiting for ``release``;
    returns the umask the rank ran with."""
    import os
    import time

    with open("/proc/self/status") as fh:
        umask = next(line.split()[1] for line in fh if line.startswith("Umask:"))
    child = os.fork()
    deadline = time.monotonic() + 300.0
    while not os.path.exists(release):
        if time.monotonic() > deadline:
            if child == 0:
                os._exit(1)
            raise TimeoutError(f"nobody created {release} within 300s (the test that runs this rank died?)")
        time.sleep(0.05)
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    return umask


def _modes(folder: str) -> dict[str, str]:
    """Every entry under ``folder`` (relative name -> octal mode), folders with a trailing /."""
    found = {"./": oct(stat.S_IMODE(os.stat(folder).st_mode))}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            full = os.path.join(root, name)
            try:
                info = os.lstat(full)
            except FileNotFoundError:  # a sampler's temporary file, renamed meanwhile
                continue
            key = os.path.relpath(full, folder) + ("/" if stat.S_ISDIR(info.st_mode) else "")
            found[key] = oct(stat.S_IMODE(info.st_mode))
    return found


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_every_file_of_a_nodes_scratch_folder_is_0600_under_umask_0(
    warm: bool, tmp_path: Path, no_leftovers: None
) -> None:
    """Spark executors often run with umask 0: the scratch folder's files (payload, the stack
    samples, faulthandler's file, a forked child's stack file, torch's error file, the trace
    request a stall sends) are 0600 all the same, looked at while the rank runs."""
    release = tmp_path / "release"
    before = set(run_temp_dirs())
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["umask"] = Distributor(num_processes=1, warm_start=warm, stall_timeout=2.0, stall_action="warn").run(
                waits_with_a_child, str(release)
            )
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            out["error"] = exc

    old = os.umask(0)
    thread = threading.Thread(target=run, name="run-under-umask-0")
    try:
        thread.start()

        def folder() -> str | None:
            new = sorted(set(run_temp_dirs()) - before)
            return new[0] if new else None

        def complete() -> bool:
            where = folder()
            if where is None or "error" in out:
                return "error" in out
            names = set(os.listdir(where))
            return set(EXPECTED) <= names and any(n.startswith("stack-0.json.child-") for n in names) and (
                "stack-0.json.trace-request" in names
            )

        _wait("the rank's scratch files (stack samples of it and its child, a stall's trace request)", complete, 120.0,
              "is stack sampling on (stall_timeout) and did the rank start?")  # fmt: skip
        assert "error" not in out, out
        where = folder()
        assert where is not None
        modes = _modes(where)
    finally:
        release.touch()
        thread.join(120.0)
        os.umask(old)
    assert not thread.is_alive() and out.get("umask") == "0000", out
    wrong = {name: mode for name, mode in modes.items() if mode != ("0o700" if name.endswith("/") else "0o600")}
    assert not wrong, (wrong, modes)

