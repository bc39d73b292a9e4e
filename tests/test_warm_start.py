"""Warm rank starts: ranks forked from a template that already imported torch behave exactly
like ranks started cold, runs do not leak state into each other, and a dead template is
rebuilt."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from spark_torch import Distributor

from .conftest import SCRIPTS


def _launcher_pid() -> int:
    """In a rank: the process that started it (the warm-start template, or the node runner),
    which is its keeper's parent (:mod:`spark_torch.node.keeper`)."""
    return psutil.Process(os.getppid()).ppid()


IGNORED = {
    "SPARK_TORCH_PARENT_PID",
    "SPARK_TORCH_RUN_ID",
    "SPARK_TORCH_NODE_TOKEN",
    "TORCHELASTIC_RUN_ID",
    "MASTER_PORT",
    "TORCHELASTIC_ERROR_FILE",
    "SPARK_TORCH_REPORT_FDS",
    "SPARK_TORCH_STORAGE",
    "SPARK_TORCH_WARM_START",
    "SPARK_TORCH_STACK_FILE",
    "_",
}


def what_a_rank_sees(marker: str) -> dict[str, Any]:
    import sys

    import torch

    leaked = getattr(sys.modules["json"], "leaked_by_an_earlier_run", None)
    import json

    json.leaked_by_an_earlier_run = marker  # type: ignore[attr-defined]
    return {
        "env": {k: v for k, v in os.environ.items() if k not in IGNORED},
        "cwd": os.getcwd(),
        "argv0": os.path.basename(sys.argv[0]),
        "argc": len(sys.argv),
        "path0": sys.path[0],
        "main": sys.modules["__main__"].__spec__.name if sys.modules["__main__"].__spec__ else None,
        "stdio": [os.readlink(f"/proc/self/fd/{fd}").split(":")[0] for fd in (0, 1, 2)],
        "threads": torch.get_num_threads(),
        "seed": torch.initial_seed(),
        "leaked": leaked,
        "ppid_cmd": " ".join(psutil.Process(_launcher_pid()).cmdline()),
        "ppid": _launcher_pid(),
        "torch_imported_before": "torch" in sys.modules,
    }


def _both(tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    os.chdir(tmp_path)
    warm = Distributor(num_processes=2).run(what_a_rank_sees, "warm")
    os.environ["SPARK_TORCH_WARM_START"] = "0"
    cold = Distributor(num_processes=2).run(what_a_rank_sees, "cold")
    return warm, cold


def test_warm_ranks_see_what_cold_ranks_see(tmp_path: Path, no_leftovers: None) -> None:
    cwd = os.getcwd()
    try:
        warm, cold = _both(tmp_path)
    finally:
        os.chdir(cwd)
    assert (
        "spark_torch.node.template.server" in warm["ppid_cmd"]
        and "spark_torch.node.template.server" not in cold["ppid_cmd"]
    )
    for key in ("cwd", "argv0", "argc", "path0", "main", "stdio", "threads"):
        assert warm[key] == cold[key], key
    # the rendezvous store is hosted before the user's code either way: warm by a fork of the
    # template before the ranks start, cold by rank 0 itself (spark_torch.rank.store)
    assert warm["env"].pop("TORCHELASTIC_USE_AGENT_STORE") == "True"
    assert cold["env"].pop("TORCHELASTIC_USE_AGENT_STORE") == "True"
    assert warm["env"] == cold["env"]
    assert warm["leaked"] is None and cold["leaked"] is None


def test_runs_do_not_leak_into_each_other_and_seeds_differ(no_leftovers: None) -> None:
    d = Distributor(num_processes=1)
    first = d.run(what_a_rank_sees, "first")
    second = d.run(what_a_rank_sees, "second")
    assert first["leaked"] is None and second["leaked"] is None  # each run: a fresh fork
    assert first["seed"] != second["seed"]  # not the template's random state


def _templates() -> list[psutil.Process]:
    """The templates this process started and that still run."""
    found = []
    for child in psutil.Process().children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "spark_torch.node.template.server" in " ".join(
                child.cmdline()
            ):
                found.append(child)
        except psutil.Error:
            continue
    return found


def test_a_killed_template_is_rebuilt(no_leftovers: None) -> None:
    first = Distributor(num_processes=1).run(what_a_rank_sees, "x")
    # the template that forked this run's rank (earlier tests' templates, for other settings, may still idle)
    (template,) = [t for t in _templates() if t.pid == first["ppid"]]
    assert len(os.listdir(f"/proc/{template.pid}/task")) == 1  # no thread in the template: fork is safe
    template.kill()
    template.wait(10)
    out = Distributor(num_processes=2).run(what_a_rank_sees, "y")
    (rebuilt,) = [t for t in _templates() if t.pid == out["ppid"]]
    assert rebuilt.pid != template.pid and "spark_torch.node.template.server" in out["ppid_cmd"]


@pytest.mark.parametrize("planted", ["another-user", "readable-by-others"])
def test_a_refused_template_folder_costs_no_warm_start(
    planted: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, no_leftovers: None
) -> None:
    """``$TMPDIR/spark_torch_templates-UID`` made first by another user (or open to others) is
    never used: ranks still start warm, from a template in a private folder of this process,
    and one WARNING names the refused folder."""
    if planted == "another-user" and os.getuid() != 0:
        pytest.skip("making a folder of another user needs root")
    tmp_path = Path(tempfile.mkdtemp(prefix="st-", dir="/tmp"))  # a socket's path has at most 107 bytes
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr("spark_torch.shared.owned_files._fallbacks", {})
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    folder = tmp_path / f"spark_torch_templates-{os.getuid()}"
    folder.mkdir(mode=0o700)
    if planted == "another-user":
        os.chown(folder, 4242, 4242)
    else:
        folder.chmod(0o755)
    before = set(_templates())
    try:
        with caplog.at_level(logging.WARNING, logger="spark_torch"):
            first = Distributor(num_processes=1).run(what_a_rank_sees, "a")
            second = Distributor(num_processes=1).run(what_a_rank_sees, "b")
        assert "spark_torch.node.template.server" in first["ppid_cmd"] and first["ppid"] == second["ppid"]
        refused = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(refused) == 1 and f"refused the folder {folder} (" in refused[0], refused
        socket_path = first["ppid_cmd"].split()[3]  # python -m MODULE SOCKET OWNER IDLE
        assert not socket_path.startswith(str(folder) + os.sep) and list(folder.iterdir()) == []
        assert f"private folder {os.path.dirname(socket_path)} instead" in refused[0]
    finally:
        for template in set(_templates()) - before:
            template.kill()
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_scripts_start_warm_too(tmp_path: Path, no_leftovers: None) -> None:
    import json

    Distributor(num_processes=2).run(str(SCRIPTS / "env_dump.py"), tmp_path, "--x=1")
    infos = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [i["argv"] for i in infos] == [["--x=1"], ["--x=1"]] and all(i["sum"] == 2.0 for i in infos)


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_warm_start_can_be_turned_off(value: str, no_leftovers: None) -> None:
    os.environ["SPARK_TORCH_WARM_START"] = value
    out = Distributor(num_processes=1).run(what_a_rank_sees, "z")
    assert (
        "spark_torch.node.template.server" not in out["ppid_cmd"]
        and sys.executable in out["ppid_cmd"]
        or "pytest" in out["ppid_cmd"]
    )


def what_starts_with_the_interpreter() -> dict[str, Any]:
    """What a rank's interpreter took from its environment when it started, and what it got
    from its node runner (umask, limits), plus every descriptor it holds."""
    import resource
    import site
    import sys
    import warnings

    import torch  # noqa: F401 - as a training function would: its import-time settings apply

    with open("/proc/self/status") as fh:
        umask = next(int(line.split()[1], 8) for line in fh if line.startswith("Umask:"))
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, closed again
            pass
    return {
        "hash": hash("spark_torch"),
        "warnoptions": list(sys.warnoptions),
        "filters": [(f[0], f[2].__name__) for f in warnings.filters if f[1] is None and f[3] is None][:3],
        "dont_write_bytecode": sys.dont_write_bytecode,
        "umask": umask,
        "nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
        "rlimits": {
            name: resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_")
        },
        "path": list(sys.path),
        "cwd": os.getcwd(),
        "user_site": site.USER_SITE,
        "user_base": site.USER_BASE,
        "fds": fds,
        "report_fds": [int(fd) for fd in os.environ.get("SPARK_TORCH_REPORT_FDS", "").split(",") if fd],
        "ppid_cmd": " ".join(psutil.Process(_launcher_pid()).cmdline()),
        "affinity": sorted(os.sched_getaffinity(0)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "oom_score_adj": int(open("/proc/self/oom_score_adj").read()),
        "sched_policy": os.sched_getscheduler(0),
        "io_class": int(psutil.Process().ionice().ioclass),
    }


#: limits a test may lower (soft only) without harm to itself
HARMLESS_LIMITS = ("RLIMIT_FSIZE", "RLIMIT_RSS", "RLIMIT_MSGQUEUE", "RLIMIT_SIGPENDING", "RLIMIT_RTTIME")


def _lower_soft_limits() -> dict[int, tuple[int, int]]:
    """Lower the soft value of every harmless limit this platform has; what they were."""
    import resource

    saved = {}
    for name in HARMLESS_LIMITS:
        which = getattr(resource, name, None)
        if which is None:
            continue
        soft, hard = resource.getrlimit(which)
        lower = 1 << 40 if soft == resource.RLIM_INFINITY else soft - 1
        if lower > 0 and (hard == resource.RLIM_INFINITY or lower <= hard):
            saved[which] = (soft, hard)
            resource.setrlimit(which, (lower, hard))
    return saved


def test_warm_ranks_start_with_the_settings_cold_ranks_start_with(tmp_path: Path, no_leftovers: None) -> None:
    """Interpreter-start settings of env= (hash seed, warnings, bytecode, PYTHONSAFEPATH, HOME
    and so the user site directory), and the node runner's umask, resource limits (all of
    them), CPU affinity, nice value, oom_score_adj, scheduling policy and I/O class as they are
    when the rank starts (changed after its template started): warm ranks get them as cold
    ranks do."""
    import resource

    env = {
        "PYTHONHASHSEED": "123",
        "PYTHONWARNINGS": "ignore::UserWarning",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONSAFEPATH": "1",
        "HOME": str(tmp_path / "home"),
    }
    (tmp_path / "work").mkdir()
    cwd = os.getcwd()
    os.chdir(tmp_path / "work")  # on no sys.path but its own (the tests run with PYTHONPATH=checkout)
    before = set(_templates())
    saved: dict[int, tuple[int, int]] = {}
    mask = os.umask(0o022)
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        Distributor(num_processes=1, env=env).run(what_starts_with_the_interpreter)  # starts their template
        os.umask(0o027)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(limits[0], 4096) - 3, limits[1]))
        saved = _lower_soft_limits()
        scheduling = _change_priority()
        Distributor(num_processes=1, env=env).run(what_starts_with_the_interpreter)  # a template for them
        scheduling["affinity"] = _change_affinity()  # after that template started
        scheduling.update(_change_policy())  # likewise
        warm = Distributor(num_processes=1, env=env).run(what_starts_with_the_interpreter)
        cold = Distributor(num_processes=1, env=env, warm_start=False).run(what_starts_with_the_interpreter)
        lowered = {
            name: resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_")
        }
    finally:
        _restore_scheduling()
        os.chdir(cwd)
        os.umask(mask)
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
        for which, value in saved.items():
            resource.setrlimit(which, value)
        for template in set(_templates()) - before:  # the one for these settings
            template.kill()
    assert (
        "spark_torch.node.template.server" in warm["ppid_cmd"]
        and "spark_torch.node.template.server" not in cold["ppid_cmd"]
    )
    assert cold["hash"] == warm["hash"] and cold["warnoptions"] == warm["warnoptions"] == ["ignore::UserWarning"]
    assert cold["filters"] == warm["filters"] and ("ignore", "UserWarning") in warm["filters"]
    assert cold["dont_write_bytecode"] is warm["dont_write_bytecode"] is True
    assert cold["umask"] == warm["umask"] == 0o027
    assert cold["nofile"] == warm["nofile"] == [min(limits[0], 4096) - 3, limits[1]]
    assert saved and cold["rlimits"] == warm["rlimits"] == lowered
    assert cold["cwd"] == warm["cwd"] == str(tmp_path / "work")
    assert cold["path"] == warm["path"] and warm["cwd"] not in warm["path"]  # PYTHONSAFEPATH: no cwd first
    assert cold["user_site"] == warm["user_site"] and warm["user_site"].startswith(str(tmp_path / "home"))
    assert cold["user_base"] == warm["user_base"]
    for key in (
        "affinity",
        "nice",
        "oom_score_adj",
        "sched_policy",
        "io_class",
    ):  # the runner's, changed after the template started
        assert cold[key] == warm[key] == scheduling[key], (key, cold[key], warm[key], scheduling[key])


_SCHEDULING_BEFORE: dict[str, Any] = {}


def _change_priority() -> dict[str, Any]:
    """Give this process (the node runner in local mode) a higher nice value, a higher
    oom_score_adj, SCHED_BATCH and the idle I/O class (undone by :func:`_restore_scheduling`:
    lowering the first two needs root); what they are now."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    with open("/proc/self/oom_score_adj") as fh:
        oom = int(fh.read())
    _SCHEDULING_BEFORE.update(
        affinity=sorted(os.sched_getaffinity(0)),
        nice=nice,
        oom_score_adj=oom,
        sched=(os.sched_getscheduler(0), os.sched_getparam(0)),
        ionice=psutil.Process().ionice(),
    )
    os.setpriority(os.PRIO_PROCESS, 0, nice + 1)
    with open("/proc/self/oom_score_adj", "w") as fh:
        fh.write(str(oom + 100))
    return {"nice": nice + 1, "oom_score_adj": oom + 100}


def _change_policy() -> dict[str, int]:
    """SCHED_BATCH and the idle I/O class for this thread (undone by :func:`_restore_scheduling`)."""
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    psutil.Process().ionice(psutil.IOPRIO_CLASS_IDLE)
    return {"sched_policy": os.SCHED_BATCH, "io_class": int(psutil.IOPRIO_CLASS_IDLE)}


def _change_affinity() -> list[int]:
    """Take one CPU from this process (when it has two or more); the CPUs it has now."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:
        os.sched_setaffinity(0, cpus[:-1])
    return sorted(os.sched_getaffinity(0))


def _restore_scheduling() -> None:
    if not _SCHEDULING_BEFORE:
        return
    os.sched_setaffinity(0, _SCHEDULING_BEFORE["affinity"])
    os.sched_setscheduler(0, *_SCHEDULING_BEFORE["sched"])
    ionice = _SCHEDULING_BEFORE["ionice"]
    psutil.Process().ionice(ionice.ioclass, ionice.value if ionice.ioclass in (1, 2) else None)
    with contextlib.suppress(PermissionError):  # root only: a test run by another user stays nicer
        os.setpriority(os.PRIO_PROCESS, 0, _SCHEDULING_BEFORE["nice"])
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write(str(_SCHEDULING_BEFORE["oom_score_adj"]))
    _SCHEDULING_BEFORE.clear()


def descriptors_of_each_rank(folder: str) -> None:
    """Every rank writes what it holds when it starts to ``folder/rank-N.json``."""
    seen = what_starts_with_the_interpreter()
    with open(os.path.join(folder, f"rank-{os.environ['RANK']}.json"), "w", encoding="utf-8") as fh:
        json.dump({"fds": seen["fds"], "report_fds": seen["report_fds"], "ppid_cmd": seen["ppid_cmd"]}, fh)


def _sigint_in_the_rank() -> tuple[bool, bool]:
    """(whether SIGINT is ignored in this rank, whether it was started warm)."""
    import signal

    started_by = psutil.Process(_launcher_pid()).cmdline()
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN, "spark_torch.node.template.server" in started_by


def test_a_warm_rank_ignores_the_signals_its_driver_ignores_now(no_leftovers: None) -> None:
    """A cold rank inherits what its driver ignores at that moment (exec keeps SIG_IGN): a driver
    started as a background job ignores SIGINT until, say, a SparkContext installs its handler.
    Warm ranks follow: templates are keyed by the ignored signals, so the rank of a run with SIGINT
    ignored ignores it and the next run's, with a handler installed, does not."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ignoring = Distributor(num_processes=1).run(_sigint_in_the_rank)
    finally:
        signal.signal(signal.SIGINT, previous)
    handling = Distributor(num_processes=1).run(_sigint_in_the_rank)
    assert ignoring == (True, True) and handling == (previous is signal.SIG_IGN, True), (ignoring, handling)


def test_ranks_hold_no_descriptor_but_their_own(tmp_path: Path, no_leftovers: None) -> None:
    """A warm rank holds stdin/stdout/stderr and its report pipes, as a cold rank does: nothing
    of the template (its socket, pidfds, pipes) and nothing of other runs' requests. Cold, rank 0
    also holds the rendezvous store it hosts before the user's code (spark_torch.rank.store):
    its sockets and torch's event loop, nothing else."""
    seen = {}
    for name, warm_start in (("warm", True), ("cold", False)):
        (tmp_path / name).mkdir()
        Distributor(num_processes=2, warm_start=warm_start).run(descriptors_of_each_rank, str(tmp_path / name))
        seen[name] = [json.loads((tmp_path / name / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert all("spark_torch.node.template.server" in rank["ppid_cmd"] for rank in seen["warm"])
    for name, ranks in seen.items():
        for rank, got in enumerate(ranks):
            fds = {int(fd): target for fd, target in got["fds"].items()}
            dump = {
                fd for fd, target in fds.items() if target.endswith(".native")
            }  # stall detection's faulthandler file
            own = {0, 1, 2, *got["report_fds"], *dump}
            assert len(dump) == 1, fds
            if name == "cold" and rank == 0:
                store = {fd: target for fd, target in fds.items() if fd not in own}
                assert store and all(
                    t.startswith(("socket:", "anon_inode:", "pipe:")) or t == "/dev/null" for t in store.values()
                ), store
            else:
                assert set(fds) == own, (name, rank, fds)
    assert len(seen["warm"][1]["report_fds"]) == len(seen["cold"][1]["report_fds"])


def test_an_idle_template_exits_and_a_later_run_starts_a_new_one(no_leftovers: None) -> None:
    """warm_start_idle: the template ends that long after its last rank, this process reaps it
    (no zombie), and the next run starts a new one. A template of its own (keyed by a startup
    variable): earlier runs' templates keep their default 300 s, which a shorter request never cuts."""
    own = {"PYTHON_SPARK_TORCH_TEST_KEY": uuid.uuid4().hex}
    first = Distributor(num_processes=1, warm_start_idle=1.0, env=own).run(what_a_rank_sees, "idle")
    template = psutil.Process(first["ppid"])
    assert "spark_torch.node.template.server" in " ".join(template.cmdline())
    deadline = time.monotonic() + 60
    while psutil.pid_exists(template.pid):
        assert time.monotonic() < deadline, (
            f"template {template.pid} still there ({template.status()}) 60 s after its 1 s idle timeout: "
            "not ended when idle, or not reaped by the process that started it"
        )
        time.sleep(0.05)
    second = Distributor(num_processes=2, warm_start_idle=1.0, env=own).run(what_a_rank_sees, "after")
    assert "spark_torch.node.template.server" in second["ppid_cmd"] and second["leaked"] is None
    (rebuilt,) = [t for t in _templates() if t.pid == second["ppid"]]  # a child of this process, reaped when it ends
    assert rebuilt.pid != template.pid


def template_of_rank() -> list[dict[str, Any]]:
    """On every rank: the template that forked it and the owner it serves (its argument after the socket)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    parent = psutil.Process(_launcher_pid())
    argv = parent.cmdline()  # python -m spark_torch.node.template.server SOCKET OWNER IDLE
    owner = int(argv[argv.index("spark_torch.node.template.server") + 2])
    mine = {"template": parent.pid, "cmdline": " ".join(argv), "owner": owner}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    dist.destroy_process_group()
    return gathered


def _kill_idle_python_workers() -> int:
    """Kill the executors' Python workers (the forks of each pyspark.daemon; Spark discards dead
    idle workers and forks new ones), leaving the daemons and templates alone."""
    from .conftest import session_executors

    killed = 0
    for executor in session_executors():
        for daemon in executor.children():
            if "pyspark.daemon" not in " ".join(daemon.cmdline()):
                continue
            for worker in daemon.children():
                if "pyspark.daemon" in " ".join(worker.cmdline()):
                    worker.kill()
                    worker.wait(10)
                    killed += 1
    return killed


@pytest.mark.slow
def test_executor_python_workers_share_one_template(cluster_spark: Any, no_leftovers: None) -> None:
    """local-cluster: each executor JVM owns one template; new Python workers (Spark replaced
    the ones of the first run) fork their ranks from it; it ends with its executor."""
    from .conftest import session_executors, wait_for_slots

    executors = {p.pid: p for p in session_executors()}
    first = Distributor(num_processes=2, local_mode=False).run(template_of_rank)
    assert all("spark_torch.node.template.server" in r["cmdline"] for r in first)
    assert {r["owner"] for r in first} <= set(executors) and len({r["owner"] for r in first}) == 2
    assert _kill_idle_python_workers() >= 2
    second = Distributor(num_processes=2, local_mode=False).run(template_of_rank)
    assert sorted(r["template"] for r in second) == sorted(r["template"] for r in first)

    owner = executors[first[0]["owner"]]
    template = psutil.Process(first[0]["template"])
    owner.kill()
    template.wait(15)  # watched through a pidfd: it goes with its executor
    wait_for_slots(cluster_spark, 2)


def who_hosts_the_store() -> list[dict[str, Any]]:
    """Rank 0 arrives late (a non-zero rank asking before rank 0 hosts the store is what costs
    torch's connect backoff); every rank says whether it listens on MASTER_PORT itself."""
    import time

    import torch.distributed as dist

    if os.environ["RANK"] == "0":
        time.sleep(0.3)
    dist.init_process_group("gloo", init_method="env://")
    port = int(os.environ["MASTER_PORT"])
    listening = [
        c for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
    ]
    mine = {
        "rank": dist.get_rank(),
        "listens": any(c.pid == os.getpid() for c in listening),
        "host_cmd": " ".join(psutil.Process(listening[0].pid).cmdline()) if listening and listening[0].pid else "",
        "agent": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
        "host_parent": psutil.Process(psutil.Process(listening[0].pid).ppid()).ppid()
        if listening and listening[0].pid
        else None,
        "parent": _launcher_pid(),
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    dist.destroy_process_group()
    return gathered


def test_the_store_is_hosted_before_the_ranks_start(no_leftovers: None) -> None:
    os.environ.pop("PYTHONUNBUFFERED", None)  # ranks get it anyway (rank_env): the store host must too
    out = Distributor(num_processes=2).run(who_hosts_the_store)
    assert [r["listens"] for r in out] == [False, False]
    assert all("spark_torch.node.template.server" in r["host_cmd"] for r in out)  # a fork of the template, not a rank
    assert all(r["host_parent"] == r["parent"] for r in out)  # the ranks' template: same start-up settings
    assert out[0]["agent"] == "True"
    os.environ["SPARK_TORCH_WARM_START"] = "0"  # warm starts off: rank 0 hosts it before the user's code
    cold = Distributor(num_processes=2).run(who_hosts_the_store)
    assert [r["listens"] for r in cold] == [True, False] and cold[0]["agent"] == "True"


def test_the_store_is_hosted_in_distributed_mode(spark_session: Any, no_leftovers: None) -> None:
    out = Distributor(num_processes=2, local_mode=False).run(who_hosts_the_store)
    assert [r["listens"] for r in out] == [False, False]
    assert all("spark_torch.node.template.server" in r["host_cmd"] for r in out)  # a fork of the template, not a rank
    assert all(r["host_parent"] == r["parent"] for r in out)  # one template per executor, store host included
    assert [r["agent"] for r in out] == ["True", None]  # only node 0's ranks are told


def tmpdir_of_rank() -> dict[str, Any]:
    """The temporary directory a rank's node runner had, and what started the rank."""
    import tempfile

    return {
        "tmpdir": os.environ.get("TMPDIR"),
        "tempdir": tempfile.gettempdir(),
        "launcher": _launcher_pid(),
        "cmd": psutil.Process(_launcher_pid()).cmdline(),
    }


def test_ranks_start_warm_under_a_130_character_temporary_directory(spark_session: Any, no_leftovers: None) -> None:
    """A YARN container's temporary directory is 100-130 characters long: the Python workers'
    ``TMPDIR`` here is 130, far past a Unix socket's 107 bytes with the template's socket name in
    it; the template listens in ``/tmp/spark_torch_templates-UID`` instead, and the second run's
    rank is forked by the template the first run started."""
    from spark_torch.node.template.client import SHORT_TEMP, SOCKET_FOLDER

    base = tempfile.mkdtemp(prefix="long-")
    long_tmp = os.path.join(base, "container_" + "x" * (130 - len(base) - len("/container_")))
    assert len(long_tmp) == 130
    os.mkdir(long_tmp, 0o700)
    short = os.path.join(SHORT_TEMP, f"{SOCKET_FOLDER}-{os.getuid()}")
    short_existed = os.path.exists(short)
    environment = spark_session.sparkContext.environment  # the Python workers' environment (a new pyspark.daemon)
    saved = environment.get("TMPDIR")
    environment["TMPDIR"] = long_tmp
    templates: list[psutil.Process] = []
    socket_path = ""
    try:
        distributor = Distributor(num_processes=1, local_mode=False, warm_start_idle=30)
        first, second = distributor.run(tmpdir_of_rank), distributor.run(tmpdir_of_rank)
        assert first["tmpdir"] == long_tmp  # the rank's environment is its node runner's (the daemon's)
        for out in (first, second):
            assert "spark_torch.node.template.server" in " ".join(out["cmd"]), out
        templates = [psutil.Process(first["launcher"])]
        assert second["launcher"] == first["launcher"]
        socket_path = first["cmd"][3]  # python -m MODULE SOCKET OWNER IDLE
        assert os.path.dirname(socket_path) == short and len(socket_path) <= 107, socket_path
        assert stat.S_IMODE(os.stat(short).st_mode) == 0o700 and stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600
    finally:
        if saved is None:
            environment.pop("TMPDIR", None)
        else:
            environment["TMPDIR"] = saved
        for template in templates:
            template.kill()
            template.wait(10)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)  # a SIGKILLed template leaves its socket
        if not short_existed:
            shutil.rmtree(short, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def test_the_socket_folder_is_chosen_by_the_socket_paths_length(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a template's socket fits in the temporary directory, its folder is there; where it
    would not (a 100-character TMPDIR), it is the short folder's, and every socket path fits."""
    from spark_torch.node.template import client

    monkeypatch.setattr("spark_torch.shared.owned_files._fallbacks", {})
    short, fits = Path(tempfile.mkdtemp(prefix="s-", dir="/tmp")), Path(tempfile.mkdtemp(prefix="t-", dir="/tmp"))
    monkeypatch.setattr(client, "SHORT_TEMP", str(short))
    name = f"{client.SOCKET_FOLDER}-{os.getuid()}"
    try:
        monkeypatch.setattr("tempfile.tempdir", str(fits))
        assert client._socket_dir() == str(fits / name)
        long_tmp = tmp_path / ("y" * max(1, 100 - len(str(tmp_path)) - 1))
        long_tmp.mkdir()
        monkeypatch.setattr("tempfile.tempdir", str(long_tmp))
        assert client._socket_dir() == str(short / name) and not (long_tmp / name).exists()
        for folder in (fits / name, short / name):
            assert len(str(folder / ("x" * 20 + ".sock"))) <= client.MAX_SOCKET_PATH
    finally:
        shutil.rmtree(short, ignore_errors=True)
        shutil.rmtree(fits, ignore_errors=True)
