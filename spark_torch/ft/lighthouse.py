"""The run's torchft lighthouse, hosted by the driver (:class:`Lighthouse`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from spark_torch.ft.gate import AddressGate
from spark_torch.ft.install import install_hint
from spark_torch.ft.rank import bind_address

__all__ = ["Lighthouse", "LighthouseOptions"]

logger = logging.getLogger(__name__)

#: where the lighthouse listens behind a gate
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class LighthouseOptions:
    """torchft's quorum rules: at least ``min_replicas`` groups form a quorum; a group that stops
    heartbeating for ``heartbeat_timeout_ms`` is dropped from it; ``join_timeout_ms`` and
    ``quorum_tick_ms`` as torchft's lighthouse has them. None: torchft's own default."""

    min_replicas: int = 1
    join_timeout_ms: int | None = None
    quorum_tick_ms: int | None = None
    heartbeat_timeout_ms: int | None = None


class Lighthouse:
    """A torchft ``LighthouseServer`` listening on ``host`` only (never every interface), reached
    by the ranks at ``advertise`` (default ``host``), stopped by :meth:`close` (idempotent) or on
    leaving a ``with`` block, whatever the end. With ``allowed`` (the addresses that may reach it:
    the cluster's), the server listens on loopback and an :class:`~spark_torch.ft.gate.AddressGate`
    on ``host`` lets only those addresses through."""

    def __init__(
        self,
        host: str,
        options: LighthouseOptions | None = None,
        advertise: str | None = None,
        allowed: Callable[[], set[str]] | None = None,
    ) -> None:
        try:
            from torchft.coordination import LighthouseServer
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                f"replica_groups > 1 needs torchft ({exc}): {install_hint()}"
            ) from exc
        opts = options or LighthouseOptions()
        self.host = host
        self.advertise = advertise or host
        self._lock = threading.Lock()  # a failing group's thread and the driver may both close it
        self._server: Any | None = LighthouseServer(
            bind=bind_address(LOOPBACK if allowed is not None else host, 0),
            min_replicas=opts.min_replicas,
            join_timeout_ms=opts.join_timeout_ms,
            quorum_tick_ms=opts.quorum_tick_ms,
            heartbeat_timeout_ms=opts.heartbeat_timeout_ms,
        )
        # torchft advertises the machine's hostname; the ranks get the address it listens on
        #: where torchft's server listens (on loopback behind a gate)
        self.server_port = int(self._server.address().rsplit(":", 1)[1])
        self._gate: AddressGate | None = None
        if allowed is not None:
            try:
                self._gate = AddressGate(host, (LOOPBACK, self.server_port), allowed)
            except BaseException:
                self.close()
                raise
        #: the port the ranks reach (the gate's, when there is one)
        self.port = self._gate.port if self._gate is not None else self.server_port

    @property
    def address(self) -> str:
        """What the ranks get as ``TORCHFT_LIGHTHOUSE``."""
        return f"http://{bind_address(self.advertise, self.port)}"

    def close(self) -> None:
        """Stop listening (idempotent)."""
        with self._lock:
            server, self._server = self._server, None
            gate, self._gate = self._gate, None
        if gate is not None:
            gate.close()
        if server is not None:
            server.shutdown()

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
