"""replica_groups (per-step fault tolerance with torchft), the parts that need no Spark and no
rank: the options' checks, each group's options, the rank's variables, the lighthouse's listener,
the DDP hook fix against torchft's own code, and spark_torch without torchft."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

from spark_torch import ConfigurationError, Distributor, ReplicaGroupError
from spark_torch.driver.api.replica_groups import group_config
from spark_torch.driver.config import DistributorConfig
from spark_torch.driver.console.logs import DriverLogSink
from spark_torch.ft.env import GroupEnv, NotInReplicaGroupError
from spark_torch.ft.lighthouse import Lighthouse, LighthouseOptions
from spark_torch.ft.rank import bind_address
from tests.ft_programs import hello_from
from tests.outsiders import as_nobody

ROOT = Path(__file__).resolve().parents[2]


def test_replica_groups_must_divide_num_processes() -> None:
    with pytest.raises(ConfigurationError) as info:
        Distributor(num_processes=3, replica_groups=2)
    message = str(info.value)
    assert "num_processes=3 is not a multiple of replica_groups=2" in message
    assert "choose num_processes = replica_groups x ranks per group" in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("value", "kind", "text"),
    [
        (0, ConfigurationError, "replica_groups must be >= 1, got 0"),
        (True, TypeError, "replica_groups must be an int >= 1"),
    ],
)
def test_replica_groups_is_a_positive_int(value: Any, kind: type[Exception], text: str) -> None:
    with pytest.raises(kind, match=text):
        Distributor(num_processes=2, replica_groups=value)


@pytest.mark.parametrize(
    ("options", "text"),
    [
        ({"num_processes": 4, "local_mode": False, "min_processes": 2}, "leave min_processes unset"),
        ({"num_processes": 4, "local_mode": False, "ranks_per_task": 4}, "a replica group is whole nodes"),
        ({"num_processes": 2, "elastic_grow": True}, "elastic_grow does not apply with replica_groups=2"),
        (
            {"num_processes": 2, "env": {"REPLICA_GROUP_ID": "1"}},
            "env may not set REPLICA_GROUP_ID with replica_groups=2",
        ),
        ({"num_processes": 2, "run_id": "r" * 61}, "run_id may have at most 60"),
    ],
)
def test_options_that_do_not_go_with_replica_groups(options: dict[str, Any], text: str) -> None:
    with pytest.raises(ConfigurationError, match=text):
        Distributor(replica_groups=2, **options)


def test_lighthouse_options_are_typed() -> None:
    with pytest.raises(TypeError, match="lighthouse_options must be a spark_torch.ft.lighthouse.LighthouseOptions"):
        Distributor(num_processes=2, replica_groups=2, lighthouse_options={"min_replicas": 1})  # type: ignore[arg-type]


def test_one_group_is_todays_run() -> None:
    config = Distributor(num_processes=2, env={"REPLICA_GROUP_ID": "mine"})._config
    assert config.replica_groups == 1 and config.env == {"REPLICA_GROUP_ID": "mine"}  # the user's own, unchecked


def test_each_group_runs_its_share_under_its_own_run_id() -> None:
    config = DistributorConfig(num_processes=6, replica_groups=3, max_restarts=2, env={"A": "1"}, timeout=30.0)
    one = group_config(config, 1, "http://127.0.0.1:5000", "abc")
    assert (one.num_processes, one.replica_groups, one.max_restarts, one.run_id) == (2, 1, 0, "abc-g1")
    assert one.env == {
        "A": "1",
        "REPLICA_GROUP_ID": "1",
        "NUM_REPLICA_GROUPS": "3",
        "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:5000",
    }
    assert one.timeout == 30.0 and one.local_mode is True and one.log_dir is None


def test_each_group_logs_apart_and_its_lines_name_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every group has a rank 0: its rank-0.log is in log_dir/group-N, its lines read
    ``[group N rank R]``; a run without groups (even with a REPLICA_GROUP_ID of the user's) as before."""
    config = DistributorConfig(num_processes=4, replica_groups=2, log_dir=str(tmp_path))
    one = group_config(config, 1, "http://127.0.0.1:5000", "abc")
    assert one.log_dir == str(tmp_path / "group-1")
    sink = DriverLogSink(one, world_size=2)
    sink(0, "stdout", "hello\nworld")
    sink.close()
    assert capsys.readouterr().out == "[group 1 rank 0] hello\n[group 1 rank 0] world\n"
    assert (tmp_path / "group-1" / "rank-0.log").read_text() == "hello\nworld\n" and (
        tmp_path / "group-1" / "rank-1.log"
    ).exists()
    plain = DriverLogSink(Distributor(num_processes=1, env={"REPLICA_GROUP_ID": "mine"})._config)
    plain(0, "stdout", "x")
    assert capsys.readouterr().out == "[rank 0] x\n"


def test_a_rank_reads_its_group() -> None:
    env = {"REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "2", "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:1"}
    assert GroupEnv.from_environ(env) == GroupEnv(1, 2, "http://127.0.0.1:1")
    assert GroupEnv(1, 2, "http://127.0.0.1:1").variables() == env


def test_manager_outside_a_replica_group_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from spark_torch import ft

    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(NotInReplicaGroupError) as info:
        ft.manager(state_dict=dict, load_state_dict=print)
    assert isinstance(info.value, RuntimeError)
    assert "NUM_REPLICA_GROUPS, REPLICA_GROUP_ID, TORCHFT_LIGHTHOUSE are not set" in str(info.value)
    assert "Distributor(num_processes=N, replica_groups=G, ...).run(...)" in str(info.value)


def test_bind_address_brackets_ipv6() -> None:
    assert bind_address("127.0.0.1", 5) == "127.0.0.1:5"
    assert bind_address("::1", 5) == "[::1]:5"


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_the_lighthouse_listens_on_its_host_only_until_closed() -> None:
    pytest.importorskip("torchft")
    import psutil

    with Lighthouse("127.0.0.1", LighthouseOptions(heartbeat_timeout_ms=500)) as lighthouse:
        assert lighthouse.address == f"http://127.0.0.1:{lighthouse.port}"
        bound = {
            c.laddr.ip
            for c in psutil.net_connections("inet")
            if c.status == "LISTEN" and c.laddr.port == lighthouse.port
        }
        assert bound == {"127.0.0.1"}
        assert _listening(lighthouse.port)
    assert not _listening(lighthouse.port)
    lighthouse.close()  # idempotent


def test_the_watch_names_the_groups_whose_manager_never_heartbeat() -> None:
    """The lighthouse's status page, as torchft 0.2.0 writes it, read by ManagerWatch: a group
    whose Manager heartbeats (under spark_torch's replica id plus torchft's UUID) is seen, the
    other is named; a Manager under the user's own replica id means no warning at all."""
    pytest.importorskip("torchft")
    from datetime import timedelta

    from torchft.coordination import LighthouseClient

    from spark_torch.driver.api.manager_watch import ManagerWatch, heartbeating
    from spark_torch.ft.rank import replica_id

    assert heartbeating("<li>\n    spark_torch_group_1:ab-12: seen 0.004s ago\n  </li>") == {"spark_torch_group_1"}
    with Lighthouse("127.0.0.1") as lighthouse:
        client = LighthouseClient(lighthouse.address, timedelta(seconds=5))
        watch = ManagerWatch(lighthouse.host, lighthouse.port, 2).start()
        client.heartbeat(f"{replica_id(1)}:{uuid.uuid4()}")
        assert watch.stop() == [0]
        client.heartbeat(f"my_own_id:{uuid.uuid4()}")
        assert ManagerWatch(lighthouse.host, lighthouse.port, 2).stop() == []
    assert ManagerWatch(lighthouse.host, lighthouse.port, 2).stop() == [0, 1]  # no lighthouse: nothing heard


def _hello_from_loopback(url: str) -> str:
    return hello_from("127.0.0.1", url)


def test_the_lighthouse_is_hidden_behind_its_gate_until_closed() -> None:
    """torchft's server in a child process of its own network namespace (no listener of this
    machine's is its), reached only through its Unix socket in a 0700 folder; the gate on the
    host the executors reach (127.0.0.3 here) lets this user's connections in and closes uid
    65534's, from the same address, before a byte reaches the lighthouse."""
    pytest.importorskip("torchft")
    import psutil

    def listeners(*processes: psutil.Process) -> set[tuple[str, int]]:
        # this test's processes only: other tests and sessions open listeners of their own meanwhile
        return {
            (c.laddr.ip, c.laddr.port)
            for process in processes
            for c in process.net_connections("inet")
            if c.status == psutil.CONN_LISTEN
        }

    me = psutil.Process()
    before = listeners(me)
    with Lighthouse(
        "127.0.0.3", LighthouseOptions(heartbeat_timeout_ms=500), allowed=lambda: {"127.0.0.1"}
    ) as lighthouse:
        hideout = lighthouse.hideout
        assert hideout is not None and lighthouse.server_port is None
        assert lighthouse.address == f"http://127.0.0.3:{lighthouse.port}"
        child = psutil.Process(hideout._process.pid)  # type: ignore[union-attr]
        # the gate only: torchft's listener is in the child's namespace, none of this machine's
        assert listeners(me, child) - before == {("127.0.0.3", lighthouse.port)}  # not its Spark JVM's
        assert os.stat(hideout.folder).st_mode & 0o777 == 0o700 and os.path.exists(hideout.path)
        assert os.readlink(f"/proc/{child.pid}/ns/net") != os.readlink("/proc/self/ns/net")
        assert hello_from("127.0.0.1", lighthouse.address) == "answered"
        assert hello_from("127.0.0.2", lighthouse.address) == "answered"  # this user, another address of the machine
        assert as_nobody(_hello_from_loopback, lighthouse.address) == "closed"
    assert not child.is_running() and not os.path.exists(hideout.folder)
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.3", lighthouse.port)) != 0


def test_where_namespaces_are_refused_the_lighthouse_says_so_and_stays_behind_its_gate(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("torchft")
    import logging

    import spark_torch.ft.lighthouse as lighthouse_module
    from spark_torch.ft.hideout import NoHideout

    def refused(options: object) -> object:
        raise NoHideout("the kernel refused a private network namespace ([Errno 1] unshare: Operation not permitted)")

    monkeypatch.setattr(lighthouse_module.Hideout, "start", refused)
    with caplog.at_level(logging.WARNING, logger="spark_torch.ft.lighthouse"):
        with Lighthouse("127.0.0.1", LighthouseOptions(heartbeat_timeout_ms=500)) as lighthouse:
            assert lighthouse.hideout is None and lighthouse.server_port is not None
            assert lighthouse.port != lighthouse.server_port  # the ranks still go through the gate
            assert hello_from("127.0.0.1", lighthouse.address) == "answered"
            assert as_nobody(_hello_from_loopback, lighthouse.address) == "closed"
    assert any(
        "could not be hidden from other users of this machine (the kernel refused" in r.getMessage()
        and "any local user can reach it" in r.getMessage()
        for r in caplog.records
    )
    assert not _listening(lighthouse.server_port) and not _listening(lighthouse.port)


def test_the_kernels_socket_table_reads_as_addresses_and_back() -> None:
    from spark_torch.ft.peers import parse_endpoint

    assert parse_endpoint("0100007F:1F90") == ("127.0.0.1", 8080)
    assert parse_endpoint("0000000000000000FFFF00000100007F:0050") == ("127.0.0.1", 80)  # IPv4 mapped into IPv6
    assert parse_endpoint("00000000000000000000000001000000:0016") == ("::1", 22)
    from spark_torch.ft.peers import kernel_form

    assert kernel_form("127.0.0.1", 8080) == ["0100007F:1F90", "0000000000000000FFFF00000100007F:1F90"]
    assert kernel_form("::ffff:127.0.0.1", 80) == kernel_form("127.0.0.1", 80)
    assert [parse_endpoint(form) for form in kernel_form("::1", 22)] == [("::1", 22)]


class _Marker:
    """Unpickled, it would create a file: what another user's heal source could send."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (self.path, "w")


def test_a_heal_unpickles_plain_data_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What torchft's PGTransport describes for a model and its optimizer comes back whole; an
    object that would run code is refused before it is built (the file is never made)."""
    pytest.importorskip("torchft")
    import pickle

    import torch
    import torchft.checkpointing.pg_transport as pg_transport
    from torchft.checkpointing.pg_transport import _prepare_state_dict

    from spark_torch.ft import safe_heal

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"user": {"model": model.state_dict(), "opt": opt.state_dict(), "n": torch.zeros((), dtype=torch.bfloat16)}}
    meta, _ = _prepare_state_dict({**state, "torchft": {"step": 3, "batches_committed": 2}}, 3, torch.device("cpu"))
    assert safe_heal.loads(pickle.dumps(meta)) == meta
    marker = tmp_path / "ran"
    meta.non_tensor_leaves.append(_Marker(str(marker)))
    with pytest.raises(safe_heal.HealRefused) as info:
        safe_heal.loads(pickle.dumps(meta))
    assert str(info.value).startswith(
        "spark_torch refused to unpickle io.open in the state a peer group sent to heal this rank"
    )
    assert "keep other objects out of the Manager's state_dict" in str(info.value) and not marker.exists()
    monkeypatch.setattr(pg_transport, "pickle", pg_transport.pickle)  # both put back after the test
    monkeypatch.setattr(pg_transport, "_spark_torch_safe_heal", False, raising=False)
    safe_heal.install(pg_transport)
    assert pg_transport.pickle.loads is safe_heal.loads and pg_transport.pickle.dumps is pickle.dumps


class _Bucket:
    """What DDP hands a communication hook (its buffer); a real GradBucket needs a reducer."""

    def __init__(self, buffer: Any) -> None:
        self._buffer = buffer

    def buffer(self) -> Any:
        return self._buffer


class _PeerGone:
    """A process group's work whose peer died mid-all-reduce."""

    def wait(self, timeout: Any = None) -> bool:
        raise RuntimeError("Connection reset by peer")

    def get_future(self) -> Any:
        import torch

        future: Any = torch.futures.Future()
        future.set_exception(RuntimeError("Connection reset by peer"))
        return future


class _InFlight:
    """A process group's work still in flight: its future completes when the test says."""

    def __init__(self) -> None:
        import torch

        self.future: Any = torch.futures.Future()

    def wait(self, timeout: Any = None) -> bool:
        raise AssertionError("not reached: the hook does not wait")

    def get_future(self) -> Any:
        return self.future


class _Manager:
    """The part of torchft's Manager that its DDP hook and _ManagedWork use."""

    def __init__(self, work: Any = None, participants: int = 2) -> None:
        self.errors: list[Exception] = []
        self._logger = self
        self.work = work if work is not None else _PeerGone()
        self.participants = participants

    def exception(self, message: str) -> None:
        pass

    def report_error(self, error: Exception) -> None:
        self.errors.append(error)

    def num_participants(self) -> int:
        return self.participants

    def allreduce(self, tensor: Any) -> Any:
        from torchft.manager import _ManagedWork

        return _ManagedWork(self, self.work, tensor)  # type: ignore[arg-type]


def test_a_peer_lost_mid_all_reduce_drops_the_step_instead_of_crashing() -> None:
    """torchft 0.2.0's own hook fails an assertion here (the surviving replica crashed); the fixed
    hooks (spark_torch's, and the waiting one it keeps for the GPU) return the bucket, and the
    Manager holds the error so that should_commit() says no."""
    pytest.importorskip("torchft")
    import torch
    from torchft import ddp

    from spark_torch.ft import ddp_fix

    bucket = _Bucket(torch.ones(3))
    manager = _Manager()
    with pytest.raises(AssertionError):  # the bug, in the installed torchft
        ddp.DistributedDataParallel.__dict__["_comm_hook"].__func__(manager, bucket)
    assert [str(e) for e in manager.errors] == ["Connection reset by peer"]
    future = ddp_fix.blocking_hook(manager, bucket)
    assert torch.equal(future.wait(), torch.ones(3))
    assert [str(e) for e in manager.errors] == ["Connection reset by peer"] * 2
    future = ddp_fix.comm_hook(manager, bucket)
    assert torch.equal(future.wait(), torch.ones(3))
    assert [str(e) for e in manager.errors] == ["Connection reset by peer"] * 3


def test_the_hook_returns_before_the_all_reduce_ends_and_averages_it_then() -> None:
    """spark_torch's hook does not wait for the bucket's all-reduce (the backward pass goes on, as
    with plain DDP): its future ends with the bucket divided by the quorum's participants, as
    torchft's own callback divides it, once the process group's work ends."""
    pytest.importorskip("torchft")
    import torch

    from spark_torch.ft import ddp_fix

    work = _InFlight()
    manager = _Manager(work, participants=2)
    bucket = _Bucket(torch.full((3,), 6.0))
    future = ddp_fix.comm_hook(manager, bucket)
    assert not future.done()
    bucket.buffer().fill_(8.0)  # what gloo's all-reduce (a sum) leaves in the bucket
    work.future.set_result([bucket.buffer()])
    assert torch.equal(future.wait(), torch.full((3,), 4.0)) and future.wait() is bucket.buffer()
    assert manager.errors == []


class _Client:
    """torchft's ManagerClient as should_commit uses it: it records the calls that went out."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: Any = None) -> bool:
        self.calls.append("should_commit")
        return should_commit

    def _quorum(self) -> str:
        self.calls.append("_quorum")
        return "quorum"


class _CommitManager:
    """The part of torchft's Manager.should_commit that asks the group's server."""

    def __init__(self, group_world_size: int) -> None:
        self._group_world_size = group_world_size
        self._client: Any = _Client()

    def should_commit(self, vote: bool) -> bool:
        return bool(self._client.should_commit(0, 1, vote, timeout=None))


def test_a_one_rank_groups_commit_is_its_own_vote_without_a_round_trip() -> None:
    """In a group of one rank, the group's Manager server answers should_commit with that rank's
    vote (torchft's manager.rs): the wrapped should_commit answers it in the rank; a group of
    two ranks still asks the server, and everything else still goes to torchft's client."""
    from spark_torch.ft import ddp_fix

    should_commit = ddp_fix.solo_should_commit(_CommitManager.should_commit)
    assert ddp_fix.solo_should_commit(should_commit) is should_commit
    solo, pair = _CommitManager(1), _CommitManager(2)
    client = solo._client
    assert should_commit(solo, True) is True and should_commit(solo, False) is False
    assert isinstance(solo._client, ddp_fix.SoloCommitClient) and client.calls == []
    assert solo._client._quorum() == "quorum" and client.calls == ["_quorum"]
    assert should_commit(pair, True) is True and should_commit(pair, False) is False
    assert pair._client.calls == ["should_commit", "should_commit"]


def test_install_puts_the_fixed_hook_on_torchfts_ddp() -> None:
    pytest.importorskip("torchft")
    import torch
    import torchft.manager as torchft_manager
    from torchft import ddp

    from spark_torch.ft import ddp_fix

    original = ddp.DistributedDataParallel.__dict__["_comm_hook"]
    commit = torchft_manager.Manager.__dict__["should_commit"]
    try:
        ddp_fix.install()
        ddp_fix.install()
        hook = ddp.DistributedDataParallel._comm_hook
        future = hook(_Manager(), _Bucket(torch.zeros(2)))
        assert torch.equal(future.wait(), torch.zeros(2))
        # DDP checks a hook's annotations as objects
        assert hook.__annotations__["bucket"] is torch.distributed.GradBucket
        wrapped = torchft_manager.Manager.should_commit
        assert wrapped.__wrapped__ is commit and wrapped._spark_torch_solo_commit  # once, however often installed
    finally:
        ddp.DistributedDataParallel._comm_hook = original
        torchft_manager.Manager.should_commit = commit


def test_a_manager_the_users_code_makes_is_wired_in_a_replica_group_rank_only() -> None:
    """The rank's start-up hook (spark_torch.ft.wiring): nothing is imported before the user's code
    imports torchft; then torchft's Manager.__init__ is wrapped (the DDP hook fix, the node's
    address, PGTransport: tests/test_replica_groups.py runs it); outside a replica group nothing."""
    pytest.importorskip("torchft")
    code = textwrap.dedent(
        """
        import os, sys
        from spark_torch.ft import wiring
        before = list(sys.meta_path)
        assert wiring.install({}) is False and sys.meta_path == before
        os.environ.update(REPLICA_GROUP_ID="1", MASTER_ADDR="127.0.0.1")
        assert wiring.install() is True and wiring.install() is True
        assert len(sys.meta_path) == len(before) + 1 and "torch" not in sys.modules
        import torchft
        assert getattr(torchft.Manager.__init__, "_spark_torch_wired", False)
        assert torchft.Manager.__init__.__wrapped__.__qualname__ == "Manager.__init__"
        print("wired")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["wired"], done.stderr[-2000:]


def test_what_a_manager_of_a_rank_gets_unless_given() -> None:
    from spark_torch.ft.wiring import filled

    environ = {"MASTER_ADDR": "10.0.0.5", "REPLICA_GROUP_ID": "2"}
    assert filled({}, environ) == {"hostname": "10.0.0.5", "replica_id": "spark_torch_group_2"}
    assert filled({"hostname": "me", "replica_id": "train_ddp_2"}, environ) == {}
    assert filled({}, {}) == {}


def test_replica_group_error_pickles_with_its_group() -> None:
    import pickle

    error = pickle.loads(pickle.dumps(ReplicaGroupError(1, [], "replica group 1 failed")))
    assert (error.group, str(error)) == (1, "replica group 1 failed")


def test_spark_torch_without_torchft() -> None:
    """The plain wheel (no [ft] extra): importing, configuring replica groups and the rank's
    variables need no torchft; hosting the lighthouse says which extra to install."""
    code = textwrap.dedent(
        """
        import sys
        class Hide:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "torchft":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, Hide())
        import spark_torch, spark_torch.ft
        from spark_torch import Distributor
        Distributor(num_processes=2, replica_groups=2)
        assert "torchft" not in sys.modules and "torch" not in sys.modules, sorted(sys.modules)
        from spark_torch.ft.lighthouse import Lighthouse
        try:
            Lighthouse("127.0.0.1")
        except ModuleNotFoundError as exc:
            print(exc)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (
        "replica_groups > 1 needs torchft" in done.stdout
        and "pip install 'torchft>=0.2.0' into the Python" in done.stdout
    )


def test_the_install_hint_names_what_pip_finds() -> None:
    """spark-torch is not on PyPI: the hint installs torchft itself, at the [ft] extra's version
    (read from the installed metadata, so a checkout and a wheel say the same)."""
    from spark_torch.ft.install import REQUIREMENT, install_hint, requirement

    assert requirement() == REQUIREMENT == "torchft>=0.2.0"  # the editable install's metadata, as pyproject.toml has it
    assert requirement(['torchft >= 0.3; extra == "ft"', "psutil>=5"]) == "torchft>=0.3"
    assert requirement(['torchft>=9; extra == "other"']) == REQUIREMENT
    assert install_hint().startswith("pip install 'torchft>=0.2.0' into the Python of the driver and of the executors")
    assert "spark-torch[ft]" not in install_hint()


def _answering_node(messages: list[dict[str, Any]]) -> tuple[str, Any]:
    """A rank's report pipes with a node end that answers every step (a thread): the rank's
    ``SPARK_TORCH_REPORT_FDS`` value and a function that closes everything."""
    import json
    import os
    import threading

    report_read, report_write = os.pipe()
    answer_read, answer_write = os.pipe()

    def node() -> None:
        with os.fdopen(report_read, encoding="utf-8") as lines, os.fdopen(answer_write, "w", encoding="utf-8") as out:
            for line in lines:
                messages.append(json.loads(line))
                out.write(json.dumps({"step": messages[-1]["step"]}) + "\n")
                out.flush()

    thread = threading.Thread(target=node, daemon=True)
    thread.start()

    def close() -> None:
        os.close(report_write)
        thread.join(10)
        assert not thread.is_alive(), "the test's node end did not see the pipe close within 10 s"
        os.close(answer_read)

    return f"{report_write},{answer_read}", close


def test_report_records_torchfts_step_once_with_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a step source (what spark_torch.ft.manager() sets), report()'s step is torchft's
    committed step, a call whose step did not move past the last one reported (or the checkpoint
    it started from) sends nothing, and rank 0's rows name the replica group."""
    from spark_torch.reporting import api

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("SPARK_TORCH_START_STEP", "3")
    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "2")
    messages: list[dict[str, Any]] = []
    fds, close = _answering_node(messages)
    step = [3]
    try:
        reporter = api._Reporter(fds)
        api.follow_steps(lambda: step[0])
        for torchft_step in (3, 5, 5, 6, 4):  # 3: the checkpoint's; 5 twice: a dropped step; 4: behind
            step[0] = torchft_step
            reporter.report({"loss": 0.5}, None)
    finally:
        api.follow_steps(None)
        close()
    assert [(m["step"], m["metrics"]) for m in messages] == [
        (5, {"loss": 0.5, "replica_group": 1}),
        (6, {"loss": 0.5, "replica_group": 1}),
    ]
    assert reporter.step == 6


def test_replica_group_is_a_name_report_keeps_for_itself() -> None:
    from spark_torch.reporting.api import _clean

    with pytest.raises(ValueError, match="'replica_group' is recorded by spark_torch; name your metric differently"):
        _clean({"replica_group": 1})


def test_last_run_is_every_groups_rows_attempts_and_checkpoints() -> None:
    """merged_result: rows in step order, each naming its group (an older row without one gets
    its group's), attempts named by group, the newest checkpoint of any group, the kept ones
    ranked together, each group's own run kept."""
    import threading

    from spark_torch.driver.api.replica_groups import GroupLoop, merged_result
    from spark_torch.driver.result import AttemptEnd, AttemptReason, AttemptRecord, Checkpoint, RunResult

    config = DistributorConfig(
        num_processes=2, replica_groups=2, checkpoint_score_attribute="loss", checkpoint_score_order="min"
    )

    def group_run(
        group: int, attempt: int, rows: list[dict[str, Any]], checkpoints: list[tuple[int, float]]
    ) -> RunResult:
        kept = [(Checkpoint(f"/runs/r-g{group}/{s}", s, {"loss": loss}), {"loss": loss}) for s, loss in checkpoints]
        return RunResult(
            run_id=f"r-g{group}",
            rows=rows,
            history=rows,
            best_checkpoints=kept,
            attempts=[AttemptRecord(attempt, 1, 1, AttemptReason.START, end=AttemptEnd.SUCCEEDED)],
            checkpoint=max((c for c, _ in kept), key=lambda c: c.step, default=None),
        )

    loops = [GroupLoop(g, config, 1, threading.Event(), lambda group: None) for g in (0, 1)]
    loops[0].results = [group_run(0, 0, [{"step": 1, "replica_group": 0}, {"step": 2, "replica_group": 0}], [(2, 0.3)])]
    loops[1].results = [
        group_run(1, 0, [{"step": 1}], []),
        group_run(1, 1, [{"step": 2, "replica_group": 1}, {"step": 3, "replica_group": 1}], [(3, 0.1), (1, 0.5)]),
    ]
    loops[0].value = "group 0's"
    merged = merged_result("r", loops, config, None, 0.0)
    assert (merged.run_id, merged.value, merged.restarts, merged.error) == ("r", "group 0's", 1, None)
    assert [(row["step"], row["replica_group"]) for row in merged.rows] == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 1)]
    assert [(row["step"], row["replica_group"]) for row in merged.history] == [(1, 0), (2, 0), (2, 1), (3, 1)]
    assert [str(a).split(":")[0] for a in merged.attempts] == ["replica group 0", "replica group 1", "replica group 1"]
    assert merged.checkpoint is not None and merged.checkpoint.path == "/runs/r-g1/3"
    assert [c.path for c, _ in merged.best_checkpoints] == ["/runs/r-g1/3", "/runs/r-g0/2", "/runs/r-g1/1"]
    assert [r.run_id for r in merged.replica_groups] == ["r-g0", "r-g1"]
    assert merged.metrics_dataframe.columns[-1] == "replica_group"


def test_a_group_resumes_from_the_newest_checkpoint_of_any_group_and_fetches_it_by_its_url(tmp_path: Path) -> None:
    """The checkpoint a replica group's attempt resumes from is the newest of its own run's and its
    peers' (its own on a tie, none when nobody has one); on storage that is not a local path the
    node downloads a peer's checkpoint from the peer's run directory (fsspec's memory filesystem)."""
    from spark_torch.driver.run.call_storage import newest_checkpoint
    from spark_torch.reporting.storage import RunStorage

    base = f"memory://ft-resume-{uuid.uuid4().hex}"
    own, peer, empty = (RunStorage(base, f"run-g{n}", {}) for n in range(3))
    assert newest_checkpoint(own, ("run-g1", "run-g2")) is None
    for storage, steps in ((own, (1, 3)), (peer, (3, 5))):
        for step in steps:
            folder = tmp_path / f"{storage.run_id}-{step}"
            folder.mkdir()
            (folder / "state.pt").write_text(f"{storage.run_id} step {step}")
            storage.upload(str(folder), step)
            storage.complete(step, attempt=0, ranks=[0])
    newest = newest_checkpoint(own, ("run-g1", "run-g2"))
    assert newest is not None and newest.step == 5 and newest.url == f"{base}/run-g1/checkpoint_000005"
    local = own.download(newest, str(tmp_path / "fetched"))
    assert (Path(local) / "state.pt").read_text() == "run-g1 step 5"
    peer.remove_checkpoint(5)  # now both runs' newest is step 3: the run's own is taken
    tie = newest_checkpoint(own, ("run-g1", "run-g2"))
    assert tie is not None and tie.step == 3 and tie.url == f"{base}/run-g0/checkpoint_000003"
    assert empty.latest() is None
