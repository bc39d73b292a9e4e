"""A torchrun-style script whose main is wrapped in torch's @record and fails on rank 1."""

import os

from torch.distributed.elastic.multiprocessing.errors import record


def load_shard(rank: int) -> None:
    if rank == 1:
        raise ValueError(f"shard {rank} is corrupt")


@record
def main() -> None:
    load_shard(int(os.environ["RANK"]))


if __name__ == "__main__":
    main()
