"""What spark_torch leaves on a host stays this user's: every file of a node's scratch folder is
created 0600 whatever the umask (a real run, looked at while its rank runs), and the private
folders a process takes instead of a refused per-user folder live as long as that process."""

from __future__ import annotations

import os
import select
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spark_torch import Distributor
from spark_torch.node.processes import with_package_on_path

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
            return (
                set(EXPECTED) <= names
                and any(n.startswith("stack-0.json.child-") for n in names)
                and ("stack-0.json.trace-request" in names)
            )

        _wait(
            "the rank's scratch files (stack samples of it and its child, a stall's trace request)",
            complete,
            120.0,
            "is stack sampling on (stall_timeout) and did the rank start?",
        )
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


#: a process that takes the private folder NAME, prints it and exits after a line on stdin
FOLDER_USER = """
import sys
from spark_torch.shared.owned_files import private_folder
print(private_folder(sys.argv[1]), flush=True)
sys.stdin.readline()
"""


class _FolderUser:
    """A real Python process that took a fallback folder (its per-user folder is another user's)."""

    def __init__(self, name: str, tmp: Path) -> None:
        env = with_package_on_path({k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"})
        env["TMPDIR"] = str(tmp)
        self.process = subprocess.Popen(
            [sys.executable, "-c", FOLDER_USER, name],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], 60.0)
        line = self.process.stdout.readline().decode().strip() if ready else ""
        if not line:
            self.process.kill()
            raise AssertionError(f"the process did not print its folder within 60s: {self.process.communicate()[1]!r}")
        self.folder = Path(line)

    def end(self, how: str) -> None:
        """``exits`` (after its line) or ``killed`` (SIGKILL: no exit handler runs)."""
        if how == "killed":
            self.process.kill()
        else:
            assert self.process.stdin is not None
            self.process.stdin.write(b"\n")
            self.process.stdin.close()
        self.process.wait(60.0)
        for pipe in (self.process.stdout, self.process.stderr):
            if pipe is not None:
                pipe.close()


def _started(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        data = fh.read()
    return data[data.rindex(b")") + 2 :].split()[19].decode()


@pytest.mark.skipif(os.getuid() != 0, reason="making a folder of another user needs root")
@pytest.mark.parametrize("name", ["spark_torch_templates", "spark_torch_traces"])
def test_a_fallback_folder_lives_as_long_as_its_process(name: str, tmp_path: Path) -> None:
    """The per-user folder is another user's (uid 65534): the process takes a private folder of
    its own, which is gone once it exits; one a SIGKILLed process left is swept by the next
    process that looks for the folder, but never another user's, nor a live process's."""
    uid = os.getuid()
    planted = tmp_path / f"{name}-{uid}"
    planted.mkdir(mode=0o700)
    os.chown(planted, 65534, 65534)

    first = _FolderUser(name, tmp_path)
    try:
        assert first.folder.parent == tmp_path and first.folder.name.startswith(f"{name}-{uid}-{first.process.pid}.")
        info = first.folder.stat()
        assert info.st_uid == uid and stat.S_IMODE(info.st_mode) == 0o700
    finally:
        first.end("exits")
    assert first.process.returncode == 0 and not first.folder.exists()

    killed = _FolderUser(name, tmp_path)
    killed.end("killed")
    assert killed.process.returncode == -signal.SIGKILL and killed.folder.is_dir()  # no exit handler ran
    # beside it: a live process's folder, another user's folder of a dead process, and one whose
    # pid now belongs to a process that started later (a reused pid)
    me = os.getpid()
    alive = tmp_path / f"{name}-{uid}-{me}.{_started(me)}-alive1"
    others = tmp_path / f"{name}-{uid}-{killed.process.pid}.1-others"
    reused = tmp_path / f"{name}-{uid}-{me}.1-reused1"
    for folder in (alive, others, reused):
        folder.mkdir(mode=0o700)
    os.chown(others, 65534, 65534)

    second = _FolderUser(name, tmp_path)
    try:
        assert not killed.folder.exists() and not reused.exists()
        assert alive.is_dir() and others.is_dir() and second.folder.is_dir()
    finally:
        second.end("exits")
    assert not second.folder.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([planted.name, alive.name, others.name])
