"""A training script that relies on Python's normal exit: a non-daemon thread that writes a file
after 1 s, a file written and never closed, an atexit handler, executor work never waited for."""

import atexit
import concurrent.futures
import os
import sys
import threading
import time

out = sys.argv[1]
rank = os.environ["RANK"]


def late_upload() -> None:
    time.sleep(1.0)
    with open(os.path.join(out, f"thread-{rank}.txt"), "w") as fh:
        fh.write("uploaded")


threading.Thread(target=late_upload).start()
unclosed = open(os.path.join(out, f"unclosed-{rank}.txt"), "w")  # noqa: SIM115 - the point of the test
unclosed.write("buffered " * 10)
atexit.register(lambda: open(os.path.join(out, f"atexit-{rank}.txt"), "w").write("ran"))
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(lambda: (time.sleep(0.5), open(os.path.join(out, f"pool-{rank}.txt"), "w").write("done")))
