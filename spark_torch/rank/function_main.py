"""Entry point of one rank in function mode: ``python -m spark_torch.rank.function_main PAYLOAD RESULT_DIR``.

The environment contract (what ``torchrun`` gives a rank, and a few of ours; the same in both
modes; ``docs/concepts.md`` has the same table, and ``tests/test_env_parity.py`` checks both
against a real rank):

====================================  ==========================================================
``RANK``                              global rank, ``0 .. WORLD_SIZE-1``
``LOCAL_RANK``                        rank on this node, ``0 .. LOCAL_WORLD_SIZE-1``
``WORLD_SIZE``                        total number of ranks (``num_processes``)
``LOCAL_WORLD_SIZE``                  ranks on this node (1 per CPU task, GPUs per task with GPUs)
``NODE_RANK``, ``GROUP_RANK``         index of this node (Spark barrier task)
``GROUP_WORLD_SIZE``                  number of nodes
``ROLE_RANK``, ``ROLE_WORLD_SIZE``    as torchrun: ``RANK`` and ``WORLD_SIZE``
``ROLE_NAME``                         ``default``
``MASTER_ADDR``                       host of node 0 as Spark knows it (``127.0.0.1`` in local mode)
``MASTER_PORT``                       a free port reserved on node 0 for this run
``CUDA_VISIBLE_DEVICES``              the GPUs Spark assigned to this node's task (empty without GPUs)
``OMP_NUM_THREADS``                   cores of the task divided by ranks per node (Spark pins it
                                      to 1); kept when the user or the cluster set it
``MKL_NUM_THREADS``                   the same as ``OMP_NUM_THREADS``
``TORCHELASTIC_RUN_ID``               the run's id
``SPARK_TORCH_RUN_ID``                the run's id
``SPARK_TORCH_NODE_TOKEN``            a random token of this node's attempt: with the run id and
                                      ``NODE_RANK``, how a stop finds the node's processes
``TORCHELASTIC_RESTART_COUNT``        restarts so far within this ``run()`` call (0)
``SPARK_TORCH_RESTART_COUNT``         restarts so far within this ``run()`` call (0)
``TORCHELASTIC_MAX_RESTARTS``         the restart budget (``max_restarts``)
``TORCHELASTIC_USE_AGENT_STORE``      ``True`` on node 0's ranks when the rendezvous store was
                                      hosted before the ranks started (warm starts), and in
                                      rank 0 when it hosted it before the user's code
                                      (:mod:`spark_torch.rank.store`)
``TORCHELASTIC_ERROR_FILE``           a file per rank where torch's ``@record`` writes an error
``TORCH_NCCL_ASYNC_ERROR_HANDLING``   ``1`` unless set: a failed NCCL collective raises
``PYTHONUNBUFFERED``                  ``1``
``PYTHONPATH``                        where this spark_torch was loaded from, ahead of the rest
``SPARK_TORCH_STACK_FILE``            stall detection (``stall_timeout`` > 0): where the rank's
                                      sampler writes its main thread's stack
``SPARK_TORCH_SAMPLE_SECONDS``        how often it samples (a tenth of ``stall_timeout``, 0.2-1 s)
``SPARK_TORCH_STACK_ALL_THREADS``     ``1`` when stall messages show every thread (``stall_all_threads``)
``SPARK_TORCH_STACK_SOURCE_LINES``    ``0`` when the sampler reads no source line (``stall_source_lines=False``)
``TORCH_FR_BUFFER_SIZE``              ``2000`` unless it or ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is set
                                      (stall detection on): torch's Flight Recorder keeps the last
                                      collectives, read on a stall
====================================  ==========================================================

So ``torch.distributed.init_process_group(backend, init_method="env://")`` works unchanged.
A rank ends like a Python program (non-daemon threads joined, atexit run, open files flushed
and closed) without the slow interpreter teardown: see :mod:`spark_torch.rank.shutdown`.
Scripts run through :mod:`spark_torch.rank.script_main` with the same environment.
This module never imports pyspark.
"""

from __future__ import annotations

import os
import sys

from spark_torch.base import envnames
from spark_torch.ft import wiring
from spark_torch.rank.deathsig import die_with_parent
from spark_torch.rank.sampler import start_sampler
from spark_torch.rank.shutdown import destroy_process_group, finish, line_buffered_output
from spark_torch.rank.store import host_rendezvous_store
from spark_torch.rank.title import rank_title, set_title
from spark_torch.shared import rank_files

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Load the payload, call the function, publish the result or the error. Returns the exit code."""
    payload_path, result_dir = argv
    rank = int(os.environ.get(envnames.RANK, "0"))
    start_sampler()  # stall detection, when the node asked for it
    host_rendezvous_store()  # rank 0, when node 0 did not host it (warm starts off)
    wiring.install()  # replica groups: a torchft.Manager the user's code makes is wired to the run
    try:
        with open(payload_path, "rb") as fh:
            fn, args, kwargs = rank_files.load_function_payload(fh.read())
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        group = os.environ.get(envnames.REPLICA_GROUP_ID)  # a replica group's rank names its group
        set_title(rank_title(rank, f"{name}()", group), name)  # ps, htop and pgrep show the function, warm or cold
        value = fn(*args, **kwargs)
    except SystemExit as exc:
        if exc.code in (None, 0):
            value = None
        else:
            rank_files.write_error(result_dir, rank, exc)
            return exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the driver
        if exc.__traceback__ is not None and exc.__traceback__.tb_next is not None:
            exc.__traceback__ = exc.__traceback__.tb_next  # the traceback starts in the user's code, not here
        rank_files.write_error(result_dir, rank, exc)
        return 1
    destroy_process_group()
    if rank == 0:
        try:
            rank_files.write_result(result_dir, rank, value)
        except Exception as exc:  # noqa: BLE001
            wrapped = TypeError(
                f"rank 0 returned a {type(value).__name__} that cannot be pickled ({exc}); "
                "return plain data (numbers, lists, dicts, tensors, state_dict()) instead"
            )
            rank_files.write_error(result_dir, rank, wrapped)
            return 1
    return 0


if __name__ == "__main__":
    die_with_parent()
    line_buffered_output()
    finish(main(sys.argv[1:]))
