"""The warm-start template driven directly, as node runners use it, well-behaved or not.

One connection's failure never ends the template (whose other ranks all die with it): a runner
that leaves before its answer, a rank's exit in the same batch as its runner leaving, fork()
refused by a pids limit; a refused request's descriptors are closed; a burst of runners all get
ranks; another user's request is closed unanswered, and a runner refuses another user's listener. Then the same through the Distributor: a run stalled in rank start-up does not end
another run's training, and eight nodes on one executor all start warm.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from spark_torch import Distributor
from spark_torch.node.processes import with_package_on_path
from spark_torch.node.template import client as warm

from .conftest import SCRIPTS


def _launcher_pid() -> int:
    """In a rank: the process that started it (the warm-start template, or the node runner),
    which is its keeper's parent (:mod:`spark_torch.node.keeper`)."""
    return psutil.Process(os.getppid()).ppid()


TEMPLATE_MODULE = "spark_torch.node.template.server"
SCRIPT_MAIN = "spark_torch.rank.script_main"
#: a fresh template imports torch: seconds on 2 busy cores
READY_SECONDS = 120.0
#: one answer of a running template (a fork takes milliseconds)
ANSWER_SECONDS = 60.0
#: the connect() system call, where a runner waits for room in a full listen queue
CONNECT_SYSCALL = {"x86_64": "42", "aarch64": "203"}


def _wait(what: str, done: Callable[[], bool], seconds: float, fix: str) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {seconds:g}s for {what}; {fix}")
        time.sleep(0.02)


class Template:
    """A template this test started as a node runner starts one (its owner: this process)."""

    def __init__(self, idle: str | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="tpl-")  # Unix socket paths are short: not under tmp_path
        self.path = os.path.join(self.dir, "t.sock")
        self.stderr_path = os.path.join(self.dir, "stderr")
        with open(self.stderr_path, "wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", TEMPLATE_MODULE, self.path, str(os.getpid()), *([idle] if idle else [])],
                env=with_package_on_path(dict(os.environ)),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,
                cwd="/",
            )
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], READY_SECONDS)
        line = self.process.stdout.readline() if ready else b""
        self.process.stdout.close()
        if line.strip() != b"ready":
            self.close()
            raise AssertionError(f"the template did not print 'ready' within {READY_SECONDS:g}s: {self.stderr()}")

    def stderr(self) -> str:
        with open(self.stderr_path, errors="replace") as fh:
            return fh.read()

    def alive(self) -> bool:
        return self.process.poll() is None

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))

    @contextlib.contextmanager
    def stopped(self) -> Iterator[None]:
        """SIGSTOP: whatever happens meanwhile is queued for the template's next select()."""
        os.kill(self.process.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.process.pid, signal.SIGCONT)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.process.pid, signal.SIGCONT)
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.process.pid).children():
                child.kill()
        self.process.kill()
        self.process.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def template() -> Iterator[Template]:
    started = Template()
    try:
        yield started
    finally:
        started.close()


class Request:
    """One rank asked of the template as a node runner asks: ``script_main SCRIPT ARGS`` (or
    ``module``'s argv) with its stdin (/dev/null) and stdout/stderr (one pipe, kept here) as
    passed descriptors."""

    def __init__(
        self, conn: socket.socket, script: str, *args: str, module: str | None = None, idle: float | None = None
    ) -> None:
        self.conn = conn
        argv = [module, script, *args] if module else [SCRIPT_MAIN, str(SCRIPTS / script), *args]
        self.output, out_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        env = with_package_on_path({**os.environ, "RANK": "0", "PYTHONUNBUFFERED": "1"})
        request = {"argv": argv, "env": env, "cwd": str(SCRIPTS), "idle": idle}
        try:
            socket.send_fds(conn, [json.dumps(request).encode()], [null, out_w, out_w])
        finally:
            os.close(out_w)
            os.close(null)

    def answer(self) -> dict[str, Any]:
        """The template's next answer ({} when it closed the connection)."""
        self.conn.settimeout(ANSWER_SECONDS)
        try:
            data = self.conn.recv(4096)
        except ConnectionResetError:  # the template ended with this connection queued
            return {}
        return json.loads(data) if data else {}

    def read_until(self, text: bytes) -> None:
        seen = b""
        deadline = time.monotonic() + ANSWER_SECONDS
        while text not in seen:
            ready, _, _ = select.select([self.output], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self.output, 4096) if ready else b""
            if not chunk:
                raise AssertionError(f"the rank did not print {text!r} within {ANSWER_SECONDS:g}s (got {seen!r})")
            seen += chunk

    def close(self) -> None:
        self.conn.close()
        with contextlib.suppress(OSError):
            os.close(self.output)


def _raw_connect(path: str) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(path)
    return conn


def _runner_connect(template: Template) -> socket.socket:
    """Connect as node runners do (spark_torch.node.template.client)."""
    conn = warm._connect(template.path)
    if conn is None:
        raise AssertionError(
            f"the template no longer listens (exit status {template.process.poll()}): {template.stderr()}"
        )
    return conn


def run_rank(template: Template, script: str, *args: str, idle: float | None = None) -> int:
    """One well-behaved rank start, to its end: its exit status."""
    request = Request(_runner_connect(template), script, *args, idle=idle)
    try:
        started = request.answer()
        assert "pid" in started, (
            f"no rank started: {started} (template exit status {template.process.poll()}): {template.stderr()}"
        )
        ended = request.answer()
        assert "exit" in ended, f"no exit status: {ended}: {template.stderr()}"
        return int(ended["exit"])
    finally:
        request.close()


def _log_lines(template: Template, text: str) -> list[str]:
    return [line for line in template.stderr().splitlines() if text in line]


def test_a_runner_that_leaves_before_its_answer_does_not_end_the_template(
    template: Template, tmp_path: Path, no_leftovers: None
) -> None:
    marker = tmp_path / "ran"
    with template.stopped():  # the runner is gone before the template reads its request
        Request(_raw_connect(template.path), "touch_file.py", str(marker)).close()
    assert run_rank(template, "exit_code.py", "0") == 0
    assert template.alive()
    assert not marker.exists()  # its runner never learnt its pid: that rank never ran
    (line,) = _log_lines(template, "closed a node runner's connection")
    assert "BrokenPipeError" in line


def _wake_as_sigchld_would(pid: int) -> None:
    """A stopped template that learns of exits through SIGCHLD and a wake-up pipe learns only
    once it runs again, after anything queued meanwhile: write to that pipe (the one pipe of
    which it holds both ends) as its signal handler would. A template that watches its children
    through pidfds saw the exit queued at once and has no such pipe."""
    ends: dict[str, list[str]] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("pipe:"):
                ends.setdefault(target, []).append(fd)
    for fds in ends.values():
        if len(fds) == 2:
            with open(f"/proc/{pid}/fd/{fds[0]}", "wb", buffering=0) as pipe:
                pipe.write(b"\x11")


def test_a_rank_exit_and_its_runner_leaving_in_one_batch(template: Template, no_leftovers: None) -> None:
    request = Request(_runner_connect(template), "hang.py")
    pid = request.answer()["pid"]
    request.read_until(b"hanging")
    with template.stopped():
        os.kill(pid, signal.SIGKILL)
        _wait(
            f"rank {pid} to exit",
            lambda: psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
            30,
            "SIGKILL did not end it",
        )
        _wake_as_sigchld_would(template.process.pid)
        request.close()  # its runner leaves: both events reach the same select() batch
    assert run_rank(template, "exit_code.py", "0") == 0
    assert template.alive(), template.stderr()
    _wait(f"rank {pid} to be reaped", lambda: not psutil.pid_exists(pid), 30, "the template did not reap it")


def test_a_killed_template_takes_its_children_along(template: Template, no_leftovers: None) -> None:
    """The template arms a parent-death signal in every child (a store host, a rank's keeper),
    so nothing it forked outlives it, reparented to init."""
    request = Request(_runner_connect(template), "0", "2", "127.0.0.1", module="spark_torch.node.store_host_main")
    pid = None
    try:
        pid = request.answer()["pid"]
        request.read_until(b"ready")
        template.process.kill()
        template.process.wait(10)
        _wait(
            f"store host {pid} to go with its template",
            lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
            30,
            "it outlived its template",
        )
    finally:
        request.close()
        if pid is not None:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


def _pids_cgroup() -> str | None:
    """A directory under which this test may create a pids cgroup (v1, or v2 with the pids
    controller enabled for children), or None."""
    own = {}
    with open("/proc/self/cgroup") as fh:
        for line in fh:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") or [""]:
                own[name] = path
    with open("/proc/self/mounts") as fh:
        mounts = [line.split() for line in fh]
    for _, mount, kind, options, *_ in mounts:
        if kind == "cgroup" and "pids" in options.split(",") and "pids" in own:
            parent = mount + own["pids"]
        elif kind == "cgroup2" and "" in own:
            parent = mount + own[""]
            try:
                with open(os.path.join(parent, "cgroup.subtree_control")) as fh:
                    if "pids" not in fh.read().split():
                        continue
            except OSError:
                continue
        else:
            continue
        if os.access(parent, os.W_OK):
            return parent
    return None


@contextlib.contextmanager
def pids_limit(pid: int) -> Iterator[Callable[[str], None]]:
    """Move process ``pid`` into a new pids cgroup; yields a setter of its ``pids.max``."""
    parent = _pids_cgroup()
    if parent is None:
        pytest.skip("needs a pids cgroup this test can create (root, cgroup v1 pids or v2 with pids delegated)")
    group = os.path.join(parent, f"spark_torch_test_{uuid.uuid4().hex[:8]}")
    os.mkdir(group)

    def write(name: str, value: str, where: str = group) -> None:
        with open(os.path.join(where, name), "w") as fh:
            fh.write(value)

    try:
        write("cgroup.procs", str(pid))
        yield lambda value: write("pids.max", value)
    finally:
        with open(os.path.join(group, "cgroup.procs")) as fh:
            for member in fh.read().split():
                with contextlib.suppress(OSError):
                    write("cgroup.procs", member, parent)
        os.rmdir(group)


def test_a_refused_fork_fails_that_request_only(template: Template, no_leftovers: None) -> None:
    with pids_limit(template.process.pid) as set_pids_max:
        set_pids_max("1")  # the template's one thread: fork() fails with EAGAIN
        request = Request(_runner_connect(template), "exit_code.py", "0")
        try:
            answer = request.answer()
        finally:
            request.close()
        assert "pid" not in answer and "Resource temporarily unavailable" in answer.get("error", ""), (
            f"{answer} (template exit status {template.process.poll()}): {template.stderr()}"
        )
        assert template.alive()
        (line,) = _log_lines(template, "closed a node runner's connection")
        assert "BlockingIOError" in line
        set_pids_max("max")
        assert run_rank(template, "exit_code.py", "0") == 0


def test_refused_requests_leave_no_descriptor_in_the_template(template: Template, no_leftovers: None) -> None:
    before = template.fds()
    for message, count in ((b"not json", 3), (b"[1, 2]", 4), (b'{"argv": ["x"], "env": {}}', 2)):
        for _ in range(5):
            conn = _raw_connect(template.path)
            null = os.open(os.devnull, os.O_RDONLY)
            try:
                socket.send_fds(conn, [message], [null] * count)
            finally:
                os.close(null)
            conn.settimeout(ANSWER_SECONDS)
            while data := conn.recv(4096):  # an error answer, then the template closes it
                assert b"pid" not in data
            conn.close()
    assert template.fds() == before, os.listdir(f"/proc/{template.process.pid}/fd")
    assert template.alive()
    assert run_rank(template, "exit_code.py", "0") == 0


def _thread_syscall(tid: int) -> str:
    with contextlib.suppress(OSError):
        with open(f"/proc/self/task/{tid}/syscall") as fh:
            return fh.read().split()[0]
    return ""


def test_a_burst_of_runners_all_get_ranks(template: Template, no_leftovers: None) -> None:
    """More runners at once than a small listen queue holds (many nodes of one executor): each
    waits for its turn and gets a rank; none falls back to a cold start."""
    syscall = CONNECT_SYSCALL.get(os.uname().machine)
    if syscall is None:
        pytest.skip(f"connect()'s system call number on {os.uname().machine} is not listed")
    n = 40
    state: list[str] = ["new"] * n
    tids: list[int] = [0] * n
    results: list[Any] = [None] * n

    def runner(i: int) -> None:
        tids[i] = threading.get_native_id()
        state[i] = "connecting"
        try:
            conn = warm._connect(template.path)
            state[i] = "connected"
            assert conn is not None
            request = Request(conn, "exit_code.py", "0")
            try:
                results[i] = (request.answer().get("pid") is not None, request.answer().get("exit"))
            finally:
                request.close()
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            state[i] = "failed"
            results[i] = exc

    threads = [threading.Thread(target=runner, args=(i,), daemon=True) for i in range(n)]
    with template.stopped():  # nobody is accepted until all have asked: the queue overflows
        for thread in threads:
            thread.start()
        _wait(
            "every runner to connect, fail, or wait inside connect()",
            lambda: all(
                s in ("connected", "failed") or (s == "connecting" and _thread_syscall(t) == syscall)
                for s, t in zip(state, tids)
            ),
            60,
            f"states {state}",
        )
    for thread in threads:
        thread.join(ANSWER_SECONDS * 2)
    assert results == [(True, 0)] * n, [r for r in results if r != (True, 0)]
    assert template.alive()


def test_an_idle_time_too_large_for_select_is_clamped(no_leftovers: None) -> None:
    """A template told to idle for ever (``inf``, as a runner passes it) and a request for 1e9 s:
    select() takes neither (the template used to exit with OverflowError, leaving its socket and
    turning warm starts off); both are clamped to a day, and the template serves."""
    template = Template(idle="inf")
    try:
        assert run_rank(template, "exit_code.py", "0", idle=1e9) == 0
        assert run_rank(template, "exit_code.py", "3", idle=float("inf")) == 3
        assert template.alive() and os.path.exists(template.path), template.stderr()
    finally:
        template.close()


def test_runs_sharing_a_template_each_keep_it_their_idle_time(no_leftovers: None) -> None:
    """Run A asks for 15 s, then run B for 0.3 s: B's shorter time does not cut A's (the template
    used to take the latest request's), and A's expires: the template removes its socket and exits."""
    template = Template()
    try:
        assert run_rank(template, "exit_code.py", "0", idle=15.0) == 0
        assert run_rank(template, "exit_code.py", "0", idle=0.3) == 0
        b_ended = time.monotonic()
        while time.monotonic() < b_ended + 2.0:  # well past B's 0.3 s, well within A's 15 s
            assert os.path.exists(template.path), f"B's 0.3 s idle time ended run A's 15 s: {template.stderr()}"
            time.sleep(0.05)
        assert run_rank(template, "exit_code.py", "0") == 0  # a request without an idle time changes nothing
        _wait(
            "the template to stop once A's 15 s passed",
            lambda: template.process.poll() is not None,
            60,
            "A's idle time did not expire",
        )
        assert template.process.returncode == 0 and not os.path.exists(template.path), template.stderr()
    finally:
        template.close()


def test_a_failure_of_the_loop_itself_removes_the_socket(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Not one connection's failure but the loop's own (here select() fails): one line on stderr,
    and the socket is gone, so the next runner starts a new template instead of meeting a dead
    socket. The loop runs in this test's process, which is no subreaper: its end sweeps none of
    the process's own children (here a bystander; in a suite, the Spark driver's JVM)."""
    from spark_torch.node.template.server import _Template

    path = str(tmp_path / "t.sock")
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    template = _Template(path, os.getpid(), None)

    def broken_select(timeout: float | None = None) -> list[Any]:
        raise OSError("select() failed (injected)")

    template.selector.select = broken_select  # type: ignore[method-assign]
    try:
        template.serve()  # nothing runs: it stops listening and, with nothing left, returns
        with pytest.raises(subprocess.TimeoutExpired):  # a SIGKILL sent would have ended it by now
            bystander.wait(1.0)
    finally:
        template.selector.close()
        os.close(template.owner_fd)
        bystander.kill()
        bystander.wait()
    assert not os.path.exists(path) and template.listener is None
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "spark_torch template" in line]
    assert "stopped taking ranks after a failure of its loop (OSError: select() failed (injected))" in line
    assert "the next rank starts a new template" in line


def test_a_runner_waits_for_room_in_a_full_listen_queue() -> None:
    """The runner's side alone: against a listener whose queue is full, connect() waits (in the
    kernel, bounded) until the listener takes one, instead of failing at once with EAGAIN."""
    syscall = CONNECT_SYSCALL.get(os.uname().machine)
    if syscall is None:
        pytest.skip(f"connect()'s system call number on {os.uname().machine} is not listed")
    directory = tempfile.mkdtemp(prefix="q-")  # not under tmp_path: Unix socket paths are short
    path = os.path.join(directory, "q.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    queued: list[socket.socket] = []
    outcome: dict[str, Any] = {}
    try:
        listener.bind(path)
        listener.listen(0)  # room for one
        while True:  # fill the queue
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            probe.setblocking(False)
            try:
                probe.connect(path)
            except BlockingIOError:
                probe.close()
                break
            queued.append(probe)

        def connect() -> None:
            outcome["tid"] = threading.get_native_id()
            try:
                outcome["conn"] = warm._connect(path)
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                outcome["conn"] = exc

        thread = threading.Thread(target=connect, daemon=True)
        thread.start()
        _wait(
            "the runner to wait inside connect() (or to fail)",
            lambda: "conn" in outcome or ("tid" in outcome and _thread_syscall(outcome["tid"]) == syscall),
            30,
            f"got {outcome}",
        )
        assert "conn" not in outcome, outcome  # it waits: no EAGAIN
        accepted, _ = listener.accept()  # room for one more: the runner gets in
        thread.join(30)
        assert isinstance(outcome.get("conn"), socket.socket), outcome
        outcome["conn"].close()
        accepted.close()
    finally:
        for conn in queued:
            conn.close()
        listener.close()
        shutil.rmtree(directory, ignore_errors=True)


# -- through the Distributor -------------------------------------------------------------


def train_until(started: str, stop: str, seconds: float = 240.0) -> dict[str, Any]:
    """On every rank: gloo all-reduces in a loop until rank 0 sees ``stop`` (bounded); rank 0
    says where it runs in ``started`` after the first one. Returns steps and wrong sums."""
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = wrong = 0
    deadline = time.monotonic() + seconds
    while True:
        t = torch.tensor([float(rank + 1), 0.0])
        if rank == 0 and (os.path.exists(stop) or time.monotonic() > deadline):
            t[1] = 1.0
        dist.all_reduce(t)
        steps += 1
        wrong += int(t[0].item() != world * (world + 1) / 2)
        if steps == 1 and rank == 0:
            with open(started + ".tmp", "w") as fh:
                json.dump({"pid": os.getpid(), "ppid": _launcher_pid()}, fh)
            os.rename(started + ".tmp", started)
        if t[1].item() > 0:
            break
        time.sleep(0.005)  # a gentle loop on 2 shared cores
    dist.destroy_process_group()
    return {"steps": steps, "wrong": wrong, "timed_out": time.monotonic() > deadline}


def parent_of_rank() -> dict[str, Any]:
    parent = psutil.Process(_launcher_pid())
    return {"ppid": parent.pid, "cmdline": " ".join(parent.cmdline())}


def test_a_run_stalled_in_rank_start_up_does_not_end_another_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_leftovers: None
) -> None:
    """Run A trains (gloo all-reduces) on ranks forked from the driver's template while run B's
    rank start-up times out: the template was stalled (SIGSTOP), B gave up on its answer and
    started its rank cold. When the template runs again it finds B's runner gone: that request
    fails alone, B's abandoned fork never runs, and A trains on to the right result."""
    started, stop = tmp_path / "started", tmp_path / "stop"
    outcome: dict[str, Any] = {}

    def run_a() -> None:
        try:
            outcome["a"] = Distributor(num_processes=2, timeout=300).run(train_until, str(started), str(stop))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            outcome["a"] = exc

    a = threading.Thread(target=run_a, daemon=True)
    a.start()
    try:
        _wait("run A's first all-reduce", lambda: started.exists() or not a.is_alive(), 180, f"run A ended: {outcome}")
        template = json.loads(started.read_text())["ppid"]
        assert TEMPLATE_MODULE in " ".join(psutil.Process(template).cmdline())
        monkeypatch.setattr(warm, "ANSWER_SECONDS", 2.0, raising=False)
        os.kill(template, signal.SIGSTOP)
        try:
            b = Distributor(num_processes=1).run(parent_of_rank)
        finally:
            os.kill(template, signal.SIGCONT)
        assert b["ppid"] == os.getpid()  # B started its rank cold
        getattr(warm, "_avoid", {}).clear()  # B's timeout keeps this process away for a while: not C
        # C is served after B's abandoned request (one queue): the template has handled it by now
        c = Distributor(num_processes=1).run(parent_of_rank)
    finally:
        stop.write_text("stop")
        a.join(300)
    result = outcome["a"]
    assert isinstance(result, dict), f"run A failed: {result!r}"
    assert result["wrong"] == 0 and not result["timed_out"] and result["steps"] > 1, result
    assert psutil.Process(template).is_running() and c["ppid"] == template, c  # the same template serves on


@pytest.fixture(scope="module")
def local8_spark() -> Iterator[Any]:
    """A ``local[8]`` session: eight slots on one executor (the driver's JVM)."""
    from .conftest import make_session

    spark = make_session("local[8]")
    yield spark
    spark.stop()


def template_of_rank() -> dict[str, Any]:
    """On every rank: the process that forked it (gathered to rank 0)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    parent = psutil.Process(_launcher_pid())
    mine = {"parent": parent.pid, "cmdline": " ".join(parent.cmdline())}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    dist.destroy_process_group()
    return {"ranks": gathered}


@pytest.mark.slow
def test_eight_nodes_on_one_executor_all_start_warm(local8_spark: Any, no_leftovers: None) -> None:
    """Eight barrier tasks (one rank each) ask the executor's template at once: all are forks
    of that one template (a rank that fell back to a cold start would be its Python worker's
    child, after a 'warm rank starts are off' warning)."""
    for _ in range(2):  # the first run also starts the template and Spark's Python workers
        out = Distributor(num_processes=8, local_mode=False, spark=local8_spark).run(template_of_rank)
        ranks = out["ranks"]
        assert all(TEMPLATE_MODULE in r["cmdline"] for r in ranks), [r["cmdline"] for r in ranks]
        assert len({r["parent"] for r in ranks}) == 1, ranks


#: the user another user's processes run as in these tests (nobody)
STRANGER = 65534


def _fork_as_stranger(work: Callable[[], int], cwd: str) -> int:
    """Run ``work`` in a forked child that moves to the folder ``cwd`` (a socket there is then
    reached by its name: the session's temporary directory above it is this user's only) and
    becomes uid/gid 65534 (nobody), and exits with the value ``work`` returned (99: it raised);
    the child's pid."""
    pid = os.fork()
    if pid == 0:  # the child: system calls only, then _exit
        code = 99
        try:
            os.chdir(cwd)
            os.setgroups([])
            os.setgid(STRANGER)
            os.setuid(STRANGER)
            code = work()
        finally:
            os._exit(code)
    return pid


def _as_stranger(work: Callable[[], int], cwd: str) -> int:
    """:func:`_fork_as_stranger`, waited for: its exit status."""
    _, status = os.waitpid(_fork_as_stranger(work, cwd), 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(os.getuid() != 0, reason="becoming another user needs root")
def test_the_template_refuses_another_users_request(template: Template, no_leftovers: None) -> None:
    """Even with its folder and socket opened to everyone (they are 0700 and 0600), a request
    from another user (``SO_PEERCRED``) is closed unanswered and starts nothing; the template
    goes on serving its own user."""
    os.chmod(template.dir, 0o711)
    os.chmod(template.path, 0o666)
    request = json.dumps({"argv": [SCRIPT_MAIN, str(SCRIPTS / "exit_code.py"), "0"], "env": {}, "cwd": "/"}).encode()

    def ask() -> int:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.settimeout(ANSWER_SECONDS)
        try:
            conn.connect(os.path.basename(template.path))
        except PermissionError:
            return 3  # refused by the file's mode: the door this test opened is shut
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            socket.send_fds(conn, [request], [null, null, null])
            answer = conn.recv(4096)
        except (BrokenPipeError, ConnectionResetError):
            return 0
        return 0 if answer == b"" else 1  # 1: it answered a stranger

    assert _as_stranger(ask, template.dir) == 0
    assert template.alive() and psutil.Process(template.process.pid).children() == []
    assert run_rank(template, "exit_code.py", "0") == 0


@pytest.mark.skipif(os.getuid() != 0, reason="becoming another user needs root")
def test_a_runner_refuses_a_template_of_another_user() -> None:
    """Something of another user listening where this user's template should: the runner
    connects, sees the peer's user and refuses it, naming the path and the user."""
    folder = tempfile.mkdtemp(prefix="tpl-")  # Unix socket paths are short: not under tmp_path
    os.chown(folder, STRANGER, STRANGER)
    path = os.path.join(folder, "t.sock")
    ready, go = os.pipe()

    def listen() -> int:
        os.close(ready)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server.bind(os.path.basename(path))
        server.listen(1)
        os.write(go, b"x")
        server.settimeout(ANSWER_SECONDS)
        server.accept()
        return 0

    pid = _fork_as_stranger(listen, folder)
    os.close(go)
    try:
        listening, _, _ = select.select([ready], [], [], ANSWER_SECONDS)
        assert listening and os.read(ready, 1) == b"x", (
            f"the stranger's listener did not start within {ANSWER_SECONDS:g}s"
        )
        with pytest.raises(
            OSError, match=rf"the warm-start template at {path} runs as user {STRANGER}, not as this user"
        ):
            warm._connect(path)
    finally:
        os.close(ready)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        shutil.rmtree(folder, ignore_errors=True)
