"""Point-to-point communication between ranks: blocking send/recv and non-blocking isend/irecv.

The first half of PyTorch's "Writing Distributed Applications with PyTorch" tutorial, run on
Spark with :class:`spark_torch.Distributor`:

* blocking: rank 0 sends a tensor to every other rank with ``dist.send``; each rank adds its
  rank number and sends it back; ``dist.recv`` blocks until the data has arrived.
* non-blocking: every rank passes its rank number to the next rank in a ring with
  ``dist.isend`` / ``dist.irecv``, which return immediately with a request; ``req.wait()``
  is the point after which the buffers may be read or reused.

    python examples/tutorial_p2p.py                    # 2 ranks on Spark barrier tasks
    python examples/tutorial_p2p.py --num-processes 3 --local-mode
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def p2p() -> dict[str, Any]:
    """Run on every rank; rank 0 returns ``{"world_size", "blocking_replies", "ring_received"}``.

    ``blocking_replies[i]`` is what rank ``i + 1`` sent back (``1.0 + (i + 1)``);
    ``ring_received[r]`` is what rank ``r`` received from its left neighbour (``r - 1 mod N``).
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()

        # --- blocking: a round trip between rank 0 and every other rank
        replies: list[float] = []
        if rank == 0:
            for peer in range(1, world):
                dist.send(torch.tensor([1.0]), dst=peer)
            for peer in range(1, world):
                buf = torch.zeros(1)
                dist.recv(buf, src=peer)
                replies.append(buf.item())
        else:
            buf = torch.zeros(1)
            dist.recv(buf, src=0)
            print(f"received {buf.item()} from rank 0", flush=True)
            dist.send(buf + rank, dst=0)

        # --- non-blocking: pass the rank number around a ring
        send_buf = torch.tensor([float(rank)])
        recv_buf = torch.zeros(1)
        requests = [
            dist.isend(send_buf, dst=(rank + 1) % world),
            dist.irecv(recv_buf, src=(rank - 1) % world),
        ]
        # ... computation that does not touch send_buf/recv_buf could overlap here ...
        for request in requests:
            request.wait()
        print(f"ring: received {recv_buf.item()} from rank {(rank - 1) % world}", flush=True)

        ring = [None] * world
        dist.all_gather_object(ring, recv_buf.item())
        return {"world_size": world, "blocking_replies": replies, "ring_received": ring}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Command line: run :func:`p2p` on ``--num-processes`` ranks and print rank 0's result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-processes", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--local-mode", action="store_true", help="run the ranks on this machine")
    args = parser.parse_args(argv)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from spark_torch import Distributor

    result = Distributor(num_processes=args.num_processes, local_mode=args.local_mode).run(p2p)
    print(f"blocking replies: {result['blocking_replies']}")
    print(f"ring received:    {result['ring_received']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
