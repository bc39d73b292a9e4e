"""The lighthouse's pump (spark_torch.ft.pump) and the driver's word that a group's rank ended
(spark_torch.ft.rank_ends): which replica ids are vouched for, retired and superseded; and, with
torchft's real lighthouse in its hideout, that a group vouched for holds a peer's quorum past the
heartbeat timeout until the driver retires it, then the quorum forms without it."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest

from spark_torch.ft import rank_ends
from spark_torch.ft.pump import Pump, group_of

PAGE = """<h2>Heartbeats</h2>
<ul>
  <li class="heartbeat">
    {}: seen 0.045254801s ago
  </li>
</ul>"""


def _page(*ids: str) -> str:
    return "\n".join(PAGE.format(replica_id) for replica_id in ids)


@pytest.mark.parametrize(
    ("replica_id", "group"),
    [
        ("spark_torch_group_1:0b6e-uuid", 1),
        ("spark_torch_group_12:0b6e-uuid", 12),
        ("train_ddp_0:0b6e-uuid", 0),
        ("spark_torch_group_3", 3),
        ("mine:0b6e-uuid", None),
        ("0b6e-uuid", None),
    ],
)
def test_a_replica_ids_group_is_its_trailing_digits_before_the_uuid(replica_id: str, group: int | None) -> None:
    assert group_of(replica_id) == group


class _Fake:
    """The status page and the heartbeats of a lighthouse, in memory."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.beats: list[str] = []
        self.lock = threading.Lock()

    def status(self) -> str:
        with self.lock:
            return _page(*self.ids)

    def heartbeat(self, replica_id: str) -> None:
        with self.lock:
            self.beats.append(replica_id)

    def beaten(self) -> set[str]:
        with self.lock:
            beats, self.beats = self.beats, []
        return set(beats)


def _until(check: Any, what: str) -> None:
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_pump_vouches_for_each_group_until_it_is_retired_and_for_its_restart() -> None:
    fake = _Fake()
    fake.ids = ["spark_torch_group_0:a", "spark_torch_group_1:b", "no_digits:c"]
    pump = Pump(0, heartbeat=fake.heartbeat, status=fake.status, interval=0.01)
    try:
        _until(lambda: pump.vouched == {"spark_torch_group_0:a": 0, "spark_torch_group_1:b": 1}, "both vouched")
        _until(lambda: fake.beaten() == {"spark_torch_group_0:a", "spark_torch_group_1:b"}, "both heartbeated")
        pump.retire(1)
        assert pump.vouched == {"spark_torch_group_0:a": 0}
        fake.beaten()  # a beat in flight while it retired
        _until(lambda: fake.beaten() == {"spark_torch_group_0:a"}, "group 1 no longer heartbeated")
        fake.ids.append("spark_torch_group_1:d")  # its restart's Manager
        _until(lambda: pump.vouched == {"spark_torch_group_0:a": 0, "spark_torch_group_1:d": 1}, "restart vouched")
        fake.ids.append("spark_torch_group_0:e")  # a newer Manager of group 0 supersedes its first
        _until(lambda: pump.vouched == {"spark_torch_group_0:e": 0, "spark_torch_group_1:d": 1}, "superseded")
    finally:
        pump.close()
    assert not pump._thread.is_alive()


def test_retiring_a_group_drops_an_id_the_pump_had_not_read_yet() -> None:
    """The dead Manager may have heartbeated once, after the pump's last read: never vouched for."""
    fake = _Fake()
    pump = Pump(0, heartbeat=fake.heartbeat, status=fake.status, interval=3600)
    try:
        fake.ids = ["spark_torch_group_1:b"]
        pump.retire(1)
        pump._discover()
        assert pump.vouched == {}
    finally:
        pump.close()


def test_a_rank_end_reaches_its_groups_listener_only_while_listening(caplog: pytest.LogCaptureFixture) -> None:
    heard: list[str] = []

    def broken() -> None:
        raise OSError("the lighthouse is stopped")

    with rank_ends.listening({"run-g0": lambda: heard.append("g0"), "run-g1": broken}):
        rank_ends.rank_ended("run-g0")
        rank_ends.rank_ended("run-g1")  # logged, never raised: the node's own failure goes on
        rank_ends.rank_ended("other-run")
    rank_ends.rank_ended("run-g0")
    assert heard == ["g0"]
    assert "could not tell the lighthouse that a rank of run-g1 ended: the lighthouse is stopped" in caplog.text


def test_a_vouched_group_holds_its_peers_quorum_until_it_is_retired() -> None:
    """torchft's lighthouse at spark_torch's defaults (300 ms heartbeat timeout), hidden: group 1
    heartbeated once, long ago, and never joins; group 0 asks for a quorum. The pump keeps group
    1 counted as alive, so with two groups alive and one joined torchft forms no quorum; once the
    driver retires group 1, the quorum forms with group 0 alone."""
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseClient

    from spark_torch.ft.lighthouse import HEARTBEAT_TIMEOUT_MS, Lighthouse

    with Lighthouse("127.0.0.1") as lighthouse:
        assert lighthouse.hideout is not None
        client = LighthouseClient(f"http://127.0.0.1:{lighthouse.port}", timedelta(seconds=10))
        client.heartbeat("spark_torch_group_1:dead", timedelta(seconds=10))
        quorum: list[Any] = []

        def ask() -> None:
            quorum.append(client.quorum(replica_id="spark_torch_group_0:live", timeout=timedelta(seconds=60), step=1))

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        asker.join(timeout=10 * HEARTBEAT_TIMEOUT_MS / 1000)
        assert asker.is_alive() and not quorum, "group 1 was dropped while vouched for"
        lighthouse.retire(1)
        asker.join(timeout=60)
        assert not asker.is_alive()
        assert [member.replica_id for member in quorum[0].participants] == ["spark_torch_group_0:live"]
    lighthouse.retire(1)  # closed: nothing
