"""A bounded flood of connections that never answer the handshake, against a loopback port.

``python flood.py PORT --rate R --seconds S --count N --sources K --hold H``: opens connections
to 127.0.0.1:PORT from 127.0.0.2 .. 127.0.0.(K+1) in turn (other loopback addresses, so they
are strangers to a driver that trusts 127.0.0.1), R per second (0: as fast as it can), never
sends a byte, keeps each one H seconds, and stops after S seconds, N connections, or when its
stdin closes, whichever comes first (out of file descriptors, it closes its oldest first). Prints ``ready`` when it starts and one JSON line when it
stops: connections opened, failed, and the seconds it ran."""

from __future__ import annotations

import argparse
import collections
import errno
import json
import resource
import select
import socket
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--sources", type=int, default=8)
    parser.add_argument("--hold", type=float, default=2.0)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sources = [f"127.0.0.{2 + i}" for i in range(args.sources)]
    held: collections.deque[tuple[float, socket.socket]] = collections.deque()
    sent = failed = 0
    print("ready", flush=True)
    start = now = time.monotonic()
    while sent < args.count and now - start < args.seconds:
        if sent % 32 == 0 and select.select([sys.stdin], [], [], 0)[0]:
            break  # stdin closed: the test is done
        if args.rate and start + sent / args.rate > now:
            time.sleep(min(start + sent / args.rate - now, 0.005))  # pacing the attacker
            now = time.monotonic()
            continue
        try:
            sock = socket.socket()
        except OSError as exc:
            if exc.errno != errno.EMFILE or not held:
                raise
            held.popleft()[1].close()
            continue
        sock.setblocking(False)
        try:
            sock.bind((sources[sent % len(sources)], 0))
            code = sock.connect_ex(("127.0.0.1", args.port))
        except OSError:
            code = -1
        if code in (0, errno.EINPROGRESS):
            held.append((now, sock))
        else:
            failed += 1
            sock.close()
        sent += 1
        now = time.monotonic()
        while held and held[0][0] < now - args.hold:
            held.popleft()[1].close()
    for _, sock in held:
        sock.close()
    print(json.dumps({"sent": sent, "failed": failed, "seconds": round(time.monotonic() - start, 3)}), flush=True)


if __name__ == "__main__":
    main()
