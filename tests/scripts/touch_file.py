"""Create the file named by argv[1] (it proves this rank ran), then exit 0."""

import sys

with open(sys.argv[1], "w") as fh:
    fh.write("ran\n")
