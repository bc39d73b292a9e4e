"""The torchrun floor: ``torchrun ... floor_script.py BODY OUT_JSON [ARGS...]``.

Calls ``bodies.BODY(*ARGS)`` (integer args) on every rank; rank 0 writes the return value as
JSON to OUT_JSON (``-`` for nowhere), the way a bare training script would report a number.
"""

import json
import os
import sys

import bodies

if __name__ == "__main__":
    name, out, *rest = sys.argv[1:]
    value = getattr(bodies, name)(*(int(a) for a in rest))
    if os.environ.get("RANK", "0") == "0" and out != "-":
        tmp = out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(value, fh)
        os.replace(tmp, out)
