#!/usr/bin/env python
"""The driver <-> node channel: its framing (AES-GCM now vs the per-frame HMAC it replaced) and
its server at simulated scale (N node clients against one driver end).

    .venv/bin/python benchmarks/bench_channel.py [--quick]   # ~1 min -> results/channel.json

``make bench`` runs the same through the ``channel`` job (``ChannelBenchmark.channel``).

Framing: frames of 1 KiB, 64 KiB and 1 MiB (a piece of rank 0's result) are (a) sealed and
opened in memory (the crypto and framing work alone) and (b) sent over a socketpair by a real
:class:`spark_torch.channel.wire.Link` and received by another (syscalls included). The HMAC
framing (``HmacLink``: HMAC-SHA256 over direction + seq + body, the body in clear) is the one
the channel used before AES-GCM, kept here only for this comparison.

Scale: one ``DriverChannel`` in this process; a child process runs N real ``NodeChannel``s
(handshake, rendezvous, 3 log blocks each, node 0 streams 8 MiB, a quiet period of heartbeats,
close). Measured on the driver: peak threads, CPU seconds, peak RSS growth; in the child: the
rendezvous time (all N clients created -> every node has the decision).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: the repository, for the test suite's channel helpers (the server's handshake, blocking)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = [1024, 64 * 1024, 1024 * 1024]
NODE_COUNTS = [32, 128, 256]
HEARTBEAT = 0.5
BLOCKS, LINES = 3, 10
RESULT_BYTES = 8 << 20
_LENGTH = struct.Struct(">I")
_SEQ = struct.Struct(">Q")


class HmacLink:
    """The framing before AES-GCM: ``length | body | HMAC(key, direction + seq + body)``."""

    def __init__(self, sock: socket.socket, key: bytes, *, server: bool) -> None:
        self.sock = sock
        self._key = key
        self._out, self._in = (b"S", b"C") if server else (b"C", b"S")
        self._out_seq = self._in_seq = 0
        self._lock = threading.Lock()

    def seal(self, body: bytes) -> list[bytes]:
        with self._lock:
            digest = hmac.new(self._key, self._out + _SEQ.pack(self._out_seq), hashlib.sha256)
            digest.update(body)
            self._out_seq += 1
        return [_LENGTH.pack(len(body)), body, digest.digest()]

    def send_body(self, body: bytes) -> None:
        """As the old ``Link.send_body``: scatter-gather, the body never copied."""
        views = [memoryview(p) for p in self.seal(body)]
        while views:
            sent = self.sock.sendmsg(views)
            while views and sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            if views and sent:
                views[0] = views[0][sent:]

    def open(self, body: memoryview, mac: bytes) -> memoryview:
        digest = hmac.new(self._key, self._in + _SEQ.pack(self._in_seq), hashlib.sha256)
        digest.update(body)
        if not hmac.compare_digest(mac, digest.digest()):
            raise ConnectionError("a frame failed its MAC")
        self._in_seq += 1
        return body

    def recv_body(self) -> memoryview:
        from spark_torch.channel.wire import _recv_exact

        (size,) = _LENGTH.unpack(_recv_exact(self.sock, 4, None))
        rest = memoryview(_recv_exact(self.sock, size + 32, None))
        return self.open(rest[:size], bytes(rest[size:]))


def _links(kind: str) -> tuple[Any, Any, socket.socket, socket.socket]:
    """(sender, receiver) links of ``kind`` over a socketpair, after the real handshake for AEAD."""
    from spark_torch.channel import wire
    from tests.reliability.channel_helpers import serve_handshake  # the server's handshake, blocking: one copy

    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    if kind == "HMAC":
        return HmacLink(b, b"k" * 32, server=False), HmacLink(a, b"k" * 32, server=True), a, b
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.setdefault("s", serve_handshake(a, b"k" * 32, idle_timeout=None)))
    t.start()
    client = wire.client_handshake(b, b"k" * 32, time.monotonic() + 5, None)
    t.join()
    return client, box["s"], a, b


def _aead_recv_body(link: Any) -> memoryview:
    """What ``Link.recv`` does up to the JSON parsing: read, decrypt, hand a view."""
    from spark_torch.channel import wire

    header = wire._recv_exact(link.sock, 4, None)
    (size,) = _LENGTH.unpack(header)
    sealed = wire._recv_exact(link.sock, size + wire.TAG_BYTES, None)
    plain = bytearray(size)
    link._open.decrypt_into(wire._NONCE.pack(link._in_direction, link._in_seq), sealed, bytes(header), plain)
    link._in_seq += 1
    return memoryview(plain)


def framing(size: int, kind: str, seconds: float = 1.0) -> dict[str, float]:
    """Frames of ``size`` bytes through a socketpair for about ``seconds``: MB/s and µs per frame."""
    sender, receiver, a, b = _links(kind)
    body = os.urandom(size)
    count = max(20, int(seconds * 1.5e9 / size)) if kind == "AEAD" else max(20, int(seconds * 0.8e9 / size))
    count = min(count, 200_000)
    recv_body = receiver.recv_body if kind == "HMAC" else (lambda: _aead_recv_body(receiver))
    done = threading.Event()

    def read() -> None:
        for _ in range(count):
            recv_body()
        done.set()

    reader = threading.Thread(target=read)
    cpu0, t0 = time.process_time(), time.perf_counter()
    reader.start()
    for _ in range(count):
        sender.send_body(body)
    done.wait(120)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    reader.join()
    a.close()
    b.close()
    return {
        "MB/s": count * size / wall / 1e6,
        "us_per_frame": wall / count * 1e6,
        "cpu_us_per_frame": cpu / count * 1e6,
    }


def crypto_only(size: int, kind: str, seconds: float = 0.5) -> float:
    """µs per frame to seal and open ``size`` bytes in memory (no sockets)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    body = os.urandom(size)
    count = max(50, min(200_000, int(seconds * (8e9 if kind == "AEAD" else 0.9e9) / size)))
    if kind == "HMAC":
        out, into = (
            HmacLink(socket.socket(), b"k" * 32, server=False),
            HmacLink(socket.socket(), b"k" * 32, server=True),
        )
        t0 = time.perf_counter()
        for _ in range(count):
            _, b, mac = out.seal(body)
            into.open(memoryview(b), mac)
        return (time.perf_counter() - t0) / count * 1e6
    seal, unseal = AESGCM(b"k" * 32), AESGCM(b"k" * 32)
    sealed, plain = bytearray(size + 16), bytearray(size)
    t0 = time.perf_counter()
    for i in range(count):
        nonce = b"C\0\0\0" + _SEQ.pack(i)
        seal.encrypt_into(nonce, body, b"\0\0\0\0", sealed)
        unseal.decrypt_into(nonce, sealed, b"\0\0\0\0", plain)
    return (time.perf_counter() - t0) / count * 1e6


# -- scale ------------------------------------------------------------------------------------


def _child(nodes: int) -> None:
    """The nodes' side (a separate process): N NodeChannels doing what a run does."""
    from spark_torch.channel.node_end import NodeChannel
    from spark_torch.shared.spec import ChannelSpec

    given = json.loads(sys.stdin.readline())
    spec = ChannelSpec(
        host="127.0.0.1",
        port=given["port"],
        secret=bytes.fromhex(given["secret"]),
        heartbeat=HEARTBEAT,
        rendezvous_timeout=120,
    )
    start = time.perf_counter()
    channels = [NodeChannel(spec, n, nodes, threading.Event()) for n in range(nodes)]
    outcomes: dict[int, Any] = {}
    callers = [
        threading.Thread(target=lambda n=n: outcomes.__setitem__(n, channels[n].rendezvous({"port": n})))
        for n in range(nodes)
    ]
    for t in callers:
        t.start()
    for t in callers:
        t.join(180)
    rendezvous = time.perf_counter() - start
    ok = len(outcomes) == nodes and all(o.peers is not None for o in outcomes.values())
    for block in range(BLOCKS):
        for n, channel in enumerate(channels):
            channel(n, "stdout", "\n".join(f"node {n} block {block} line {i}" for i in range(LINES)))
    result = os.urandom(RESULT_BYTES)
    piece = channels[0].bulk_piece
    for offset in range(0, len(result), piece):
        channels[0].send_bulk({"offset": offset}, memoryview(result)[offset : offset + piece], time.monotonic() + 60)
    ok = channels[0].drain(60) and ok
    time.sleep(HEARTBEAT * 5)  # a quiet period: only heartbeats
    for channel in channels:
        channel.close(timeout=60)
    print(
        json.dumps({"rendezvous_s": rendezvous, "ok": ok, "reconnects": sum(c.connections - 1 for c in channels)}),
        flush=True,
    )


def scale(nodes: int) -> dict[str, Any]:
    """One driver end here, ``nodes`` clients in a child process; the driver's costs."""
    import psutil

    from spark_torch.channel.driver_end import DriverChannel, new_secret

    class Sink:
        def __init__(self) -> None:
            self.lines = 0

        def __call__(self, rank: int, stream: str, block: str) -> None:
            self.lines += block.count("\n") + 1

        def flush(self) -> None: ...

        def rank_event(self, rank: int, state: str) -> None: ...

    class Bulk:
        received = 0

        def piece(self, node: int, header: Any, data: Any) -> None:
            self.received += len(data)

    me = psutil.Process()
    rss0, threads0 = me.memory_info().rss, threading.active_count()
    sink = Sink()
    driver = DriverChannel(
        sink,
        nodes=nodes,
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        secret=new_secret(),
        heartbeat=HEARTBEAT,
        rendezvous_timeout=120,
    )
    bulk = driver.bulk_sink = Bulk()
    peak = {"threads": 0, "rss": rss0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.01):
            peak["threads"] = max(peak["threads"], threading.active_count() - threads0 - 1)
            peak["rss"] = max(peak["rss"], me.memory_info().rss)

    sampler = threading.Thread(target=sample)
    sampler.start()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--child", str(nodes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(json.dumps({"port": driver.port, "secret": driver.spec.secret.hex()}) + "\n")
    child.stdin.flush()
    out = json.loads(child.stdout.readline() or "{}")
    child.wait(120)
    finished = driver.wait_for_nodes(30)
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    stop.set()
    sampler.join()
    driver.close()
    left = [t.name for t in threading.enumerate() if t.name.startswith("spark-torch-channel")]
    return {
        "nodes": nodes,
        "rendezvous_s": out.get("rendezvous_s"),
        "driver_threads_peak": peak["threads"],
        "driver_cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
        "driver_rss_growth_mb": (peak["rss"] - rss0) / 1e6,
        "wall_s": wall,
        "lines": sink.lines,
        "lines_ok": sink.lines == nodes * BLOCKS * LINES,
        "result_ok": bulk.received == RESULT_BYTES,
        "all_finished": finished and bool(out.get("ok")),
        "reconnects": out.get("reconnects"),
        "threads_left_after_close": len(left),
    }


def _median_run(size: int, kind: str, reps: int, seconds: float) -> dict[str, float]:
    """The run of median MB/s among ``reps`` (the kinds alternate: background load hits both)."""
    runs = sorted((framing(size, kind, seconds) for _ in range(reps)), key=lambda r: r["MB/s"])
    return {
        **runs[len(runs) // 2],
        "crypto_us_per_frame": sorted(crypto_only(size, kind) for _ in range(reps))[reps // 2],
    }


def run_all(quick: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"framing": [], "scale": [], "loadavg_start": os.getloadavg()}
    reps = 1 if quick else 3
    for size in SIZES:
        row: dict[str, Any] = {"size": size}
        for kind in ("HMAC", "AEAD"):
            row[kind] = _median_run(size, kind, reps, 0.3 if quick else 0.7)
        row["ratio_MB/s"] = row["AEAD"]["MB/s"] / row["HMAC"]["MB/s"]
        out["framing"].append(row)
    for nodes in [32] if quick else NODE_COUNTS:
        out["scale"].append(scale(nodes))
    out["loadavg_end"] = os.getloadavg()
    return out


def print_tables(out: dict[str, Any]) -> None:
    print(
        f"load average at start / end: {out['loadavg_start'][0]:.1f} / {out['loadavg_end'][0]:.1f} on {os.cpu_count()} CPUs\n"
    )
    print("| frame | HMAC MB/s | AEAD MB/s | AEAD/HMAC | HMAC µs/frame | AEAD µs/frame | crypto only µs: HMAC / AEAD |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in out["framing"]:
        h, a = r["HMAC"], r["AEAD"]
        print(
            f"| {r['size'] // 1024} KiB | {h['MB/s']:.0f} | {a['MB/s']:.0f} | {r['ratio_MB/s']:.2f}x | {h['us_per_frame']:.1f} | "
            f"{a['us_per_frame']:.1f} | {h['crypto_us_per_frame']:.1f} / {a['crypto_us_per_frame']:.1f} |"
        )
    print(
        "\n| nodes | rendezvous (s) | driver threads (peak) | driver CPU (s) | driver RSS growth (MB) | wall (s) | all delivered | threads left |"
    )
    print("|---:|---:|---:|---:|---:|---:|:--:|---:|")
    for r in out["scale"]:
        ok = r["lines_ok"] and r["result_ok"] and r["all_finished"] and not r["reconnects"]
        print(
            f"| {r['nodes']} | {r['rendezvous_s']:.2f} | {r['driver_threads_peak']} | {r['driver_cpu_s']:.2f} | "
            f"{r['driver_rss_growth_mb']:.1f} | {r['wall_s']:.1f} | {'yes' if ok else 'NO'} | {r['threads_left_after_close']} |"
        )


class ChannelBenchmark:
    """The ``channel`` job of ``make bench`` (a mixin of the worker's harness)."""

    # the harness's (worker_base.WorkerBase)
    quick: bool
    notes: dict[str, Any]
    record: Callable[..., dict[str, Any]]

    def channel(self) -> None:
        out = run_all(self.quick)
        for r in out["framing"]:
            for kind in ("HMAC", "AEAD"):
                self.record("channel", r["size"], kind, "framing MB/s", "MB/s")["values"].append(r[kind]["MB/s"])
                self.record("channel", r["size"], kind, "framing µs per frame", "µs")["values"].append(
                    r[kind]["us_per_frame"]
                )
        for r in out["scale"]:
            for metric, unit in (
                ("rendezvous_s", "s"),
                ("driver_threads_peak", "threads"),
                ("driver_cpu_s", "s"),
                ("driver_rss_growth_mb", "MB"),
            ):
                self.record("channel", r["nodes"], "spark_torch", metric, unit)["values"].append(r[metric])
        self.notes["channel"] = out
        print_tables(out)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(int(sys.argv[2]))
        return 0
    quick = "--quick" in sys.argv
    out = run_all(quick)
    print_tables(out)
    here = os.path.dirname(os.path.abspath(__file__))
    os.makedirs(os.path.join(here, "results"), exist_ok=True)
    with open(os.path.join(here, "results", "channel.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
