"""Start a grandchild that sleeps, print both pids, then hang."""

import os
import subprocess
import sys
import time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(f"rank {os.environ['RANK']} pid {os.getpid()} grandchild {child.pid}", flush=True)
time.sleep(600)
