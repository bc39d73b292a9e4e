"""Another user of this machine, played by uid/gid 65534 (nobody) in a forked child: the tests
run as root (tests/README.md)."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

#: nobody's user and group id
NOBODY = 65534


def as_nobody(fn: Callable[..., Any], *args: Any, timeout: float = 30.0) -> Any:
    """``fn(*args)`` in a forked child that first became uid and gid 65534; its value (or its
    exception, raised here). The child imports nothing new: what it needs must be imported here
    first (the interpreter's folder may be root's only)."""
    import select

    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child: never returns
        os.close(read_end)
        code = 0
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            outcome: tuple[bool, Any] = (True, fn(*args))
        except BaseException as exc:  # noqa: BLE001 - carried to the parent
            outcome, code = (False, exc), 1
        try:
            os.write(write_end, pickle.dumps(outcome))
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], timeout)
        if not ready:
            os.kill(child, 9)
            raise TimeoutError(f"the child as uid {NOBODY} did not answer within {timeout:.0f} s")
        data = b""
        while chunk := os.read(read_end, 65536):
            data += chunk
    finally:
        os.close(read_end)
        os.waitpid(child, 0)
    ok, value = pickle.loads(data)
    if not ok:
        raise value
    return value


def torchft_hello(address: str, replica_id: str = "outsider_9:0") -> str:
    """What torchft's own lighthouse client got at ``address`` for a heartbeat of ``replica_id``:
    "joined", or its error (tests/scripts/submit_ft_driver.py sends its copy by value to executors)."""
    from datetime import timedelta

    from torchft.coordination import LighthouseClient

    try:
        LighthouseClient(address, timedelta(seconds=5)).heartbeat(replica_id)
    except Exception as exc:  # noqa: BLE001 - the outcome is the answer
        return f"{type(exc).__name__}: {exc}"
    return "joined"
