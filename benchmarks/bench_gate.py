#!/usr/bin/env python
"""What the gates in front of torchft's lighthouse cost a rank's call to it.

    .venv/bin/python benchmarks/bench_gate.py [--pairs 10] [--calls 500]

In distributed mode with ``replica_groups`` the ranks reach the lighthouse through
``spark_torch.ft.gate.AddressGate`` (a byte-for-byte relay that admits the cluster's addresses
only). One lighthouse on loopback, one gRPC client straight to it and one through a gate in front
of it; each measurement is the median of ``--calls`` heartbeat round trips (torchft's
``LighthouseClient.heartbeat``, a whole gRPC call), the two clients alternating in ``--pairs``
interleaved pairs (``analysis.alternating_pairs``): the ratio gated / direct is a geometric mean
of the pairs' ratios with a 95% interval, and the added time per call the median difference.
Then the path distributed mode takes now (a node's relay, ``spark_torch.ft.node_relay``, whose
connection proved the run's secret to a gate with ``secret``) against the gate alone, the same way
(``relayed_s``, ``relay_ratio``: the relay's hop, the handshake being paid once per connection).
Writes benchmarks/results/gate.json and prints the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from analysis import alternating_pairs  # noqa: E402

from spark_torch.ft.gate import AddressGate  # noqa: E402
from spark_torch.ft.node_relay import NodeRelay  # noqa: E402


def median_call(client: object, calls: int) -> float:
    """The median seconds of ``calls`` heartbeats."""
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        client.heartbeat("bench_replica_0")  # type: ignore[attr-defined]
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    from torchft.coordination import LighthouseClient, LighthouseServer

    # torchft's own server on loopback (spark_torch's Lighthouse hides it in a namespace: no direct path)
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    port = int(server.address().rsplit(":", 1)[1])
    try:
        gate = AddressGate("127.0.0.1", ("127.0.0.1", port), lambda: {"127.0.0.1"})
        secret = os.urandom(32)
        secret_gate = AddressGate("127.0.0.1", ("127.0.0.1", port), lambda: {"127.0.0.1"}, secret=secret)
        relay = NodeRelay(("127.0.0.1", secret_gate.port), secret)
        try:
            wait = timedelta(seconds=10)
            direct = LighthouseClient(f"http://127.0.0.1:{port}", wait)
            gated = LighthouseClient(f"http://127.0.0.1:{gate.port}", wait)
            relayed = LighthouseClient(relay.address, wait)
            for client in (direct, gated, relayed):  # connections made, first calls done
                median_call(client, 50)
            pairs = alternating_pairs(
                args.pairs, lambda: median_call(gated, args.calls), lambda: median_call(direct, args.calls)
            )
            relay_pairs = alternating_pairs(
                args.pairs, lambda: median_call(relayed, args.calls), lambda: median_call(gated, args.calls)
            )
        finally:
            relay.close()
            secret_gate.close()
            gate.close()
    finally:
        server.shutdown()
    added = statistics.median(g - d for g, d in zip(pairs["a"], pairs["b"]))
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "calls": args.calls,
        "gated_s": pairs["a"],
        "direct_s": pairs["b"],
        "ratio": pairs.get("ratio"),
        "interval": [pairs.get("low"), pairs.get("high")],
        "added_us": added * 1e6,
        "relayed_s": relay_pairs["a"],
        "gated_again_s": relay_pairs["b"],
        "relay_ratio": relay_pairs.get("ratio"),
        "relay_interval": [relay_pairs.get("low"), relay_pairs.get("high")],
        "relay_added_us": statistics.median(r - g for r, g in zip(relay_pairs["a"], relay_pairs["b"])) * 1e6,
    }
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "gate.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    print(
        f"heartbeat round trip: direct {statistics.median(pairs['b']) * 1e6:.0f} us, through the gate "
        f"{statistics.median(pairs['a']) * 1e6:.0f} us; ratio {result['ratio']} {result['interval']}; added {added * 1e6:.0f} us per call"
    )
    print(
        f"through a node's relay and the gate with the secret {statistics.median(relay_pairs['a']) * 1e6:.0f} us "
        f"against the gate alone {statistics.median(relay_pairs['b']) * 1e6:.0f} us; ratio {result['relay_ratio']} "
        f"{result['relay_interval']}; added {result['relay_added_us']:.0f} us per call"
    )


if __name__ == "__main__":
    main()
