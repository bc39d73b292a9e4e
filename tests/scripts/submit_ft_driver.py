"""A spark-submit driver: replica groups across hosts, each rank probing the lighthouse's defences.

    spark-submit --master MASTER [--conf ...] tests/scripts/submit_ft_driver.py WORK [--env KEY=VALUE ...] \
        [--all-reduce-first [--then-env KEY=VALUE ...] [--all-reduce-only]]

Runs ``Distributor(num_processes=2, replica_groups=2, local_mode=False, max_restarts=1)`` with
tests/ft_programs.py's ``train`` (pickled by value: the executors need not see tests/), group 1's
rank SIGKILLing itself at its second step. The driver writes the address of the lighthouse's gate
(what the nodes' relays reach) to ``WORK/gate`` before the groups start. The first process of
each group, before it trains, probes from its own host and writes ``WORK/probe-g{GROUP}.json``:
what its node's relay (its ``TORCHFT_LIGHTHOUSE``) did with a connection of uid 65534 (another
user of that host), and what torchft's own client got from the driver's gate when it talks to it
without the handshake. Prints ``WEIGHTS <list>`` and exits 0 once the run ended ok.

With ``--all-reduce-first``, tests/scripts/submit_driver.py's runs come first in this same
application (no second driver and executor JVMs to start): its 2-rank all_reduce, then, after
``=== then ===``, the same with the ``--then-env`` variables in the driver's environment (removed
again after it, its duration printed as ``THEN_SECONDS <s>``); ``=== replica groups ===`` then
starts this script's own run (left out with ``--all-reduce-only``: torchft not installed). It exits
1 if an all_reduce sum is not 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from submit_driver import say  # noqa: E402 - tests/scripts, beside this file

NOBODY = 65534
#: tests/ft_programs.py's train, set by main() (pickled by value with the job)
TRAIN: Any = None


def _as_nobody(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a forked child that became uid/gid 65534 (its value, through a pipe)."""
    import pickle
    import select

    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read_end)
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            outcome = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - carried to the parent
            outcome = f"{type(exc).__name__}: {exc}"
        os.write(write_end, pickle.dumps(outcome))
        os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 30)
        data = os.read(read_end, 65536) if ready else b""
    finally:
        os.close(read_end)
        if not data:
            os.kill(child, 9)
        os.waitpid(child, 0)
    return pickle.loads(data) if data else "no answer within 30 s"


def _hello(url: str) -> str:
    """What the listener at ``url`` did with an HTTP/2 client's first bytes: answered or closed."""
    import socket
    from urllib.parse import urlparse

    where = urlparse(url)
    with socket.create_connection((where.hostname, where.port), timeout=10) as client:
        client.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        try:
            return "answered" if client.recv(100) else "closed"
        except ConnectionResetError:
            return "closed"


def _torchft_hello(url: str) -> str:
    from datetime import timedelta

    from torchft.coordination import LighthouseClient

    try:
        LighthouseClient(url, timedelta(seconds=5)).heartbeat("outsider_9:0")
    except Exception as exc:  # noqa: BLE001 - the outcome is the answer
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return "joined"


def job(work: str) -> list[float]:
    """Probe (first process of each group), then train (tests/ft_programs.py)."""
    import socket

    group = os.environ["REPLICA_GROUP_ID"]
    probe = Path(work) / f"probe-g{group}.json"
    if not probe.exists():
        relay = os.environ["TORCHFT_LIGHTHOUSE"]
        gate = (Path(work) / "gate").read_text().strip()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:  # which address this host has
            udp.connect((os.environ["MASTER_ADDR"], 9))
            host = udp.getsockname()[0]
        found = {
            "host": host,
            "relay": relay,
            "mine": _hello(relay),
            "nobody": _as_nobody(_hello, relay),
            "gate": _torchft_hello(gate),
        }
        probe.write_text(json.dumps(found))
    return TRAIN(5, work, 1, 2)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("work")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--all-reduce-first", action="store_true")
    parser.add_argument("--then-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--all-reduce-only", action="store_true", help="leave the replica-groups run out")
    args = parser.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    then = dict(item.split("=", 1) for item in args.then_env)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

    import cloudpickle
    from pyspark.sql import SparkSession

    import spark_torch.driver.api.replica_groups as replica_groups
    from spark_torch import Distributor
    from spark_torch.ft.lighthouse import Lighthouse, LighthouseOptions
    from tests import ft_programs
    from tests.sessions import wait_for_slots

    global TRAIN
    cloudpickle.register_pickle_by_value(ft_programs)
    TRAIN = ft_programs.train
    work = Path(args.work)

    class Recorded(Lighthouse):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            (work / "gate").write_text(self.address)

    replica_groups.Lighthouse = Recorded  # type: ignore[misc]
    spark = SparkSession.builder.appName("spark-torch-submit-ft-driver").getOrCreate()
    try:
        wait_for_slots(spark, 2, then_go_on=True)
        sums_ok = _all_reduce_runs(env, then) if args.all_reduce_first else True
        if args.all_reduce_only:
            return 0 if sums_ok else 1
        options = LighthouseOptions(min_replicas=1, join_timeout_ms=500, quorum_tick_ms=20, heartbeat_timeout_ms=1_000)
        weights = Distributor(
            num_processes=2,
            local_mode=False,
            replica_groups=2,
            max_restarts=1,
            lighthouse_options=options,
            timeout=200,
            env=env or None,
        ).run(job, str(work))
    finally:
        spark.stop()
    say(f"WEIGHTS {weights!r}")
    return 0 if sums_ok else 1


def _all_reduce_runs(env: dict[str, str], then: dict[str, str]) -> bool:
    """submit_driver.py's run, then its run with ``then`` in the driver's environment; True if both sums are 3."""
    import cloudpickle
    import submit_driver

    cloudpickle.register_pickle_by_value(submit_driver)  # the executors need not see tests/scripts
    outs = [submit_driver._run(2, env)]
    say("=== then ===")
    start = time.monotonic()
    with mock.patch.dict(os.environ, then):  # the driver's environment as it was, afterwards
        outs.append(submit_driver._run(2, env))
    say(f"THEN_SECONDS {time.monotonic() - start:.1f}")
    say("=== replica groups ===")
    return all(out["sum"] == 3 for out in outs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
