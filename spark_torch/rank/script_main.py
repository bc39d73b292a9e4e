"""Entry point of one rank in script mode: ``python -m spark_torch.rank.script_main SCRIPT ARGS...``.

Runs SCRIPT exactly as ``python SCRIPT ARGS...`` would (``__name__ == "__main__"``,
``sys.argv``, ``sys.path[0]`` = the script's folder, ``__file__``), with the environment
documented in :mod:`spark_torch.rank.function_main`. Then, like a function rank, it tears down a
process group the script left open and ends like ``python`` would (non-daemon threads joined,
atexit handlers run, open files flushed and closed: :mod:`spark_torch.rank.shutdown`) without
tearing the interpreter down: with torch/gloo loaded, teardown costs about a second and can
abort the process ("terminate called without an active exception"), which would turn a
successful rank into a SIGABRT. Exit status: the script's ``sys.exit`` code, 1 for an uncaught
exception (its traceback goes to stderr, as with ``python``).
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from types import TracebackType

from spark_torch.base import envnames
from spark_torch.ft import wiring
from spark_torch.rank.deathsig import die_with_parent
from spark_torch.rank.sampler import start_sampler
from spark_torch.rank.shutdown import destroy_process_group, finish, line_buffered_output
from spark_torch.rank.store import host_rendezvous_store
from spark_torch.rank.title import rank_title, set_title

__all__ = ["main"]


def _from_script(tb: TracebackType | None, script: str) -> TracebackType | None:
    """``tb`` from the script's own frame on, as ``python SCRIPT`` prints it (no runpy, no us)."""
    path, start = os.path.abspath(script), tb
    while start is not None and os.path.abspath(start.tb_frame.f_code.co_filename) != path:
        start = start.tb_next
    return start if start is not None else tb


def main(argv: list[str]) -> int:
    """Run the script; return its exit status."""
    script, *args = argv
    sys.argv = [script, *args]
    # ps, htop and pgrep -f show the script and its arguments, warm or cold
    name = os.path.basename(script)
    group = os.environ.get(envnames.REPLICA_GROUP_ID)
    set_title(rank_title(os.environ.get(envnames.RANK, "0"), " ".join([name, *args]), group), name)
    start_sampler()  # stall detection, when the node asked for it
    host_rendezvous_store()  # rank 0, when node 0 did not host it (warm starts off)
    wiring.install()  # replica groups: a torchft.Manager the user's code makes is wired to the run
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException as exc:  # noqa: BLE001 - reported like the interpreter would
        traceback.print_exception(exc.with_traceback(_from_script(exc.__traceback__, script)))
        code = 1
    destroy_process_group()
    return code


if __name__ == "__main__":
    die_with_parent()
    line_buffered_output()
    finish(main(sys.argv[1:]))
