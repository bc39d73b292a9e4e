"""A spark-submit driver: a 2-rank distributed gloo all_reduce through spark_torch.

    spark-submit --master MASTER [--conf ...] tests/scripts/submit_driver.py \
        [--num-processes N] [--env KEY=VALUE ...] [--wait-slots SECONDS] [--then-env KEY=VALUE ...]

Each rank contributes ``rank + 1``; the driver prints ``RESULT <sum>`` and, on one line,
``RANKS <json>`` (every rank's torchrun variables, GLOO_SOCKET_IFNAME and the local address it
uses to reach MASTER_ADDR), then exits 0 if the sum is N(N+1)/2 and 1 otherwise. With
``--then-env``, a second run follows in the same application (no second driver and executor
JVMs to start) with those variables in the driver's environment, where spark_torch reads its
settings for each run: it prints ``=== then ===`` first, then its own ``RESULT`` and ``RANKS``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def say(line: str) -> None:
    """Print one line in one write: spark-submit runs this driver unbuffered (PYTHONUNBUFFERED) and
    copies its output into the JVM's, where print's two writes (the text, then the newline) once let
    a JVM log line in between ("RESULT 326/12/03 ... INFO SparkContext: ...")."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def all_reduce_job() -> dict[str, Any]:
    import os
    import socket

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:  # no packet is sent: this only asks the kernel which source address it would use
        probe.connect((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
        local_addr = probe.getsockname()[0]
    finally:
        probe.close()
    keys = (
        "RANK",
        "WORLD_SIZE",
        "NODE_RANK",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "GLOO_SOCKET_IFNAME",
        "SPARK_LOCAL_IP",
    )
    mine = {k: os.environ.get(k) for k in keys}
    mine["local_addr"] = local_addr
    print(f"all_reduce sum={t.item():g} MASTER_ADDR={mine['MASTER_ADDR']} local_addr={local_addr}", flush=True)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    dist.destroy_process_group()
    return {"sum": t.item(), "ranks": gathered}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--wait-slots",
        type=float,
        default=120.0,
        help="wait up to this long for executors to register (0: do not wait)",
    )
    parser.add_argument(
        "--then-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="then run again with KEY=VALUE in the driver's environment",
    )
    args = parser.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    then = dict(item.split("=", 1) for item in args.then_env)

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for tests.sessions
    from pyspark.sql import SparkSession

    from tests.sessions import wait_for_slots

    spark = SparkSession.builder.appName("spark-torch-submit-driver").getOrCreate()
    try:
        # standalone executors can take longer than the library's own wait on a busy machine
        wait_for_slots(spark, args.num_processes, args.wait_slots, then_go_on=True)
        outs = [_run(args.num_processes, env)]
        if then:
            say("=== then ===")
            os.environ.update(then)
            outs.append(_run(args.num_processes, env))
    finally:
        spark.stop()
    n = args.num_processes
    return 0 if all(out["sum"] == n * (n + 1) / 2 for out in outs) else 1


def _run(n: int, env: dict[str, str]) -> dict[str, Any]:
    """One distributed run; prints its RESULT and RANKS lines."""
    from spark_torch import Distributor

    out: dict[str, Any] = Distributor(num_processes=n, local_mode=False, env=env or None).run(all_reduce_job)
    say(f"RESULT {out['sum']:g}")
    say(f"RANKS {json.dumps(out['ranks'])}")
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
