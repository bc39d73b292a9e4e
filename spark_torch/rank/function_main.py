"""Entry point of one rank in function mode: ``python -m spark_torch.rank.function_main PAYLOAD RESULT_DIR``.

The environment contract (the same as ``torchrun`` gives a rank, in both modes):

=====================  ==========================================================
``RANK``               global rank, ``0 .. WORLD_SIZE-1``
``LOCAL_RANK``         rank on this node, ``0 .. LOCAL_WORLD_SIZE-1``
``WORLD_SIZE``         total number of ranks (``num_processes``)
``LOCAL_WORLD_SIZE``   ranks on this node (1 per CPU task, GPUs per task with GPUs)
``NODE_RANK``          index of this node (Spark barrier task); alias ``GROUP_RANK``
``GROUP_WORLD_SIZE``   number of nodes
``MASTER_ADDR``        host of node 0 as Spark knows it (``127.0.0.1`` in local mode)
``MASTER_PORT``        a free port reserved on node 0 for this run
``CUDA_VISIBLE_DEVICES``  with GPUs: the GPUs Spark assigned to this node's task
``OMP_NUM_THREADS``    cores of the task divided by ranks per node (Spark pins it to 1)
``TORCHELASTIC_RUN_ID`` / ``SPARK_TORCH_RUN_ID``  the run's id
``TORCHELASTIC_RESTART_COUNT`` / ``SPARK_TORCH_RESTART_COUNT``  restarts so far (0)
=====================  ==========================================================

So ``torch.distributed.init_process_group(backend, init_method="env://")`` works unchanged.
A rank ends like a Python program (non-daemon threads joined, atexit run, open files flushed
and closed) without the slow interpreter teardown: see :mod:`spark_torch.rank.shutdown`.
Scripts run through :mod:`spark_torch.rank.script_main` with the same environment.
This module never imports pyspark.
"""

from __future__ import annotations

import os
import sys

from spark_torch import envelopes
from spark_torch.rank.deathsig import die_with_parent
from spark_torch.rank.shutdown import destroy_process_group, finish, line_buffered_output

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Load the payload, call the function, publish the result or the error. Returns the exit code."""
    payload_path, result_dir = argv
    rank = int(os.environ.get("RANK", "0"))
    try:
        with open(payload_path, "rb") as fh:
            fn, args, kwargs = envelopes.load_function_payload(fh.read())
        value = fn(*args, **kwargs)
    except SystemExit as exc:
        if exc.code in (None, 0):
            value = None
        else:
            envelopes.write_error(result_dir, rank, exc)
            return exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the driver
        envelopes.write_error(result_dir, rank, exc)
        return 1
    destroy_process_group()
    if rank == 0:
        try:
            envelopes.write_result(result_dir, rank, value)
        except Exception as exc:  # noqa: BLE001
            wrapped = TypeError(
                f"rank 0 returned a {type(value).__name__} that cannot be pickled ({exc}); "
                "return plain data (numbers, lists, dicts, tensors, state_dict()) instead"
            )
            envelopes.write_error(result_dir, rank, wrapped)
            return 1
    return 0


if __name__ == "__main__":
    die_with_parent()
    line_buffered_output()
    finish(main(sys.argv[1:]))
