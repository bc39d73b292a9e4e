"""Print a line, then hang until killed (for timeout and Ctrl-C tests)."""

import os
import time

print(f"rank {os.environ['RANK']} hanging", flush=True)
time.sleep(600)
