"""Ctrl-C in a run with replica groups: SIGINT to this driver once every group's rank has
started (a file per group, never a delay), then print what run() raised and which of the ranks
still run, and what ``last_run`` says (``python tests/scripts/ft_interrupt.py WORK_DIR``, from
the repository's root)."""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil

from spark_torch import Distributor
from tests import ft_programs

work = Path(sys.argv[1])
files = [work / f"started-{group}" for group in (0, 1)]


def interrupt_once_started() -> None:
    deadline = time.monotonic() + 120
    while not all(f.exists() for f in files):
        if time.monotonic() > deadline:
            print("the ranks did not start within 120 s", flush=True)
            os._exit(3)
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGINT)


threading.Thread(target=interrupt_once_started, daemon=True).start()
distributor = Distributor(num_processes=2, replica_groups=2, log_ranks=[])
try:
    distributor.run(ft_programs.hang, str(work))
    print("returned")
except KeyboardInterrupt:
    print("interrupted")
last = distributor.last_run
if last is None:
    print("last_run: None")
else:
    groups = [str(group.outcome) for group in last.replica_groups]
    print(f"last_run: {last.outcome}, {type(last.error).__name__}, groups {groups}", flush=True)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


print(f"ranks still running: {[pid for pid in (int(f.read_text()) for f in files) if running(pid)]}", flush=True)
