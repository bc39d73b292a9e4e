"""One gloo rank that runs ``count`` all_reduces of a [4] tensor, then a last collective that
hangs, and writes torch's Flight Recorder JSON dump once it is inside that hang.

    python fr_dump.py RANK WORLD STORE_FILE OUT_DIR COUNT MODE

MODE ``mismatch``: rank 1's last collective is a broadcast, the others' an all_reduce (gloo waits
forever). MODE ``skip``: rank 1 skips the last collective and dumps once its ``count`` are done.
Every rank writes ``OUT_DIR/rank_R.json`` and, once every rank has, exits (``os._exit``: the
hang never ends).
"""

import os
import sys
import threading
import time

import torch
import torch.distributed as dist

DEADLINE_SECONDS = 120.0


def dump() -> bytes:
    return torch._C._distributed_c10d._dump_fr_trace_json(True, True)  # type: ignore[no-any-return]


def dump_when(ready, path: str) -> None:  # type: ignore[no-untyped-def]
    """Write the dump once ``ready(entries)`` holds (polling torch's record), then exit."""
    import json

    deadline = time.monotonic() + DEADLINE_SECONDS
    while True:
        data = dump()
        if ready(json.loads(data)["entries"]):
            break
        if time.monotonic() > deadline:
            print(f"fr_dump: the expected entries never appeared in {DEADLINE_SECONDS}s", file=sys.stderr, flush=True)
            os._exit(3)
        time.sleep(0.05)  # polling torch's record, which has no wait
    with open(path + ".tmp", "wb") as fh:
        fh.write(data)
    os.replace(path + ".tmp", path)
    # every rank stays until all have dumped: one that left early would end the others' hang
    folder, world = os.path.dirname(path), int(sys.argv[2])
    while len([n for n in os.listdir(folder) if n.endswith(".json")]) < world:
        if time.monotonic() > deadline:
            os._exit(4)
        time.sleep(0.05)
    os._exit(0)


def main() -> None:
    rank, world, store, out, count, mode = sys.argv[1:7]
    rank, world, count = int(rank), int(world), int(count)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    tensor = torch.ones(4)
    for _ in range(count):
        dist.all_reduce(tensor)
    path = os.path.join(out, f"rank_{rank}.json")
    skips = mode == "skip" and rank == 1
    if skips:  # once torch marked its collectives done (it does so a little after they return)
        dump_when(lambda entries: all(e["retired"] for e in entries), path)
    hanging = count + 1  # the last collective's number
    threading.Thread(
        target=dump_when,
        args=(lambda entries: any(e["collective_seq_id"] == hanging and not e["retired"] for e in entries), path),
        daemon=True,
    ).start()
    try:
        if mode == "mismatch" and rank == 1:
            dist.broadcast(tensor, 0)
        else:
            dist.all_reduce(tensor)
    except RuntimeError:
        pass  # a peer that had dumped exited: this rank's dumper exits next
    time.sleep(DEADLINE_SECONDS)


if __name__ == "__main__":
    main()
