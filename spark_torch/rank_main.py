"""Entry point of one rank in function mode: ``python -m spark_torch.rank_main PAYLOAD RESULT_DIR``.

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
Scripts run through :mod:`spark_torch.script_main` with the same environment.
This module never imports pyspark.
"""

from __future__ import annotations

import os
import sys

from . import serialization

__all__ = ["main"]


def _destroy_process_group() -> None:
    """Tear down a process group the function left open.

    Exiting with a live gloo group can abort the interpreter ("terminate called without an
    active exception"), which would turn a successful rank into a SIGABRT.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def main(argv: list[str]) -> int:
    """Load the payload, call the function, publish the result or the error. Returns the exit code."""
    payload_path, result_dir = argv
    rank = int(os.environ.get("RANK", "0"))
    try:
        with open(payload_path, "rb") as fh:
            fn, args, kwargs = serialization.load_function_payload(fh.read())
        value = fn(*args, **kwargs)
    except SystemExit as exc:
        if exc.code in (None, 0):
            value = None
        else:
            serialization.write_error(result_dir, rank, exc)
            return exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the driver
        serialization.write_error(result_dir, rank, exc)
        return 1
    _destroy_process_group()
    if rank == 0:
        try:
            serialization.write_result(result_dir, rank, value)
        except Exception as exc:  # noqa: BLE001
            wrapped = TypeError(
                f"rank 0 returned a {type(value).__name__} that cannot be pickled ({exc}); "
                "return plain data (numbers, lists, dicts, tensors, state_dict()) instead"
            )
            serialization.write_error(result_dir, rank, wrapped)
            return 1
    return 0


def _line_buffered_output() -> None:
    """Send each complete line at once, as a terminal would (the ranks write into pipes).

    Unbuffered output (``PYTHONUNBUFFERED=1``, which the ranks' child processes inherit) does one
    write per ``print`` argument and newline: two system calls per line. Line buffering
    without write-through does one per line and still shows every line live.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True, write_through=False)  # type: ignore[union-attr]
        except (AttributeError, ValueError):  # replaced or closed by a sitecustomize: leave it
            pass


def _exit_fast(code: int) -> None:
    """Run atexit handlers, flush, and leave without tearing the interpreter down.

    Tearing down an interpreter that imported torch takes about a second (measured 1.0-1.7 s
    vs 0.1 s on this project's 2-core machine), paid by every run after the result is already
    written. User atexit handlers still run; only module/GC teardown is skipped.
    """
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not turn success into failure
                pass
        os._exit(code)


if __name__ == "__main__":
    _line_buffered_output()
    _exit_fast(main(sys.argv[1:]))
