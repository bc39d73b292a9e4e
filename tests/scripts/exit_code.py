"""Exit with the code given as argv[1] on the rank given as argv[2] (default: every rank)."""

import os
import sys
import time

code = int(sys.argv[1])
only = sys.argv[2] if len(sys.argv) > 2 else None
if only is None or os.environ["RANK"] == only:
    print(f"rank {os.environ['RANK']} exiting with {code}", file=sys.stderr)
    sys.exit(code)
time.sleep(600)  # the other ranks wait until they are torn down
