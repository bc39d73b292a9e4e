"""Hang until SIGTERM; on SIGTERM take half a second (say, to save a checkpoint), write
DIR/rank-N.terminated and exit (a graceful shutdown)."""

import os
import signal
import sys
import time

out = sys.argv[1]


def on_term(signum, frame):
    time.sleep(0.5)
    with open(os.path.join(out, f"rank-{os.environ['RANK']}.terminated"), "w") as fh:
        fh.write("bye")
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
print("hanging", flush=True)
while True:
    time.sleep(0.1)
